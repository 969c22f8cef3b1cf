"""The ablation job on a local Ray at tiny scale: cells x seeds as Ray tasks, baselines, reports,
MLflow parent + children with the same metric names, a failing cell counted, resume."""

import csv

import mlflow
import pytest

from hllm.config import load_config
from hllm.job.ablations import AblationConfig
from pipelines import ablations
from pipelines.common import PipelineConfig

from conftest import SEED, copy_job
from builders import PIPELINE_JOB as JOB

pytestmark = pytest.mark.slow

GRID = AblationConfig(
    axes={"architecture": {"linear": {"student.head.kind": "linear"},
                           "scalar_listmle": {"student.head.kind": "scalar", "student.loss.terms": {"listmle": 1.0}}},
          "signal": {"graded": {"student.loss.terms": {"graded_ce": 1.0}}},
          "adaptation": {"frozen": {"student.adapt.mode": "frozen"}},
          # fails inside its task (no such model): counted and reported, the others go on
          "broken": {"missing_model": {"student.init_from_teacher": False, "student.model.preset": "hf",
                                       "student.model.path": "/nonexistent/model"}}},
    seeds=[0, 1], latency_requests=2, latency_sizes=[4, 8], latency_size_requests=3, cpus_per_cell=1)


def test_grid_runs_reports_and_resumes(tiny_job, tmp_path):
    # the session's slates and teacher rankings (the same data and teacher): the grid's own work is what is tested
    cfg = load_config(PipelineConfig, None, JOB + [f"output_dir={copy_job(tiny_job[3], tmp_path, only=SEED)}",
                                                   "student.train.steps=3"])
    grid = AblationConfig(**{**GRID.__dict__, "reports_dir": str(tmp_path / "reports")})
    out = ablations.run(cfg, grid)

    assert [(f["variant"], f["seed"]) for f in out.failures] == [("missing_model", 0), ("missing_model", 1)]
    cells = [r for r in out.rows if r.kind == "cell"]
    assert [r.variant for r in cells] == ["reference", "linear", "scalar_listmle", "graded", "frozen"]
    assert [r.variant for r in out.rows if r.kind == "baseline"] == ["first stage", "FIRST-style", "AR teacher"]
    for r in cells:
        assert r.seeds == 2 and r.metrics["validity"][0] == 1.0
        mean, half = r.metrics["nDCG@10"]
        assert 0 <= mean <= 1 and half == half  # a finite CI from two seeds
        assert r.metrics["latency_p50_ms"][0] > 0
    teacher = next(r for r in out.rows if r.variant == "AR teacher")
    assert teacher.metrics["kendall_tau"][0] == pytest.approx(1.0) and teacher.metrics["latency_p50_ms"][0] > 0
    decoders = {(d["variant"], d["decoder"]): d for d in out.decoders}
    assert len(decoders) == 5 * 5 and decoders[("reference", "hungarian")]["delta_vs_main"] == 0.0
    assert decoders[("scalar_listmle", "sort")]["same_as_main"] == 1.0  # one column: Hungarian = sorting
    assert set(out.latency_by_n) == {4, 8} and set(out.latency_by_n[8]) == {"AR teacher", "single pass", "FIRST-style"}

    names = {p.rsplit("/", 1)[1] for p in out.reports}
    assert names == {"ablations.md", "ablations.csv", "ablations_metrics.png", "ablations_decoders.png",
                     "ablations_latency_vs_n.png"}
    assert "## Failed cells (2)" in (tmp_path / "reports" / "ablations.md").read_text()
    rows = list(csv.DictReader(open(tmp_path / "reports" / "ablations.csv")))
    assert len(rows) == 5 * 5 + 3

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    children = mlflow.search_runs(experiment_names=["hllm"], output_format="list",
                                  filter_string=f"tags.mlflow.parentRunId = '{out.mlflow_run_id}'")
    kinds = sorted(r.data.tags["ablation.kind"] for r in children)
    assert kinds == ["baseline"] * 3 + ["cell"] * 10
    shared = {"nDCG_at_1", "nDCG_at_5", "nDCG_at_10", "MRR_at_10", "kendall_tau", "top1_agreement", "validity", "latency_p50_ms"}
    for r in children:
        assert shared <= set(r.data.metrics), r.info.run_name
    cell = next(r for r in children if r.info.run_name == "linear/seed1")
    assert cell.data.params["student.head.kind"] == "linear" and cell.data.params["student.train.seed"] == "1"
    assert [m.step for m in client.get_metric_history(cell.info.run_id, "loss")] == [1, 2, 3]
    artifacts = {a.path for a in client.list_artifacts(out.mlflow_run_id)}
    assert {"ablations.md", "ablations.csv", "ablations_metrics.png", "grid.json"} <= artifacts

    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "ablations").rglob("stage.json")}
    assert len(stamps) == 10
    again = ablations.run(cfg, grid)  # a re-run trains nothing that is done (the broken cell retries and fails again)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "ablations").rglob("stage.json")} == stamps
    assert len(again.failures) == 2
