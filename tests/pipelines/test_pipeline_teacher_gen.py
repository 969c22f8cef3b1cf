"""Ray Data teacher generation on a local Ray: fan-out, output rows, kill-and-resume."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hllm.config import load_config
from hllm.data import store
from pipelines import teacher_gen
from pipelines.common import PipelineConfig

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

GEN_JOB = [
    "data.synthetic.catalogue_size=300", "data.synthetic.slate_size=6", "data.synthetic.train_slates=48",
    "data.synthetic.val_slates=2", "data.synthetic.test_slates=2",
    # the tiny preset by name: the entry point run below reads configs/default.yaml, whose teacher is the shipped one
    "sized_for=tiny", "teacher.model.preset=tiny",
    "teacher.bootstrap=false", "teacher.model.hidden_size=32", "teacher.model.layers=1", "teacher.model.heads=2",
    "teacher.model.intermediate_size=64", "teacher.model.context_length=256",
    "teacher.generation.constrained=true", "teacher.generation.batch_size=8",
    "cluster.teacher_actors=2", "cluster.teacher_cpus_per_actor=0.5", "cluster.teacher_batch_slates=8",
]


def test_generation_fans_out_and_writes_one_row_per_slate(ray_local, tmp_path):
    cfg = load_config(PipelineConfig, None, GEN_JOB + [f"output_dir={tmp_path}"])
    _, rankings = teacher_gen.run(cfg)
    assert {k: len(r.items) for k, r in rankings.items()} == {"train": 48, "val": 2, "test": 2}  # every split, one path
    train = rankings["train"]
    rows = store.read_rankings(train.directory)  # the one reader, typed records back
    assert len(rows) == 48 and len({r.slate.slate_id for r in rows}) == 48
    stats = train.stats
    assert stats.validity == 1.0 and stats.counts.ok == 48  # constrained decoding
    assert stats.slates_per_s > 0 and stats.output_tokens_per_s > 0
    row = rows[0].ranking
    assert sorted(row.permutation) == list(range(6)) and len(rows[0].slate.candidates) == 6 and rows[0].slate.grades
    assert row.raw_text.count("[") == 6 and row.output_tokens == 12 and row.prompt_tokens > 0 and row.node
    assert len(store.shards(train.directory)) == 6  # one shard per batch of 8
    schema = pq.read_schema(store.shards(train.directory)[0])
    assert schema.field("ranking").type.field("permutation").type == pa.list_(pa.int64())  # nested, not JSON
    # MLflow holds the run with its counts and throughput
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = {r.data.tags["hllm.stage"]: r for r in mlflow.search_runs(experiment_names=["hllm"], output_format="list")}
    assert set(runs) == {"data", "teacher_generation"}  # the data stage's run too: throughput, peak, bad input
    assert runs["data"].data.metrics["data.slates.train"] == 48 and runs["data"].data.metrics["data.slates_per_s"] > 0
    run = runs["teacher_generation"]
    assert run.data.metrics["teacher_gen.train.counts.ok"] == 48 and "teacher_gen.train.slates_per_s" in run.data.metrics
    assert run.data.params["cluster.teacher_actors"] == "2"


def test_killed_run_resumes_with_exactly_one_row_per_slate(tmp_path):
    overrides = GEN_JOB + [f"output_dir={tmp_path}", "data.synthetic.train_slates=40", "cluster.teacher_actors=1",
                           "cluster.teacher_batch_slates=4", "teacher.generation.batch_size=4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "pipelines/teacher_gen.py", *overrides], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    shards = lambda: list((tmp_path / "rankings").glob("train-*/part-*.parquet"))  # noqa: E731
    while time.time() < deadline and len(shards()) < 3:
        assert proc.poll() is None, "the generation finished before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, its Ray and the actors, mid-run
    proc.wait()
    # an actor's worker may finish the shard it was writing a moment after the kill: count once none appears for 5 s
    shards_before, settle = len(shards()), time.time() + 5
    while time.time() < settle:
        time.sleep(0.5)
        if len(shards()) != shards_before:
            shards_before, settle = len(shards()), time.time() + 5
    assert 3 <= shards_before < 10
    result = subprocess.run([sys.executable, "pipelines/teacher_gen.py", *overrides], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = store.read_rankings(shards()[0].parent)
    assert len(rows) == 40 and len({r.slate.slate_id for r in rows}) == 40
    assert f"resumed {4 * shards_before} done" in result.stdout  # the finished shards were not redone


def test_rankings_from_a_file_stream_through_the_actor_pool_into_the_store(ray_local, tmp_path):
    """`teacher.rankings`: the same actor pool looks the rankings up (no model, no GPU); what the file
    lacks is counted in the footers, the stage's stats and MLflow."""
    from hllm.data.splits import load_splits
    from conftest import gold_run

    job = [o for o in GEN_JOB if not o.startswith("teacher.")] + [
        "teacher.bootstrap=false", "student.init_from_teacher=false", "student.model.preset=tiny"]
    data = load_config(PipelineConfig, None, job + ["teacher.rankings=/dev/null"]).data
    slates = [s for split in load_splits(data).values() for s in split]
    skipped = sorted(s.slate_id for s in slates)[:3]
    gold_run(slates, tmp_path / "teacher.tsv", skip=set(skipped))
    cfg = load_config(PipelineConfig, None, job + [f"output_dir={tmp_path / 'out'}", f"teacher.rankings={tmp_path / 'teacher.tsv'}"])
    _, rankings = teacher_gen.run(cfg)
    assert {k: r.stats.slates for k, r in rankings.items()} == {"train": 48, "val": 2, "test": 2}
    assert sum(r.stats.coverage["uncovered"] for r in rankings.values()) == 3  # one row per slate all the same
    unranked = sorted(i.slate.slate_id for r in rankings.values() for i in r.items if i.ranking.permutation is None)
    assert unranked == skipped
    assert len(store.shards(rankings["train"].directory)) == 6 and len(rankings["train"].stats.nodes) == 1
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    (run,) = mlflow.search_runs(experiment_names=["hllm"], output_format="list",
                                filter_string="tags.`hllm.stage` = 'teacher_generation'")
    assert run.data.metrics["teacher_gen.file.queries"] == 50 and run.data.metrics["teacher_gen.file.other_queries"] == 1
    assert run.data.metrics["teacher_gen.file.uncovered"] == 3
