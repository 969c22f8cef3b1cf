"""Peak memory (RSS) of a Serve replica and of a Ray Train + DeepSpeed training worker.

    python benchmarks/memory.py --run-dir runs/default [--train-steps 30] [--requests 200]

Needs a finished job in `--run-dir` (student/, teacher/model, rankings/). Linux: the peak is the
kernel's high-water mark `VmHWM` from /proc/<pid>/status (sampled every 0.1 s for training workers,
which exit when training ends). Prints a table and writes `reports/memory.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path

import psutil
from bench import local_ray, write_report  # benchmarks/ is on sys.path when run as a script

PORT = 8133


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def watch_peaks(tag: str, stop: threading.Event, peaks: dict[int, float]) -> None:
    """Samples the high-water mark of every process whose command line contains `tag`."""
    while not stop.is_set():
        for proc in psutil.process_iter(["cmdline"]):
            if any(tag in part for part in (proc.info["cmdline"] or [])):
                try:
                    peaks[proc.pid] = max(peaks.get(proc.pid, 0.0), peak_rss_mb(proc.pid))
                except (OSError, RuntimeError):
                    pass
        time.sleep(0.1)


def serve_replica(student: Path, docs: list[int], requests_n: int) -> list[tuple[str, float]]:
    import requests
    from ray import serve

    from serve.app import RerankDeployment
    from serve.common import AppArgs
    from serve.faults import replica_processes
    from serve_load import bodies, load

    serve.run(RerankDeployment.options(num_replicas=1).bind(AppArgs(model=str(student.resolve()), threads=1, max_documents=max(docs)).model_dump()),
              name="hllm", route_prefix="/")
    (proc,) = replica_processes("hllm", "Reranker")
    rows = [("serve replica: loaded, idle (RSS)", rss_mb(proc.pid))]
    for n in docs:
        stats = load(bodies(n, requests_n), concurrency=8, url=f"http://127.0.0.1:{PORT}/v1/rerank")
        assert stats["errors"] == 0, stats
        rows.append((f"serve replica: after {requests_n} requests at N = {n}, concurrency 8 (peak RSS)", peak_rss_mb(proc.pid)))
    requests.get(f"http://127.0.0.1:{PORT}/healthz", timeout=10)
    serve.shutdown()
    return rows


def train_worker(run_dir: Path, steps: int) -> list[tuple[str, float]]:
    from hllm.config import from_dict
    from hllm.model.backbones import ModelConfig
    from hllm.job.config import student_ranker_config
    from pipelines import train_student
    from pipelines.common import PipelineConfig

    job = json.loads((run_dir / "config.json").read_text())
    cfg = from_dict(PipelineConfig, job)
    with tempfile.TemporaryDirectory() as out:
        train = dataclasses.replace(cfg.student.train, steps=steps)
        cfg = dataclasses.replace(cfg, output_dir=out, student=dataclasses.replace(cfg.student, train=train),
                                  distill=dataclasses.replace(cfg.distill, checkpoint_every=steps))
        teacher = from_dict(ModelConfig, {**dataclasses.asdict(cfg.teacher.model), "preset": "hf",
                                          "path": str((run_dir / "teacher" / "model").resolve())})
        rankings = {split: max((run_dir / "rankings").glob(f"{split}-*"), key=lambda p: p.stat().st_mtime)
                    for split in ("train", "val")}
        peaks: dict[int, float] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=watch_peaks, args=("RayTrainWorker", stop, peaks))
        watcher.start()
        result = train_student.train(cfg, student_ranker_config(cfg, teacher), rankings["train"], rankings["val"])
        stop.set()
        watcher.join()
        if result.error:
            raise RuntimeError(result.error)
    return [(f"Ray Train worker {i} (DeepSpeed ZeRO-{cfg.distill.zero_stage}, batch {train.batch_size}, {steps} steps; peak RSS)", mb)
            for i, mb in enumerate(sorted(peaks.values(), reverse=True))]


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/default")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--docs", type=int, nargs="+", default=[20, 100])
    args = parser.parse_args()
    run = Path(args.run_dir)
    local_ray(serve_port=PORT)
    rows = serve_replica(run / "student", args.docs, args.requests) + train_worker(run, args.train_steps)
    ray.shutdown()
    weights = sum(f.stat().st_size for f in (run / "teacher" / "model").glob("*.safetensors")) / 2**20
    text = (f"Student backbone weights on disk: {weights:.1f} MiB (safetensors). RSS includes the Python, torch and Ray "
            "runtime of each process.\n\n| process | MiB |\n| --- | ---: |\n" + "\n".join(f"| {k} | {v:.0f} |" for k, v in rows) + "\n")
    write_report("memory", "Peak memory", text)


if __name__ == "__main__":
    main()
