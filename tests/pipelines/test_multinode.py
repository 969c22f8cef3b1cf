"""A two-node Ray cluster on one machine: data tasks, teacher actors and training workers land on both nodes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builders import PIPELINE_JOB as JOB

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_teacher_actors_and_train_workers_use_both_nodes(tmp_path):
    overrides = [o for o in JOB if not o.startswith(("cluster.", "eval."))] + [
        "cluster.teacher_actors=2", "cluster.teacher_cpus_per_actor=1", "cluster.teacher_batch_slates=4",
        "cluster.train_workers=2", "cluster.train_cpus_per_worker=1", "student.train.steps=2",
        "distill.checkpoint_every=2", "data.synthetic.shards=3"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "multinode_job.py"), str(tmp_path), *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert len(out["nodes"]) == 2
    assert out["data_nodes"] == out["nodes"], "the data stage's tasks did not spread over both nodes"
    assert out["teacher_nodes"] == out["nodes"], "teacher actors did not spread over both nodes"
    assert out["train_nodes"] == out["nodes"], "training workers did not spread over both nodes"
    assert out["steps"] == 2
