"""The job's stages, one function each: bootstrap the teacher, the teacher's rankings of a split,
train the student, evaluate. The single-process job (`hllm.recipes.local_job`) and the Ray pipelines call
these same functions; what differs is passed in: how slates are ranked (in this process, or a Ray
Data actor pool) and how the student is fitted (in this process, or Ray Train + DeepSpeed).

Each stage writes its output under `output_dir` with a `stage.json` fingerprint (`hllm.data.cache`);
the same inputs and config reuse it. Teacher rankings are written shard by shard to the rankings
store (`hllm.data.store`), so an interrupted generation resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hllm.data import store
from hllm.data.cache import fingerprint, mark_done, stage_done, stage_info
from hllm.data.order import InputOrder, reorder
from hllm.eval.evaluation import (EvalConfig, Means, StudentEval, StudentSums, TeacherSums, add_quality, first_stage_order,
                                  latency_profile, quality_of)
from hllm.data.progress import Progress
from hllm.eval.metrics import input_order_values
from hllm.model.calibration import Calibrator, ReliabilitySums, calibration_report, calibration_sums, fit_calibrator
from hllm.model.confidence import CascadeThresholds
from hllm.job.config import JobConfig, StudentStageConfig, student_ranker_config
from hllm.model.backbones import (EMBEDDED_TEACHER, PROVENANCE, WEIGHTS, ModelConfig, embedded_provenance, file_sha256, load_backbone,
                                  save_backbone, weights_id)
from hllm.model.prompts import PromptBuilder, PromptConfig
from hllm.model.ranker import RankerConfig, SinglePassRanker
from hllm.model.card import CONFIG_FILE, ModelCard, PromptCard, write_model_card
from hllm.records import ParseCounts, RankedSlate, RerankRequest
from hllm.reranker import Reranker
from hllm.teacher.endpoint import EndpointTeacher, FailureBudget, endpoint_figures, endpoint_line
from hllm.teacher.external import FileTeacher
from hllm.teacher.generation import ARTeacher
from hllm.train.loop import bootstrap_teacher, student_examples, train_student

log = logging.getLogger("hllm")


# ---- teacher -------------------------------------------------------------------------------------
def teacher_model(cfg: JobConfig) -> ModelConfig:
    """Where the job's teacher loads from: its bootstrapped weights under `output_dir/teacher`
    (`teacher.bootstrap`), or the configured model. Nothing is trained here."""
    if not cfg.teacher.bootstrap:
        return cfg.teacher.model
    return dataclasses.replace(cfg.teacher.model, preset="hf", path=str(Path(cfg.output_dir) / "teacher" / "model"))


def bootstrap_teacher_stage(cfg: JobConfig, train: list[RerankRequest], val: list[RerankRequest],
                            device: torch.device) -> ModelConfig:
    """-> the ModelConfig that loads the teacher: bootstrapped on the train split's gold rankings
    (the val split's answer loss picks the weights kept) and saved (`teacher.bootstrap`), or the
    configured model as it is."""
    t = cfg.teacher
    saved = teacher_model(cfg)
    if not t.bootstrap:
        return saved
    out = Path(cfg.output_dir) / "teacher"
    key = fingerprint(cfg.data, cfg.prompt, t.model, t.bootstrap_cfg)
    if stage_done(out, key):
        log.info("teacher bootstrap: reusing %s", out)
        return saved
    model, tokenizer = load_backbone(t.model)
    model.to(device)
    builder = PromptBuilder(tokenizer, cfg.prompt, t.model.context_length)
    log.info("teacher bootstrap: fine-tuning %s (%s) on %d gold rankings, %d held out", t.model.preset,
             t.bootstrap_cfg.adapt.mode, len(train), len(val))

    def progress(step: int, row: dict) -> None:
        held_out = f", held-out answer loss {row['val_answer_nll']:.4f}" if "val_answer_nll" in row else ""
        log.info("  bootstrap step %d loss %.4f%s (%.0fs)", step, row["loss"], held_out, row["elapsed_s"])

    model, history = bootstrap_teacher(model, builder, train, t.bootstrap_cfg, log=progress, val=val)
    save_backbone(model, tokenizer, out / "model")
    last = history[-1]
    mark_done(out, key, steps=len(history), seconds=last["elapsed_s"], final_loss=last["loss"],
              **{k: last[k] for k in ("kept_step", "kept_val_answer_nll") if k in last})
    return saved


def export_teacher(run_dir: str | Path, to: str | Path = EMBEDDED_TEACHER) -> dict[str, Any]:
    """A job's bootstrapped teacher -> a model folder with `provenance.json` (what `embedded` loads):
    the recipe (data, prompt, model, bootstrap settings), the bootstrap's record (steps, seconds,
    the kept step and its held-out loss), the job's test figures where it has them, and the
    weights' SHA-256. -> the provenance."""
    run_dir, to = Path(run_dir), Path(to)
    source = run_dir / "teacher" / "model"
    if stage_info(run_dir / "teacher") is None or not (source / WEIGHTS).is_file():
        raise FileNotFoundError(f"no finished teacher bootstrap under {run_dir} (teacher/stage.json, teacher/model)")
    job = json.loads((run_dir / "config.json").read_text())
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").is_file() else None
    to.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        shutil.copy2(f, to / f.name)
    provenance = {
        "made_by": f"hllm export-teacher {run_dir}",
        "recipe": {"data": job["data"], "prompt": job["prompt"], "model": job["teacher"]["model"],
                   "bootstrap_cfg": job["teacher"]["bootstrap_cfg"]},
        "bootstrap": stage_info(run_dir / "teacher"),
        "test": None if report is None else {
            "slates": report["test_slates"], "first_stage_nDCG@10": report["first_stage"]["nDCG@10"],
            "teacher_nDCG@10": report["teacher"]["nDCG@10"], "teacher_decoding": report["teacher_decoding"]},
        "sha256": file_sha256(to / WEIGHTS),
    }
    (to / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    return provenance


Teacher = ARTeacher | FileTeacher | EndpointTeacher  # what ranks slates: a model here, a file of what one wrote, a server


def answers_dir(cfg: JobConfig) -> Path:
    """Where a served teacher's answers are kept (`hllm.teacher.endpoint.AnswerCache`): one folder for the
    job, so every split and every rerun shares what was paid for."""
    return Path(cfg.output_dir) / "teacher-answers"


def load_teacher(model_cfg: ModelConfig, cfg: JobConfig, device: torch.device | str) -> Teacher:
    """The job's teacher: a server (`teacher.endpoint`), its rankings file (`teacher.rankings`), else the
    model, loaded on `device`."""
    if cfg.teacher.endpoint.url is not None:
        return EndpointTeacher(cfg.teacher.endpoint, cfg.prompt, cfg.teacher.generation, answers_dir(cfg))
    if cfg.teacher.rankings is not None:
        return FileTeacher(cfg.teacher.rankings_format, cfg.teacher.rankings)
    if model_cfg.preset == "embedded":
        check_embedded_prompt(cfg.prompt)
    model, tokenizer = load_backbone(model_cfg)
    tokenizer.padding_side = "left"
    return ARTeacher(model.to(device), tokenizer, cfg.prompt, model_cfg.context_length, cfg.teacher.generation)


def check_embedded_prompt(prompt: PromptConfig) -> None:
    """The shipped teacher writes rankings for the prompt it was bootstrapped on, and no other."""
    trained = embedded_provenance()["recipe"]["prompt"]
    differs = {k: (v, trained[k]) for k, v in dataclasses.asdict(prompt).items() if k in trained and trained[k] != v}
    if differs:
        raise ValueError("the embedded teacher was bootstrapped on another prompt: " + ", ".join(
            f"prompt.{k}={v!r} (trained: {t!r})" for k, (v, t) in differs.items())
            + "; use its prompt, or bootstrap a teacher for this one (teacher.model.preset=tiny teacher.bootstrap=true)")


def generation_key(cfg: JobConfig, teacher_model: ModelConfig) -> str:
    """Identifies a teacher's rankings: data, prompt, teacher weights and decoding settings; for rankings
    from a file, the data and the file (its format and SHA-256); for a served teacher, the data, the prompt, the
    served model's name and what shapes its answers (windows, repair, max tokens), not the URL nor how hard
    the server is driven."""
    if cfg.teacher.endpoint.url is not None:
        e, g = cfg.teacher.endpoint, cfg.teacher.generation
        return fingerprint(cfg.data, cfg.prompt, "teacher endpoint", e.model, e.max_tokens,
                           {k: getattr(g, k) for k in ("window", "stride", "windowing", "repair", "max_new_tokens")})
    if cfg.teacher.rankings is not None:
        return fingerprint(cfg.data, "teacher rankings file", cfg.teacher.rankings_format, file_sha256(Path(cfg.teacher.rankings)))
    weights = stage_info(Path(cfg.output_dir) / "teacher") if cfg.teacher.bootstrap else weights_id(teacher_model)
    return fingerprint(cfg.data, cfg.prompt, teacher_model, cfg.teacher.generation, weights or "")


# ---- teacher rankings ----------------------------------------------------------------------------
RankSlates = Callable[[store.SplitSlates, Path], "dict[str, Any] | None"]
"""Ranks the split's slates not yet in the store folder with the teacher and writes them there (shards,
atomically); -> figures of the run worth keeping (e.g. the workers' peak memory), or None."""


def ranking_summary(items: Sequence[RankedSlate]) -> store.Summary:
    """A shard's additive summary for the store's footer: parse counts, tokens, latency, input-order
    agreement (sums, so any set of shards totals exactly), provenance."""
    same, taus = input_order_values([i.ranking.permutation for i in items])
    counts = ParseCounts()
    for i in items:
        counts.add(i.ranking.counts)
    nodes: dict[str, int] = {}
    for i in items:
        nodes[i.ranking.node or "local"] = nodes.get(i.ranking.node or "local", 0) + 1
    return {"counts": dataclasses.asdict(counts), "ranked": len(same), "same_as_input": sum(same), "tau_to_input_sum": sum(taus),
            "prompt_tokens": sum(i.ranking.prompt_tokens for i in items),
            "output_tokens": sum(i.ranking.output_tokens for i in items),
            "latency_s": sum(i.ranking.latency_s for i in items), "nodes": nodes,
            "failed": sum(bool(i.ranking.failure) for i in items)}


def rank_and_write(teacher: Teacher, slates: list[RerankRequest], directory: Path, node: str = "") -> list[RankedSlate]:
    """One shard: the teacher ranks `slates`, the rows go to `directory` atomically, its summary in the footer
    with what the teacher adds (a file's: how it fit the slates, `hllm.teacher.external.Coverage`)."""
    rankings, extra = teacher.rank_summarized(slates)
    items = [RankedSlate(s, dataclasses.replace(r, node=node)) for s, r in zip(slates, rankings)]
    store.write_shard(items, directory, {**ranking_summary(items), **extra})
    return items


def rank_in_process(teacher: Teacher, shard_slates: int = 64, max_failed_share: float = 1.0) -> RankSlates:
    """The local `RankSlates`: this process's teacher, a shard per `shard_slates` slates still to rank; stops
    once more than `max_failed_share` of the split failed (`FailureBudget`)."""
    def rank(source: store.SplitSlates, directory: Path) -> None:
        done = set(store.finished_ids(directory))
        progress = Progress(f"teacher rankings {source.split}", source.count - len(done), log)
        budget = FailureBudget(source.split, source.count, max_failed_share)
        for batch in source.batches(shard_slates):
            pending = [s for s in batch if s.slate_id not in done]
            if pending:
                budget.add([i.ranking for i in rank_and_write(teacher, pending, directory)])
                progress.update(len(pending))
    return rank


@dataclass
class RankingStats:
    """A split's teacher rankings in figures: totals over the store's footers (every slate's), and what this run
    generated (slates ranked now, throughput)."""

    slates: int
    counts: ParseCounts  # how the answers parsed
    same_as_input: float  # share of the rankings identical to the input (first-stage) order
    tau_to_input: float  # their mean Kendall tau to it
    rankings: int  # slates with a ranking
    nodes: dict[str, int]  # slates ranked per node
    generated_now: int = 0
    resumed_from: int = 0  # slates already in the store when this run started
    seconds: float = 0.0
    slates_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    coverage: dict[str, Any] | None = None  # a rankings file's cover of the split (hllm.teacher.external.Coverage)
    endpoint: dict[str, Any] | None = None  # a served teacher's figures (hllm.teacher.endpoint.endpoint_figures)
    ranker: dict[str, Any] = field(default_factory=dict)  # what the ranking function reported (Ray: worker peak MB, batches by node)

    @classmethod
    def from_summary(cls, summary: store.Summary, **run: Any) -> RankingStats:
        """A store's summary (its footers added up) and this run's figures (`run`: generated_now, seconds, ...)."""
        ranked = summary.get("ranked", 0)
        return cls(summary["slates"], ParseCounts(**summary.get("counts", {})),
                   summary["same_as_input"] / ranked if ranked else float("nan"),
                   summary["tau_to_input_sum"] / ranked if ranked else float("nan"), ranked, summary.get("nodes", {}),
                   coverage=summary.get("coverage"), **run)

    @property
    def validity(self) -> float:
        return self.counts.validity

    def to_json(self) -> dict[str, Any]:
        """As `stage.json` keeps it and MLflow logs it: the ranker's own figures at the top level."""
        out = {"slates": self.slates, "counts": dataclasses.asdict(self.counts), "validity": self.validity,
               "same_as_input": self.same_as_input, "tau_to_input": self.tau_to_input, "rankings": self.rankings,
               "nodes": self.nodes, **({"coverage": self.coverage} if self.coverage is not None else {}),
               "generated_now": self.generated_now, "resumed_from": self.resumed_from, "seconds": self.seconds,
               "slates_per_s": self.slates_per_s, "output_tokens_per_s": self.output_tokens_per_s,
               "prompt_tokens_per_s": self.prompt_tokens_per_s, **self.ranker}
        return out | ({"endpoint": self.endpoint} if self.endpoint is not None else {})


@dataclass
class Rankings:
    """A split's teacher rankings, complete: one per slate. The figures come from the store's footers;
    the rows are read only when asked for (`items`: in the split's order where the split was held in
    this process, else by slate id)."""

    split: str
    directory: Path
    key: str  # the generation fingerprint
    stats: RankingStats
    order: list[str] | None = None  # slate ids in the split's order, where known

    @functools.cached_property
    def items(self) -> list[RankedSlate]:
        rows = store.read_rankings(self.directory)
        if self.order is None:
            return rows
        by_id = {i.slate.slate_id: i for i in rows}
        return [by_id[i] for i in self.order]

    @property
    def slates(self) -> list[RerankRequest]:
        return [i.slate for i in self.items]

    @property
    def permutations(self) -> list[list[int] | None]:
        return [i.ranking.permutation for i in self.items]

    @property
    def counts(self) -> ParseCounts:
        return self.stats.counts


def teacher_rankings_stage(cfg: JobConfig, teacher_model: ModelConfig, split: str,
                           slates: Sequence[RerankRequest] | store.SplitSlates, rank: RankSlates,
                           known: Sequence[RankedSlate] = ()) -> Rankings:
    """The teacher's rankings of one split: reused when complete, otherwise the slates not yet in
    the store are ranked by `rank` (resuming an interrupted run). `slates`: held in this process, or
    the data stage's shards. Complete means exactly one row per slate: the store's footers give its
    count and id sum, which must equal the split's. `known`: rankings of some of these slates already paid for
    (a served teacher's answers in the traffic log), written to a fresh store first so only the rest are asked."""
    source = slates if isinstance(slates, store.SplitSlates) else store.SplitSlates.held(split, slates)
    key = generation_key(cfg, teacher_model)
    directory = Path(cfg.output_dir) / "rankings" / f"{split}-{key}"
    before = store.index(directory, ranking_summary)
    if known and before.slates == 0:
        store.write_shard(list(known), directory)
        log.info("teacher rankings %s: %d of %d slates' rankings reused (the served teacher's, from the traffic log)",
                 split, len(known), source.count)
        before = store.index(directory, ranking_summary)
    complete = lambda ix: ix.slates == source.count and ix.id_sum == source.id_sum  # noqa: E731
    t0, extra = time.perf_counter(), None
    if before.summary.get("failed") and not stage_done(directory, key):  # a run that stopped: its failed slates again
        retried = store.drop_shards(directory, lambda summary: summary.get("failed", 0) > 0)
        log.info("teacher rankings %s: %d slates failed in an earlier run; their shards (%d slates) are ranked again, "
                 "what was answered coming from the answer cache", split, before.summary["failed"], retried)
        before = store.index(directory, ranking_summary)
    if not complete(before):
        log.info("teacher rankings %s: %d slates, %d already in the store, %d to go", split, source.count,
                 before.slates, source.count - before.slates)
        extra = rank(source, directory)
    elapsed = time.perf_counter() - t0
    after = store.index(directory, ranking_summary)
    if not complete(after):
        raise RuntimeError(
            f"teacher rankings {split} incomplete: {after.slates} rows in {directory} for {source.count} slates "
            + (f"({source.count - after.slates} slates missing)" if after.slates < source.count else
               "(slates written twice)" if after.slates > source.count else "(rows of other slates)"))
    fresh = {k: after.summary.get(k, 0) - before.summary.get(k, 0) for k in ("output_tokens", "prompt_tokens")}
    generated = after.slates - before.slates
    if after.summary.get("failed"):  # within the budget while ranking; a store made under a looser one is refused here
        budget = FailureBudget(split, source.count, cfg.teacher.max_failed_share)
        budget.add_counts(after.summary.get("endpoint", {}).get("failures", {"unknown": after.summary["failed"]}), {})
    stats = RankingStats.from_summary(
        after.summary, generated_now=generated, resumed_from=before.slates, seconds=elapsed,
        slates_per_s=generated / elapsed if generated else 0.0,
        output_tokens_per_s=fresh["output_tokens"] / elapsed if generated else 0.0,
        prompt_tokens_per_s=fresh["prompt_tokens"] / elapsed if generated else 0.0, ranker=extra or {},
        endpoint=endpoint_figures(after.summary["endpoint"], elapsed if generated else None, generated, cfg.teacher.endpoint)
        if "endpoint" in after.summary else None)
    rankings = Rankings(split, directory, key, stats, [s.slate_id for s in source.slates] if source.slates is not None else None)
    if generated or not stage_done(directory, key):
        log.info("teacher rankings %s: %d slates (%d ranked now in %.1fs), parse %s, same as input order %.3f, "
                 "Kendall tau to input order %.3f", split, source.count, generated, elapsed, rankings.counts,
                 stats.same_as_input, stats.tau_to_input)
        if stats.endpoint is not None:
            log.info("teacher endpoint %s: %s", split, endpoint_line(stats.endpoint))
        if stats.coverage and (stats.coverage.get("uncovered") or stats.coverage.get("missing_ids")):
            log.warning("teacher rankings %s from %s: %s", split, cfg.teacher.rankings, stats.coverage)
        mark_done(directory, key, **stats.to_json())
    return rankings


# ---- student -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StudentFit:
    """What fitting the student did: the student stage's `Fit` returns it, its `stage.json` keeps it (None fields left out)."""

    steps: int
    seconds: float
    final_loss: float
    val_loss: float | None = None  # the held-out (val) loss at the last evaluation
    stopped_early: bool = False
    dropped_slates: int | None = None  # in process: training slates without a teacher permutation
    resumed_from_step: int | None = None  # Ray Train: the checkpoint step it resumed from (0: from scratch)
    slates_per_s: float | None = None  # Ray Train: all workers together
    worker_peak_mb: float | None = None  # Ray Train: the largest worker's peak RSS

    def record(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


Fit = Callable[[RankerConfig, Rankings, Rankings, Path], StudentFit]
"""Trains the student described by the ranker config on the train rankings (held-out loss on the
val rankings), saves it to the folder; -> what it did."""


def train_student_model(rcfg: RankerConfig, student: StudentStageConfig, train: Sequence[RankedSlate],
                        val: Sequence[RankedSlate], device: torch.device | str,
                        log_fn: Callable[[int, dict], None] | None = None) -> tuple[SinglePassRanker, list[dict], int]:
    """Builds and trains a student in this process. -> (ranker, history, slates dropped by the filter)."""
    torch.manual_seed(student.train.seed)  # the head's initialisation
    ranker = SinglePassRanker.build(rcfg).to(device)
    examples, dropped = student_examples(ranker.prompts, train, student.loss, student.train_orders)
    held_out, _ = student_examples(ranker.prompts, val, student.loss)
    log.info("student: training %s head, %s backbone on %d slates (%d dropped without a teacher permutation), "
             "%d held out", rcfg.head.kind, rcfg.adapt.mode, len(examples), dropped, len(held_out))
    history = train_student(ranker, examples, student.train, student.loss, held_out, log=log_fn)
    return ranker, history, dropped


def history_summary(history: list[dict], dropped: int) -> StudentFit:
    last = history[-1]
    return StudentFit(last["step"], last["elapsed_s"], last["loss"], last.get("val_loss"), bool(last.get("stopped_early")), dropped)


def fit_in_process(cfg: JobConfig, device: torch.device) -> Fit:
    def fit(rcfg: RankerConfig, train: Rankings, val: Rankings, out: Path) -> StudentFit:
        ranker, history, dropped = train_student_model(
            rcfg, cfg.student, train.items, val.items, device,
            lambda step, row: log.info("  student step %d loss %.4f%s (%.0fs)", step, row["loss"],
                                       f" val {row['val_loss']:.4f}" if "val_loss" in row else "", row["elapsed_s"]))
        ranker.save(out, bundle_base=True)
        return history_summary(history, dropped)
    return fit


class DegenerateTeacher(RuntimeError):
    """The teacher's rankings are not worth distilling (unparseable, or a copy of the input order)."""


def check_teacher(train: Rankings, student: StudentStageConfig, bootstrapped: bool = False) -> None:
    """Refuses to distil a teacher whose train rankings fail the student stage's thresholds."""
    validity, copy = train.counts.validity, train.stats
    problems = []
    if validity < student.min_teacher_validity:
        problems.append(f"validity {validity:.3f} < student.min_teacher_validity {student.min_teacher_validity}")
    if copy.rankings and copy.same_as_input > student.max_teacher_same_as_input:
        problems.append(f"{copy.same_as_input:.1%} of its answers repeat the input (first-stage) order "
                        f"> student.max_teacher_same_as_input {student.max_teacher_same_as_input}")
    if copy.rankings and copy.tau_to_input > student.max_teacher_tau_to_input:
        problems.append(f"mean Kendall tau to the input order {copy.tau_to_input:.3f} "
                        f"> student.max_teacher_tau_to_input {student.max_teacher_tau_to_input}")
    if problems:
        raise DegenerateTeacher(
            f"refusing to distil the teacher's {train.split} rankings ({train.directory}): " + "; ".join(problems)
            + ". " + ("The bootstrapped teacher has not learned to rank: more train queries or steps, "
                      "teacher.bootstrap_cfg.shuffle_candidates, or a stronger model" if bootstrapped else
                      "A teacher that cannot rank zero-shot can be fine-tuned on the train qrels first "
                      "(teacher.bootstrap=true)") + "; to distil it anyway, relax the threshold.")


def train_student_stage(cfg: JobConfig, teacher_model: ModelConfig, train: Rankings, val: Rankings, fit: Fit,
                        fit_key: Any = None) -> Path:
    """The student, distilled from the train rankings by `fit`; reused when its inputs are unchanged.
    `fit_key` is what else changes the result (e.g. DeepSpeed settings)."""
    out = Path(cfg.output_dir) / "student"
    rcfg = student_ranker_config(cfg, teacher_model)
    key = fingerprint(rcfg, cfg.student.train, cfg.student.loss, cfg.student.train_orders, train.key, fit_key)
    if stage_done(out, key):
        log.info("student: reusing %s", out)
    else:
        check_teacher(train, cfg.student, cfg.teacher.bootstrap)
        shutil.rmtree(out, ignore_errors=True)  # a stale calibration or cascade must not outlive its student
        done = fit(rcfg, train, val, out)
        write_model_card(out, job_model_card(cfg, rcfg, train, done))
        mark_done(out, key, **done.record())
    if (out / CONFIG_FILE).is_file() and Calibrator.load(out) is None:
        try:
            calibrate_student(out, val.slates, cfg.eval.binary_rel)
        except ValueError as err:  # e.g. a val split without relevant items: said, and scores stay rank-derived
            log.warning("student: not calibrated (%s); relevance_score stays rank-derived", err)
    if (out / CONFIG_FILE).is_file() and CascadeThresholds.load(out) is None:
        cascade_thresholds(out, val.slates)
    return out


def cascade_thresholds(student_dir: Path, held_out: Sequence[RerankRequest]) -> CascadeThresholds:
    """The quantiles of the student's confidence on held-out training-side slates (the val split), saved with it: a
    cascade asks for "about 25%" of traffic without refitting (hllm.serving.cascade)."""
    from hllm.serving.cascade import fit_thresholds

    table = fit_thresholds(Reranker.load(student_dir, merge_lora=True), held_out, "the job's val split")
    table.save(student_dir)
    log.info("student: cascade thresholds from %d val slates (margin below %.4g: about 25%% of them)", len(held_out),
             table.threshold("margin", 0.25))
    return table


def calibrate_student(student_dir: Path, held_out: Sequence[RerankRequest], rel: int) -> Calibrator:
    """Fits P(relevant) on held-out slates (the val split: never trained on) and saves it with the student."""
    reranker = Reranker.load(student_dir, merge_lora=True)
    calibrator = fit_calibrator(*_scored(reranker, held_out, reranker.score_slates(held_out)), rel)
    calibrator.save(student_dir)
    log.info("student: calibrated on %s held-out slates (%s items, %s relevant)", *calibrator.fitted_on.values())
    return calibrator


def job_model_card(cfg: JobConfig, rcfg: RankerConfig, train: Rankings, done: StudentFit) -> ModelCard:
    """What a served student knows: its base model, what it was trained on and how, its limits."""
    m, t = rcfg.model, cfg.teacher
    teacher = f"{t.model.preset}{' ' + t.model.path if t.model.path else ''}" + \
        (" bootstrapped on the train queries' qrels" if t.bootstrap else "")
    if t.endpoint.url is not None:
        teacher = f"{t.endpoint.model} behind an OpenAI-compatible endpoint"
    if t.rankings is not None:
        teacher = f"rankings read from {Path(t.rankings).name} ({t.rankings_format}, sha256 {file_sha256(Path(t.rankings))[:16]})"
    data = cfg.data
    return ModelCard(
        base_model=(f"{t.model.preset} (the teacher's weights)" if cfg.student.init_from_teacher
                    else f"{m.preset}{' ' + m.path if m.path else ''}"),
        teacher=teacher,
        training_data={"source": data.source, "path": data.path, "top_n": data.top_n, "train_slates": train.stats.slates},
        vocabulary=("synthetic word-level (the embedded catalogue's words only)" if t.model.preset in ("tiny", "embedded")
                    else "the base model's"),
        positions=rcfg.head.positions,
        prompt=PromptCard(rcfg.prompt.template, rcfg.prompt.max_doc_tokens, m.context_length),
        adapt=rcfg.adapt.mode, head=rcfg.head.kind,
        figures={"loss": cfg.student.loss.terms, "steps": done.steps, "val_loss": done.val_loss},
    )


# ---- evaluation ----------------------------------------------------------------------------------
@dataclass
class EvalSums:
    """Partial sums of the held-out evaluation over a batch of test slates: the first stage, the teacher
    as generated (and decoding freely, where its rankings were constrained), the student under every
    decoder, the calibration bins. `merge` adds another batch's, in any order, to the same figures bit
    for bit: the test split evaluated on an actor pool equals it evaluated in one process."""

    rel: int
    first_stage: Means
    teacher: TeacherSums
    teacher_free: TeacherSums | None
    student: StudentSums
    calibration: ReliabilitySums | None
    shuffled: Means  # the same slates shuffled (SHUFFLED), the order undeclared: "input" its own, "student" the student's
    slates: int = 0
    slate_size: int = 0

    def merge(self, other: "EvalSums") -> "EvalSums":
        self.first_stage.merge(other.first_stage)
        self.shuffled.merge(other.shuffled)
        self.teacher.merge(other.teacher)
        if self.teacher_free is not None and other.teacher_free is not None:
            self.teacher_free.merge(other.teacher_free)
        self.student.merge(other.student)
        if self.calibration is not None and other.calibration is not None:
            self.calibration.merge(other.calibration)
        self.slates += other.slates
        self.slate_size = max(self.slate_size, other.slate_size)
        return self


SHUFFLED = InputOrder("shuffled", 0)  # the job's robustness check: its test slates in one fixed shuffle each


def eval_batch_sums(reranker: Reranker, teacher: Teacher, items: Sequence[RankedSlate], cfg: EvalConfig) -> EvalSums:
    """One batch of test slates with their teacher rankings: scored once by the student (the decoder
    report and the calibration read the same matrices); where the teacher's rankings were constrained,
    the teacher decodes the batch freely too (validity is only informative without the grammar)."""
    slates, rel = [i.slate for i in items], cfg.binary_rel
    matrices = reranker.score_slates(slates)
    first_stage = Means()
    add_quality(first_stage, "", slates, first_stage_order(slates), rel)
    # the student handed the same candidates as a set: one fixed shuffle per slate, no order declared
    moved = [reorder(s, SHUFFLED) for s in slates]
    shuffled = Means()
    add_quality(shuffled, "input/", moved, first_stage_order(moved), rel)
    add_quality(shuffled, "student/", moved, [reranker.decode(m).permutation.tolist()
                                              for m in reranker.score_slates(moved, first_stage_order=False)], rel)
    free = None
    if teacher.decoding == "constrained":
        free = TeacherSums(rel).add(slates, teacher.with_config(constrained=False).rank(slates))
    calibration = None
    if reranker.calibrator is not None:
        calibration = calibration_sums(reranker.calibrator, *_scored(reranker, slates, matrices))
    return EvalSums(rel, first_stage, TeacherSums(rel).add(slates, [i.ranking for i in items]), free,
                    StudentSums(cfg).add(slates, matrices, [i.ranking.permutation for i in items]), calibration,
                    shuffled, slates=len(slates), slate_size=max((len(s.candidates) for s in slates), default=0))


def shard_sums(reranker: Reranker, teacher: Teacher, items: Sequence[RankedSlate], cfg: EvalConfig) -> EvalSums:
    """One shard of the test rankings store, in batches of `eval.batch_slates`: the unit of work of every
    evaluation, so the batches, and with them the figures, do not depend on who evaluates which shard
    or in what order (a batch's float arithmetic, e.g. its padding, is the same wherever it runs; the
    sums are exact)."""
    total = None
    for start in range(0, len(items), cfg.batch_slates):
        sums = eval_batch_sums(reranker, teacher, items[start:start + cfg.batch_slates], cfg)
        total = sums if total is None else total.merge(sums)
    if total is None:
        raise ValueError("evaluation: an empty shard")
    return total


ScoreTest = Callable[[Path, "Rankings"], EvalSums]
"""Evaluates the student folder (and the teacher) on every shard of the test rankings (`shard_sums`)
elsewhere (e.g. an actor pool); -> the merged sums."""


def sums_in_process(reranker: Reranker, teacher: Teacher, test: Rankings, cfg: EvalConfig) -> EvalSums:
    """Every shard of the test rankings in this process, shard after shard."""
    progress, total = Progress("evaluation", test.stats.slates, log), None
    for path in store.shards(test.directory):
        sums = shard_sums(reranker, teacher, store.shard_rows(path), cfg)
        total = sums if total is None else total.merge(sums)
        progress.update(sums.slates)
    if total is None:
        raise ValueError(f"evaluation: no test slates in {test.directory}")
    return total


@dataclass
class EvalReport:
    """The job's held-out comparison: first stage, teacher and student on the same test slates."""

    test_slates: int
    slate_size: int
    first_stage: dict[str, float]
    teacher: dict[str, float]
    teacher_decoding: str  # "constrained", "free" or "file": how the rankings were produced
    teacher_free: dict[str, float] | None  # free decoding, measured apart when the rankings were constrained
    student: StudentEval
    latency: dict[str, dict[str, float]]
    calibration: dict[str, Any] | None = None  # ECE and reliability bins of relevance_score on the test slates
    # the same test slates shuffled (SHUFFLED), no order declared: {"input": the shuffled order's own, "student": ...}
    shuffled: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, sums: EvalSums, latency: dict[str, dict[str, float]], teacher_decoding: str) -> "EvalReport":
        return cls(test_slates=sums.slates, slate_size=sums.slate_size, first_stage=quality_of(sums.first_stage, "", sums.rel),
                   shuffled={who: quality_of(sums.shuffled, f"{who}/", sums.rel) for who in ("input", "student")},
                   teacher=sums.teacher.report(), teacher_decoding=teacher_decoding,
                   teacher_free=sums.teacher_free.report() if sums.teacher_free is not None else None,
                   student=sums.student.report(), latency=latency,
                   calibration=sums.calibration.report() if sums.calibration is not None else None)


def evaluate_stage(cfg: JobConfig, teacher: Teacher, student_dir: Path, test: Rankings, device: torch.device,
                   score: ScoreTest | None = None) -> EvalReport:
    """The student against the first stage and the teacher on every test slate: the quality figures
    are sums over batches (`score`: in this process by default, or an actor pool), so no process
    holds the split; the latency profile times the first `eval.latency_requests` slates here."""
    reranker = Reranker.load(student_dir, device=str(device), merge_lora=True, decoder=cfg.eval.main_decoder)
    sums = score(student_dir, test) if score is not None else sums_in_process(reranker, teacher, test, cfg.eval)
    if sums.slates != test.stats.slates:
        raise RuntimeError(f"evaluation: {sums.slates} slates evaluated of the {test.stats.slates} test slates")
    timed = store.head(test.directory, cfg.eval.latency_requests)
    # a file's rankings: no AR teacher to time; a served one's latency is in the rankings stage's figures (timed
    # here, its answers would come from the answer cache)
    generates = teacher.decoding not in ("file", "endpoint")
    return EvalReport.of(sums, latency_profile(reranker, teacher if generates else None, timed, cfg.eval), teacher.decoding)


def _scored(reranker: Reranker, slates: Sequence[RerankRequest], matrices: list[np.ndarray]):
    """-> (matrices, the reranker's permutations, grades with None for unjudged) for calibration."""
    perms = [reranker.decode(m).permutation for m in matrices]
    return matrices, perms, [s.grades or [None] * len(s.candidates) for s in slates]


def calibration_on(reranker: Reranker, slates: Sequence[RerankRequest],
                   matrices: list[np.ndarray] | None = None) -> dict[str, Any] | None:
    """ECE and reliability bins of the reranker's calibrated scores on `slates` (scored here unless given)."""
    if reranker.calibrator is None:
        return None
    return calibration_report(reranker.calibrator, *_scored(reranker, slates, matrices or reranker.score_slates(slates)))


def summary_lines(report: EvalReport, main_decoder: str) -> list[str]:
    s, t, lat = report.student.decoders[main_decoder], report.teacher, report.latency
    pre, single = lat["bare_prefill"]["p50_ms"], lat["single_pass"]["p50_ms"]
    if "ar_teacher" in lat:
        ar = lat["ar_teacher"]["p50_ms"]
        speed = (f"AR teacher {ar:.1f} ms | bare prefill {pre:.1f} ms | single pass {single:.1f} ms  -> AR/single "
                 f"{ar / single:.1f}x (bound AR/prefill {ar / pre:.1f}x)")
    else:
        speed = f"bare prefill {pre:.1f} ms | single pass {single:.1f} ms (the teacher's rankings came from a file: not timed)"
    validity = (f"validity  teacher {t['validity']:.3f} (its file's answers, as parsed) | student {s['validity']:.3f}"
                if report.teacher_decoding == "file" else
                f"validity  teacher {(report.teacher_free or t)['validity']:.3f} (free decoding, before repair; "
                f"{report.teacher_decoding} decoding gives the rankings) | student {s['validity']:.3f}")
    return [
        f"nDCG@10 over {report.test_slates} test queries: first stage {report.first_stage['nDCG@10']:.4f} | "
        f"teacher {t['nDCG@10']:.4f} | student ({main_decoder}) {s['nDCG@10']:.4f}",
        f"the same test queries shuffled ({SHUFFLED}, no order declared: read as a set): the shuffled order itself "
        f"{report.shuffled['input']['nDCG@10']:.4f} | student {report.shuffled['student']['nDCG@10']:.4f}",
        f"student vs teacher: Kendall tau {s['kendall_tau']:.3f}, top-1 agreement {s['top1_agreement']:.3f} | "
        f"teacher vs first stage: {t['same_as_input']:.1%} of answers identical, Kendall tau {t['tau_to_input']:.3f}",
        validity,
        f"latency p50 @ N={report.slate_size}, batch 1: {speed}, "
        f"single/prefill {lat['single_pass']['over_prefill']:.3f} (median of per-request ratios)",
        "decoders: " + ", ".join(f"{k} {v['nDCG@10']:.4f}" for k, v in report.student.decoders.items())
        + f" | rank-1 energy {report.student.matrix['rank1_energy_mean']:.3f}",
    ] + ([f"relevance_score calibration on {c['items']} test items ({c['positives']} relevant): ECE {c['ece']:.4f}"]
         if (c := report.calibration) else ["relevance_score: not calibrated (rank-derived)"])
