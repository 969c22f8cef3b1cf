"""Shared fixtures: one tiny backbone per session (deep-copied per test), seeds reset per test."""

from __future__ import annotations

import copy
import importlib.abc
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hllm.data.synthetic import SyntheticConfig, generate
from hllm.model.backbones import ModelConfig, load_backbone
from teacher_server import API_KEY

# the served teacher's key, in the environment before the session's Ray starts, so its workers read it as
# a deployment's would (never in a config): tests/hllm/teacher/test_endpoint_teacher.py
os.environ.setdefault("HLLM_TEST_TEACHER_KEY", API_KEY)

FAST_TIER = "not slow and not gpu"  # pyproject's default -m: plain `pytest`


class _NoRayInTheFastTier(importlib.abc.MetaPathFinder):
    """Plain `pytest` (the fast tier) runs without Ray: a test that imports it belongs to the slow tier."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "ray":
            raise ImportError(f"the fast tier imports no Ray ({name}): mark the test @pytest.mark.slow")
        return None


def pytest_configure(config):
    if config.option.markexpr == FAST_TIER:
        sys.meta_path.insert(0, _NoRayInTheFastTier())


SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SERVE_PORT = 8123  # the session's one Serve HTTP port (Serve keeps the first serve.start's options)
TINY = ModelConfig(hidden_size=32, layers=2, heads=2, intermediate_size=64, context_length=512)


@pytest.fixture(autouse=True)
def _seed():
    """Seeds reset before each test; torch's thread count put back after it (recipes and replicas run in-process
    set it for themselves: a test must not leave the next one another float summation order)."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def _tiny_backbone():
    return load_backbone(TINY)


@pytest.fixture
def tiny_backbone(_tiny_backbone):
    model, tokenizer = _tiny_backbone
    return copy.deepcopy(model), tokenizer


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    """A tiny untrained student saved to a folder (LoRA r=2, K=4), once per module."""
    from hllm.model.heads import HeadConfig
    from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker

    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(lora_r=2, lora_alpha=4),
                                                 head=HeadConfig(positions=4, width=32, num_heads=2)))
    path = tmp_path_factory.mktemp("student")
    ranker.save(path)
    return path


@pytest.fixture(scope="session")
def small_splits():
    splits, _ = generate(SyntheticConfig(catalogue_size=400, slate_size=8, train_slates=24, val_slates=4, test_slates=8))
    return splits


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"{SHARED_DATA} is absent")
    return SHARED_DATA


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole session (4 logical CPUs on 2 cores, dashboard off)."""
    import ray

    from serve.common import thin_ingress

    thin_ingress()  # Serve as deployed: HAProxy + direct ingress
    # a stopping direct-ingress replica stays up 30 s for load balancers to deregister it; not in tests
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_job(ray_local, tmp_path_factory):
    """The main job's distillation at tiny scale, run once for the session (teacher rankings of every split through
    Ray Data, Ray Train + DeepSpeed, the streamed evaluation, MLflow, the student registered as hllm-student v1 under
    @candidate) -> (its config, its overrides, the report, the distill run's id, its output_dir). A test that changes
    what it made (the flywheel's refresh) works on a copy (`copy_job`)."""
    from hllm.config import load_config
    from pipelines import train_student
    from pipelines.common import PipelineConfig
    from builders import PIPELINE_TINY_JOB as TINY_JOB

    out = tmp_path_factory.mktemp("tiny_job")
    cfg = load_config(PipelineConfig, None, TINY_JOB + [f"output_dir={out}"])
    report, run_id = train_student.run(cfg)
    return cfg, report, run_id, out


SEED = ("slates", "rankings")  # what a job of the same data and teacher reuses from another (copy_job)


def copy_job(job_dir: Path, to: Path, only: tuple[str, ...] | None = None) -> Path:
    """A finished job's output folder copied (its MLflow db with it: a registry of its own; the artifacts stay where
    the db says, in the original's mlartifacts), or only its folders `only`: `("slates", "rankings")` seeds a job of
    the same data, prompt and teacher, which reuses them (the stages' keys name no cluster or student setting)."""
    import shutil

    for folder in only or ("",):
        shutil.copytree(job_dir / folder, to / folder, ignore=shutil.ignore_patterns("mlartifacts"), dirs_exist_ok=True)
    return to


def graded_examples(ranker, slates):
    """Student examples from slates alone (no teacher ranking): for graded-label training in tests."""
    from hllm.records import ParseCounts, RankedSlate, TeacherRanking
    from hllm.train.loop import LossConfig, student_examples

    unranked = [RankedSlate(s, TeacherRanking(s.slate_id, None, "", ParseCounts())) for s in slates]
    return student_examples(ranker.prompts, unranked, LossConfig({"graded_ce": 1.0}))[0]


def gold_run(slates, path, skip=(), foreign=()):
    """A run file ranking each slate by its grades (a perfect teacher), but for the `skip` slates; the
    `foreign` slates' lists also name a passage they lack, and a query of no slate is ranked too."""
    lines = ["query-id\tcorpus-id\trank\tscore"]
    for s in slates:
        if s.slate_id in skip:
            continue
        order = sorted(range(len(s.candidates)), key=lambda i: -(s.grades[i] or 0))
        docids = [s.candidates[i].docid for i in order] + (["elsewhere"] if s.slate_id in foreign else [])
        lines += [f"{s.slate_id}\t{d}\t{r + 1}\t{100 - r}" for r, d in enumerate(docids)]
    lines.append("no-such-query\tx\t1\t1")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="session")
def teacher_server():
    """A real OpenAI-compatible teacher for the session: llama.cpp's server with SmolLM2-135M-Instruct, on a free
    loopback port, stopped at the end (tests/teacher_server.py); skips where it cannot be installed."""
    from teacher_server import LlamaServer, why_unavailable

    reason = why_unavailable()
    if reason:
        if os.environ.get("CI"):  # CI runs the README's test command, whose setup installs the server: absent is a failure
            pytest.fail(f"the teacher server should be installed here: {reason}")
        pytest.skip(reason)  # e.g. a plain `scripts/setup.sh` without --tests
    server = LlamaServer()
    yield server
    server.stop()


@pytest.fixture
def fault_proxy(teacher_server):
    """A fault-injecting proxy in front of the session's teacher server (its queue starts empty)."""
    from teacher_server import FaultProxy

    proxy = FaultProxy(teacher_server.url, hang_s=3.0)
    yield proxy
    proxy.stop()
