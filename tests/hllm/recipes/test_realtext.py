"""The real-text recipe at tiny scale, from the judgments: cross-year fits over cached states, the shipped student,
and `hllm rerank` with that student giving the figures the recipe reported (teachers: test_realtext_teachers.py)."""

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
    overrides = [f"output_dir={tmp_path / 'run'}", "top_n=10", "cv_folds=2", "layers=[1]", "ranker.state_layer=1",
                 "ranker.adapt.mode=frozen", "ranker.pooling=last+mean", "ranker.head.kind=utility", "ranker.head.prior=logrank",
                 "ranker.prompt.max_doc_tokens=8", "ranker.head.positions=4", "sgd_head.positions=4", "sgd_head.width=32",
                 "sgd_head.num_heads=2", "train.steps=12", "train.batch_size=2", "train.log_every=4", "train.warmup_steps=2",
                 f"cross_year=[{{train_on: [{a}], test_on: [{b}]}}]", f"ship_on=[{a}, {b}]", f"ship_to={tmp_path / 'shipped'}",
                 f"transfer=[{c}]", "transfer_fraction=1.0", *(f"{k}={v}" for k, v in extra.items())]
    cfg = load_config(RealTextConfig, None, overrides)
    cfg.ranker.model = TINY
    return cfg


SGD = {"variants": "[{name: sgd, target: judgments, fit: sgd, layer: 1}]"}  # the paper's attention head (sgd_head), by SGD
RIDGE = {"variants": "[{name: ridge, target: judgments, fit: ridge, layer: 1}]", "ranker.head.guard": "distance"}  # the shipped recipe's shape


@pytest.mark.parametrize("fit", ["sgd", "ridge"])
def test_cross_year_folds_and_the_shipped_student_rank_as_hllm_rerank_does(tmp_path, capsys, fit):
    cfg = tiny_config(tmp_path, **(RIDGE if fit == "ridge" else SGD))
    report = run(cfg)
    (cross,) = report["cross_year"]
    fold = cross["tests"]["b"]
    assert cross["trained_on"] == ["a"] and cross["queries"] == 4 and fold["queries"] == 4
    assert cross["chosen"] == {"student_judged": fit} and 0 <= fold["methods"]["student_judged"]["nDCG@10"] <= 1
    record = cross["cv"][fit]
    assert record["cv_score"] >= record["cv_first_stage"] or fit == "ridge"  # CV over (l2, scale): none is the first stage
    assert json.loads((tmp_path / "run" / "report.json").read_text())["cross_year"][0]["tests"]["b"]["queries"] == 4
    (transfer,) = report["transfer"]
    shipped = Reranker.load(tmp_path / "shipped")
    assert shipped.default_window == 10 and len(shipped.model.body.layers) == 1
    assert json.loads((tmp_path / "shipped" / "model_card.json").read_text())["window"] == 10
    provenance = json.loads((tmp_path / "shipped" / "provenance.json").read_text())
    assert set(provenance["sha256"]) == {"head.safetensors", "hllm_ranker.json", "cascade.json"}
    assert provenance["recipe"]["variants"][0]["fit"] == fit and report["shipped"]["queries"] == 8
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
        for row in (fold["guard"]["ridge"], transfer):
            assert 0 <= row["trust"]["mean"] <= 1 and 0 <= row["student_unguarded"]["nDCG@10"] <= 1
        assert report["shipped"]["guard"]["guard_high"] > report["shipped"]["guard"]["guard_low"]
        assert "domain guard, c (transfer-test): mean trust" in out.with_suffix(".md").read_text()
    assert float(rows["b", "cross-year", "student"]["nDCG@10"]) == round(fold["methods"]["student_judged"]["nDCG@10"], 4)
    assert rows["c", "transfer-test", "student"]["queries"] == "4" and "| c | 4 | transfer-test |" in out.with_suffix(".md").read_text()
    # states are reused: a second run computes none
    states = sorted((tmp_path / "run" / "states").glob("*/shard-*"))
    stamps = [p.stat().st_mtime_ns for p in states]
    run(cfg)
    assert [p.stat().st_mtime_ns for p in states] == stamps


def test_cross_validation_chooses_the_step_and_trains_on_every_query(tmp_path):
    from hllm.model.ranker import SinglePassRanker
    from hllm.recipes.realtext import Collections
    from hllm.train.probes import VariantFitter

    cfg = tiny_config(tmp_path, cv_folds=3, **SGD)
    ranker = SinglePassRanker.build(cfg.ranker).eval()
    data = Collections(cfg, ranker)
    queries = data.all(str(tmp_path / "a")) + data.all(str(tmp_path / "b"))
    fitter = VariantFitter(cfg, ranker, queries[0].states[1].shape[1] // 2)  # last+mean: two halves
    record = fitter.fit(cfg.variants[0], None, queries)
    curve = record.cv_curve
    assert sorted(curve) == [0, 4, 8, 12] and record.best_step in curve
    assert record.cv_score == max(curve.values()) and record.cv_first_stage == curve[0]
    assert record.summary() == {"cv_score": record.cv_score, "cv_first_stage": curve[0], "best_step": record.best_step}
    assert record.ridge_lambda is None and "cv_curve" in record.to_json() and "cv_curve" not in record.to_json(without=["cv_curve"])
    with pytest.raises(ValueError, match="at least 2 of its"):
        fitter.fit(cfg.variants[0], None, queries[:1])


TEACHER = "teachers=[{name: t, rankings: r.tsv}]"
@pytest.mark.parametrize("overrides,match", [
    (["ranker.adapt.mode=lora"], "frozen"),
    (["ship_on=[x]"], "ship_on and ship_to go together"),
    (["transfer=[x]"], "transfer collections are checked with the shipped student"),
    ([], "nothing to do"),
    (["cv_folds=1", "folds=2"], "cv_folds >= 2"),
    (["folds=2"], "give teacher_collection"),
    (["cross_year=[{train_on: [a], test_on: [b]}]", "variants=[{name: t, target: teacher}]"], "learns from a teacher"),
    (["cross_year=[{train_on: [a], test_on: [b]}]", "variants=[{name: t, target: teacher}]", TEACHER, "teacher_collection=c"],
     "a training set of"),
    (["ship_on=[a]", "ship_to=x", "cascade_from=out-of-fold"], "out-of-fold"),
    (["ship_on=[a]", "ship_to=x", "ship_method=student_distilled"], "there are none"),
    (["ship_on=[a]", "ship_to=x", "variants=[{name: v, target: judgments, layer: 12}]"], "not among layers"),
    (["folds=2", "teacher_collection=c", TEACHER, "first_stages=[bm25]", "variants=[{name: v, target: teacher, test_stages: [dense]}]"],
     "not among first_stages"),
    (["folds=2", "teacher_collection=c", TEACHER, "first_stages=[bm25, dense]", "variants=[{name: v, target: teacher, test_stages: [dense]}]"],
     "must include bm25"),
    (["folds=2", "teacher_collection=c", TEACHER, "layers=[12, 16]", "variants=[{name: v, target: teacher, fit: lora}]"], "layers must be"),
    (["folds=2", "teacher_collection=c", TEACHER, "variants=[{name: v, target: both, fit: lora}]"], "learns from the teacher"),
    (["folds=2", "teacher_collection=c", TEACHER, "variants=[{name: v, target: teacher, fit: lora, lora_layers: 2},"
      " {name: w, target: teacher, fit: lora, lora_layers: 3}]"], "one lora_layers"),
    (["folds=2", "teacher_collection=c", TEACHER, "headline=w", "variants=[{name: v, target: teacher}]"], "not one trial"),
    (["cross_year=[{train_on: [a], test_on: [b], variants: [w]}]", "variants=[{name: v, target: judgments}]"], "are not variants"),
    (["cross_year=[{train_on: [a], test_on: [b]}]", "first_stage_weights=[0.0, 1.0]"], "give folds"),
])
def test_bad_realtext_configs_say_why(overrides, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(RealTextConfig, None, overrides)


@pytest.mark.parametrize("path", REALTEXT_CONFIGS, ids=[p.name for p in REALTEXT_CONFIGS])
def test_every_shipped_realtext_config_loads(path):
    cfg = load_config(RealTextConfig, path)
    assert (cfg.cross_year or cfg.folds) and cfg.ranker.head.prior != "none" and cfg.ranker.adapt.mode == "frozen"
    assert cfg.ship_to or cfg.methods == []  # a config ships its student, or is a study of its variants (no method chosen)


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


def test_states_are_cached_under_the_recipes_config_whatever_head_was_fitted_last(tmp_path):
    from hllm.model.ranker import SinglePassRanker
    from hllm.recipes.realtext import Collections
    from hllm.train.probes import Variant, VariantFitter

    cfg = tiny_config(tmp_path, **RIDGE)
    ranker = SinglePassRanker.build(cfg.ranker).eval()
    data = Collections(cfg, ranker)
    a = data.all(str(tmp_path / "a"))
    VariantFitter(cfg, ranker, a[0].states[1].shape[1] // 2).new_head(Variant(name="m", target="judgments", layer=1, pooling="mean"))
    assert ranker.cfg.pooling == "mean"  # a fitted head that reads half of the cached states
    b = data.all(str(tmp_path / "b"))
    assert b[0].states[1].shape == a[0].states[1].shape and ranker.cfg.pooling == "mean"
    assert len(list((tmp_path / "run" / "states").iterdir())) == 2  # one folder a collection, both under the recipe's key
