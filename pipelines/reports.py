"""The ablation study's reports: a Markdown table, a CSV with every decoder, and PNG plots.

Report writing and plotting live here, outside the library (`hllm/` stays free of matplotlib);
the statistics they show come from `hllm.job.ablations`.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from hllm.job.ablations import METRICS, REFERENCE, Row


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


def plot_reliability(reports: dict[str, dict[str, Any]], path: Path) -> Path:
    """Reliability diagram(s): fraction relevant against mean predicted P(relevant) per bin, with the
    diagonal, the ECE and what each curve averages in the legend. `reports`: label -> calibration_report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect calibration")
    for label, rep in reports.items():
        bins = [b for b in rep["bins"] if b["count"]]
        ax.plot([b["mean_predicted"] for b in bins], [b["fraction_relevant"] for b in bins], marker="o",
                label=f"{label}: ECE {rep['ece']:.3f} ({rep['items']} items, {rep['slates']} queries)")
    ax.set_xlabel("mean predicted relevance_score (bin)")
    ax.set_ylabel(f"fraction relevant (grade >= {next(iter(reports.values()))['rel']})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
