from pathlib import Path

import pytest
import yaml

from hllm.config import ConfigError, flatten, load_config, parse_overrides
from hllm.job.config import JobConfig

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))


def test_defaults_and_overrides_win():
    cfg = load_config(JobConfig, None, ["student.train.steps=7", "data.synthetic.slate_size=10",
                                        "student.head.kind=linear", "eval.decoders=[sort, greedy]",
                                        "eval.main_decoder=sort"])
    assert cfg.student.train.steps == 7 and cfg.data.synthetic.slate_size == 10
    assert cfg.student.head.kind == "linear" and cfg.eval.decoders == ["sort", "greedy"]


@pytest.mark.parametrize("override,match", [
    (["student.train.stpes=3"], r"unknown config key\(s\) \['student.train.stpes'\]"),
    (["student.head.kind=mlp"], r"student.head.kind: 'mlp' is not one of"),
    (["student.train.steps=many"], r"student.train.steps: expected int"),
    (["teacher.model.preset=hf"], r"model.path is required"),
    (["student.loss.terms={nope: 1.0}"], r"unknown loss \['nope'\]"),
    (["eval.decoders=[magic]"], r"unknown \['magic'\]"),
    (["nokey"], r"not of the form key=value"),
    (["eval.decoders=[sort]"], r"eval.main_decoder 'hungarian' must be one of eval.decoders"),
    # keys that would be ignored are errors that say why
    (["student.model.preset=tiny"], r"student.model would be ignored: student.init_from_teacher is true"),
    (["student.init_from_teacher=false"], r"student.model is required when student.init_from_teacher is false"),
    (["student.prompt.template=compact"], r"unknown config key\(s\) \['student.prompt'\]"),
    (["data.path=/tmp/x"], r"data.path / data.run_file are read only by file sources"),
    (["data.source=hllm", "data.path=/tmp/x", "data.run_file=/tmp/run"], r"data.run_file is read only by data.source=beir"),
])
def test_bad_configs_name_the_key(override, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(JobConfig, None, override)


def test_a_student_with_its_own_backbone():
    cfg = load_config(JobConfig, None, ["student.init_from_teacher=false", "student.model.preset=tiny", "student.model.layers=2"])
    assert cfg.student.model.layers == 2


def test_parse_overrides_types():
    assert parse_overrides(["a=1", "b=0.5", "c=true", "d=null", "e=x", "f=3e-3"]) == {
        "a": 1, "b": 0.5, "c": True, "d": None, "e": "x", "f": 0.003}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    from pipelines.common import PipelineConfig  # the Ray job reads the same files, with its cluster section

    cfg = load_config(PipelineConfig, path)
    assert flatten(cfg)["output_dir"]


def test_a_real_model_never_inherits_the_tiny_models_sizes():
    with pytest.raises(ConfigError, match=r"models are \['smollm2-135m'\] but .* sized for 'embedded'"):
        load_config(JobConfig, CONFIGS[0].parent / "default.yaml", ["teacher.model.preset=smollm2-135m"])
    from pipelines.common import PipelineConfig

    with pytest.raises(ConfigError, match="sized for 'smollm2-135m'"):  # and the other way round
        load_config(PipelineConfig, CONFIGS[0].parent / "dl19-smollm2.yaml", ["teacher.model.preset=tiny"])
    acknowledged = load_config(JobConfig, None, ["teacher.model.preset=smollm2-135m", "sized_for=smollm2-135m"])
    assert acknowledged.sized_for == "smollm2-135m"


def test_the_real_model_config_sets_every_size_itself():
    """What costs time on a real LM is written in its config, not taken from a dataclass default."""
    raw = flatten(yaml.safe_load((CONFIGS[0].parent / "dl19-smollm2.yaml").read_text()))
    for key in ("sized_for", "teacher.bootstrap_cfg.train.steps", "teacher.bootstrap_cfg.train.batch_size",
                "teacher.generation.batch_size", "student.train.steps", "student.train.batch_size",
                "eval.latency_requests", "cluster.teacher_batch_slates", "data.top_n", "prompt.max_doc_tokens"):
        assert key in raw, key


def test_configs_exist():
    assert CONFIGS, "configs/*.yaml missing"
