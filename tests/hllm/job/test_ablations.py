"""The ablation grid as data: expansion and validation, statistics, paired decoder comparison, reports."""

import csv
from pathlib import Path

import numpy as np
import pytest

from hllm.config import ConfigError, load_config
from hllm.job.ablations import AblationConfig, aggregate, decoder_comparison, expand_cells, mean_ci, slates_of_size, with_seed
from hllm.job.config import JobConfig
from pipelines.reports import markdown_report, write_csv

ROOT = Path(__file__).resolve().parents[3]
GRIDS = sorted((ROOT / "configs" / "grids").glob("*.yaml"))


@pytest.mark.parametrize("path", GRIDS, ids=[p.name for p in GRIDS])
def test_every_shipped_grid_expands_against_the_default_job(path):
    grid = load_config(AblationConfig, path)
    cells = expand_cells(grid, load_config(JobConfig, ROOT / "configs" / "default.yaml"))
    assert cells[0].name == "reference" and len({c.name for c in cells}) == len(cells)
    assert all(c.config.teacher == cells[0].config.teacher for c in cells)  # one teacher for all


def test_variants_change_one_axis_and_are_validated_before_training():
    base = load_config(JobConfig, None)
    grid = AblationConfig(axes={"architecture": {"linear": {"student.head.kind": "linear"},
                                                 "scalar": {"student.head.kind": "scalar", "student.loss.terms": {"listmle": 1.0}}},
                                "loss": {"scalar": {"student.head.kind": "scalar", "student.loss.terms": {"listmle": 1.0}}}})
    cells = {c.name: c for c in expand_cells(grid, base)}
    assert set(cells) == {"reference", "linear", "scalar"} and cells["scalar"].axes == ["architecture", "loss"]
    assert cells["scalar"].config.student.loss.terms == {"listmle": 1.0}  # a mapping replaces, never merges
    assert cells["linear"].config.student.loss.terms == base.student.loss.terms
    seeded = with_seed(cells["linear"].config, 7)
    assert seeded.seed == 7 and seeded.student.train.seed == 7 and cells["linear"].config.seed == base.seed


@pytest.mark.parametrize("axes,match", [
    ({"a": {"x": {"teacher.model.layers": 2}}}, r"a.x: 'teacher.model.layers' is not a student setting"),
    ({"a": {"x": {"student.head.kind": "mlp"}}}, r"ablation a.x: .*'mlp' is not one of"),
    ({"a": {"x": {"student.nope": 1}}}, r"ablation a.x: .*unknown config key"),
    ({"a": {"x": {"student.train.steps": 1}}, "b": {"x": {"student.train.steps": 2}}}, r"'x' appears in two axes"),
    ({"a": {"reference": {}}}, r"'reference' is the unchanged job config"),
])
def test_bad_grids_name_the_variant(axes, match):
    with pytest.raises(ConfigError, match=match):
        expand_cells(AblationConfig(axes=axes), load_config(JobConfig, None))


def test_mean_ci_is_the_student_t_interval():
    mean, half, n = mean_ci([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3) and half == pytest.approx(4.302653 / np.sqrt(3), rel=1e-6)
    assert np.isnan(mean_ci([0.5])[1]) and mean_ci([])[2] == 0
    assert mean_ci([0.2, float("nan"), 0.4])[0] == pytest.approx(0.3)  # NaN (no pair) left out


def _result(hung, sort, same):
    dec = lambda v: {"nDCG@1": v, "nDCG@5": v, "nDCG@10": v, "MRR@10": v, "kendall_tau": 0.5,  # noqa: E731
                     "top1_agreement": 0.5, "validity": 1.0, "decode_ms": 0.1}
    return {"decoders": {"hungarian": {**dec(np.mean(hung)), "same_as_main": 1.0}, "sort": {**dec(np.mean(sort)), "same_as_main": same}},
            "matrix": {"rank1_energy_mean": 0.6}, "per_query": {"hungarian": hung, "sort": sort}}


def test_decoder_comparison_is_paired_per_seed():
    # seed 0: sort loses 0.1 on every query; seed 1: loses 0.3 on every query -> mean -0.2
    seeds = [_result([0.5, 0.7], [0.4, 0.6], 0.0), _result([0.9, 0.3], [0.6, 0.0], 0.5)]
    rows = {r["decoder"]: r for r in decoder_comparison("ref", seeds, "hungarian", 0.95)}
    assert rows["hungarian"]["delta_vs_main"] == 0.0 and rows["hungarian"]["same_as_main"] == 1.0
    assert rows["sort"]["delta_vs_main"] == pytest.approx(-0.2) and rows["sort"]["same_as_main"] == 0.25
    assert rows["sort"]["delta_ci"] == pytest.approx(12.7062 * 0.1, rel=1e-4)  # sd 0.1414, sem 0.1
    row = aggregate("ref", "", seeds, "hungarian", {"p50_ms": 7.0, "p95_ms": 9.0}, 0.95)
    assert row.metrics["nDCG@10"][0] == pytest.approx(0.6) and row.metrics["MRR@10"][0] == pytest.approx(0.6)
    assert row.metrics["rank1_energy"][0] == pytest.approx(0.6)
    assert row.metrics["latency_p50_ms"] == (7.0, pytest.approx(float("nan"), nan_ok=True))


def test_reports_list_every_row_and_failure(tmp_path):
    seeds = [_result([0.5, 0.7], [0.4, 0.6], 0.0), _result([0.9, 0.3], [0.6, 0.0], 0.5)]
    rows = [aggregate("reference", "", seeds, "hungarian", {"p50_ms": 7.0, "p95_ms": 9.0}, 0.95)]
    decs = decoder_comparison("reference", seeds, "hungarian", 0.95)
    meta = {"cells": 1, "seeds": 2, "main_decoder": "hungarian", "confidence": 0.95, "test_slates": 2, "slate_size": 20,
            "latency_requests": 5}
    text = markdown_report(rows, decs, {10: {"AR teacher": {"p50_ms": 50.0}, "single pass": {"p50_ms": 5.0}}}, meta,
                           [{"variant": "linear", "seed": 1, "error": "boom"}])
    assert "| **reference** |  | 2 | " in text and "| reference | sort | 0.4000" in text and "| 10 | 50.0 | 5.0 |" in text
    assert "## Failed cells (1)" in text and "linear seed 1: boom" in text
    write_csv(rows, decs, tmp_path / "t.csv")
    lines = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert lines[0]["variant"] == "reference" and float(lines[0]["nDCG@10"]) == pytest.approx(0.6)


def test_slates_of_size_fill_from_the_pool(small_splits):
    pool = small_splits["test"]
    slates = slates_of_size(pool, 20, 3)
    assert [len(s.candidates) for s in slates] == [20, 20, 20] and slates[0].query.text == pool[0].query.text
    assert slates[0].candidates[:8] == pool[0].candidates and slates[0].candidates[8:16] == pool[1].candidates
