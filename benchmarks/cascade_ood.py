"""Out of domain, the cascade's confidence must read "unsure": with no teacher, its fallback is the first stage.

    python benchmarks/cascade_ood.py [--states runs/cascade_ood/states] [--split test|rest] [--queries 100] [--ship-thresholds]

The shipped, guarded `smollm2-trec-dl` (judgment-fitted on TREC DL19 + DL21, a domain guard) on collections it never
saw — ArguAna and Cranfield, the queries `hllm realtext` checked it on (`transfer-test`: the hashed test split,
capped; `--split rest`: `transfer-confirm`, queries never looked at). Thresholds come from the TREC training queries
only: each signal's 10% and 25% quantile over the 96 DL19 + DL21 queries it was fitted on (`in_sample_thresholds`, the
table `hllm realtext` ships in the model's folder: `--ship-thresholds` writes it into the shipped asset); nothing is
fitted on, or chosen after looking at, the transfer collections. Per collection: the share of queries each signal
flags (below the threshold), and nDCG@10 of the first stage, the student alone (guard suspended), the guard (the
shipped model), and the confidence-gated fallback (the guard's ranking, the first-stage order where flagged).
Goal: gated >= first stage - 0.005 on both. States are computed once into `--states` (~14 s a query on 2 cores).
Writes reports/cascade_ood_<split>.md and its `cascade-ood *` rows of reports/real_data.csv.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hllm.data.readers import read_slates  # noqa: E402
from hllm.eval.evaluation import first_stage_order  # noqa: E402
from hllm.eval.runfile import relevance_threshold  # noqa: E402
from hllm.model.confidence import SIGNALS, THRESHOLDS_FILE, CascadeThresholds  # noqa: E402
from hllm.model.ranker import SinglePassRanker  # noqa: E402
from hllm.model.card import record_in_provenance  # noqa: E402
from hllm.data.splits import split_by_hash  # noqa: E402
from hllm.eval.metrics import top10_by_query  # noqa: E402
from hllm.train.probes import in_sample_thresholds  # noqa: E402
from hllm.train.head_fit import StateSlate, decode_orders, guarded_orders, score_state_slates, state_confidence  # noqa: E402
from hllm.train.state_cache import cached_states, states_key  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
ASSET = ROOT / "hllm" / "assets" / "smollm2-trec-dl"
TREC = ("trec-dl19-passage-bm25top100", "trec-dl21-passage-bm25top100")
TRANSFER = ("arguana", "cranfield")
SHARES = (0.10, 0.25)


def scored(model: SinglePassRanker, slates, states_root: Path, name: str) -> dict:
    """A collection's slates -> matrices and orders, guarded and not, the guard's trust, each slate's confidence."""
    directory = states_root / f"{name}-{states_key(model.cfg, slates)}"
    states = cached_states(model, slates, directory, shard_slates=4, progress=lambda d, t, s: print(
        f"{name} states: {d}/{t} shards ({s:.0f}s)", flush=True))
    items = [StateSlate(s, x) for s, x in zip(slates, states)]
    conf = state_confidence(model, items)  # as Reranker.rank_assessed reads it
    with model.head.guard.suspended():
        alone = decode_orders(score_state_slates(model, items))
    return {"slates": slates, "items": items, "orders": guarded_orders(model, items), "alone": alone,
            "trust": np.array([c.trust for c in conf]), "confidence": conf}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", default="runs/cascade_ood/states")
    parser.add_argument("--split", choices=("test", "rest"), default="test", help="test: transfer-test; rest: transfer-confirm")
    parser.add_argument("--queries", type=int, default=100, help="at most this many transfer queries a collection")
    parser.add_argument("--reports", default=str(ROOT / "reports"))
    parser.add_argument("--ship-thresholds", action="store_true", help="also write the TREC thresholds as the shipped "
                        "model's cascade.json (fitted on its own training queries)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    model = SinglePassRanker.load(ASSET).eval()
    root = Path(args.states)
    trec = [scored(model, read_slates("beir", DATA / c, top_n=100), root, c) for c in TREC]
    table = in_sample_thresholds(model, [i for t in trec for i in t["items"]], list(TREC))  # as `hllm realtext` ships it
    if args.ship_thresholds:
        table.save(ASSET)
        record_in_provenance(ASSET, THRESHOLDS_FILE, "python benchmarks/cascade_ood.py --ship-thresholds")
        print(f"wrote {ASSET / THRESHOLDS_FILE}", flush=True)
    split_name = "transfer-test" if args.split == "test" else "transfer-confirm"
    rows, lines = [], []
    for name in TRANSFER:
        slates = read_slates("beir", DATA / name, top_n=100)
        rest, test = split_by_hash(slates, 0.2)  # hllm realtext's transfer rule (transfer_fraction 0.2)
        slates = (test if args.split == "test" else rest)[: args.queries]
        got = scored(model, slates, root, name)
        rel, _ = relevance_threshold({s.slate_id: s.qrels() for s in slates})

        def ndcg(orders) -> np.ndarray:
            values = top10_by_query(slates, orders, rel)["nDCG@10"]
            return np.array([values[s.slate_id] for s in slates])

        first_orders = first_stage_order(slates)
        first, alone, guard = ndcg(first_orders), ndcg(got["alone"]), ndcg(got["orders"])
        base = [("first_stage", first), ("student_alone", alone), ("guard", guard)]
        lines += [f"## {name} ({len(slates)} queries, {split_name}; relevant: grade >= {rel})", "",
                  f"The guard's trust: mean {got['trust'].mean():.2f}, {np.mean(got['trust'] == 0):.0%} of queries fully back "
                  "to the first stage.", "", "| method | flagged | nDCG@10 | vs first stage |", "|---|---|---|---|"]
        lines += [f"| {m} | | {v.mean():.4f} | {v.mean() - first.mean():+.4f} |" for m, v in base]
        rows += [[name, len(slates), split_name, f"cascade-ood {m}", f"{v.mean():.4f}"] for m, v in base]
        for signal in SIGNALS:
            values = np.array([c.value(signal) for c in got["confidence"]])
            for share in SHARES:
                flagged = values < table.threshold(signal, share)
                gated = ndcg([f if flag else o for f, o, flag in zip(first_orders, got["orders"], flagged)])
                method = f"gated {signal} < TREC q{int(share * 100)} ({table.threshold(signal, share):.4g})"
                lines.append(f"| {method} | {flagged.mean():.0%} | {gated.mean():.4f} | {gated.mean() - first.mean():+.4f} |")
                rows.append([name, len(slates), split_name, f"cascade-ood gated-{signal}@{int(share * 100)}%", f"{gated.mean():.4f}"])
        lines.append("")
        print(f"{name}: first stage {first.mean():.4f}, student alone {alone.mean():.4f}, guard {guard.mean():.4f}", flush=True)
    write(Path(args.reports), table, split_name, lines, rows)


def write(reports: Path, table: CascadeThresholds, split_name: str, lines: list[str], rows: list[list]) -> None:
    head = [f"# The cascade out of domain ({split_name})", "", __doc__.split("\n\n", 2)[2].strip(), "",
            f"Thresholds fitted on {table.fitted_on['queries']} TREC queries ({table.fitted_on['source']}): " + ", ".join(
                f"{s} q10 {table.threshold(s, 0.1):.4g} / q25 {table.threshold(s, 0.25):.4g}" for s in SIGNALS), ""]
    path = reports / f"cascade_ood_{split_name}.md"
    path.write_text("\n".join(head + lines) + "\n")
    csv_path = reports / "real_data.csv"
    with csv_path.open() as f:
        reader = csv.reader(f)
        header = next(reader)
        kept = [r for r in reader if not (r[2] == split_name and r[3].startswith("cascade-ood"))]
    width = len(header)
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(kept + [r + [""] * (width - len(r)) for r in rows])
    print(f"wrote {path} and {len(rows)} rows of {csv_path}", flush=True)


if __name__ == "__main__":
    main()
