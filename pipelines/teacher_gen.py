"""Teacher generation at scale: Ray Data fans the autoregressive teacher out over an actor pool.

    ray job submit --working-dir . -- python pipelines/teacher_gen.py [--config configs/default.yaml] [key=value ...]
    python pipelines/teacher_gen.py cluster.teacher_actors=2          # local Ray

The library's teacher-rankings stage (`hllm.recipes.stages.teacher_rankings_stage`) decides what is still
to rank, checks completeness and writes the stage's stats; this module only supplies how: each
actor loads the teacher once and, per batch of slates, calls `hllm.recipes.stages.rank_and_write`, which
writes one shard of the rankings store (`hllm.data.store`: typed Parquet, atomic). A restarted run
skips the slates already written and ends with exactly one row per slate. Every split (train,
val, test) is produced this way.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `ray job submit --working-dir .`

import pyarrow as pa  # noqa: E402

from hllm.config import from_dict, to_dict  # noqa: E402
from hllm.data import store  # noqa: E402
from hllm.data.splits import SPLITS, load_splits  # noqa: E402
from hllm.model.backbones import ModelConfig  # noqa: E402
from hllm.recipes.stages import Rankings, RankSlates, bootstrap_teacher_stage, teacher_rankings_stage  # noqa: E402
from hllm.records import RerankRequest  # noqa: E402
from pipelines.common import (PipelineConfig, cluster_has_gpus, init_ray, log_metrics, mlflow_run, parse_job,
                              wait_for_actors)  # noqa: E402

log = logging.getLogger("hllm.pipelines.teacher_gen")


class TeacherActor:
    """Loads the teacher once per actor; ranks a batch of slates and writes its shard."""

    def __init__(self, job: dict[str, Any], teacher_model: dict[str, Any], out_dir: str, use_gpu: bool):
        import ray
        import torch

        from hllm.recipes.stages import load_teacher

        cfg = from_dict(PipelineConfig, job)
        torch.set_num_threads(cfg.threads or 1)
        self.teacher = load_teacher(from_dict(ModelConfig, teacher_model), cfg, "cuda" if use_gpu else "cpu")
        self.out_dir = Path(out_dir)
        self.node_id = ray.get_runtime_context().get_node_id()  # provenance of every row

    def __call__(self, batch: pa.Table) -> dict[str, list]:
        from hllm.recipes.stages import rank_and_write

        slates = store.slates_from_rows(batch.to_pylist())
        items = rank_and_write(self.teacher, slates, self.out_dir, node=self.node_id)
        return {"slate_id": [i.slate.slate_id for i in items]}


def ray_ranker(cfg: PipelineConfig, teacher_model: ModelConfig) -> RankSlates:
    """A `RankSlates` that runs an actor pool of `cluster.teacher_actors` teachers (a GPU each where
    the cluster has GPUs), `cluster.teacher_batch_slates` slates per batch and shard."""
    def rank(slates: list[RerankRequest], directory: Path) -> None:
        import ray

        init_ray(cfg.cluster)
        gpu = cluster_has_gpus(cfg.cluster)
        directory.mkdir(parents=True, exist_ok=True)
        batch = cfg.cluster.teacher_batch_slates
        table = store.slates_table(slates)
        ds = ray.data.from_arrow([table.slice(start, batch) for start in range(0, len(slates), batch)])  # a block per batch
        wait_for_actors(ds, cfg.cluster)
        ranked = ds.map_batches(
            TeacherActor,
            fn_constructor_kwargs={"job": to_dict(cfg), "teacher_model": to_dict(teacher_model),
                                   "out_dir": str(directory), "use_gpu": gpu},
            batch_size=batch, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=cfg.cluster.teacher_actors),
            num_gpus=1 if gpu else 0, num_cpus=cfg.cluster.teacher_cpus_per_actor,
            **({"scheduling_strategy": "SPREAD"} if cfg.cluster.spread else {}),
        )
        ranked.materialize()  # run it; the rows are in the store, the stage reads them from there
    return rank


def run(cfg: PipelineConfig, parent_run_id: str | None = None, splits: tuple[str, ...] = SPLITS
        ) -> tuple[ModelConfig, dict[str, Rankings]]:
    """Bootstrap (or load) the teacher, then its rankings of each split, as one MLflow run."""
    from hllm.model.backbones import resolve_device

    data = load_splits(cfg.data)
    teacher_model = bootstrap_teacher_stage(cfg, data["train"], data["val"], resolve_device(cfg.device))
    with mlflow_run(cfg, "teacher_generation", parent_run_id, teacher=str(teacher_model.path or teacher_model.preset)):
        rankings = {name: teacher_rankings_stage(cfg, teacher_model, name, data[name], ray_ranker(cfg, teacher_model))
                    for name in splits}
        for name, r in rankings.items():
            log_metrics({**r.stats, "actors": cfg.cluster.teacher_actors}, prefix=f"teacher_gen.{name}.")
    return teacher_model, rankings


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_job("Teacher generation with Ray Data", argv)
    _, rankings = run(cfg)
    for name, r in rankings.items():
        s = r.stats
        print(f"teacher rankings {name}: {r.directory} | {s['slates']} slates, resumed {s['resumed_from']} done | "
              f"validity {s['validity']:.3f} | {s['slates_per_s']:.2f} slates/s, {s['output_tokens_per_s']:.0f} output tokens/s")


if __name__ == "__main__":
    main()
