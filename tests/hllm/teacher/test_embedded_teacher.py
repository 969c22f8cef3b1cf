"""The shipped embedded teacher: intact, made by the recipe it records, ranking unseen slates well above
their first-stage order; and `hllm export-teacher`, which makes such a folder from a job's run."""

import json

import pytest
from builders import ONE_PROCESS_JOB as TINY_JOB

from hllm.config import load_config
from hllm.data.synthetic import SyntheticConfig, generate
from hllm.eval.evaluation import evaluate_teacher, first_stage_order, quality
from hllm.model.backbones import EMBEDDED_TEACHER, PROVENANCE, WEIGHTS, ModelConfig, embedded_provenance, file_sha256
from hllm.model.ranker import RankerConfig, SinglePassRanker
from hllm.job.config import JobConfig
from hllm.job.stages import load_teacher
from hllm.recipes.local_job import run
from pipelines.cli import main as cli

DEFAULT = load_config(JobConfig, EMBEDDED_TEACHER.parents[2] / "configs" / "default.yaml")


def test_the_shipped_weights_are_the_ones_its_provenance_names():
    provenance = embedded_provenance()
    assert file_sha256(EMBEDDED_TEACHER / WEIGHTS) == provenance["sha256"]
    recipe = provenance["recipe"]
    assert recipe["model"]["preset"] == "tiny" and recipe["bootstrap_cfg"]["train"]["steps"] >= 1000
    assert recipe["prompt"]["template"] == DEFAULT.prompt.template  # the prompt the default job shows it
    assert provenance["test"]["teacher_nDCG@10"] >= provenance["test"]["first_stage_nDCG@10"] + 0.10


def test_the_shipped_teacher_ranks_slates_of_a_catalogue_it_never_saw():
    # seed 1: another catalogue and other queries than the train split it was bootstrapped on (seed 0)
    splits, _ = generate(SyntheticConfig(seed=1, train_slates=0, val_slates=0, test_slates=48))
    slates = splits["test"]
    teacher = load_teacher(DEFAULT.teacher.model, DEFAULT, "cpu")
    written = evaluate_teacher(slates, teacher.rank(slates), 2)
    first = quality(slates, first_stage_order(slates), 2)["nDCG@10"]
    assert written["nDCG@10"] >= first + 0.10, (written["nDCG@10"], first)
    assert written["same_as_input"] < 0.5  # (ties keep the input order, so a slate already in grade order stays)


def test_the_shipped_teacher_refuses_a_prompt_it_was_not_trained_on():
    cfg = load_config(JobConfig, EMBEDDED_TEACHER.parents[2] / "configs" / "default.yaml", ["prompt.template=rankgpt"])
    with pytest.raises(ValueError, match=r"bootstrapped on another prompt: prompt.template='rankgpt' \(trained: 'compact'\)"):
        load_teacher(cfg.teacher.model, cfg, "cpu")


def test_a_student_saved_on_the_shipped_teacher_carries_its_base(tmp_path):
    ranker = SinglePassRanker.build(RankerConfig(model=ModelConfig(preset="embedded"), prompt=DEFAULT.prompt))
    ranker.save(tmp_path / "student", bundle_base=True)
    saved = json.loads((tmp_path / "student" / "hllm_ranker.json").read_text())["model"]
    assert saved["preset"] == "hf" and saved["path"] == "base"  # self-contained: not tied to this checkout's asset
    assert file_sha256(tmp_path / "student" / "base" / WEIGHTS) == embedded_provenance()["sha256"]
    SinglePassRanker.load(tmp_path / "student")


def test_export_teacher_writes_weights_and_provenance(tmp_path):
    job = tmp_path / "job"
    report = run(load_config(JobConfig, None, TINY_JOB + [f"output_dir={job}"]))
    to = tmp_path / "asset"
    assert cli(["export-teacher", str(job), "--to", str(to)]) == 0
    provenance = json.loads((to / PROVENANCE).read_text())
    assert provenance["sha256"] == file_sha256(to / WEIGHTS) == file_sha256(job / "teacher" / "model" / WEIGHTS)
    assert provenance["bootstrap"]["steps"] == 3 and provenance["recipe"]["bootstrap_cfg"]["train"]["steps"] == 3
    assert provenance["test"]["teacher_nDCG@10"] == report.teacher["nDCG@10"]
    assert cli(["export-teacher", str(tmp_path / "nothing"), "--to", str(tmp_path / "x")]) == 2  # no run there
