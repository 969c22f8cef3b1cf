"""The ablation study as data: a grid of variants of the job config, cells trained and evaluated
on one teacher's rankings, and the statistics and reports that compare them.

A grid (YAML, `AblationConfig`) names axes; each variant of an axis is a set of dotted overrides
of the job config, which itself is the reference cell. Cells vary one axis at a time from the
reference (the paper's study); a variant that should cross two axes says so in its overrides
(`{student.ranker.head.kind: linear, student.ranker.head.positions: 10}`). Variants may change
only the student and its evaluation: every cell reuses the same teacher rankings.

Each cell runs once per seed. Metrics are reported as mean and a Student-t confidence interval over
seeds; decoders are compared paired, on the same score matrices of each seed. The Ray job that
schedules cells and logs them to MLflow is `pipelines/ablations.py`; everything here is plain.
"""

from __future__ import annotations

import copy
import csv
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
from hllm.evaluation import decoder_report, quality, score_matrices
from hllm.metrics import agreement, ir_metrics_per_query, validity_rate
from hllm.models import ModelConfig
from hllm.ranker import SinglePassRanker
from hllm.records import Candidate, Query, RerankRequest
from hllm.training import student_examples, train_student

REFERENCE = "reference"
# table columns: (label, key in a cell's flat metrics); the same names go to MLflow
METRICS: list[tuple[str, str]] = [
    ("nDCG@1", "nDCG@1"), ("nDCG@5", "nDCG@5"), ("nDCG@10", "nDCG@10"), ("MRR", "MRR"),
    ("Kendall τ", "kendall_tau"), ("top-1 agr.", "top1_agreement"), ("validity", "validity"),
    ("p50 ms", "latency_p50_ms"), ("p95 ms", "latency_p95_ms"), ("rank-1 energy", "rank1_energy"),
]


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
def train_cell(config: Any, teacher_model: ModelConfig, train: list[RerankRequest], train_perms: list[list[int] | None],
               test: list[RerankRequest], test_perms: list[list[int] | None], out_dir: Path,
               device: torch.device | str = "cpu") -> dict[str, Any]:
    """Trains one cell x seed (the library trainer, same loss step as the Ray Train worker),
    saves the student to `out_dir` and evaluates every decoder on the test matrices.
    -> {"decoders", "per_query", "history", "train_s", "examples"}."""
    from hllm.workflow import student_config  # the job module imports this one's siblings only

    torch.manual_seed(config.seed)  # the head's initialisation
    ranker = SinglePassRanker.build(student_config(config, teacher_model)).to(device)
    examples = student_examples(ranker.prompts, train, train_perms)
    if config.student.loss.needs_teacher:
        examples = [e for e in examples if e.perm is not None]
    t0 = time.perf_counter()
    history = train_student(ranker, examples, config.student.train, config.student.loss)
    train_s = time.perf_counter() - t0
    ranker.save(out_dir)
    ranker.eval()
    report, per_query = decoder_report(test, score_matrices(ranker, test), test_perms, config.eval)
    return {"decoders": report, "per_query": per_query, "history": history, "train_s": train_s,
            "examples": len(examples)}


# ---- baselines -----------------------------------------------------------------------------------
def baseline_metrics(requests: Sequence[RerankRequest], perms: Sequence[list[int] | None],
                     teacher_perms: Sequence[list[int] | None], rel: int) -> dict[str, Any]:
    """Quality (unparseable answers scored as the input order), agreement, validity, per-query nDCG@10."""
    sizes = [len(r.candidates) for r in requests]
    scored = [p if p is not None else list(range(n)) for p, n in zip(perms, sizes)]
    by_qid = ir_metrics_per_query(requests, scored)
    measured = quality(requests, scored, rel)
    mrr = next(v for k, v in measured.items() if k.startswith("RR("))
    return {**measured, "MRR": mrr, **agreement(perms, teacher_perms), "validity": validity_rate(perms, sizes),
            "per_query": [by_qid.get(r.slate_id, float("nan")) for r in requests]}


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


def flat_metrics(decoders: dict[str, dict], decoder: str) -> dict[str, float]:
    """One decoder's metrics under the table's names (MRR from the trec_eval RR key)."""
    d = decoders[decoder]
    mrr = next((v for k, v in d.items() if k.startswith("RR(")), float("nan"))
    return {"nDCG@1": d["nDCG@1"], "nDCG@5": d["nDCG@5"], "nDCG@10": d["nDCG@10"], "MRR": mrr,
            "kendall_tau": d["kendall_tau"], "top1_agreement": d["top1_agreement"], "validity": d["validity"],
            "rank1_energy": decoders.get("matrix", {}).get("rank1_energy_mean", float("nan"))}


@dataclass
class Row:
    """A line of the comparison table: a cell (with one decoder) or a baseline."""

    variant: str
    kind: str  # "cell" or "baseline"
    axes: str
    decoder: str
    seeds: int
    metrics: dict[str, tuple[float, float]]  # key -> (mean, CI half-width)


def aggregate(name: str, axes: str, per_seed: list[dict[str, Any]], decoder: str, latency: dict[str, float],
              confidence: float) -> Row:
    """Seeds of one cell -> a Row for `decoder` (latency is per cell, measured once)."""
    flats = [flat_metrics(r["decoders"], decoder) for r in per_seed]
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
        if dec == "matrix":
            continue
        deltas = [float(np.nanmean(np.subtract(r["per_query"][dec], r["per_query"][main]))) for r in per_seed]
        delta, delta_ci, _ = mean_ci(deltas, confidence)
        ndcg, ndcg_ci, _ = mean_ci([r["decoders"][dec]["nDCG@10"] for r in per_seed], confidence)
        out.append({"variant": name, "decoder": dec, "nDCG@10": ndcg, "nDCG@10_ci": ndcg_ci, "delta_vs_main": delta,
                    "delta_ci": delta_ci, "same_as_main": float(np.mean([r["decoders"][dec].get("same_as_main", np.nan)
                                                                          for r in per_seed])),
                    "decode_ms": float(np.mean([r["decoders"][dec]["decode_ms"] for r in per_seed]))})
    return out


# ---- reports -------------------------------------------------------------------------------------
def _fmt(mean: float, ci: float, digits: int = 4) -> str:
    if mean != mean:
        return "–"
    return f"{mean:.{digits}f}" + ("" if ci != ci else f" ± {ci:.{digits}f}")


def markdown_report(rows: list[Row], decoders: list[dict[str, Any]], latency_by_n: dict[int, dict[str, dict]],
                    meta: dict[str, Any], failures: list[dict[str, Any]]) -> str:
    conf = int(round(100 * meta["confidence"]))
    lines = [f"# Ablations ({meta['cells']} cells × {meta['seeds']} seeds, main decoder {meta['main_decoder']})", "",
             f"Test split: {meta['test_slates']} slates of N = {meta['slate_size']}. Mean ± {conf}% CI (Student t over "
             "seeds); baselines are deterministic given the teacher. Latency: batch 1, p50/p95 over "
             f"{meta['latency_requests']} requests (each cell's first-seed model), every method timed on the same request "
             "before the next.", "",
             "| variant | axis | seeds | " + " | ".join(label for label, _ in METRICS) + " |",
             "| --- | --- | ---: |" + " ---: |" * len(METRICS)]
    for r in rows:
        cells = [_fmt(*r.metrics.get(key, (float("nan"), float("nan"))), digits=1 if key.startswith("latency") else 4)
                 for _, key in METRICS]
        name = f"**{r.variant}**" if r.variant == REFERENCE else r.variant
        lines.append(f"| {name} | {r.axes or ('baseline' if r.kind == 'baseline' else '')} | {r.seeds} | " + " | ".join(cells) + " |")
    lines += ["", f"## Decoders on the same matrices (paired; Δ = nDCG@10 − {meta['main_decoder']}'s, per seed, then mean ± {conf}% CI)",
              "", "| variant | decoder | nDCG@10 | Δ vs main | same permutation as main | decode ms |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for d in decoders:
        lines.append(f"| {d['variant']} | {d['decoder']} | {_fmt(d['nDCG@10'], d['nDCG@10_ci'])} | "
                     f"{_fmt(d['delta_vs_main'], d['delta_ci'])} | {100 * d['same_as_main']:.1f}% | {d['decode_ms']:.3f} |")
    if latency_by_n:
        lines += ["", "## Latency against N (p50 ms, batch 1)", "", "| N | " + " | ".join(next(iter(latency_by_n.values()))) + " |",
                  "| ---: |" + " ---: |" * len(next(iter(latency_by_n.values())))]
        for n, methods in latency_by_n.items():
            lines.append(f"| {n} | " + " | ".join(f"{m['p50_ms']:.1f}" for m in methods.values()) + " |")
    if failures:
        lines += ["", f"## Failed cells ({len(failures)})", ""] + [f"- {f['variant']} seed {f['seed']}: {f['error']}" for f in failures]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[Row], decoders: list[dict[str, Any]], path: Path) -> None:
    """One line per (variant, decoder): every metric's mean and CI half-width."""
    keys = [key for _, key in METRICS]
    extra = {(d["variant"], d["decoder"]): d for d in decoders}
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["variant", "kind", "axes", "decoder", "seeds", *[f"{k}{s}" for k in keys for s in ("", "_ci")],
                    "delta_ndcg10_vs_main", "delta_ci", "same_as_main", "decode_ms"])
        for r in rows:
            d = extra.get((r.variant, r.decoder), {})
            w.writerow([r.variant, r.kind, r.axes, r.decoder, r.seeds,
                        *[v for k in keys for v in r.metrics.get(k, (float("nan"), float("nan")))],
                        d.get("delta_vs_main", ""), d.get("delta_ci", ""), d.get("same_as_main", ""), d.get("decode_ms", "")])


def plot_reports(rows: list[Row], decoders: list[dict[str, Any]], latency_by_n: dict[int, dict[str, dict]],
                 out_dir: Path, name: str) -> list[Path]:
    """PNGs: each metric by variant with its CI; decoder Δ by cell; latency against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    shown = [("nDCG@10", "nDCG@10"), ("nDCG@1", "nDCG@1"), ("MRR", "MRR"), ("Kendall τ", "kendall_tau"),
             ("top-1 agr.", "top1_agreement"), ("p50 ms", "latency_p50_ms")]
    labels = [r.variant for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 0.35 * len(rows) + 4), sharey=True)
    for ax, (label, key) in zip(axes.flat, shown):
        means = [r.metrics.get(key, (np.nan, np.nan))[0] for r in rows]
        cis = [r.metrics.get(key, (np.nan, np.nan))[1] for r in rows]
        colors = ["tab:gray" if r.kind == "baseline" else "tab:blue" for r in rows]
        ax.barh(range(len(rows)), np.nan_to_num(means), xerr=np.nan_to_num(cis), color=colors, capsize=3)
        ax.set_yticks(range(len(rows)), labels)
        ax.set_title(label)
    axes.flat[0].invert_yaxis()  # the y axis is shared: once puts the reference on top everywhere
    fig.tight_layout()
    paths.append(out_dir / f"{name}_metrics.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    cells = sorted({d["variant"] for d in decoders}, key=labels.index)
    decs = list(dict.fromkeys(d["decoder"] for d in decoders))
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(cells) * len(decs) / 2 + 3))
    height = 0.8 / len(decs)
    for j, dec in enumerate(decs):
        rows_d = {d["variant"]: d for d in decoders if d["decoder"] == dec}
        ax.barh([i + j * height for i in range(len(cells))], [rows_d[c]["delta_vs_main"] for c in cells], height,
                xerr=[np.nan_to_num(rows_d[c]["delta_ci"]) for c in cells], label=dec, capsize=2)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cells))], cells)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("Δ nDCG@10 vs the main decoder (paired, same matrices)")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / f"{name}_decoders.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if latency_by_n:
        sizes = list(latency_by_n)
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in next(iter(latency_by_n.values())):
            ax.plot(sizes, [latency_by_n[n][method]["p50_ms"] for n in sizes], marker="o", label=method)
        ax.set_xlabel("N candidates")
        ax.set_ylabel("latency p50 per request (ms)")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        paths.append(out_dir / f"{name}_latency_vs_n.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
