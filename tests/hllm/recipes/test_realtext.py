"""The real-text recipe at tiny scale: cross-year folds over cached states, the shipped student,
and `hllm rerank` with that student giving the figures the recipe reported."""

import json
from pathlib import Path

import pytest

from hllm.config import ConfigError, load_config
from hllm.recipes.realtext import RealTextConfig, run
from hllm.reranker import Reranker
from pipelines.cli import main as cli

from conftest import TINY
from builders import beir_folder as _beir

ROOT = Path(__file__).resolve().parents[3]
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


RIDGE = {"fit": "ridge", "cv_folds": 2, "ranker.head.kind": "utility", "ranker.head.prior": "logrank", "seeds": "[0]",
         "ranker.pooling": "last+mean", "ranker.head.guard": "distance"}  # the shipped recipe's shape


@pytest.mark.parametrize("fit", ["sgd", "ridge"])
def test_cross_year_folds_and_the_shipped_student_rank_as_hllm_rerank_does(tmp_path, capsys, fit):
    cfg = tiny_config(tmp_path, **(RIDGE if fit == "ridge" else {}))
    report = run(cfg)
    (fold,) = report["folds"]
    assert fold["collection"] == "b" and fold["trained_on"] == ["a"] and fold["queries"] == 4
    assert len(fold["student_per_seed"]) == len(cfg.seeds) and 0 <= fold["student"]["nDCG@10"] <= 1
    for t in fold["training"]:
        assert t["train_queries"] + t["val_queries"] == 4
        assert t["val_nDCG@10"] >= t["val_nDCG@10_at_start"] or fit == "ridge"  # CV over (l2, scale): none is the first stage
    assert json.loads((tmp_path / "run" / "report.json").read_text())["folds"][0]["queries"] == 4
    (transfer,) = report["transfer"]
    shipped = Reranker.load(tmp_path / "shipped")
    assert shipped.default_window == 10 and len(shipped.model.body.layers) == 1
    assert json.loads((tmp_path / "shipped" / "model_card.json").read_text())["window"] == 10
    provenance = json.loads((tmp_path / "shipped" / "provenance.json").read_text())
    assert set(provenance["sha256"]) == {"head.safetensors", "hllm_ranker.json", "cascade.json"} and provenance["recipe"]["fit"] == fit
    assert "in sample" in shipped.cascade_thresholds.fitted_on["source"]  # its confidence on the queries it was fitted on
    capsys.readouterr()
    metrics = tmp_path / "m.json"
    assert cli(["rerank", "--model", str(tmp_path / "shipped"), "--data", str(tmp_path / "c"),
                "--out", str(tmp_path / "c.trec"), "--json", str(metrics), "--quiet"]) == 0
    assert "1.0 per query" in capsys.readouterr().out  # the whole list in one pass: the model's window
    got = json.loads(metrics.read_text())
    assert got["reranked"]["nDCG@10"] == pytest.approx(transfer["student"]["nDCG@10"], abs=1e-6)
    assert got["first stage (input order)"]["nDCG@10"] == pytest.approx(transfer["first_stage"]["nDCG@10"], abs=1e-6)
    # the report rows our checks read
    import csv
    import subprocess
    import sys
    out = tmp_path / "real_data.csv"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_data.py"), "--cross-year", str(tmp_path / "run"),
                           "--confirm", str(tmp_path / "run"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["collection"], r["split"], r["method"]): r for r in csv.DictReader(out.open())}
    confirm = {k: rows.pop(k) for k in list(rows) if k[1] == "transfer-confirm"}  # the second run's transfer rows alone
    assert {(c, m) for c, _, m in confirm} == {(c, m) for c, split, m in rows if split == "transfer-test"}
    guarded = {("b", "cross-year", "student_unguarded"), ("c", "transfer-test", "student_unguarded")} if fit == "ridge" else set()
    assert set(rows) == {("b", "cross-year", "first_stage"), ("b", "cross-year", "student"),
                         ("c", "transfer-test", "first_stage"), ("c", "transfer-test", "student")} | guarded
    if fit == "ridge":  # the guard's trust, and the same head without it, on every test set
        for row in (fold, transfer):
            assert 0 <= row["trust"]["mean"] <= 1 and 0 <= row["student_unguarded"]["nDCG@10"] <= 1
        assert report["shipped"]["guard"]["guard_high"] > report["shipped"]["guard"]["guard_low"]
        assert "domain guard, c (transfer-test): mean trust" in out.with_suffix(".md").read_text()
    assert float(rows["b", "cross-year", "student"]["nDCG@10"]) == round(fold["student"]["nDCG@10"], 4)
    assert rows["c", "transfer-test", "student"]["queries"] == "4" and "| c | 4 | transfer-test |" in out.with_suffix(".md").read_text()
    # states are reused: a second run computes none
    states = sorted((tmp_path / "run" / "states").glob("*/shard-*"))
    stamps = [p.stat().st_mtime_ns for p in states]
    run(cfg)
    assert [p.stat().st_mtime_ns for p in states] == stamps


def test_cross_validation_chooses_the_step_and_trains_on_every_query(tmp_path):
    from hllm.model.ranker import SinglePassRanker
    from hllm.recipes.realtext import Collections, train_head

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
    (["fit=ridge", "folds=[{train_on: [a], test_on: [b]}]"], "fit=ridge sets a utility head under the logrank prior"),
])
def test_bad_realtext_configs_say_why(overrides, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(RealTextConfig, None, overrides)


@pytest.mark.parametrize("path", REALTEXT_CONFIGS, ids=[p.name for p in REALTEXT_CONFIGS])
def test_every_shipped_realtext_config_loads(path):
    cfg = load_config(RealTextConfig, path)
    assert cfg.folds and cfg.ranker.head.prior != "none" and cfg.ranker.adapt.mode == "frozen"


def test_the_ridge_probe_ranks_by_its_utility_minus_the_scaled_log_rank(small_splits):
    import numpy as np
    import torch

    from hllm.model.heads import HeadConfig
    from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
    from hllm.train.head_fit import StateSlate, ridge_utility, set_utility, state_orders

    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(mode="frozen"),
                                                 head=HeadConfig(kind="utility", positions=8, prior="logrank"))).eval()
    torch.manual_seed(0)
    items = [StateSlate(s, torch.randn(len(s.candidates), 32)) for s in small_splits["train"][:12]]
    assert state_orders(ranker, items) == [list(range(len(i.slate.candidates))) for i in items]  # untrained: the input order
    w, b = ridge_utility(items, lam=10.0)
    x = torch.cat([i.states for i in items]).double()
    y = torch.tensor([g for i in items for g in i.grades(0)], dtype=torch.float64)
    xs = (x - x.mean(0)) / (x.std(0) + 1e-6)
    direct = torch.linalg.lstsq(torch.cat([xs, 10 ** 0.5 * torch.eye(32, dtype=torch.float64)]),
                                torch.cat([y - y.mean(), torch.zeros(32, dtype=torch.float64)])).solution
    np.testing.assert_allclose((x @ w.double()).numpy() - (x @ w.double()).mean().item(), (xs @ direct).numpy()
                               - (xs @ direct).mean().item(), atol=1e-3)
    for scale in (0.5, 2.0):
        set_utility(ranker, w, b, scale)
        for item, order in zip(items, state_orders(ranker, items)):
            u = (item.states @ w + b).double()
            fused = (u - u.mean()) / (u.std(unbiased=False) + 1e-6) - scale * torch.log1p(torch.arange(len(u), dtype=torch.float64))
            assert order[:8] == torch.argsort(fused, descending=True).tolist()[:8]
