"""The real-text recipe with teachers: distillation from a real teacher's file at tiny scale: teacher-folds (every query tested once, each
method's variant chosen on training queries), the share of the teacher's gain kept, cross-year, the
shipped student ranking as the recipe measured it."""

import json
from pathlib import Path

import numpy as np
import pytest

from hllm.config import load_config
from hllm.eval.metrics import ir_metrics
from hllm.data.readers import read_qrels, read_slates
from hllm.model.backbones import file_sha256
from hllm.model.prompts import document_text
from hllm.eval.metrics import share_kept
from hllm.recipes.realtext import RealTextConfig, run, trials
from hllm.train.probes import teacher_grades
from hllm.reranker import Reranker

from conftest import TINY
from builders import beir_folder as _beir

ROOT = Path(__file__).resolve().parents[3]


def _teacher_run(root: Path, noise: int) -> Path:
    """A teacher that ranks by the qrels' grade, with `noise` adjacent swaps below its top 2."""
    qrels = read_qrels(root / "qrels" / "test.tsv")
    lines = ["query-id\tcorpus-id\trank\tscore"]
    for qid, judged in qrels.items():
        order = sorted(judged, key=lambda d: (-judged[d], int(d[1:])))
        for i in range(2, 2 + noise):
            order[i], order[i + 1] = order[i + 1], order[i]
        lines += [f"{qid}\t{d}\t{r + 1}\t{100 - r}" for r, d in enumerate(order)]
    path = root / f"teacher-noise{noise}.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_config(tmp_path: Path) -> RealTextConfig:
    a, b = _beir(tmp_path / "a", queries=9, docs=8), _beir(tmp_path / "b", queries=4, docs=8)
    overrides = [f"output_dir={tmp_path / 'run'}", f"teacher_collection={a}", f"cross_year=[{{train_on: [{a}], test_on: [{b}]}}]",
                 "top_n=8", "folds=2", "cv_folds=2",
                 f"teachers=[{{name: gold, rankings: {_teacher_run(a, 0)}}}, {{name: noisy, rankings: {_teacher_run(a, 2)}}}]",
                 "layers=[1, 2]", "ranker.state_layer=2", "ranker.adapt.mode=frozen", "ranker.pooling=last+mean", "ranker.prompt.max_doc_tokens=8", "ranker.head.positions=4",
                 "sgd_head.positions=4", "sgd_head.width=32", "sgd_head.num_heads=2", "teacher_depth=4",
                 "train.steps=8", "train.batch_size=4", "train.log_every=4", "train.warmup_steps=2", "bootstrap=200",
                 "variants=[{name: r1, target: teacher, layer: 1, pooling: mean}, {name: r2, target: teacher, layer: 2},"
                 " {name: j2, target: judgments, layer: 2}, {name: b2, target: both, layer: 2, pooling: last},"
                 " {name: sgd, target: teacher, fit: sgd, layer: 2, sample_items: 4}]",
                 f"ship_on=[{a}]", f"ship_to={tmp_path / 'shipped'}", "ship_method=student_distilled",
                 "cascade_from=out-of-fold", "calibrate=true"]
    cfg = load_config(RealTextConfig, None, overrides)
    cfg.ranker.model = TINY
    return cfg


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("realtext-teachers")
    cfg = tiny_config(tmp_path)
    return cfg, run(cfg), tmp_path


def test_teacher_folds_test_every_query_once_and_ship_the_distilled_student(distilled):
    cfg, report, tmp_path = distilled
    folds = report["teacher_folds"]
    slates = read_slates("beir", cfg.teacher_collection, top_n=8)
    assert folds["queries"] == 9 and report["coverage"]["gold"]["ranked"] == 9
    table = folds["table"]
    # the teacher's own figures are its file's, measured like every method (here: the grades' order of the candidates)
    gold = [sorted(range(8), key=lambda i: (-s.grades[i], int(s.candidates[i].docid[1:]))) for s in slates]
    assert table["teacher@gold"]["nDCG@10"] == pytest.approx(ir_metrics(slates, gold, ["nDCG@10"])["nDCG@10"])
    assert table["first_stage"]["tau_to_gold"] < 1 and table["teacher@gold"]["tau_to_gold"] == pytest.approx(1.0)
    for t in ("gold", "noisy"):
        for m in ("student_distilled", "student_both", "student_judged"):
            assert f"{m}@{t}" in table and f"{m}@{t}" in folds["share_kept"]
            assert len(table[f"{m}@{t}"]["per_query_nDCG@10"]) == 9  # every query tested once
    # each fold chose among its method's own variants, by the CV score on its training queries
    for chosen, cv in zip(folds["chosen"], folds["cv"]):
        assert chosen["student_judged@gold"] == "j2" and chosen["student_both@noisy"] == "b2@noisy"
        picked = chosen["student_distilled@gold"]
        assert picked in ("r1@gold", "r2@gold", "sgd@gold")
        assert cv[picked]["cv_score"] == max(cv[n]["cv_score"] for n in ("r1@gold", "r2@gold", "sgd@gold"))
    # cross-year: first stage and each method on the other collection
    (cross,) = report["cross_year"]
    assert cross["trained_on"] == ["a"] and cross["queries"] == 9
    test = cross["tests"]["b"]
    assert test["queries"] == 4 and {"first_stage", "student_distilled@gold", "student_judged@gold"} <= set(test["methods"])
    # the shipped student ranks b as the recipe measured it, and its card names the teacher and the data
    card = json.loads((tmp_path / "shipped" / "model_card.json").read_text())
    assert card["teacher"]["name"] == "gold" and card["training_data"] == {"collections": ["a"], "queries": 9, "top_n": 8}
    shipped = Reranker.load(tmp_path / "shipped")
    b = read_slates("beir", tmp_path / "b", top_n=8)
    orders = [shipped.decode(m).permutation.tolist() for m in shipped.score_slates(b)]
    assert ir_metrics(b, orders, ["nDCG@10"])["nDCG@10"] == pytest.approx(test["methods"]["student_distilled@gold"]["nDCG@10"], abs=1e-6)
    # relevance_score: calibrated on out-of-fold matrices, non-increasing along the ranking, its ECE on the card
    ranked = shipped.rank(b[0].query.text, [document_text(c) for c in b[0].candidates])
    assert all(r.relevance is not None for r in ranked)
    assert all(x.relevance >= y.relevance for x, y in zip(ranked, ranked[1:]))
    cal = report["calibration"]
    assert cal["oof"]["items"] == 9 * 8 and card["relevance_score"]["ece_held_out_queries"] == pytest.approx(cal["oof"]["ece"])
    assert cal["trial"] == card["variant"]  # calibrated on the shipped variant's own out-of-fold matrices
    assert cal["cross_year"]["b"]["items"] == 4 * 8
    thresholds = shipped.cascade_thresholds  # the cascade's, from the same out-of-fold matrices: like unseen traffic
    assert thresholds.fitted_on["queries"] == 9 and "out of fold" in thresholds.fitted_on["source"]
    provenance = json.loads((tmp_path / "shipped" / "provenance.json").read_text())
    for name, digest in provenance["sha256"].items():  # the shipped files are the ones measured
        assert file_sha256(tmp_path / "shipped" / name) == digest, name
    assert {"head.safetensors", "calibration.json"} <= set(provenance["sha256"]) and set(provenance["teacher_rankings_sha256"]) == {"gold", "noisy"}


def test_a_stopped_run_resumes_at_the_next_fold_with_the_same_figures(distilled):
    cfg, report, _ = distilled
    saved = sorted((Path(cfg.output_dir) / "folds").glob("fold*.npz"))
    assert len(saved) == 2 * len(trials(cfg))  # one per trial and fold
    stopped = [p for p in saved if p.name.startswith("fold1-")]
    for p in stopped[len(stopped) // 2:]:
        p.unlink()  # as if the run had stopped during the second fold
    again = run(cfg)
    assert all(p.is_file() for p in stopped)
    assert again["teacher_folds"]["table"] == report["teacher_folds"]["table"]
    assert again["teacher_folds"]["chosen"] == report["teacher_folds"]["chosen"]


def test_teacher_grades_and_the_share_of_the_gain_kept():
    assert teacher_grades([2, 0, 3, 1], depth=2) == [1, 0, 2, 0]
    first, teacher = np.array([0.2, 0.4, 0.3, 0.5]), np.array([0.6, 0.8, 0.5, 0.9])
    student = first + 0.5 * (teacher - first)
    got = share_kept(student, first, teacher, resamples=500, seed=0)
    assert got["share"] == pytest.approx(0.5) and got["ci_low"] == pytest.approx(0.5) and got["ci_high"] == pytest.approx(0.5)
    noisy = share_kept(student + np.array([0.1, -0.1, 0.05, -0.02]), first, teacher, resamples=500, seed=0)
    assert noisy["ci_low"] < noisy["share"] < noisy["ci_high"]


def test_mlflow_records_a_parent_and_a_child_per_trial_with_the_reports_figures(distilled):
    import mlflow

    from pipelines.common import RecipeJob, TrackingConfig
    from pipelines.recorded_recipes import log_realtext as log_report

    cfg, report, tmp_path = distilled
    parent = log_report(RecipeJob(cfg, TrackingConfig(experiment="hllm-realtext", registered_model=None)), report)
    mlflow.set_tracking_uri(f"sqlite:///{Path(cfg.output_dir).resolve() / 'mlflow.db'}")
    children = mlflow.search_runs(experiment_names=["hllm-realtext"], output_format="list",
                                  filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    trials = {c.data.tags["ablation.variant"]: c for c in children}
    assert set(trials) == {"r1@gold", "r1@noisy", "r2@gold", "r2@noisy", "j2", "b2@gold", "b2@noisy", "sgd@gold", "sgd@noisy"}
    table = report["teacher_folds"]["table"]
    for name, child in trials.items():
        assert child.data.metrics["folds.nDCG_at_10"] == pytest.approx(table[f"trial:{name}"]["nDCG@10"])
        assert child.data.params["variant.name"] == name.split("@")[0]
    assert trials["j2"].data.params["teacher"] == "judgments"
    top = mlflow.get_run(parent).data.metrics
    assert top["folds.student_distilled_at_gold.share_kept.share"] == pytest.approx(
        report["teacher_folds"]["share_kept"]["student_distilled@gold"]["share"])


@pytest.mark.parametrize("path", [p for p in sorted((ROOT / "configs" / "realtext").glob("*.yaml")) if "teachers:" in p.read_text()],
                         ids=lambda p: p.name)
def test_every_shipped_config_with_teachers_loads_with_teachers_that_exist_in_its_data(path):
    cfg = load_config(RealTextConfig, path)
    assert cfg.teachers and cfg.variants and cfg.folds and cfg.ranker.adapt.mode == "frozen"
    if cfg.methods is None:
        assert {v.target for v in cfg.variants} == {"teacher", "both", "judgments"}  # every method has a variant
    data = ROOT.parent / "shared" / "data"
    if data.is_dir():
        for t in cfg.teachers:
            for stage in cfg.first_stages or [""]:
                assert (ROOT / t.rankings.format(stage=stage)).is_file(), t.rankings


def test_real_data_report_takes_the_teacher_folds_rows_and_keeps_every_other_row(distilled, tmp_path):
    import csv
    import subprocess
    import sys

    cfg, report, _ = distilled
    out = tmp_path / "real_data.csv"
    out.write_text("collection,queries,split,method,nDCG@10,MRR@10\ncranfield,40,transfer-test,student,0.3903,0.5457\n"
                   "b,4,cross-year,first_stage,0.1,0.1\nb,4,cross-year,student,0.2,0.2\n")
    out.with_suffix(".md").write_text("# Real text: first stage, teacher, student\n\nearlier rows\n")
    for _ in range(2):  # a second run replaces its own rows, never doubles them
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_data.py"), "--teacher-folds", cfg.output_dir,
                               "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert rows[0]["collection"] == "cranfield" and rows[0]["teacher"] == ""
    # the same (collection, split, method, teacher) is replaced where it stood: b's first stage, measured again
    assert [(r["collection"], r["method"]) for r in rows[1:3]] == [("b", "first_stage"), ("b", "student")]
    assert float(rows[1]["nDCG@10"]) == pytest.approx(report["cross_year"][0]["tests"]["b"]["methods"]["first_stage"]["nDCG@10"], abs=1e-4)
    folds = [r for r in rows if r["split"] == "teacher-folds"]
    assert len(folds) == 2 * 5  # per teacher: first stage, teacher, three students
    table, shares = report["teacher_folds"]["table"], report["teacher_folds"]["share_kept"]
    got = {(r["method"], r["teacher"]): r for r in folds}
    assert float(got["student_distilled", "gold"]["nDCG@10"]) == pytest.approx(table["student_distilled@gold"]["nDCG@10"], abs=1e-4)
    assert float(got["student_distilled", "gold"]["share_kept"]) == pytest.approx(shares["student_distilled@gold"]["share"], abs=0.005)
    assert float(got["first_stage", "noisy"]["tau_to_teacher"]) == pytest.approx(table["first_stage"]["tau_to_noisy"], abs=5e-4)
    cross = [r for r in rows if r["split"] == "cross-year"]
    assert [(r["collection"], r["method"], r["teacher"]) for r in cross] == [
        ("b", "first_stage", ""), ("b", "student", ""), ("b", "student_distilled", "gold"), ("b", "student_distilled", "noisy")]
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# Real text") and "earlier rows" in md and md.count("## Real teachers") == 1


def test_the_cli_records_a_finished_report_and_refuses_one_of_another_config(distilled, tmp_path, capsys):
    import yaml

    from hllm.config import to_dict
    from pipelines.cli import main as cli

    cfg, report, _ = distilled
    config = tmp_path / "realtext.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    store = f"tracking.tracking_uri=sqlite:///{tmp_path / 'cli.db'}"
    report_path = str(Path(cfg.output_dir) / "report.json")
    assert cli(["distilltext", "--config", str(config), "--report", report_path, store]) in (0, None)  # the old name: an alias
    out = capsys.readouterr().out
    assert "teacher-folds student_distilled@gold" in out and "mlflow parent run" in out
    assert cli(["distilltext", "--config", str(config), "--report", report_path, "cv_folds=3", store]) == 2
    assert "another config" in capsys.readouterr().err


@pytest.mark.slow
def test_the_lora_step_benchmark_runs_at_a_tiny_size(tmp_path):
    import subprocess
    import sys

    data = _beir(tmp_path / "a", queries=2, docs=6)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora_step.py"), "--tiny", "--data", str(data),
                           "--top-n", "6", "--rank", "2", "--steps", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = {line.split(":")[0].strip(): line for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert any(k.startswith("LoRA r=2") for k in figures) and "frozen" in figures
    for line in proc.stdout.splitlines():
        if line.strip().endswith(" s"):
            assert float(line.rsplit(":", 1)[1].split()[0]) > 0


def test_a_variant_grades_the_teacher_to_its_own_depth(tmp_path):
    import dataclasses

    import torch

    from hllm.train.probes import CachedQuery, Variant, VariantFitter
    from hllm.records import Candidate, Query, RerankRequest

    cfg = tiny_config(tmp_path)  # teacher_depth=4
    slate = RerankRequest(Query("q0", "text"), [Candidate(f"d{i}", "x") for i in range(6)], [0, 1, 0, 2, 0, 0])
    query = CachedQuery(slate, {layer: torch.zeros(6, 2 * 3) for layer in cfg.layers}, {"gold": [3, 1, 0, 2, 5, 4]})
    fitter = VariantFitter(cfg, None, width=3)
    for depth, want in ((None, [2, 3, 1, 4, 0, 0]), (6, [4, 5, 3, 6, 1, 2]), (1, [0, 0, 0, 1, 0, 0])):
        v = Variant(name="v", target="teacher", layer=2, pooling="mean", teacher_depth=depth)
        items, _ = fitter.views(v, "gold", [query])
        assert items[0].utility == want and items[0].states.shape == (6, 3)
    both = Variant(name="b", target="both", layer=2, teacher_depth=6)
    items, _ = fitter.views(both, "gold", [query])
    assert items[0].utility == pytest.approx([g + 3.0 * t / 6 for g, t in zip([0, 1, 0, 2, 0, 0], [4, 5, 3, 6, 1, 2])])
    with pytest.raises(ValueError, match="teacher_depth must be >= 1"):
        RealTextConfig(teachers=cfg.teachers, variants=[dataclasses.replace(v, layer=16, teacher_depth=0)])
