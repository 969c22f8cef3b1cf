"""The single-process job end to end on a tiny config (seconds)."""

import json

import pyarrow.parquet as pq

from hllm import Reranker
from hllm.config import load_config
from hllm.job.config import JobConfig
from hllm.job.stages import summary_lines
from hllm.recipes.local_job import run

from builders import ONE_PROCESS_JOB as TINY_JOB


def test_job_runs_and_resumes(tmp_path):
    cfg = load_config(JobConfig, None, TINY_JOB + [f"output_dir={tmp_path}"])
    report = run(cfg)
    assert 0 <= report.teacher["nDCG@10"] <= 1 and 0 <= report.student.decoders["hungarian"]["nDCG@10"] <= 1
    assert report.student.decoders["hungarian"]["validity"] == 1.0 and report.test_slates == 6
    assert set(report.latency) == {"tokenize", "bare_prefill", "single_pass", "ar_teacher"}
    lines = summary_lines(report, "hungarian")
    assert len(lines) == 7 and lines[-1].startswith("relevance_score calibration on 36 test items")
    assert lines[1].startswith("the same test queries shuffled (shuffled:0, no order declared: read as a set): the shuffled order itself ")
    assert 0 <= report.shuffled["student"]["nDCG@10"] <= 1 and 0 <= report.shuffled["input"]["nDCG@10"] <= 1
    assert (tmp_path / "student" / "calibration.json").exists() and 0 <= report.calibration["ece"] <= 1
    thresholds = Reranker.load(tmp_path / "student").cascade_thresholds  # the cascade's, from the val split
    assert thresholds.fitted_on["source"] == "the job's val split" and thresholds.fitted_on["queries"] > 0
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


def test_evaluation_is_sums_of_shards_equal_in_any_order_and_to_the_whole_split_figures(tmp_path):
    """The evaluation adds exact per-batch sums: shards merged in any order give the report bit for bit,
    and the figures equal trec_eval's (and Kendall tau's) means over the whole split."""
    import dataclasses
    import math

    from hllm import Reranker
    from hllm.data import store
    from hllm.eval.evaluation import first_stage_order, quality
    from hllm.eval.metrics import agreement
    from hllm.job.stages import EvalReport, load_teacher, shard_sums, teacher_model

    cfg = load_config(JobConfig, None, TINY_JOB + [f"output_dir={tmp_path}", "eval.batch_slates=2"])
    report = run(cfg)
    (test_dir,) = (tmp_path / "rankings").glob("test-*")
    items = store.read_rankings(test_dir)
    reranker = Reranker.load(tmp_path / "student", merge_lora=True)
    teacher = load_teacher(teacher_model(cfg), cfg, "cpu")
    whole = shard_sums(reranker, teacher, items, cfg.eval)  # batches of 2: (0, 1), (2, 3), (4, 5)
    parts = [shard_sums(reranker, teacher, items[i:i + 2], cfg.eval) for i in (4, 0, 2)]  # the same batches, shuffled
    merged = parts[0].merge(parts[1]).merge(parts[2])
    strip = lambda r: {**dataclasses.asdict(r), "latency": None, "student": {  # noqa: E731
        **dataclasses.asdict(r.student), "decoders": {d: {k: v for k, v in m.items() if k != "decode_ms"}
                                                      for d, m in r.student.decoders.items()}}}
    decoding = "constrained" if teacher.cfg.constrained else "free"
    a, b = EvalReport.of(whole, {}, decoding), EvalReport.of(merged, {}, decoding)
    assert json.dumps(strip(a)) == json.dumps(strip(b))
    assert json.dumps(strip(a)) == json.dumps({**strip(report), "latency": None})  # the job's own evaluation
    slates = [i.slate for i in items]
    perms = [reranker.decode(m, "hungarian").permutation.tolist() for m in reranker.score_slates(slates)]
    expect = {"first": quality(slates, first_stage_order(slates), 2), "student": quality(slates, perms, 2)}
    for name, got in (("first", a.first_stage), ("student", a.student.decoders["hungarian"])):
        assert all(math.isclose(got[k], v, abs_tol=1e-12) for k, v in expect[name].items()), (name, got, expect[name])
    tau = agreement(perms, [i.ranking.permutation for i in items])["kendall_tau"]
    assert math.isclose(a.student.decoders["hungarian"]["kendall_tau"], tau, abs_tol=1e-12)
    assert a.test_slates == 6 and a.calibration["items"] == 36  # every slate, every item
