"""Teacher generation at scale: Ray Data fans the autoregressive teacher out over an actor pool.

    ray job submit --working-dir . -- python pipelines/teacher_gen.py [--config configs/default.yaml] [key=value ...]
    python pipelines/teacher_gen.py cluster.teacher_actors=2          # local Ray

Input: the training slates of any source the library reads. Output: Parquet shards under
`<output_dir>/rankings/train/`, one row per slate (slate id, candidate ids, teacher permutation,
raw text, parse counts, prompt/output tokens, latency, windows) plus the slate itself, so the
distillation stage needs nothing else. Each actor writes its batch's shard atomically (temp file
+ rename, named by the batch's slate ids); a restarted run skips the slates already written and
ends with exactly one row per slate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hllm.config import from_dict, to_dict
from hllm.records import ParseCounts, RerankRequest, record_to_dict, request_from_dict
from pipelines.common import PipelineConfig, parse_job, cluster_has_gpus, init_ray, log_metrics, mlflow_run

log = logging.getLogger("hllm.pipelines.teacher_gen")
COUNT_FIELDS = ("ok", "wrong_format", "repeated", "missing", "out_of_range")


def shard_name(slate_ids: list[str]) -> str:
    return "part-" + hashlib.sha256("\n".join(sorted(slate_ids)).encode()).hexdigest()[:20] + ".parquet"


def write_shard_atomically(table: pa.Table, directory: Path, name: str) -> None:
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, directory / name)  # readers never see half a shard


def finished_slates(directory: Path) -> list[str]:
    """Slate ids in the complete shards of `directory` (temp files are ignored)."""
    ids: list[str] = []
    for path in sorted(directory.glob("part-*.parquet")):
        ids += pq.read_table(path, columns=["slate_id"]).column("slate_id").to_pylist()
    return ids


class TeacherActor:
    """Loads the teacher once per actor; ranks a batch of slates and writes its shard."""

    def __init__(self, job: dict[str, Any], teacher_model: dict[str, Any], out_dir: str, use_gpu: bool):
        import torch

        from hllm.models import ModelConfig
        from hllm.workflow import load_teacher

        cfg = from_dict(PipelineConfig, job)
        torch.set_num_threads(cfg.threads or 1)
        device = torch.device("cuda" if use_gpu else "cpu")
        self.teacher = load_teacher(from_dict(ModelConfig, teacher_model), cfg, device)
        self.out_dir = Path(out_dir)
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        requests = [request_from_dict(json.loads(s)) for s in batch["slate"]]
        t0 = time.perf_counter()
        rankings = self.teacher.rank(requests)
        elapsed = time.perf_counter() - t0
        rows: dict[str, list] = {
            "slate_id": [r.slate_id for r in rankings],
            "candidate_ids": [[c.docid for c in q.candidates] for q in requests],
            "permutation": [r.permutation for r in rankings],
            "raw_text": [r.raw_text for r in rankings],
            **{f: [getattr(r.counts, f) for r in rankings] for f in COUNT_FIELDS},
            "prompt_tokens": [r.prompt_tokens for r in rankings],
            "output_tokens": [r.output_tokens for r in rankings],
            "latency_s": [r.latency_s for r in rankings],
            "windows": [r.windows for r in rankings],
            "node_id": [self.node_id] * len(rankings),  # provenance: which Ray node ranked it
            "slate": list(batch["slate"]),
        }
        write_shard_atomically(pa.table(rows), self.out_dir, shard_name(rows["slate_id"]))
        return {"slate_id": rows["slate_id"], **{f: rows[f] for f in COUNT_FIELDS},
                "prompt_tokens": rows["prompt_tokens"], "output_tokens": rows["output_tokens"],
                "batch_seconds": [elapsed] * len(rankings)}


def generate(cfg: PipelineConfig, teacher_model: Any, slates: list[RerankRequest], out_dir: Path) -> dict[str, Any]:
    """Ranks every slate not yet in `out_dir`; -> stats over this run plus the completeness check."""
    import ray

    init_ray(cfg.cluster)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = set(finished_slates(out_dir))
    pending = [s for s in slates if s.slate_id not in done]
    log.info("teacher generation: %d slates, %d already done, %d to go, %d actors", len(slates), len(done),
             len(pending), cfg.cluster.teacher_actors)
    t0 = time.perf_counter()
    summary: list[dict] = []
    if pending:
        gpu = cluster_has_gpus(cfg.cluster)
        ds = ray.data.from_items([{"slate_id": s.slate_id, "slate": json.dumps(record_to_dict(s))} for s in pending],
                                 override_num_blocks=max(1, len(pending) // cfg.cluster.teacher_batch_slates))
        ranked = ds.map_batches(
            TeacherActor,
            fn_constructor_kwargs={"job": to_dict(cfg), "teacher_model": to_dict(teacher_model),
                                   "out_dir": str(out_dir), "use_gpu": gpu},
            batch_size=cfg.cluster.teacher_batch_slates,
            compute=ray.data.ActorPoolStrategy(size=cfg.cluster.teacher_actors),
            num_gpus=1 if gpu else 0,
            num_cpus=cfg.cluster.teacher_cpus_per_actor,
            **({"scheduling_strategy": "SPREAD"} if cfg.cluster.spread else {}),
        )
        summary = ranked.take_all()
    elapsed = time.perf_counter() - t0
    ids = finished_slates(out_dir)
    missing = {s.slate_id for s in slates} - set(ids)
    duplicates = len(ids) - len(set(ids))
    if missing or duplicates:
        raise RuntimeError(f"teacher generation incomplete: {len(missing)} slates missing, {duplicates} duplicated in {out_dir}")
    counts = ParseCounts(total=len(summary), **{f: int(sum(r[f] for r in summary)) for f in COUNT_FIELDS})
    out_tokens = sum(r["output_tokens"] for r in summary)
    stats = {
        "slates": len(slates), "generated_now": len(summary), "resumed_from": len(done), "seconds": elapsed,
        "slates_per_s": len(summary) / elapsed if summary else 0.0,
        "output_tokens_per_s": out_tokens / elapsed if summary else 0.0,
        "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in summary) / elapsed if summary else 0.0,
        "actors": cfg.cluster.teacher_actors, "counts": dataclasses.asdict(counts),
        "validity": counts.validity if summary else float("nan"),
    }
    log.info("teacher generation: %s", json.dumps(stats))
    return stats


def read_rankings(out_dir: Path) -> list[dict[str, Any]]:
    """All rows of a finished generation, sorted by slate id."""
    table = pa.concat_tables([pq.read_table(p) for p in sorted(out_dir.glob("part-*.parquet"))])
    return sorted(table.to_pylist(), key=lambda r: r["slate_id"])


def run(cfg: PipelineConfig, parent_run_id: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Bootstrap (or load) the teacher, then generate its rankings of the training split."""
    from hllm.workflow import generation_key, load_splits, prepare_teacher, resolve_device

    splits = load_splits(cfg.data)
    teacher_model = prepare_teacher(cfg, splits, resolve_device(cfg.device))
    out_dir = Path(cfg.output_dir) / "rankings" / f"train-{generation_key(cfg, teacher_model)}"
    with mlflow_run(cfg, "teacher_generation", parent_run_id, teacher=str(teacher_model.path or teacher_model.preset)):
        stats = generate(cfg, teacher_model, splits["train"], out_dir)
        log_metrics(stats, prefix="teacher_gen.")
    return out_dir, stats


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_job("Teacher generation with Ray Data", argv)
    out_dir, stats = run(cfg)
    print(f"teacher rankings: {out_dir} | {stats['slates']} slates, resumed {stats['resumed_from']} done | "
          f"validity {stats['validity']:.3f} | "
          f"{stats['slates_per_s']:.2f} slates/s, {stats['output_tokens_per_s']:.0f} output tokens/s")


if __name__ == "__main__":
    main()
