"""Long lists: RankGPT sliding windows vs. a block tournament vs. one pass, at equal cost.

    python benchmarks/windows.py --model runs/default/student                        # embedded data, N = 100
    python benchmarks/windows.py --model runs/dl19-smollm2/student --data ../shared/data/trec-dl19-passage-bm25top100

Ranks the same slates (top `--top-n` of the first stage) with the student through each windowing,
counting prefills (windows) per query, and reports nDCG@10 / MRR@10 beside the first-stage order,
plus one pass over all N where the prompt fits the context. The embedded data's test slates are
redrawn at N = `--top-n` (the same catalogue and query draws as the job's data, so no train query
is in them beyond chance collisions). Writes `reports/windows.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from hllm.data.readers import read_beir
from hllm.data.synthetic import SyntheticConfig, generate
from hllm.eval.evaluation import first_stage_order, quality
from hllm.model.prompts import PromptTooLong, document_text
from hllm.reranker import Reranker

ARMS = [("sliding", 10), ("sliding", 16), ("blocks", None)]  # at N = 100, K = 20: 9, 6 and 6 windows


def slates_for(args: argparse.Namespace):
    if args.data:
        slates = read_beir(args.data, top_n=args.top_n)
        return slates[: args.queries], f"{Path(args.data).name} (BM25 top {args.top_n})"
    splits, _ = generate(dataclasses.replace(SyntheticConfig(), slate_size=args.top_n))
    return splits["test"][: args.queries], f"embedded test slates (BM25 top {args.top_n})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", help="a BEIR folder (default: the embedded data)")
    parser.add_argument("--top-n", type=int, default=100)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--window", type=int, help="default: the head's K positions")
    parser.add_argument("--rel", type=int, default=2)
    parser.add_argument("--out", default="reports/windows.md")
    args = parser.parse_args()
    slates, name = slates_for(args)
    queries = [s.query.text for s in slates]
    docs = [[document_text(c) for c in s.candidates] for s in slates]
    base = Reranker.load(args.model)
    window = args.window or base.positions
    rows = [("first stage (input order)", "-", 0.0, quality(slates, first_stage_order(slates), args.rel), 0.0)]
    for windowing, stride in ARMS:
        ranker = Reranker(base.model, window=window, stride=stride, windowing=windowing)
        t0 = time.perf_counter()
        ranked = ranker.windowed_orders(queries, docs, first_stage_order=True)
        ms = 1000 * (time.perf_counter() - t0) / len(slates)
        label = f"{windowing} (stride {stride})" if stride else windowing
        rows.append((label, f"{window}", sum(ranked.windows) / len(slates), quality(slates, ranked.orders, args.rel), ms))
        print(rows[-1], flush=True)
    try:
        t0 = time.perf_counter()
        orders = [[r.index for r in ranking] for ranking in base.rank_batch(queries, docs, batch_size=4)]
        ms = 1000 * (time.perf_counter() - t0) / len(slates)
        rows.append((f"one pass over all {args.top_n} (K = {base.positions})", "-", 1.0, quality(slates, orders, args.rel), ms))
    except PromptTooLong as err:
        rows.append((f"one pass over all {args.top_n}: does not fit ({err})", "-", 0.0, None, 0.0))
    lines = [f"# Long lists: windowings at equal cost ({args.model})", "",
             f"{len(slates)} queries of {name}; window = {window} documents (the head's K = {base.positions}); "
             f"MRR@10 counts grade >= {args.rel}. One run, 2 CPU threads.", "",
             "| method | window | prefills / query | nDCG@10 | MRR@10 | ms / query |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, w, prefills, q, ms in rows:
        cells = f"{q['nDCG@10']:.4f} | {q['MRR@10']:.4f}" if q else "- | -"
        lines.append(f"| {label} | {w} | {prefills:.1f} | {cells} | {ms:.0f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
