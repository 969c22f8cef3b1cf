"""Replica-failure drill on the trained student: 2 replicas on loopback, bounded closed-loop load,
one replica SIGKILLed; failed requests (goal <= 1%) and time to recover.

    python benchmarks/replica_failure.py --model-dir runs/default/student [--clients 4] [--duration 40]

Prints the figures and writes `reports/replica_failure.md`. The same drill runs at tiny scale in
tests/serve/test_serve.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PORT = 8132


def main() -> None:
    import ray
    from ray import serve

    from bench import local_ray, write_report  # benchmarks/ is on sys.path when run as a script
    from serve_load import bodies
    from serve.app import RerankDeployment
    from serve.common import AppArgs
    from serve.faults import kill_replica_under_load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--kill-after", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=40.0)
    args = parser.parse_args()
    local_ray(serve_port=PORT)
    dep = RerankDeployment.options(num_replicas=2, ray_actor_options={"num_cpus": 1})
    serve.run(dep.bind(AppArgs(model=str(Path(args.model_dir).resolve()), threads=1).model_dump()), name="hllm", route_prefix="/")
    result = kill_replica_under_load(f"http://127.0.0.1:{PORT}/v1/rerank", bodies(args.docs, 1)[0], "hllm", "Reranker",
                                     target_replicas=2, clients=args.clients, kill_after_s=args.kill_after, duration_s=args.duration)
    s = result.summary()
    recovery = "not recovered" if s["recovery_s"] is None else f"{s['recovery_s']:.1f}"
    text = (f"2 replicas (1 CPU, 1 thread each), N = {args.docs} documents, {args.clients} closed-loop clients, "
            f"SIGKILL of one replica process after {args.kill_after:.0f} s, {args.duration:.0f} s of load in all, loopback only\n\n"
            "| requests | failed | failure rate | time to recover (s) | p50 ms | p99 ms | errors |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | --- |\n"
            f"| {s['requests']} | {s['failed']} | {100 * s['failure_rate']:.2f}% | {recovery} | "
            f"{s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {json.dumps(s['errors'])} |\n")
    write_report("replica_failure", "Replica failure under load", text)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
