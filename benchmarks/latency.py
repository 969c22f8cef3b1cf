"""Latency against N: bare prefill, single pass (head + each decoder), FIRST-style single pass,
and the AR teacher — same backbone, same requests, batch 1, measured interleaved in one run.

    python benchmarks/latency.py [--run-dir runs/default] [--sizes 10 20 50 100] [--requests 10]
    python benchmarks/latency.py --run-dir runs/dl19-smollm2 --sizes 20 --requests 6 \
        --data ../shared/data/trec-dl19-passage-bm25top100 --output reports/latency_smollm2.md

Needs a finished job in `--run-dir` (teacher/model and student/). Prints Markdown tables, writes
`reports/latency.md` and `reports/latency.png`. Figures, not a timed test; read the ratios.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench import write_report

from hllm import Reranker
from hllm.config import from_dict
from hllm.data.readers import read_beir
from hllm.data.synthetic import SyntheticConfig, generate
from hllm.eval.evaluation import interleaved_latency, paired_ratio, single_pass_methods
from hllm.model.decoding import DECODERS
from hllm.job.config import JobConfig
from hllm.job.stages import load_teacher
from hllm.teacher.baselines import first_style_scores


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/default")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 20, 50, 100])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", help="a BEIR folder: real passages (its first-stage top N) instead of embedded slates")
    parser.add_argument("--output", default="reports/latency.md", help="Markdown report (a .png beside it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    run = Path(args.run_dir)
    cfg = from_dict(JobConfig, {k: v for k, v in json.loads((run / "config.json").read_text()).items()
                                if k in JobConfig.__dataclass_fields__})
    reranker = Reranker.load(run / "student", device="cpu")  # LoRA merged, as served
    teacher_model = reranker.model.cfg.model  # the student's base is the teacher's weights
    teacher = load_teacher(teacher_model, cfg, torch.device("cpu"))
    rows = []
    for n in args.sizes:
        if args.data:
            slates = read_beir(args.data, top_n=n)[: args.requests]
        else:
            slates = generate(SyntheticConfig(slate_size=n, catalogue_size=max(3000, 40 * n), train_slates=1,
                                              val_slates=1, test_slates=args.requests, seed=1))[0]["test"]
        prompts = {id(r): reranker.encode_slate(r) for r in slates}
        matrices = {}

        def single(req):  # prefill + head + Hungarian; every decoder is also timed alone below
            matrices[id(req)] = reranker.score_encoded([prompts[id(req)]])[0]
            reranker.decode(matrices[id(req)], "hungarian")

        methods = {"prefill": single_pass_methods(reranker, prompts)["bare_prefill"],
                   "single": single,
                   "first_style": lambda req: first_style_scores(teacher.model, teacher.prompts, [req]),
                   "ar_teacher": lambda req: teacher.rank([req])}
        with torch.no_grad():
            lat = interleaved_latency(methods, slates, warmup=2, samples=True)  # shuffled order per request
        t = {k: [v["p50_ms"]] for k, v in lat.items()}
        t["ratio"] = [paired_ratio(lat, "single", "prefill")]
        for name, fn in DECODERS.items():
            t[name] = [timed(lambda: fn(m)) for m in matrices.values()]
        med = {k: float(np.median(v)) for k, v in t.items()}
        med["tokens"] = float(np.mean([len(p.input_ids) for p in prompts.values()]))
        med["read"] = float(np.mean([max(p.item_positions) + 1 for p in prompts.values()]))
        rows.append((n, med))
        print(f"N={n}: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()), flush=True)
    lines = ["Milliseconds, medians over the requests; single / prefill is the median of each request's own ratio "
             "(its two times are taken moments apart, so the machine's drift cancels).", "",
             "| N | bare prefill | single pass (prefill+head+hungarian) | single / prefill | FIRST-style | AR teacher | "
             "AR / single | bound AR / prefill | AR/single ÷ bound |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, m in rows:
        single = m["single"]
        lines.append(f"| {n} | {m['prefill']:.1f} | {single:.1f} | {m['ratio']:.3f} | {m['first_style']:.1f} | "
                     f"{m['ar_teacher']:.0f} | {m['ar_teacher'] / single:.1f}x | {m['ar_teacher'] / m['prefill']:.1f}x | "
                     f"{(m['ar_teacher'] / single) / (m['ar_teacher'] / m['prefill']):.3f} |")
    lines += ["", "Decoder cost alone (ms, median):", "", "| N | " + " | ".join(DECODERS) + " |",
              "| ---: |" + " ---: |" * len(DECODERS)]
    lines += [f"| {n} | " + " | ".join(f"{m[d]:.3f}" for d in DECODERS) + " |" for n, m in rows]
    lines += ["", "Prompt tokens (mean): the bare prefill runs all of them; the single pass runs those up to the last "
              "candidate (causal: the closing instruction cannot reach an item state), its last decoder layer at "
              "the N item positions only.", "", "| N | prompt tokens | run by the single pass |", "| ---: | ---: | ---: |"]
    lines += [f"| {n} | {m['tokens']:.0f} | {m['read']:.0f} |" for n, m in rows]
    prompt = reranker.model.cfg.prompt
    setup = (f"Backbone `{cfg.teacher.model.preset}`{' (bootstrapped)' if cfg.teacher.bootstrap else ''}, "
             f"{'passages of ' + Path(args.data).name if args.data else 'embedded slates'}, head {reranker.model.cfg.head.kind} "
             f"({reranker.model.cfg.head.layers} layers, width {reranker.model.cfg.head.width}), prompt "
             f"`{prompt.template}` with passages of at most {prompt.max_doc_tokens} tokens; LoRA merged.")
    output = write_report("latency", f"Latency against N (batch 1, {args.threads} threads, median of {args.requests} requests)",
                          "\n".join([setup, "", *lines]), args.output)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        sizes = [n for n, _ in rows]
        plt.figure(figsize=(6, 4))
        for key, label in (("ar_teacher", "AR teacher"), ("first_style", "FIRST-style"), ("prefill", "bare prefill")):
            plt.plot(sizes, [m[key] for _, m in rows], marker="o", label=label)
        plt.plot(sizes, [m["single"] for _, m in rows], marker="o", label="single pass + Hungarian")
        plt.xlabel("N candidates")
        plt.ylabel("latency per request (ms)")
        plt.yscale("log")
        plt.legend()
        plt.tight_layout()
        plt.savefig(output.with_suffix(".png"), dpi=120)
    except ImportError:
        print("(matplotlib not installed: no plot)")


if __name__ == "__main__":
    main()
