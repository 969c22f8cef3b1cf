"""The real-text recipe at tiny scale: cross-year folds over cached states, the shipped student,
and `hllm rerank` with that student giving the figures the recipe reported."""

import json
from pathlib import Path

import pytest

from hllm.config import ConfigError, load_config
from hllm.realtext import RealTextConfig, run
from hllm.reranker import Reranker
from pipelines.cli import main as cli

from conftest import TINY
from test_cli import _beir

ROOT = Path(__file__).resolve().parents[1]
REALTEXT_CONFIGS = sorted((ROOT / "configs" / "realtext").glob("*.yaml"))


def tiny_config(tmp_path: Path, **extra) -> RealTextConfig:
    a, b, c = (_beir(tmp_path / name, queries=4, docs=10) for name in ("a", "b", "c"))
    overrides = [f"output_dir={tmp_path / 'run'}", "top_n=10", "seeds=[0, 1]", "val_fraction=0.3", "cv_folds=0",
                 "ranker.state_layer=1", "ranker.adapt.mode=frozen", "ranker.head.prior=rank", "ranker.prompt.max_doc_tokens=8", "ranker.head.positions=4",
                 "ranker.head.width=32", "ranker.head.num_heads=2", "train.steps=12", "train.batch_size=2",
                 "train.log_every=4", "train.warmup_steps=2", f"folds=[{{train_on: [{a}], test_on: [{b}]}}]",
                 f"ship_on=[{a}, {b}]", f"ship_to={tmp_path / 'shipped'}", f"transfer=[{c}]", "transfer_fraction=1.0",
                 *(f"{k}={v}" for k, v in extra.items())]
    cfg = load_config(RealTextConfig, None, overrides)
    cfg.ranker.model = TINY
    return cfg


def test_cross_year_folds_and_the_shipped_student_rank_as_hllm_rerank_does(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    report = run(cfg)
    (fold,) = report["folds"]
    assert fold["collection"] == "b" and fold["trained_on"] == ["a"] and fold["queries"] == 4
    assert len(fold["student_per_seed"]) == 2 and 0 <= fold["student"]["nDCG@10"] <= 1
    for t in fold["training"]:
        assert t["train_queries"] + t["val_queries"] == 4 and t["val_nDCG@10"] >= t["val_nDCG@10_at_start"]
    assert json.loads((tmp_path / "run" / "report.json").read_text())["folds"][0]["queries"] == 4
    (transfer,) = report["transfer"]
    shipped = Reranker.load(tmp_path / "shipped")
    assert shipped.default_window == 10 and len(shipped.model.body.layers) == 1
    assert json.loads((tmp_path / "shipped" / "model_card.json").read_text())["window"] == 10
    capsys.readouterr()
    metrics = tmp_path / "m.json"
    assert cli(["rerank", "--model", str(tmp_path / "shipped"), "--data", str(tmp_path / "c"),
                "--out", str(tmp_path / "c.trec"), "--json", str(metrics), "--quiet"]) == 0
    assert "1.0 per query" in capsys.readouterr().out  # the whole list in one pass: the model's window
    got = json.loads(metrics.read_text())
    assert got["reranked"]["nDCG@10"] == pytest.approx(transfer["student"]["nDCG@10"], abs=1e-6)
    assert got["first stage (input order)"]["nDCG@10"] == pytest.approx(transfer["first_stage"]["nDCG@10"], abs=1e-6)
    # states are reused: a second run computes none
    states = sorted((tmp_path / "run" / "states").glob("*/shard-*"))
    stamps = [p.stat().st_mtime_ns for p in states]
    run(cfg)
    assert [p.stat().st_mtime_ns for p in states] == stamps


def test_cross_validation_chooses_the_step_and_trains_on_every_query(tmp_path):
    from hllm.realtext import Collections, train_head
    from hllm.ranker import SinglePassRanker

    cfg = tiny_config(tmp_path, cv_folds=3)
    ranker = SinglePassRanker.build(cfg.ranker).eval()
    items = Collections(cfg, ranker).items(str(tmp_path / "a")) + Collections(cfg, ranker).items(str(tmp_path / "b"))
    record = train_head(ranker, items, cfg, seed=0)
    curve = record["cv_curve"]
    assert sorted(curve) == [0, 4, 8, 12] and record["best_step"] in curve
    assert record["val_nDCG@10"] == max(curve.values()) and record["val_nDCG@10_at_start"] == curve[0]
    assert record["train_queries"] == 8 and record["val_queries"] == 0
    with pytest.raises(ValueError, match="at least 2 of its"):
        train_head(ranker, items[:1], cfg, seed=0)


@pytest.mark.parametrize("overrides,match", [
    (["ranker.adapt.mode=lora"], "frozen"),
    (["ship_on=[x]"], "ship_on and ship_to go together"),
    (["transfer=[x]"], "transfer collections are checked with the shipped head"),
    ([], "nothing to do"),
])
def test_bad_realtext_configs_say_why(overrides, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(RealTextConfig, None, overrides)


@pytest.mark.parametrize("path", REALTEXT_CONFIGS, ids=[p.name for p in REALTEXT_CONFIGS])
def test_every_shipped_realtext_config_loads(path):
    cfg = load_config(RealTextConfig, path)
    assert cfg.folds and cfg.ranker.head.prior == "rank" and cfg.ranker.adapt.mode == "frozen"
