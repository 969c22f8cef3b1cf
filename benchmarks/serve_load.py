"""Load test of the Serve app on loopback: latency percentiles, throughput with and without
batching, and the replica count under load (autoscaling 1 -> 2).

    python benchmarks/serve_load.py --model-dir runs/default/student [--concurrency 8] [--requests 400]

Bounded: a fixed number of requests, each with a timeout, sent only to 127.0.0.1. Prints a table
and writes `reports/serve_load.md`. Figures, not a timed test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import threading
import time
from pathlib import Path

import numpy as np
import requests

PORT = 8131
URL = f"http://127.0.0.1:{PORT}/v1/rerank"


def bodies(n_docs: int, count: int) -> list[dict]:
    from hllm.synthetic import SyntheticConfig, generate

    splits, _ = generate(SyntheticConfig(train_slates=1, val_slates=1, test_slates=max(count, 1), slate_size=n_docs))
    return [{"query": s.query.text, "documents": [c.text for c in s.candidates]} for s in splits["test"]]


def load(payloads: list[dict], concurrency: int, url: str = URL, replica_timings: list | None = None) -> dict:
    """Closed-loop clients, each with a keep-alive session (as a real client keeps its connection).
    `replica_timings` collects each response's `meta.timings_ms` (the time spent inside the replica)."""
    latencies, errors = [], 0
    local = threading.local()

    def session() -> requests.Session:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return local.session

    def one(body: dict) -> float | None:
        t0 = time.perf_counter()
        try:
            r = session().post(url, json=body, timeout=60)
            elapsed = time.perf_counter() - t0
        except requests.RequestException:
            return None
        if r.status_code != 200:
            return None
        if replica_timings is not None:
            replica_timings.append(r.json()["meta"]["timings_ms"])
        return elapsed

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for lat in pool.map(one, payloads):
            if lat is None:
                errors += 1
            else:
                latencies.append(1000 * lat)
    wall = time.perf_counter() - t0
    p = np.percentile(latencies, [50, 95, 99]) if latencies else [float("nan")] * 3
    return {"p50": p[0], "p95": p[1], "p99": p[2], "rps": len(latencies) / wall, "errors": errors, "n": len(payloads)}


def model_p50_ms(model: str, payloads: list[dict]) -> float:
    """The library path alone (`Reranker.rank`: encode, one forward pass, decode), in this process with
    one thread like a replica: what the HTTP path is compared with."""
    import torch

    from hllm import Reranker

    torch.set_num_threads(1)
    reranker = Reranker.load(model)
    times = []
    for body in payloads[:5] + payloads:
        t0 = time.perf_counter()
        reranker.rank(body["query"], body["documents"])
        times.append(1000 * (time.perf_counter() - t0))
    return float(np.median(times[5:]))


def replicas() -> int:
    from ray import serve

    app = serve.status().applications.get("hllm")
    if not app:
        return 0
    return sum(sum(d.replica_states.values()) for d in app.deployments.values())


def main() -> None:
    import ray
    from ray import serve

    from bench import local_ray, write_report
    from serve.app import AppArgs, RerankDeployment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--docs", type=int, default=20)
    args = parser.parse_args()
    local_ray(serve_port=PORT)
    payloads = bodies(args.docs, args.requests)
    app_args = AppArgs(model=str(Path(args.model_dir).resolve()), threads=1).model_dump()
    rows, inside = {}, []
    model_ms = model_p50_ms(app_args["model"], payloads)
    # 1) one replica, latency alone (concurrency 1), then throughput without and with batching
    settings = (("sequential", 8, 0.005, 1), ("sequential, no batch wait", 8, 0.0, 1),
                ("no batching", 1, 0.0, args.concurrency), ("batching", 8, 0.005, args.concurrency),
                ("batching, no batch wait", 8, 0.0, args.concurrency))
    for name, batch, wait, conc in settings:
        dep = RerankDeployment.options(num_replicas=1, user_config={"max_batch_size": batch, "batch_wait_timeout_s": wait})
        serve.run(dep.bind(app_args), name="hllm", route_prefix="/")
        load(payloads[:10], 2)  # warm-up
        rows[name] = load(payloads, conc, replica_timings=inside if name == "sequential, no batch wait" else None)
    # 2) autoscaling: 1 -> 2 replicas under a burst
    dep = RerankDeployment.options(num_replicas="auto", autoscaling_config={
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 1,
        "downscale_delay_s": 60, "metrics_interval_s": 0.5, "look_back_period_s": 2},
        user_config={"max_batch_size": 8, "batch_wait_timeout_s": 0.005})
    serve.run(dep.bind(app_args), name="hllm", route_prefix="/")
    counts, stop = [], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            counts.append((time.perf_counter(), replicas()))
            time.sleep(0.5)

    watcher = threading.Thread(target=watch)
    watcher.start()
    rows["autoscaling burst"] = load(payloads * 3, 4 * args.concurrency)
    stop.set()
    watcher.join()
    seen = [c for _, c in counts]
    lines = [f"N = {args.docs} documents per request, {args.requests} requests, concurrency {args.concurrency}, loopback only\n",
             "| setting | p50 ms | p95 ms | p99 ms | req/s | errors |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {k} | {v['p50']:.1f} | {v['p95']:.1f} | {v['p99']:.1f} | {v['rps']:.1f} | {v['errors']}/{v['n']} |" for k, v in rows.items()]
    http = rows["sequential, no batch wait"]["p50"]
    replica = {k: float(np.median([t[k] for t in inside])) for k in inside[0]}
    lines += ["", f"model p50 ms: {model_ms:.1f}", f"http p50 ms: {http:.1f}", "",
              f"Sequential, N = {args.docs}, `batch_wait_timeout_s: 0` (the default 5 ms wait holds a lone request back "
              f"for company: {rows['sequential']['p50']:.1f} ms p50 with it): HTTP p50 - model p50 = **{http - model_ms:.1f} ms**. "
              "The model is `hllm.Reranker.rank` in one process, one thread, like a replica. Inside the replica (p50 of the "
              f"response's own timings): tokenize {replica['tokenize']:.1f}, queue + forward {replica['queue_and_forward']:.1f} "
              f"(forward {replica['forward_batch']:.1f}), decode {replica['decode']:.1f}, total {replica['total']:.1f} ms; the "
              f"other {http - replica['total']:.1f} ms are Serve's HTTP proxy, the proxy-to-replica hop, FastAPI and JSON."]
    lines.append(f"\nbatching / no batching throughput: **{rows['batching']['rps'] / rows['no batching']['rps']:.2f}x**")
    lines.append(f"replicas during the burst: started at {seen[0] if seen else '?'}, max {max(seen) if seen else '?'} "
                 f"(samples: {seen[:: max(1, len(seen) // 20)]})")
    write_report("serve_load", "Serve load test", "\n".join(lines))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
