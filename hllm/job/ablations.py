"""The ablation study as data: a grid of variants of the job config, cells trained and evaluated
on one teacher's rankings, and the statistics that compare them.

A grid (YAML, `AblationConfig`) names axes; each variant of an axis is a set of dotted overrides
of the job config, which itself is the reference cell. Cells vary one axis at a time from the
reference (the paper's study); a variant that should cross two axes says so in its overrides
(`{student.head.kind: linear, student.head.positions: 10}`). Variants may change
only the student and its evaluation: every cell reuses the same teacher rankings.

Each cell runs once per seed. Metrics are reported as mean and a Student-t confidence interval over
seeds; decoders are compared paired, on the same score matrices of each seed. The Ray job that
schedules cells and logs them to MLflow is `pipelines/ablations.py`, and its reports (Markdown,
CSV, plots) come from `pipelines/reports.py`; everything here is plain.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from hllm.config import ConfigError, from_dict, set_dotted, to_dict
from hllm.eval.evaluation import evaluate_student, quality
from hllm.eval.metrics import agreement, ir_metrics_per_query, validity_rate
from hllm.model.backbones import ModelConfig
from hllm.job.config import student_ranker_config
from hllm.job.stages import train_student_model
from hllm.records import Candidate, Query, RankedSlate, RerankRequest
from hllm.reranker import Reranker

REFERENCE = "reference"
# table columns: (label, key in a cell's flat metrics); the same names go to MLflow
METRICS: list[tuple[str, str]] = [
    ("nDCG@1", "nDCG@1"), ("nDCG@5", "nDCG@5"), ("nDCG@10", "nDCG@10"), ("MRR@10", "MRR@10"),
    ("Kendall τ", "kendall_tau"), ("top-1 agr.", "top1_agreement"), ("validity", "validity"),
    ("p50 ms", "latency_p50_ms"), ("p95 ms", "latency_p95_ms"), ("rank-1 energy", "rank1_energy"),
]
QUALITY = ("nDCG@1", "nDCG@5", "nDCG@10", "MRR@10", "kendall_tau", "top1_agreement", "validity")  # cells and baselines


@dataclass
class AblationConfig:
    """An ablation grid. The job config is the reference cell; each variant overrides it."""

    axes: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # axis -> variant -> {dotted key: value}
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    confidence: float = 0.95
    # latency: per method, batch 1, interleaved across all cells (the first seed's model) and baselines;
    # the driver holds every cell's student at once, so set 0 to skip it for large backbones
    latency_requests: int = 20
    latency_sizes: list[int] = field(default_factory=lambda: [5, 10, 20, 40])  # latency against N
    latency_size_requests: int = 8
    cpus_per_cell: float = 1.0  # Ray resources of one cell x seed task
    threads_per_cell: int = 1
    gpus_per_cell: float | None = None  # None: 1 where the cluster has GPUs
    reports_dir: str | None = None  # None: <output_dir>/reports
    report_name: str = "ablations"

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"ablation seeds must be distinct and non-empty, got {self.seeds}")
        if not 0 < self.confidence < 1:
            raise ConfigError(f"ablation confidence must be in (0, 1), got {self.confidence}")
        seen: dict[str, dict] = {}
        for axis, variants in self.axes.items():
            if not isinstance(variants, dict) or not variants:
                raise ConfigError(f"ablation axis {axis!r}: expected a mapping of variant -> overrides")
            for name, overrides in variants.items():
                if name == REFERENCE:
                    raise ConfigError(f"ablation axis {axis!r}: {REFERENCE!r} is the unchanged job config")
                if not isinstance(overrides, dict):
                    raise ConfigError(f"ablation {axis}.{name}: overrides must be a mapping, got {overrides!r}")
                if name in seen and seen[name] != overrides:
                    raise ConfigError(f"ablation variant {name!r} appears in two axes with different overrides")
                seen[name] = overrides


@dataclass
class Cell:
    """One configuration of the grid (trained once per seed)."""

    name: str
    axes: list[str]
    overrides: dict[str, Any]
    config: Any  # the job config with the overrides applied


STUDENT_ONLY = ("student", "eval", "seed", "threads", "device")  # top-level sections a variant may change


def expand_cells(grid: AblationConfig, base: Any) -> list[Cell]:
    """-> the reference cell, then each variant (a variant listed under two axes is one cell).

    Every cell's config is built and validated here, before anything trains.
    """
    cells = [Cell(REFERENCE, [], {}, base)]
    by_name: dict[str, Cell] = {}
    base_tree = to_dict(base)
    for axis, variants in grid.axes.items():
        for name, overrides in variants.items():
            if name in by_name:
                by_name[name].axes.append(axis)
                continue
            tree = copy.deepcopy(base_tree)
            for key, value in overrides.items():
                if key.split(".")[0] not in STUDENT_ONLY:
                    raise ConfigError(f"ablation {axis}.{name}: {key!r} is not a student setting; cells share one teacher "
                                      f"and its rankings (allowed sections: {list(STUDENT_ONLY)})")
                set_dotted(tree, key, value)
            try:
                config = from_dict(type(base), tree)
            except ConfigError as err:
                raise ConfigError(f"ablation {axis}.{name}: {err}") from None
            by_name[name] = Cell(name, [axis], dict(overrides), config)
            cells.append(by_name[name])
    return cells


def with_seed(config: Any, seed: int) -> Any:
    """The cell's config for one seed: the job seed and the student's training seed."""
    train = dataclasses.replace(config.student.train, seed=seed)
    return dataclasses.replace(config, seed=seed, student=dataclasses.replace(config.student, train=train))


# ---- one cell -------------------------------------------------------------------------------------
def train_cell(config: Any, teacher_model: ModelConfig, train: list[RankedSlate], val: list[RankedSlate],
               test: list[RankedSlate], out_dir: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Trains one cell x seed with the student stage's own trainer (`train_student_model`: the same
    filter, parameter groups and loop as every other path), saves it to `out_dir` and evaluates every
    decoder on the test matrices through the `Reranker` path.
    -> {"decoders", "matrix", "per_query", "history", "train_s", "examples"}."""
    rcfg = student_ranker_config(config, teacher_model)
    t0 = time.perf_counter()
    ranker, history, dropped = train_student_model(rcfg, config.student, train, val, device)
    train_s = time.perf_counter() - t0
    ranker.save(out_dir)
    slates = [t.slate for t in test]
    evaluation = evaluate_student(Reranker(ranker), slates, [t.ranking.permutation for t in test], config.eval)
    return {**dataclasses.asdict(evaluation), "history": history, "train_s": train_s, "examples": len(train) - dropped}


# ---- baselines -----------------------------------------------------------------------------------
@dataclass
class Baseline:
    """A ranking method without a trained head, on the same test slates as the cells."""

    metrics: dict[str, float]  # canonical IR metrics, agreement to the teacher, validity
    per_query: list[float]  # nDCG@10 per slate, in slate-id order (as a cell's)


def baseline_metrics(requests: Sequence[RerankRequest], perms: Sequence[list[int] | None],
                     teacher_perms: Sequence[list[int] | None], rel: int) -> Baseline:
    """Quality (unparseable answers scored as the input order), agreement, validity, per-query nDCG@10."""
    sizes = [len(r.candidates) for r in requests]
    scored = [p if p is not None else list(range(n)) for p, n in zip(perms, sizes)]
    by_qid = ir_metrics_per_query(requests, scored)
    return Baseline({**quality(requests, scored, rel), **agreement(perms, teacher_perms), "validity": validity_rate(perms, sizes)},
                    [by_qid.get(i, float("nan")) for i in sorted(r.slate_id for r in requests)])


def scores_to_perm(scores: np.ndarray) -> list[int]:
    return np.argsort(-np.asarray(scores), kind="stable").tolist()


def slates_of_size(pool: Sequence[RerankRequest], n: int, count: int) -> list[RerankRequest]:
    """`count` slates of exactly n candidates for latency against N: each takes a pool slate's
    query and fills its candidates from that slate and the next ones (relevance is not used)."""
    out = []
    for i in range(count):
        cands: list[Candidate] = []
        j = i
        while len(cands) < n:
            cands += pool[j % len(pool)].candidates
            j += 1
        out.append(RerankRequest(Query(f"{pool[i % len(pool)].slate_id}@{n}", pool[i % len(pool)].query.text), cands[:n]))
    return out


# ---- statistics ---------------------------------------------------------------------------------
def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, int]:
    """-> (mean, half-width of the Student-t interval, n). n < 2 gives a NaN half-width."""
    x = np.asarray([v for v in values if v == v], dtype=float)
    if len(x) == 0:
        return float("nan"), float("nan"), 0
    if len(x) < 2:
        return float(x.mean()), float("nan"), 1
    sem = x.std(ddof=1) / math.sqrt(len(x))
    return float(x.mean()), float(stats.t.ppf(0.5 + confidence / 2, len(x) - 1) * sem), len(x)


def flat_metrics(result: dict[str, Any], decoder: str) -> dict[str, float]:
    """One cell x seed result -> the table's metrics for `decoder` (the keys of `METRICS`)."""
    d = result["decoders"][decoder]
    return {**{key: d[key] for key in QUALITY}, "rank1_energy": result["matrix"]["rank1_energy_mean"]}


@dataclass
class Row:
    """A line of the comparison table: a cell (with one decoder) or a baseline."""

    variant: str
    kind: str  # "cell" or "baseline"
    axes: str
    decoder: str | None  # None for a baseline
    seeds: int
    metrics: dict[str, tuple[float, float]]  # key -> (mean, CI half-width)


@dataclass
class Study:
    """An ablation grid's run (`pipelines/ablations.py`): what its report shows and where it went."""

    rows: list[Row]  # the report's table: every cell with the main decoder, then the baselines
    csv_rows: list[Row]  # every cell with every decoder, then the baselines (the CSV)
    decoders: list[dict[str, Any]]  # decoder_comparison's rows: each decoder against the main one, per cell
    latency_by_n: dict[int, dict[str, dict[str, float]]]  # slate size -> method -> p50 / p95 ms
    failures: list[dict[str, Any]]  # cell x seed runs that failed: variant, seed, error (retried on a re-run)
    reports: list[str]  # the Markdown report, the CSV, the plots
    mlflow_run_id: str  # the grid's parent run


def aggregate(name: str, axes: str, per_seed: list[dict[str, Any]], decoder: str, latency: dict[str, float],
              confidence: float) -> Row:
    """Seeds of one cell -> a Row for `decoder` (latency is per cell, measured once)."""
    flats = [flat_metrics(r, decoder) for r in per_seed]
    metrics = {key: mean_ci([f[key] for f in flats], confidence)[:2] for key in flats[0]}
    metrics["latency_p50_ms"] = (latency.get("p50_ms", float("nan")), float("nan"))
    metrics["latency_p95_ms"] = (latency.get("p95_ms", float("nan")), float("nan"))
    return Row(name, "cell", axes, decoder, len(per_seed), metrics)


def decoder_comparison(name: str, per_seed: list[dict[str, Any]], main: str, confidence: float) -> list[dict[str, Any]]:
    """Paired comparison of each decoder with `main` on the same matrices: per seed, the mean over
    queries of nDCG@10(decoder) - nDCG@10(main); then mean and CI over seeds. Also the share of
    slates where the decoder returns exactly main's permutation, and its time per matrix."""
    out = []
    for dec in per_seed[0]["decoders"]:
        deltas = [float(np.nanmean(np.subtract(r["per_query"][dec], r["per_query"][main]))) for r in per_seed]
        delta, delta_ci, _ = mean_ci(deltas, confidence)
        ndcg, ndcg_ci, _ = mean_ci([r["decoders"][dec]["nDCG@10"] for r in per_seed], confidence)
        out.append({"variant": name, "decoder": dec, "nDCG@10": ndcg, "nDCG@10_ci": ndcg_ci, "delta_vs_main": delta,
                    "delta_ci": delta_ci, "same_as_main": float(np.mean([r["decoders"][dec].get("same_as_main", np.nan)
                                                                          for r in per_seed])),
                    "decode_ms": float(np.mean([r["decoders"][dec]["decode_ms"] for r in per_seed]))})
    return out
