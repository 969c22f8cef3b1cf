"""The real-text report cannot rot: a tiny job on TREC DL19, then benchmarks/real_data.py on it,
with Cranfield as the collection the job never saw."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.data
def test_real_data_report_from_a_finished_job(shared_data, tmp_path):
    job = tmp_path / "job"
    subprocess.run([sys.executable, "-m", "hllm.recipes.local_job", "--config", str(ROOT / "configs" / "default.yaml"),
                    f"output_dir={job}", "data.source=beir", f"data.path={shared_data / 'trec-dl19-passage-bm25top100'}",
                    "data.top_n=5", "prompt.max_doc_tokens=8", "sized_for=tiny", "teacher.model.preset=tiny",
                    "teacher.bootstrap=true", "teacher.bootstrap_cfg.unjudged_grade=0",
                    "teacher.bootstrap_cfg.train.steps=2", "teacher.bootstrap_cfg.train.batch_size=2",
                    "teacher.bootstrap_cfg.train.log_every=1", "student.train.steps=2", "student.train.batch_size=2",
                    "student.head.positions=5", "eval.latency_requests=1", "eval.latency_warmup=0",
                    "student.max_teacher_same_as_input=1.0", "student.max_teacher_tau_to_input=1.0"],
                   check=True, cwd=ROOT, capture_output=True, timeout=900)
    out = tmp_path / "real_data.csv"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_data.py"), "--job", str(job), "--transfer",
                           str(shared_data / "cranfield"), "--transfer-queries", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert list(rows[0]) == ["collection", "queries", "split", "method", "nDCG@10", "MRR@10", "teacher", "tau_to_teacher",
                             "share_kept", "share_kept_ci95",  # the teacher-folds rows' (empty here)
                             "input_order", "order_declared", "nDCG@10_ci95"]  # the input-order rows' (a job's: first-stage)
    assert all(r["teacher"] == "" and r["input_order"] == "first-stage" for r in rows)
    got = {(r["collection"], r["split"], r["method"]): r for r in rows}
    for collection, split, queries in (("trec-dl19-passage-bm25top100", "test", 11), ("cranfield", "transfer-test", 3)):
        for method in ("first_stage", "teacher", "student", "first_style"):
            row = got[(collection, split, method)]
            assert int(row["queries"]) == queries and 0.0 <= float(row["nDCG@10"]) <= 1.0
    assert out.with_suffix(".md").read_text().count("| cranfield |") == 4
