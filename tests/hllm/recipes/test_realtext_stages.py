"""The real-text recipe over several first stages (issue #48's study, one recipe since #53) at tiny scale: folds keep a
query's lists from every first stage together; LoRA students over cached prefix states beside closed-form probes, each
ranking its test stages; the first-stage blend chosen per fold and stage on the other folds; cross-year; a stopped run
resumes from its finished (trial, fold) files with the same figures; its rows replace their own in the results CSV; MLflow
records a child per trial."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from hllm.config import load_config, to_dict
from hllm.data.readers import read_qrels
from hllm.model.ranker import SinglePassRanker
from hllm.recipes.realtext import FOLD_SALT, RealTextConfig, run, summary_lines
from hllm.train.head_fit import query_folds
from hllm.train.probes import VariantFitter, load_queries

from builders import beir_folder as _beir


def _multistage(root: Path, queries: int = 8, docs: int = 8) -> Path:
    """A tiny multistage folder: `bm25` (the tiny BEIR run), `dense` (its reverse); the teacher orders by grade."""
    _beir(root, queries=queries, docs=docs)
    qrels = read_qrels(root / "qrels" / "test.tsv")
    (root / "runs" / "dense_top100.tsv").write_text("\n".join(
        ["query-id\tcorpus-id\trank\tscore"] + [f"q{q}\td{q * docs + d}\t{docs - d}\t{d}" for q in range(queries) for d in range(docs)]) + "\n")
    (root / "teacher-runs").mkdir()
    for stage in ("bm25", "dense"):
        lines = ["query-id\tcorpus-id\trank\tscore"]
        for q in range(queries):
            order = sorted(qrels[f"q{q}"], key=lambda d: (-qrels[f"q{q}"][d], d))
            lines += [f"q{q}\t{d}\t{r + 1}\t{101 - r - 1}" for r, d in enumerate(order)]
        (root / "teacher-runs" / f"teach_{stage}_top100.tsv").write_text("\n".join(lines) + "\n")
    return root


def stages_config(tmp_path: Path, data: Path, **extra) -> RealTextConfig:
    tiny = "{hidden_size: 32, layers: 3, heads: 2, intermediate_size: 64, context_length: 1024}"
    lora = ("{name: %s, target: teacher, fit: lora, layer: 3, lora_layers: 2, lora_r: 4, pooling: %s,"
            " head: {kind: attention, positions: 4, width: 32, num_heads: 2, prior: rank},"
            " train: {steps: 3, batch_size: 4, lr: 0.001, warmup_steps: 1, log_every: 3}%s}")
    overrides = [f"output_dir={tmp_path / 'run'}", f"teacher_collection={data}", "first_stages=[bm25, dense]",
                 f"teachers=[{{name: teach, rankings: '{data}/teacher-runs/teach_{{stage}}_top100.tsv'}}]",
                 f"ranker.model={tiny}", "ranker.adapt.mode=frozen", "ranker.head.kind=utility", "ranker.head.prior=logrank",
                 "ranker.state_layer=3", "ranker.pooling=last+mean", "ranker.head.positions=4",
                 "ranker.prompt={template: rankgpt-query, max_doc_tokens: 8}", "top_n=8", "folds=2", "cv_folds=2", "methods=[]",
                 "ridge_lambdas=[1000.0]", "prior_scales=[0.5]", "teacher_depth=8", "sub_slates={items: 4, per_list: 2}",
                 "first_stage_weights=[0.0, 1.0, .inf]", "in_sample=2", "bootstrap=100", "headline=lora",
                 f"report_to={tmp_path / 'stages.md'}",
                 "variants=[" + ", ".join([lora % ("lora", "last+mean", ""),
                                           "{name: probe, target: teacher, layer: 3, pooling: mean, train_stages: [bm25], test_stages: [bm25]}",
                                           lora % ("warm", "mean", ", head_init: ridge")]) + "]"]
    return load_config(RealTextConfig, None, overrides + [f"{k}={v}" for k, v in extra.items()])


def test_folds_hold_out_a_querys_lists_from_every_stage_together(tmp_path):
    cfg = stages_config(tmp_path, _multistage(tmp_path / "data"))
    ranker = SinglePassRanker.build(cfg.ranker).eval()
    queries, coverage = load_queries(cfg, ranker, cfg.teacher_collection, cfg.teachers, stages=cfg.first_stages, prefix=cfg.prefix())
    assert len(queries) == 16 and [q.stage for q in queries] == ["bm25"] * 8 + ["dense"] * 8 and coverage["teach"]["ranked"] == 16
    assert [c.docid for c in queries[8].slate.candidates] == [c.docid for c in queries[0].slate.candidates][::-1]
    for train, test in query_folds(len(queries), [q.slate.slate_id for q in queries], cfg.folds, FOLD_SALT):
        assert not {queries[i].slate.slate_id for i in train} & {queries[i].slate.slate_id for i in test}
        assert sorted(queries[i].stage for i in test) == sorted(["bm25", "dense"] * (len(test) // 2))  # both stages of each query
    for q in queries:  # every list's prefix states and its two training sub-slates, the teacher's relative order
        assert q.prefix is not None and len(q.prefix.sub_index) == 2 and q.states[3].shape == (8, 2 * 32)
        for j in q.prefix.sub_index:
            sub, perm = q.prefix.subs.states.slates[j], q.prefix.subs.perms[j]
            assert [sub.candidates[i].docid for i in perm] == [d for d in (q.slate.candidates[i].docid for i in q.perms["teach"])
                                                              if d in {c.docid for c in sub.candidates}]
    # the warm-started LoRA student starts from the ridge probe: its head the probe's kind, over its pooling
    warm = next(v for v in cfg.variants if v.name == "warm")
    rc = VariantFitter(cfg, ranker, 32).lora_config(warm)
    assert rc.head.kind == "utility" and rc.pooling == "mean" and rc.adapt.lora_layers == 2 and rc.adapt.mode == "lora"


@pytest.mark.slow
def test_the_recipe_runs_over_several_first_stages_end_to_end_and_resumes_from_its_folds(tmp_path, caplog):
    data = _multistage(tmp_path / "data")
    csv_path = tmp_path / "real_data.csv"
    csv_path.write_text("collection,queries,split,method,nDCG@10,MRR@10,teacher,tau_to_teacher,share_kept,share_kept_ci95\n"
                        "data,8,stage-bm25,lora,0.1,0.1,teach,,,\nx,1,teacher-folds,kept,0.2,0.2,,,,\n")
    other = _beir(tmp_path / "other", queries=3, docs=8)
    cfg = stages_config(tmp_path, data, cross_year=f"[{{train_on: [{data}], test_on: [{other}], variants: [lora]}}]", csv_to=csv_path)
    report = run(cfg)
    stages = report["by_stage"]
    assert set(stages) == {"bm25", "dense"} and report["teacher_folds"] == stages["bm25"]
    bm25, dense = stages["bm25"]["table"], stages["dense"]["table"]
    trials = {f"trial:{n}@teach{b}" for n in ("lora", "probe", "warm") for b in ("", "+first-stage")}
    assert set(bm25) == {"first_stage", "teacher@teach"} | trials
    assert "trial:probe@teach" not in dense and "trial:lora@teach+first-stage" in dense  # the probe ranks only its test_stages
    assert bm25["teacher@teach"]["tau_to_teach"] == pytest.approx(1.0)
    assert all(len(row["per_query_nDCG@10"]) == 8 for t in (bm25, dense) for row in t.values())
    assert all("share_kept" in bm25[n] for n in trials)
    weights = report["first_stage_weights"]["lora@teach"]
    assert set(weights) == {"bm25", "dense"} and all(len(w) == 2 and set(w) <= {0.0, 1.0, float("inf")} for w in weights.values())
    fits = report["fits"]["lora@teach"]
    assert len(fits) == 2 and all(len(f["losses"]) == 3 and f["in_sample"]["lists"] == 2 for f in fits)
    text = (tmp_path / "stages.md").read_text()
    assert "## dense" in text and "| lora+first-stage |" in text and "share kept, tiny lora (bm25): " in text
    assert "over dense: student " in text and "Cross-year: trained on every list of data" in text
    x = report["cross_year"][0]
    assert set(x["cv"]) == {"lora@teach"}  # only the variants asked
    test = x["tests"]["other"]
    assert test["queries"] == 3 and 0.0 <= test["trials"]["lora@teach"]["nDCG@10"] <= 1.0
    assert test["trials"]["lora@teach+first-stage"]["first_stage_weight"] in (0.0, 1.0, float("inf"))
    summary = summary_lines(cfg, report)  # no methods: the console names each trial, on the folds and cross-year
    assert any(line.startswith("teacher-folds trial:lora@teach+first-stage (8 queries): nDCG@10 ") for line in summary)
    assert any(line.startswith("cross-year data -> other (3 queries) lora@teach: nDCG@10 ") for line in summary)
    with csv_path.open() as f:  # the results table's columns (hllm.eval.results_table.FIELDS), the other rows kept
        rows = {(r["collection"], r["split"], r["method"]): r for r in csv.DictReader(f)}
    assert rows["x", "teacher-folds", "kept"]["nDCG@10"] == "0.2" and rows["data", "stage-bm25", "lora"]["nDCG@10"] != "0.1"  # its own row replaced
    assert ("data", "stage-dense", "lora+first-stage") in rows and ("other", "stage-cross-year", "lora@teach") in rows
    assert all(r["input_order"] == "first-stage" for r in rows.values())
    folds = sorted((Path(cfg.output_dir) / "folds").glob("*.npz"))
    assert len(folds) == 6  # three trials x two folds
    with np.load(folds[0]) as z:
        assert json.loads(str(z["meta"]))["test_lists"] > 0
    # a stopped run resumes: one (trial, fold) file removed, the others read back; the same figures
    stopped = next(f for f in folds if f.name.startswith("fold1-lora@"))
    stopped.unlink()
    caplog.set_level("INFO", logger="hllm")
    again = run(cfg)
    assert "fold 1/2 lora@teach: read from" in caplog.text and "fold 2/2 lora@teach: read from" not in caplog.text
    assert stopped.is_file()
    assert again["by_stage"]["bm25"]["table"]["trial:lora@teach"]["nDCG@10"] == pytest.approx(bm25["trial:lora@teach"]["nDCG@10"], abs=1e-6)
    assert again["by_stage"]["bm25"]["table"]["trial:probe@teach"] == bm25["trial:probe@teach"]


@pytest.mark.slow
def test_a_finished_run_is_recorded_in_mlflow_with_a_child_per_trial_and_stage_figures(tmp_path):
    import mlflow
    import yaml

    from pipelines.cli import main as cli

    cfg = stages_config(tmp_path, _multistage(tmp_path / "data"))
    run(cfg)
    config = tmp_path / "stages.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    store = f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"
    # `hllm adaptation`: the study's old command name, now the real-text recipe's alias
    assert cli(["adaptation", "--config", str(config), "--report", str(tmp_path / "run" / "report.json"), store]) in (0, None)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["hllm-realtext"])
    assert sorted(runs["tags.mlflow.runName"]) == ["lora@teach", "probe@teach", "realtext", "warm@teach"]
    child = runs[runs["tags.mlflow.runName"] == "lora@teach"].iloc[0]
    assert 0.0 <= child["metrics.stage.bm25.raw.nDCG_at_10"] <= 1.0 and "metrics.stage.dense.blended.share_kept.share" in runs
    assert child["params.variant.fit"] == "lora"
    # a report made under another config is refused (a usage error, nothing recorded)
    assert cli(["realtext", "--config", str(config), "--report", str(tmp_path / "run" / "report.json"), "folds=3", store]) == 2
    assert len(mlflow.search_runs(experiment_names=["hllm-realtext"])) == 4
