"""The single-process job end to end on a tiny config (seconds)."""

import json

import pyarrow.parquet as pq

from hllm.config import load_config
from hllm.recipes.job import JobConfig
from hllm.recipes.stages import summary_lines
from hllm.recipes.workflow import run

TINY_JOB = [
    "data.synthetic.catalogue_size=300", "data.synthetic.slate_size=6", "data.synthetic.train_slates=16",
    "data.synthetic.val_slates=2", "data.synthetic.test_slates=6",
    "teacher.model.hidden_size=32", "teacher.model.layers=1", "teacher.model.heads=2",
    "teacher.model.intermediate_size=64", "teacher.model.context_length=256",
    "teacher.bootstrap_cfg.train.steps=3", "teacher.bootstrap_cfg.train.batch_size=4",
    "student.head.positions=6", "student.head.width=32", "student.adapt.lora_r=2",
    "student.train.steps=3", "student.train.batch_size=4", "eval.latency_requests=2", "eval.latency_warmup=1",
    # a teacher of a few steps (or none) copies its input: the gates that stop that (tests/test_store.py) are off
    "student.max_teacher_same_as_input=1.0", "student.max_teacher_tau_to_input=1.0",
]


def test_job_runs_and_resumes(tmp_path):
    cfg = load_config(JobConfig, None, TINY_JOB + [f"output_dir={tmp_path}"])
    report = run(cfg)
    assert 0 <= report.teacher["nDCG@10"] <= 1 and 0 <= report.student.decoders["hungarian"]["nDCG@10"] <= 1
    assert report.student.decoders["hungarian"]["validity"] == 1.0 and report.test_slates == 6
    assert set(report.latency) == {"tokenize", "bare_prefill", "single_pass", "ar_teacher"}
    lines = summary_lines(report, "hungarian")
    assert len(lines) == 6 and lines[-1].startswith("relevance_score calibration on 36 test items")
    assert (tmp_path / "student" / "calibration.json").exists() and 0 <= report.calibration["ece"] <= 1
    assert (tmp_path / "report.json").exists() and (tmp_path / "student" / "head.safetensors").exists()
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("stage.json")}
    assert len(stamps) == 5  # teacher, train / val / test rankings, student
    student = json.loads((tmp_path / "student" / "stage.json").read_text())
    assert student["steps"] == 3 and student["val_loss"] > 0  # the val split is held out while training
    card = json.loads((tmp_path / "student" / "model_card.json").read_text())  # what Serve's /v1/models says
    assert card["training_data"]["source"] == "synthetic" and card["training_data"]["train_slates"] > 0
    assert card["positions"] == 6 and card["base_model"].startswith("tiny") and card["steps"] == 3
    run(cfg)  # same config: every stage is reused, none redone
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("stage.json")} == stamps
    assert json.loads((tmp_path / "teacher" / "stage.json").read_text())["steps"] == 3


def test_same_seed_same_teacher_outputs_and_student_metrics(tmp_path):
    reports = []
    for name in ("a", "b"):
        cfg = load_config(JobConfig, None, TINY_JOB + [f"output_dir={tmp_path / name}"])
        reports.append(run(cfg))
    def rows(name):
        (test,) = (tmp_path / name / "rankings").glob("test-*")
        table = pq.read_table(sorted(test.glob("part-*.parquet"))).to_pylist()
        return [{**r, "ranking": {k: v for k, v in r["ranking"].items() if k != "latency_s"}} for r in table]
    assert rows("a") == rows("b")
    assert reports[0].teacher == reports[1].teacher
    untimed = lambda student: {d: {k: v for k, v in m.items() if k != "decode_ms"} for d, m in student.decoders.items()}  # noqa: E731
    assert untimed(reports[0].student) == untimed(reports[1].student)
