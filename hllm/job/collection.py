"""Reranking a whole collection into a TREC run, with the student or, for comparison, the AR teacher.

    spec = RerankSpec(model="runs/default/student")                 # or teacher="runs/default"
    run = rerank_collection(spec, slates, "run.trec", shard_size=64)   # -> CollectionRun: run.path, run.queries, ...

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hllm.data.order import reorder
from hllm.data.store import merge
from hllm.eval.runfile import ShardedRun
from hllm.records import RerankRequest
from hllm.teacher.endpoint import FailureBudget

@dataclass
class RerankSpec:
    """What ranks the queries and how; travels to Ray actors as a dict."""

    model: str | None = None  # a student: folder, runs:/RUN_ID/student or models:/NAME@ALIAS
    teacher: str | None = None  # or a job's output folder: its AR teacher (config.json says which)
    teacher_url: str | None = None  # or an OpenAI-compatible server's base URL: the AR teacher it serves
    teacher_model: str | None = None  # the served model's name (with teacher_url)
    teacher_api_key_env: str | None = None  # the environment variable holding its API key (with teacher_url)
    concurrency: int = 8  # a served teacher: requests in flight (all actors together)
    qps: float | None = None  # a served teacher: request starts a second (all actors together)
    max_failed_share: float = 0.05  # a served teacher: stop once more queries failed (retries ran out, no ranking)
    window: int | None = None  # None: the student's own window (its config's, else its head's K; teacher: 20)
    stride: int | None = None  # sliding windows' step (None: window // 2)
    windowing: Literal["sliding", "blocks"] = "sliding"
    batch_size: int = 16  # prompts per forward pass
    # and at most this many padded tokens per forward pass (student; None: no cap; auto: a CPU's cap, none on a GPU)
    max_batch_tokens: int | Literal["auto"] | None = "auto"
    device: str = "auto"
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    tag: str = "hllm"  # the run file's last column
    # the order each query's candidates are handed over in (hllm.data.order: first-stage, shuffled[:SEED], reversed),
    # and whether it is declared a first-stage ranking the student's prior may read (None: only the first stage's is)
    input_order: str = "first-stage"
    declare_order: bool | None = None

    def __post_init__(self) -> None:
        from hllm.data.order import InputOrder

        order = InputOrder.parse(self.input_order)
        if self.declare_order and not order.declared:
            raise ValueError(f"input order {order} is no first-stage ranking: it cannot be declared one")
        if sum(x is not None for x in (self.model, self.teacher, self.teacher_url)) != 1:
            raise ValueError("give exactly one of a student model, a teacher job folder or a teacher URL")
        if (self.teacher_url is None) != (self.teacher_model is None):
            raise ValueError("a served teacher needs both its URL and its model's name (--teacher-url, --teacher-model)")

    def ranking_settings(self) -> dict[str, Any]:
        """The fields that decide the rankings, which a resumed run must share with its shards; how the
        work runs (`RUN_ONLY`: batch sizes, token cap, device, threads) may change between runs."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in RUN_ONLY}

    @property
    def first_stage_order(self) -> bool:
        """Whether the candidates go to the student as a declared first-stage ranking."""
        from hllm.data.order import InputOrder

        return InputOrder.parse(self.input_order).declared if self.declare_order is None else self.declare_order


# RerankSpec fields that do not change a ranking (a served teacher's: where it is and how hard it is driven)
RUN_ONLY = ("batch_size", "max_batch_tokens", "device", "threads", "teacher_url", "teacher_api_key_env", "concurrency",
            "qps", "max_failed_share")


class ShardRanker:
    """Loads the ranker once; `__call__(slates) -> (orders, stats)` ranks one shard. A served teacher's
    failures count against `FailureBudget(queries, spec.max_failed_share)`: past it, the shard in hand is not
    written and the run stops (a rerun asks again only what failed; the rest comes from the answer cache)."""

    def __init__(self, spec: RerankSpec, queries: int = 0, answers: str | Path | None = None, workers: int = 1):
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
        elif spec.teacher_url is not None:
            self.teacher = served_teacher(spec, answers, workers)
        else:
            self.teacher = load_job_teacher(spec)
        self.budget = FailureBudget("rerank", queries, spec.max_failed_share) if spec.teacher_url else None

    def __call__(self, slates: Sequence[RerankRequest], progress: Callable[[int], None] | None = None
                 ) -> tuple[list[list[int]], dict[str, Any], list[dict[str, Any]] | None]:
        """A shard, `batch_size` queries at a time (their windows share forward passes); `progress(n)` is
        told after each such group, so a long shard shows its queries done as they are. -> (orders, counts,
        per-query notes: a student's confidence signals and guard trust, None for a teacher)."""
        orders: list[list[int]] = []
        totals: dict[str, Any] = {}
        notes: list[dict[str, Any]] | None = [] if self.spec.model is not None else None
        step = max(1, self.spec.batch_size)
        for start in range(0, len(slates), step):
            part, stats, more = self._rank(slates[start:start + step])
            orders += part
            totals = merge(totals, stats)
            if notes is not None:
                notes += more
            if progress is not None:
                progress(len(part))
        return orders, totals, notes

    def _rank(self, slates: Sequence[RerankRequest]) -> tuple[list[list[int]], dict[str, Any], list[dict[str, Any]]]:
        """-> orders as indices into `slates`' own (first-stage) candidate lists, whatever order `spec.input_order`
        handed the candidates over in."""
        from hllm.data.order import InputOrder

        order = InputOrder.parse(self.spec.input_order)
        perms = [order.permutation(len(s.candidates), s.slate_id, [c.shown for c in s.candidates])
                 for s in slates]  # new position -> first-stage index
        orders, stats, notes = self._rank_as_given([reorder(s, order) for s in slates])
        return [[perm[j] for j in o] for perm, o in zip(perms, orders)], stats, notes

    def _rank_as_given(self, slates: Sequence[RerankRequest]) -> tuple[list[list[int]], dict[str, Any], list[dict[str, Any]]]:
        from hllm.model.prompts import document_text

        if self.spec.model is not None:
            docs = [[document_text(c) for c in s.candidates] for s in slates]
            ranked = self.reranker.windowed_orders([s.query.text for s in slates], docs,
                                                   first_stage_order=self.spec.first_stage_order)
            notes = [{"qid": s.slate_id, "confidence": c.as_dict(), "trust": t, "windows": w}
                     for s, c, t, w in zip(slates, ranked.confidence, ranked.trust, ranked.windows)]
            fell_back = sum(t is not None and t < 1 for t in ranked.trust) if self.spec.first_stage_order else 0
            return ranked.orders, {"queries": len(slates), "windows": sum(ranked.windows), "failed": 0, "fell_back": fell_back,
                                   "unknown_tokens": sum(ranked.unknown_tokens), "shown_tokens": sum(ranked.shown_tokens)}, notes
        rankings, extra = self.teacher.rank_summarized(list(slates))
        if self.budget is not None:
            self.budget.add(rankings)
        orders = [r.permutation if r.permutation is not None else list(range(len(s.candidates)))
                  for s, r in zip(slates, rankings)]
        windows = sum(max(1, len(r.windows)) for r in rankings)
        return orders, {"queries": len(slates), "windows": windows,
                        "failed": sum(r.permutation is None for r in rankings), **extra}, []


def load_job_teacher(spec: RerankSpec):
    """The AR teacher of a job's output folder, generating with the spec's window settings."""
    from hllm.config import from_dict
    from hllm.model.backbones import resolve_device
    from hllm.job.config import JobConfig
    from hllm.job.stages import load_teacher, teacher_model

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


def served_teacher(spec: RerankSpec, answers: str | Path | None, workers: int = 1):
    """The served teacher of `--teacher-url`: RankGPT's prompt, windows as the spec says (20 by default, the
    answers repaired and counted), its share of the concurrency and qps when `workers` processes ask at once."""
    from hllm.model.prompts import PromptConfig
    from hllm.teacher.endpoint import EndpointConfig, EndpointTeacher
    from hllm.teacher.generation import TeacherConfig

    window = spec.window or 20
    endpoint = EndpointConfig(url=spec.teacher_url, model=spec.teacher_model, api_key_env=spec.teacher_api_key_env,
                              concurrency=spec.concurrency, qps=spec.qps).split_among(workers)
    generation = TeacherConfig(window=window, stride=spec.stride or window // 2, windowing=spec.windowing, repair=True)
    return EndpointTeacher(endpoint, PromptConfig(), generation, answers)


def answers_folder(out: str | Path) -> Path:
    """Where `hllm rerank --teacher-url` keeps the server's answers: beside the run file, so a rerun (even of a
    finished run) asks nothing twice; delete it to ask again."""
    return Path(out).with_name(Path(out).name + ".answers")


MapShards = Callable[[RerankSpec, ShardedRun, list[list[RerankRequest]], Callable[[int], None]], None]
"""Ranks and writes the given shards elsewhere (e.g. a Ray actor pool); calls back with queries done."""


@dataclass(frozen=True)
class CollectionRun:
    """What `rerank_collection` wrote: the run file and the counts summed over every shard (resumed ones too)."""

    path: Path
    queries: int
    windows: int  # prefills (student) or generations (teacher), summed over the queries' windows
    shards: int
    resumed_shards: int  # found finished on disk, not ranked again
    failed: int = 0  # teacher answers without a permutation: those queries kept the first-stage order
    fell_back: int = 0  # a student with a declared order: queries its domain guard sent toward the first stage
    unknown_tokens: int = 0  # a student: of the shown tokens, those its vocabulary cannot read
    shown_tokens: int = 0
    endpoint: dict[str, Any] | None = None  # a served teacher's raw figures (hllm.teacher.endpoint.endpoint_figures)
    teacher: dict[str, Any] = field(default_factory=dict)  # a teacher's other counts (tokens generated, ...)

    @classmethod
    def from_totals(cls, path: Path, totals: dict[str, Any], shards: int, resumed: int) -> "CollectionRun":
        named = {f.name for f in dataclasses.fields(cls)} - {"path", "shards", "resumed_shards", "teacher"}
        return cls(path=path, shards=shards, resumed_shards=resumed, **{k: v for k, v in totals.items() if k in named},
                   teacher={k: v for k, v in totals.items() if k not in named})


def rerank_collection(spec: RerankSpec, slates: Sequence[RerankRequest], out: str | Path, shard_size: int = 64,
                      settings: dict[str, Any] | None = None, map_shards: MapShards | None = None,
                      progress: bool = True) -> CollectionRun:
    """Ranks every query not yet on disk into the run file `out`. -> the run file and its counts."""
    from tqdm.auto import tqdm

    run = ShardedRun(out, slates, shard_size, {**spec.ranking_settings(), **(settings or {})})
    todo = run.todo()
    resumed = len(run.shards) - len(todo)
    with tqdm(total=len(slates), initial=len(slates) - sum(len(s) for s in todo), unit="query",
              disable=not progress, desc="rerank") as bar:
        if map_shards is not None:
            map_shards(spec, run, todo, bar.update)
        elif todo:
            ranker = ShardRanker(spec, len(slates), answers_folder(out))
            for shard in todo:  # the bar moves per group of queries, not per shard
                orders, stats, notes = ranker(shard, bar.update)
                run.writer.write(shard, orders, spec.tag, stats, notes)
    totals = run.stats()
    run.finish()
    return CollectionRun.from_totals(run.out, {"queries": 0, "windows": 0, **totals}, len(run.shards), resumed)
