from pathlib import Path

import pytest

from hllm.config import ConfigError, flatten, load_config, parse_overrides
from hllm.workflow import JobConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_defaults_and_overrides_win():
    cfg = load_config(JobConfig, None, ["student.train.steps=7", "data.synthetic.slate_size=10",
                                        "student.ranker.head.kind=linear", "eval.decoders=[sort, greedy]"])
    assert cfg.student.train.steps == 7 and cfg.data.synthetic.slate_size == 10
    assert cfg.student.ranker.head.kind == "linear" and cfg.eval.decoders == ["sort", "greedy"]


@pytest.mark.parametrize("override,match", [
    (["student.train.stpes=3"], r"unknown config key\(s\) \['student.train.stpes'\]"),
    (["student.ranker.head.kind=mlp"], r"student.ranker.head.kind: 'mlp' is not one of"),
    (["student.train.steps=many"], r"student.train.steps: expected int"),
    (["teacher.model.preset=hf"], r"model.path is required"),
    (["student.loss.terms={nope: 1.0}"], r"unknown loss \['nope'\]"),
    (["eval.decoders=[magic]"], r"unknown \['magic'\]"),
    (["nokey"], r"not of the form key=value"),
])
def test_bad_configs_name_the_key(override, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(JobConfig, None, override)


def test_parse_overrides_types():
    assert parse_overrides(["a=1", "b=0.5", "c=true", "d=null", "e=x", "f=3e-3"]) == {
        "a": 1, "b": 0.5, "c": True, "d": None, "e": "x", "f": 0.003}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = load_config(JobConfig, path)
    assert flatten(cfg)["output_dir"]


def test_configs_exist():
    assert CONFIGS, "configs/*.yaml missing"
