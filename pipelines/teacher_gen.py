"""Teacher generation at scale: Ray Data fans the autoregressive teacher out over an actor pool.

    ray job submit --working-dir . -- python pipelines/teacher_gen.py [--config configs/default.yaml] [key=value ...]
    python pipelines/teacher_gen.py cluster.teacher_actors=2          # local Ray

The slates come from the data stage (`pipelines/data.py`): its Parquet shards are read by Ray Data and
streamed through the actor pool; the driver holds none. The library's teacher-rankings stage
(`hllm.job.stages.teacher_rankings_stage`) decides whether there is anything to rank and checks
completeness from the store's footers (slate count and id sum equal the split's); this module only
supplies how: each actor loads the teacher once and, per batch of slates, calls
`hllm.job.stages.rank_and_write`, which writes one shard of the rankings store (`hllm.data.store`:
typed Parquet, atomic, its summary in the footer). A restarted run skips the slates already written
and ends with exactly one row per slate. Every split (train, val, test) is produced this way.

A served teacher (`teacher.endpoint`, docs/teachers.md) goes the same way: each actor holds an
`hllm.teacher.endpoint.EndpointTeacher` with its share of `teacher.endpoint.concurrency` and `qps`, needs no GPU,
and reports its failed slates per reason with each batch; the driver stops the pool once the split's failures
pass `teacher.max_failed_share` (`FailureBudget`), naming the reason, the count and an example.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `ray job submit --working-dir .`

import pyarrow as pa  # noqa: E402

from hllm.config import from_dict, to_dict  # noqa: E402
from hllm.data import store  # noqa: E402
from hllm.data.progress import Progress  # noqa: E402
from hllm.data.splits import SPLITS  # noqa: E402
from hllm.model.backbones import ModelConfig  # noqa: E402
from hllm.job.stages import Rankings, RankSlates, bootstrap_teacher_stage, teacher_rankings_stage  # noqa: E402
from hllm.teacher.endpoint import FailureBudget  # noqa: E402
from pipelines import data as data_stage  # noqa: E402
from pipelines.common import (PipelineConfig, cluster_has_gpus, init_ray, log_metrics, mlflow_run, parse_job,
                              wait_for_actors)  # noqa: E402

log = logging.getLogger("hllm.pipelines.teacher_gen")


class TeacherActor:
    """Loads the teacher once per actor; ranks a batch of slates and writes its shard. The slates already
    in the store (read from its shards when the actor starts) are skipped, so the driver never needs a
    list of what is done; a retried batch writes the same shard name again (named by its slate ids)."""

    def __init__(self, job: dict[str, Any], teacher_model: dict[str, Any], out_dir: str, use_gpu: bool):
        import ray
        import torch

        from hllm.job.stages import load_teacher

        cfg = from_dict(PipelineConfig, job)
        torch.set_num_threads(cfg.threads or 1)
        self.teacher = load_teacher(from_dict(ModelConfig, teacher_model), cfg, "cuda" if use_gpu else "cpu")
        self.out_dir = Path(out_dir)
        self.done = set(store.finished_ids(self.out_dir))
        self.node_id = ray.get_runtime_context().get_node_id()  # provenance of every row

    def __call__(self, batch: pa.Table) -> pa.Table:
        from hllm.job.stages import rank_and_write
        from hllm.teacher.endpoint import failure_counts

        t0 = time.perf_counter()
        slates = [s for s in store.slates_from_rows(batch.select(["slate"]).to_pylist()) if s.slate_id not in self.done]
        items = rank_and_write(self.teacher, slates, self.out_dir, node=self.node_id) if slates else []
        failures, examples = failure_counts([i.ranking for i in items])
        return pa.table({"ranked": [len(slates)], "skipped": [batch.num_rows - len(slates)],
                         "seconds": [time.perf_counter() - t0], "node": [self.node_id],
                         "peak_mb": [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024],
                         "failures": [json.dumps(failures)], "examples": [json.dumps(examples)]})


def slates_dataset(source: store.SplitSlates, batch: int) -> Any:
    """A split's slates as a Ray dataset of blocks of `batch` slates (a streaming repartition, no
    shuffle: the actor pool gets a block, so a shard, per task): the data stage's shards read where they
    lie, or a split held in this process (e.g. the flywheel's traffic)."""
    import ray

    if source.folder is not None:
        ds = ray.data.read_parquet(str(source.folder), columns=["slate"])
    else:
        ds = ray.data.from_arrow(store.slates_table(source.slates))
    return ds.repartition(target_num_rows_per_block=batch)


def ray_ranker(cfg: PipelineConfig, teacher_model: ModelConfig) -> RankSlates:
    """A `RankSlates` that streams the split through an actor pool of `cluster.teacher_actors` teachers (a
    GPU each where the cluster has GPUs), `cluster.teacher_batch_slates` slates per batch and shard. The
    driver sees one small row per batch (slates ranked, seconds, the worker's node and peak memory) and
    logs rows/s and the ETA; -> the workers' peak RSS and the batches per node."""
    def rank(source: store.SplitSlates, directory: Path) -> dict[str, Any]:
        import ray

        init_ray(cfg.cluster)
        remote = cfg.teacher.rankings is not None or cfg.teacher.endpoint.url is not None
        gpu = cluster_has_gpus(cfg.cluster) and not remote  # a rankings file or a server needs no GPU here
        # a served teacher: the job's concurrency and qps shared among the actors
        job = to_dict(dataclasses.replace(cfg, teacher=dataclasses.replace(
            cfg.teacher, endpoint=cfg.teacher.endpoint.split_among(cfg.cluster.teacher_actors))))
        directory.mkdir(parents=True, exist_ok=True)
        batch = cfg.cluster.teacher_batch_slates
        ds = slates_dataset(source, batch)
        wait_for_actors(ds, cfg.cluster)
        ranked = ds.map_batches(
            TeacherActor,
            fn_constructor_kwargs={"job": job, "teacher_model": to_dict(teacher_model),
                                   "out_dir": str(directory), "use_gpu": gpu},
            batch_size=batch, batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=cfg.cluster.teacher_actors),
            num_gpus=1 if gpu else 0, num_cpus=cfg.cluster.teacher_cpus_per_actor,
            **({"scheduling_strategy": "SPREAD"} if cfg.cluster.spread else {}),
        )
        progress = Progress(f"teacher rankings {source.split}", source.count - store.index(directory).slates, log)
        peak, batches_by_node = 0.0, {}
        budget = FailureBudget(source.split, source.count, cfg.teacher.max_failed_share)
        for rows in ranked.iter_batches(batch_size=None, batch_format="pyarrow"):  # streams: a row per batch
            for r in rows.to_pylist():
                progress.update(r["ranked"])
                peak = max(peak, r["peak_mb"])
                batches_by_node[r["node"]] = batches_by_node.get(r["node"], 0) + 1
                budget.add_counts(json.loads(r["failures"]), json.loads(r["examples"]))  # past the budget: stops here
        return {"worker_peak_mb": round(peak, 1), "batches_by_node": batches_by_node}
    return rank


def split_sources(cfg: PipelineConfig, parent_run_id: str | None = None) -> dict[str, store.SplitSlates]:
    """The data stage (`pipelines/data.py`: Ray Data, reused when done; its MLflow run under `parent_run_id`)
    -> each split's slate shards."""
    shards = data_stage.run_logged(cfg, parent_run_id)
    return {name: store.SplitSlates(name, shards.stats.slates[name], shards.stats.id_sums[name],
                                    folder=shards.split_dir(name)) for name in SPLITS}


def file_coverage(cfg: PipelineConfig, rankings: dict[str, Rankings]) -> dict[str, int]:
    """A rankings file against every split: its queries, and those no slate of the job has (another
    collection's, or a mismatch of ids), logged as warnings where there are any."""
    from hllm.teacher.external import FileTeacher

    queries = FileTeacher(cfg.teacher.rankings_format, cfg.teacher.rankings).queries()
    ranked = sum(r.stats.coverage["ranked"] for r in rankings.values())
    out = {"queries": queries, "other_queries": queries - ranked,
           **{k: sum(r.stats.coverage[k] for r in rankings.values()) for k in ("uncovered", "missing_ids", "outside_slate",
                                                                                    "repeated_ids")}}
    if out["other_queries"] or out["uncovered"]:
        log.warning("teacher rankings file %s: %d of its %d queries are in no split; %d slates it does not rank "
                    "(no permutation: the student skips them)", cfg.teacher.rankings, out["other_queries"], queries,
                    out["uncovered"])
    return out


def run(cfg: PipelineConfig, parent_run_id: str | None = None, splits: tuple[str, ...] = SPLITS
        ) -> tuple[ModelConfig, dict[str, Rankings]]:
    """The data stage, the teacher bootstrapped (or loaded), then its rankings of each split streamed
    from the slate shards, as one MLflow run. The driver holds no slate (a bootstrap reads the train
    and val splits: it fine-tunes on them)."""
    from hllm.model.backbones import resolve_device

    sources = split_sources(cfg, parent_run_id)
    held = (lambda name: sources[name].load()) if cfg.teacher.bootstrap else (lambda name: [])
    teacher_model = bootstrap_teacher_stage(cfg, held("train"), held("val"), resolve_device(cfg.device))
    with mlflow_run(cfg, "teacher_generation", parent_run_id, teacher=str(teacher_model.path or teacher_model.preset)):
        rankings = {}
        for name in splits:
            rankings[name] = r = teacher_rankings_stage(cfg, teacher_model, name, sources[name], ray_ranker(cfg, teacher_model))
            log_metrics({**r.stats.to_json(), "actors": cfg.cluster.teacher_actors,
                         "driver_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
                        prefix=f"teacher_gen.{name}.")
        if cfg.teacher.rankings is not None and set(splits) == set(SPLITS):
            log_metrics(file_coverage(cfg, rankings), prefix="teacher_gen.file.")
    return teacher_model, rankings


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_job("Teacher generation with Ray Data", argv)
    _, rankings = run(cfg)
    for name, r in rankings.items():
        s = r.stats
        print(f"teacher rankings {name}: {r.directory} | {s.slates} slates, resumed {s.resumed_from} done | "
              f"validity {s.validity:.3f} | {s.slates_per_s:.2f} slates/s, {s.output_tokens_per_s:.0f} output tokens/s")


if __name__ == "__main__":
    main()
