"""Evaluation on Ray: the test rankings stream through an actor pool; the driver adds partial sums.

    ray job submit --working-dir . -- python pipelines/evaluate.py [--config configs/default.yaml] [key=value ...]

The library's evaluation stage (`hllm.job.stages.evaluate_stage`) asks a `ScoreTest` for the sums
of the test split and times a few requests itself; this module supplies the sums from Ray Data: each
shard of the test rankings store is read where it lies (`read_binary_files`: a file is a row) and
handed to one of `cluster.teacher_actors` actors, each holding the student and the teacher (which
decodes freely where its rankings were constrained). A shard comes back as one row, the partial sums
of `hllm.job.stages.shard_sums` (the same batches as in one process), which add up in any order
to exactly the figures of the in-process evaluation. The driver holds a shard's sums at a time, never
a slate.
"""

from __future__ import annotations

import logging
import pickle
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `ray job submit --working-dir .`

import pyarrow as pa  # noqa: E402

from hllm.config import from_dict, to_dict  # noqa: E402
from hllm.data import store  # noqa: E402
from hllm.data.progress import Progress  # noqa: E402
from hllm.model.backbones import ModelConfig  # noqa: E402
from hllm.job.stages import Rankings, ScoreTest, EvalSums  # noqa: E402
from pipelines.common import PipelineConfig, cluster_has_gpus, init_ray, parse_job, wait_for_actors  # noqa: E402

log = logging.getLogger("hllm.pipelines.evaluate")


class EvalActor:
    """Loads the student and the teacher once per actor; a batch of test rankings -> one row, its sums."""

    def __init__(self, job: dict[str, Any], teacher_model: dict[str, Any], student_dir: str, use_gpu: bool):
        import torch

        from hllm.job.stages import load_teacher
        from hllm.reranker import Reranker

        self.cfg = cfg = from_dict(PipelineConfig, job)
        torch.set_num_threads(cfg.threads or 1)
        device = "cuda" if use_gpu else "cpu"
        self.teacher = load_teacher(from_dict(ModelConfig, teacher_model), cfg, device)
        self.reranker = Reranker.load(student_dir, device=device, merge_lora=True, decoder=cfg.eval.main_decoder)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from hllm.job.stages import shard_sums

        parts = [shard_sums(self.reranker, self.teacher, store.shard_rows(b), self.cfg.eval) for b in batch["bytes"].to_pylist()]
        return pa.table({"slates": [p.slates for p in parts], "sums": [pickle.dumps(p) for p in parts]})  # exact Fractions


def ray_scorer(cfg: PipelineConfig, teacher_model: ModelConfig) -> ScoreTest:
    """A `ScoreTest` over an actor pool of `cluster.teacher_actors` (a GPU each where the cluster has
    GPUs), a shard of the test rankings per task (read by Ray Data where it lies: a file is a row);
    logs rows/s and the ETA."""
    def score(student_dir: Path, test: Rankings) -> EvalSums:
        import ray

        init_ray(cfg.cluster)
        gpu = cluster_has_gpus(cfg.cluster)
        ds = ray.data.read_binary_files(str(test.directory), file_extensions=["parquet"])
        wait_for_actors(ds, cfg.cluster)
        sums = ds.map_batches(
            EvalActor,
            fn_constructor_args=(to_dict(cfg), to_dict(teacher_model), str(Path(student_dir).resolve()), gpu),
            batch_size=1, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=cfg.cluster.teacher_actors),
            num_gpus=1 if gpu else 0, num_cpus=cfg.cluster.teacher_cpus_per_actor,
            **({"scheduling_strategy": "SPREAD"} if cfg.cluster.spread else {}),
        )
        progress, total = Progress("evaluation", test.stats.slates, log), None
        for rows in sums.iter_batches(batch_size=None, batch_format="pyarrow"):
            for row in rows.to_pylist():
                part: EvalSums = pickle.loads(row["sums"])
                total = part if total is None else total.merge(part)
                progress.update(row["slates"])
        if total is None:
            raise ValueError(f"evaluation: no test slates in {test.directory}")
        return total
    return score


def main(argv: list[str] | None = None) -> None:
    """Evaluates `output_dir/student` on the test split's teacher rankings (generated or reused)."""
    from hllm.model.backbones import resolve_device
    from hllm.job.stages import evaluate_stage, load_teacher, summary_lines
    from pipelines import teacher_gen

    cfg, _ = parse_job("Evaluation of the student on the test split, on a Ray actor pool", argv)
    teacher_model, rankings = teacher_gen.run(cfg, splits=("test",))
    device = resolve_device(cfg.device)
    report = evaluate_stage(cfg, load_teacher(teacher_model, cfg, device), Path(cfg.output_dir) / "student",
                            rankings["test"], device, ray_scorer(cfg, teacher_model))
    for line in summary_lines(report, cfg.eval.main_decoder):
        print(line)


if __name__ == "__main__":
    main()
