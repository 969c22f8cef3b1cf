"""Throughput of a shipped real-text student on real queries: the library path (`hllm rerank` runs
it), the `hllm rerank` command end to end, and a Serve replica over HTTP.

    python benchmarks/real_throughput.py --model smollm2-trec-dl --data ../shared/data/trec-dl19-passage-bm25top100
    python benchmarks/real_throughput.py --max-batch-tokens none --output /tmp/uncapped.md   # every path uncapped

(`reports/real_throughput.md` as committed: both runs' tables and what they say.)

Each query is its collection's first-stage top `--top-n` as one request (the model's window: one
prefill). Sequential in-process timings (`Reranker.rank`, `--threads` torch threads, after one
warm-up), then `hllm rerank` on the same queries (a subprocess, end to end: Python start and model
load included; the in-process load time is printed beside it), then one Serve replica with the same thread count answering
the same bodies over loopback HTTP, one client and then two at once. Bounded: `--queries` requests
each, every one with a timeout. Prints a table and writes `reports/real_throughput.md`. Figures,
not a timed test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PORT = 8133


def main() -> None:
    import torch

    from bench import local_ray, write_report
    from hllm.data.readers import read_slates
    from hllm.records import record_to_dict
    from hllm.reranker import Reranker
    from hllm.uris import resolve_model_uri
    from pipelines.cli import batch_tokens
    from serve_load import load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-trec-dl", help="a named model, a student folder or a model URI")
    parser.add_argument("--data", default="../shared/data/trec-dl19-passage-bm25top100", help="a BEIR folder with runs/")
    parser.add_argument("--queries", type=int, default=6)
    parser.add_argument("--top-n", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch-tokens", type=batch_tokens, default="auto", metavar="N|auto|none",
                        help="every path's max_batch_tokens (a forward pass holds at most this many padded tokens; "
                        "auto: 8192 on a CPU)")
    parser.add_argument("--output", default="reports/real_throughput.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_uri(args.model)
    slates = read_slates("beir", args.data, top_n=args.top_n)[: args.queries + 1]
    bodies = [{"query": s.query.text, "documents": [c.text for c in s.candidates]} for s in slates]
    warm, bodies = bodies[0], bodies[1:]
    t0 = time.perf_counter()
    reranker = Reranker.load(model_dir, max_batch_tokens=args.max_batch_tokens)
    load_s = time.perf_counter() - t0
    reranker.rank(warm["query"], warm["documents"])
    seconds = []
    for body in bodies:
        t0 = time.perf_counter()
        reranker.rank(body["query"], body["documents"])
        seconds.append(time.perf_counter() - t0)
    library = {"p50": float(np.median(seconds)), "qps": len(seconds) / sum(seconds)}
    tokens = int(np.median([len(reranker.encode(b["query"], b["documents"]).input_ids) for b in bodies]))
    del reranker
    # `hllm rerank` on the same queries (an hllm JSONL of the slates), end to end
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "slates.jsonl"
        data.write_text("".join(json.dumps(record_to_dict(s)) + "\n" for s in slates[1:]))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "rerank", "--model", str(model_dir), "--data", str(data),
                               "--format", "hllm", "--out", str(Path(tmp) / "run.trec"), "--threads", str(args.threads),
                               "--max-batch-tokens", str(args.max_batch_tokens).lower(), "--quiet"], capture_output=True, text=True, timeout=3600)
        cli_wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"hllm rerank failed: {proc.stderr[-2000:]}")
    # one Serve replica, same threads, loopback HTTP
    from ray import serve

    from serve.app import RerankDeployment
    from serve.common import AppArgs

    local_ray(serve_port=PORT)
    app_args = AppArgs(model=str(model_dir), threads=args.threads, max_batch_tokens=args.max_batch_tokens).model_dump()
    serve.run(RerankDeployment.options(num_replicas=1).bind(app_args), name="hllm", route_prefix="/")
    url = f"http://127.0.0.1:{PORT}/v1/rerank"
    load([warm], 1, url, timeout=600)
    http = {c: load(bodies, c, url, timeout=600) for c in (1, 2)}
    serve.shutdown()
    lines = [
        f"Model `{args.model}` ({model_dir.name}), {len(bodies)} queries of `{Path(args.data).name}`, each its first-stage top "
        f"{args.top_n} in one prompt (median {tokens} tokens), torch threads {args.threads}, on this machine "
        f"({torch.get_num_threads()} threads available to torch). One warm-up request first, not counted.", "",
        "| path | p50 s a query | queries/s | errors |", "| --- | ---: | ---: | ---: |",
        f"| library, in-process (`Reranker.rank`, what `hllm rerank` runs) | {library['p50']:.2f} | {library['qps']:.3f} | 0 |",
        f"| `hllm rerank`, end to end: {cli_wall:.0f} s for {len(bodies)} queries, Python start and model load "
        f"(~{load_s:.0f} s in-process) included | | {len(bodies) / cli_wall:.3f} | 0 |",
        *(f"| Serve, 1 replica, {c} client{'s' if c > 1 else ''} at once (HTTP, loopback; max_batch_tokens "
          f"{args.max_batch_tokens}) | {h['p50'] / 1000:.2f} | "
          f"{h['rps']:.3f} | {h['errors']}/{h['n']} |" for c, h in http.items())]
    write_report("real_throughput", "Throughput of a real-text student on 2 cores", "\n".join(lines), args.output)


if __name__ == "__main__":
    main()
