"""The whole job: the data stage (Ray Data -> slate shards) -> teacher -> Ray Data generation streamed
from those shards -> Ray Train distillation -> evaluation -> Ray Serve deployment + HTTP smoke test
-> summary and the MLflow run id. The driver builds no slate list: the data lives in the shards.

    ray job submit --working-dir . -- python pipelines/full.py [--config FILE] [--ablations GRID] [key=value ...]
    python pipelines/full.py                                   # the embedded default, local Ray

Every stage is skipped when its output for the same inputs and config exists (teacher bootstrap
and student by fingerprint, generation shard by shard), so a re-run resumes. On a multi-node
cluster `output_dir` must be storage every node sees (NFS, EFS, a mounted bucket).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `ray job submit --working-dir .`

from hllm.config import to_dict  # noqa: E402
from hllm.data import store  # noqa: E402
from hllm.job.stages import summary_lines  # noqa: E402
from pipelines import data as data_stage, train_student  # noqa: E402
from pipelines.common import PipelineConfig, init_ray, parse_job, mlflow_run, tracking_uri  # noqa: E402

log = logging.getLogger("hllm.pipelines.full")


@dataclass
class SmokeTest:
    """The deployed student's answer to one real request over HTTP."""

    url: str
    top5: list[int]  # the candidates it put first, by index
    latency_ms: float  # the request's round trip
    top1_grade: int | None  # the judged grade of its first answer (None: an unjudged slate)


def deploy_and_smoke_test(cfg: PipelineConfig, student_dir: Path) -> SmokeTest:
    """Deploys the student on Ray Serve (loopback) and sends one real request over HTTP."""
    import requests
    from ray import serve

    from pipelines import console
    from serve.app import app_builder
    from serve.common import start_serve

    console.quiet_loggers()  # again: importing Serve configures its logger
    start_serve({"host": "127.0.0.1", "port": cfg.cluster.serve_port})
    serve.run(app_builder({"model": str(student_dir.resolve()), "threads": 1}), name="hllm", route_prefix="/")
    (slate,) = store.head(data_stage.run(cfg, say_reused=False).split_dir("test"), 1)  # the data stage's: one slate read
    body = {"query": slate.query.text, "documents": [c.text for c in slate.candidates], "top_n": 5}
    t0 = time.perf_counter()
    response = requests.post(f"http://127.0.0.1:{cfg.cluster.serve_port}/v1/rerank", json=body, timeout=120)
    latency_ms = 1000 * (time.perf_counter() - t0)
    response.raise_for_status()
    results = response.json()["results"]
    top = [r["index"] for r in results]
    if len(set(top)) != len(top) or not all(0 <= i < len(slate.candidates) for i in top):
        raise RuntimeError(f"smoke test: invalid ranking {top}")
    return SmokeTest(f"http://127.0.0.1:{cfg.cluster.serve_port}/v1/rerank", top, latency_ms,
                     slate.grades[top[0]] if slate.grades else None)


def main(argv: list[str] | None = None) -> None:
    def configure(parser):
        parser.add_argument("--no-serve", action="store_true", help="skip the Serve deployment")
        parser.add_argument("--ablations", metavar="GRID", help="also run this ablation grid (e.g. configs/grids/ablations.yaml) "
                            "on the same teacher rankings, as a child of this run")

    cfg, args = parse_job("hLLM: the whole pipeline on Ray", argv, configure=configure)
    t0 = time.perf_counter()
    init_ray(cfg.cluster)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.output_dir) / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    with mlflow_run(cfg, "full") as parent:
        report, distill_run_id = train_student.run(cfg, parent_run_id=parent.info.run_id)
        smoke = None if args.no_serve else deploy_and_smoke_test(cfg, Path(cfg.output_dir) / "student")
        study = None
        if args.ablations:
            from pipelines import ablations

            study = ablations.run(cfg, ablations.load_grid(args.ablations, []), parent_run_id=parent.info.run_id)
        import mlflow

        if smoke:
            mlflow.log_metric("serve.smoke_latency_ms", smoke.latency_ms)
        summary = summary_lines(report, cfg.eval.main_decoder)
        mlflow.log_text("\n".join(summary), "summary.txt")
        parent_id = parent.info.run_id
    print("=" * 100)
    for line in summary:
        print(line)
    if smoke:
        print(f"serve: {smoke.url} answered top-5 {smoke.top5} in {smoke.latency_ms:.0f} ms (top-1 grade {smoke.top1_grade})")
    if study:
        print(f"ablations: {study.reports[0]} ({len(study.failures)} failed cell runs), mlflow run {study.mlflow_run_id}")
    print(f"mlflow: parent run {parent_id}, distill run {distill_run_id} at {tracking_uri(cfg)}")
    print(f"total {time.perf_counter() - t0:.0f}s")
    if study and study.failures:
        sys.exit(f"{len(study.failures)} ablation cell run(s) failed (listed in {study.reports[0]})")


if __name__ == "__main__":
    main()
