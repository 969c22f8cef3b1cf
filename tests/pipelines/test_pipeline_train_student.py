"""Ray Train + DeepSpeed distillation on a local Ray (2 CPU workers, ZeRO-2): MLflow run, worker kill."""

import dataclasses
import json
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from hllm import Reranker
from hllm.config import load_config
from hllm.data import store
from hllm.job.config import student_ranker_config
from hllm.job.stages import evaluate_stage, load_teacher
from pipelines import teacher_gen, train_student
from pipelines.common import PipelineConfig

from builders import PIPELINE_JOB as JOB
from conftest import SEED, copy_job

pytestmark = pytest.mark.slow


def test_distill_with_deepspeed_logs_everything_to_mlflow(tiny_job):
    cfg, report, run_id, tmp_path = tiny_job
    # the evaluation streamed through the actor pool (a shard a task) equals the same store evaluated in
    # this process, to the last bit: teacher (and its free decoding), every decoder, calibration
    teacher_model, rankings = teacher_gen.run(cfg, splits=("test",))  # reused
    assert len(store.shards(rankings["test"].directory)) == 2  # 6 test slates, 4 a shard
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or 1)  # as the evaluation actors run: another thread count sums floats in another order
    try:
        local = evaluate_stage(cfg, load_teacher(teacher_model, cfg, "cpu"), tmp_path / "student", rankings["test"], "cpu")
    finally:
        torch.set_num_threads(threads)
    assert report.teacher_free is not None and report.calibration is not None and report.test_slates == 6
    assert json.dumps(_untimed(local)) == json.dumps(_untimed(report))
    stage = json.loads((tmp_path / "student" / "stage.json").read_text())
    assert stage["steps"] == 4 and stage["val_loss"] > 0  # the held-out loss comes from the worker's loop
    assert report.student.decoders["hungarian"]["validity"] == 1.0
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = mlflow.get_run(run_id)
    assert run.data.params["distill.zero_stage"] == "2" and run.data.params["student.train.steps"] == "4"
    assert "eval.student.decoders.hungarian.nDCG_at_10" in run.data.metrics and "eval.teacher.nDCG_at_10" in run.data.metrics
    assert "eval.latency.single_pass.p50_ms" in run.data.metrics
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2, 3, 4]  # only rank 0 logs
    assert run.data.tags["git_commit"] and "rankings/train-" in run.data.tags["teacher_rankings"]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "student/artifacts/student")}
    assert {f"student/artifacts/student/{f}" for f in ("head.safetensors", "hllm_ranker.json", "adapter")} <= artifacts
    # registered as a pyfunc with a signature, version 1 under the configured alias
    assert (tmp_path / "mlartifacts").is_dir()  # the artifacts outlive the Ray job's working copy
    version = mlflow.MlflowClient().get_model_version_by_alias("hllm-student", "candidate")
    assert str(version.version) == "1" and version.run_id == run_id
    pyfunc = mlflow.pyfunc.load_model("models:/hllm-student@candidate")
    assert pyfunc.metadata.get_input_schema().input_names() == ["query", "documents"]
    import pandas as pd
    out = pyfunc.predict(pd.DataFrame({"query": ["boots"], "documents": [["red boots", "blue shirt", "boots"]]}))
    assert sorted(out["ranking"][0]) == [0, 1, 2]
    # the logged student config is the one that trained: the teacher's weights as its backbone
    logged = mlflow.artifacts.load_dict(f"runs:/{run_id}/student_config.json")
    assert logged["model"] == dataclasses.asdict(cfg.teacher.model) and logged["prompt"] == dataclasses.asdict(cfg.prompt)
    # the public API loads the logged student by its MLflow URI (the `runs` resolver plug-in)
    import os
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    try:
        ranked = Reranker.load(f"runs:/{run_id}/student").rank("boots", ["red boots", "blue shirt", "boots"])
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]
    assert sorted(d.index for d in ranked) == [0, 1, 2]


def _untimed(report) -> dict:
    """A report without its timings (latency profile, decode time)."""
    out = dataclasses.asdict(report)
    out["latency"] = None
    for figures in out["student"]["decoders"].values():
        figures.pop("decode_ms")
    return out


def _has_checkpoint(snapshot: Path) -> bool:
    try:
        return bool(json.loads(snapshot.read_text()).get("checkpoint_results"))
    except (OSError, json.JSONDecodeError):  # Ray rewrites the file in place: a read may catch it half written
        return False


def _kill_one_worker_after_first_checkpoint(storage: Path, killed: list):
    deadline = time.time() + 600
    # the controller writes its snapshot once it has registered a checkpoint: kill after that
    while time.time() < deadline and not any(_has_checkpoint(p) for p in storage.rglob("checkpoint_manager_snapshot.json")):
        time.sleep(0.2)
    for proc in psutil.process_iter(["cmdline"]):
        if any("RayTrainWorker" in part for part in (proc.info["cmdline"] or [])):
            proc.kill()
            killed.append(proc.pid)
            return


def test_killed_worker_resumes_from_the_latest_checkpoint(tiny_job, tmp_path):
    cfg = load_config(PipelineConfig, None, JOB + [f"output_dir={copy_job(tiny_job[3], tmp_path, only=SEED)}",
                                                      "student.train.steps=20", "distill.checkpoint_every=2"])
    teacher_model, rankings = teacher_gen.run(cfg, splits=("train", "val"))  # the session's, reused
    killed: list = []
    killer = threading.Thread(target=_kill_one_worker_after_first_checkpoint, args=(tmp_path / "ray_train", killed))
    killer.start()
    result = train_student.train(cfg, student_ranker_config(cfg, teacher_model), rankings["train"].directory,
                           rankings["val"].directory)
    killer.join()
    assert killed, "no Ray Train worker was found to kill"
    assert result.error is None
    assert result.metrics["step"] == 20  # the planned number of steps
    assert result.metrics["resumed_from_step"] >= 2  # continued from a checkpoint, not from scratch
