"""Reranking a whole collection into a TREC run, with the student or, for comparison, the AR teacher.

    spec = RerankSpec(model="runs/default/student")                 # or teacher="runs/default"
    path, stats = rerank_collection(spec, slates, "run.trec", shard_size=64)

Queries go in shards (`hllm.eval.runfile.ShardedRun`): each shard is ranked by a `ShardRanker` (loaded
once per process, or once per Ray actor when a caller passes `map_shards`) and written atomically;
a re-run resumes from the shards on disk. Lists longer than the window are ranked in windows, one
prefill (student) or one generation (teacher) per window. A teacher answer that yields no
permutation keeps that query's first-stage order and is counted (`failed`), never hidden.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hllm.eval.runfile import ShardedRun
from hllm.records import RerankRequest

@dataclass
class RerankSpec:
    """What ranks the queries and how; travels to Ray actors as a dict."""

    model: str | None = None  # a student: folder, runs:/RUN_ID/student or models:/NAME@ALIAS
    teacher: str | None = None  # or a job's output folder: its AR teacher (config.json says which)
    window: int | None = None  # None: the student's own window (its config's, else its head's K; teacher: 20)
    stride: int | None = None  # sliding windows' step (None: window // 2)
    windowing: Literal["sliding", "blocks"] = "sliding"
    batch_size: int = 16  # prompts per forward pass
    # and at most this many padded tokens per forward pass (student; None: no cap; auto: a CPU's cap, none on a GPU)
    max_batch_tokens: int | Literal["auto"] | None = "auto"
    device: str = "auto"
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    tag: str = "hllm"  # the run file's last column

    def __post_init__(self) -> None:
        if (self.model is None) == (self.teacher is None):
            raise ValueError("give exactly one of a student model or a teacher job folder")

    def ranking_settings(self) -> dict[str, Any]:
        """The fields that decide the rankings, which a resumed run must share with its shards; how the
        work runs (`RUN_ONLY`: batch sizes, token cap, device, threads) may change between runs."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in RUN_ONLY}


RUN_ONLY = ("batch_size", "max_batch_tokens", "device", "threads")  # RerankSpec fields that do not change a ranking


class ShardRanker:
    """Loads the ranker once; `__call__(slates) -> (orders, stats)` ranks one shard."""

    def __init__(self, spec: RerankSpec):
        import torch

        from hllm.reranker import Reranker

        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        if spec.model is not None:
            self.reranker = Reranker.load(spec.model, device=spec.device, batch_size=spec.batch_size,
                                          stride=spec.stride, windowing=spec.windowing,
                                          max_batch_tokens=spec.max_batch_tokens)
            self.reranker.window = spec.window or self.reranker.default_window  # the default needs the loaded model
        else:
            self.teacher = load_job_teacher(spec)

    def __call__(self, slates: Sequence[RerankRequest], progress: Callable[[int], None] | None = None
                 ) -> tuple[list[list[int]], dict[str, int]]:
        """A shard, `batch_size` queries at a time (their windows share forward passes); `progress(n)` is
        told after each such group, so a long shard shows its queries done as they are."""
        orders: list[list[int]] = []
        totals: dict[str, int] = {}
        step = max(1, self.spec.batch_size)
        for start in range(0, len(slates), step):
            part, stats = self._rank(slates[start:start + step])
            orders += part
            for k, v in stats.items():
                totals[k] = totals.get(k, 0) + v
            if progress is not None:
                progress(len(part))
        return orders, totals

    def _rank(self, slates: Sequence[RerankRequest]) -> tuple[list[list[int]], dict[str, int]]:
        from hllm.model.prompts import document_text

        if self.spec.model is not None:
            docs = [[document_text(c) for c in s.candidates] for s in slates]
            ranked = self.reranker.windowed_orders([s.query.text for s in slates], docs)
            return ranked.orders, {"queries": len(slates), "windows": sum(ranked.windows), "failed": 0,
                                   "unknown_tokens": sum(ranked.unknown_tokens), "shown_tokens": sum(ranked.shown_tokens)}
        rankings = self.teacher.rank(list(slates))
        orders = [r.permutation if r.permutation is not None else list(range(len(s.candidates)))
                  for s, r in zip(slates, rankings)]
        windows = sum(max(1, len(r.windows)) for r in rankings)
        return orders, {"queries": len(slates), "windows": windows,
                        "failed": sum(r.permutation is None for r in rankings)}


def load_job_teacher(spec: RerankSpec):
    """The AR teacher of a job's output folder, generating with the spec's window settings."""
    from hllm.config import from_dict
    from hllm.model.backbones import resolve_device
    from hllm.recipes.job import JobConfig
    from hllm.recipes.stages import load_teacher, teacher_model

    folder = Path(spec.teacher)
    saved = folder / "config.json"
    if not saved.is_file():
        raise FileNotFoundError(f"no job at {spec.teacher!r}: expected the job's output folder with config.json")
    data = json.loads(saved.read_text())
    fields = {f.name for f in dataclasses.fields(JobConfig)}
    cfg = from_dict(JobConfig, {**{k: v for k, v in data.items() if k in fields}, "output_dir": str(folder)})
    window = spec.window or 20
    generation = dataclasses.replace(cfg.teacher.generation, window=window, stride=spec.stride or window // 2,
                                     windowing=spec.windowing, batch_size=spec.batch_size, repair=True)
    cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, generation=generation))
    return load_teacher(teacher_model(cfg), cfg, resolve_device(spec.device))


MapShards = Callable[[RerankSpec, ShardedRun, list[list[RerankRequest]], Callable[[int], None]], None]
"""Ranks and writes the given shards elsewhere (e.g. a Ray actor pool); calls back with queries done."""


def rerank_collection(spec: RerankSpec, slates: Sequence[RerankRequest], out: str | Path, shard_size: int = 64,
                      settings: dict[str, Any] | None = None, map_shards: MapShards | None = None,
                      progress: bool = True) -> tuple[Path, dict[str, int]]:
    """-> (the run file, totals over all shards: queries, windows, failed, resumed shards)."""
    from tqdm.auto import tqdm

    run = ShardedRun(out, slates, shard_size, {**spec.ranking_settings(), **(settings or {})})
    todo = run.todo()
    resumed = len(run.shards) - len(todo)
    with tqdm(total=len(slates), initial=len(slates) - sum(len(s) for s in todo), unit="query",
              disable=not progress, desc="rerank") as bar:
        if map_shards is not None:
            map_shards(spec, run, todo, bar.update)
        elif todo:
            ranker = ShardRanker(spec)
            for shard in todo:  # the bar moves per group of queries, not per shard
                orders, stats = ranker(shard, bar.update)
                run.writer.write(shard, orders, spec.tag, stats)
    totals = run.stats()
    run.finish()
    return run.out, {**totals, "shards": len(run.shards), "resumed_shards": resumed}
