"""Real teachers on real text: a single-pass student distilled from an autoregressive teacher's
rankings (a file: RankVicuna-7B's or gpt-3.5's run), measured on the teacher's own queries.

    python -m hllm.recipes.distilltext --config configs/distilltext/smollm2-dl19-rankvicuna.yaml [key=value ...]
    hllm distilltext --config configs/distilltext/smollm2-dl19-rankvicuna.yaml

Every query's first-stage top `top_n` is one prompt; a frozen LM's item states are computed once per
query for every layer of `layers` (one prefill, `hllm.train.state_cache.cached_layer_states`), kept
as `ranker.pooling` (`last+mean`: a variant reading `last` or `mean` takes its half). A variant
(`Variant`) is one way to fit the head on them: a target (the teacher's permutation, the judgments,
or both), a fit (`ridge`: a utility probe under the first-stage prior in closed form; `sgd`: the
paper's N x K attention head under the rank prior, trained on the teacher's permutation with its
loss, on whole lists or on sub-slates with the teacher's relative order), a layer and a pooling.

`teacher-folds`: the queries are cut into `folds` by a hash of their id; on each fold's training
queries every variant chooses its own settings (L2 weight and prior scale, or its step count) by
`cv_folds`-fold cross-validation, and the methods choose their variant by the same cross-validated
score (nDCG@10 on the held-out training queries' judgments); the chosen one ranks the fold's test
queries once. Every query is tested once. Methods: `first_stage`, `teacher` (its run on the same
candidates), `student_distilled` (teacher-only targets), `student_both` (teacher and judgments),
`student_judged` (judgments only). Each variant's own test figures are kept as the ablation. A
finished fold is kept in `output_dir/folds`: a stopped run resumes at the next fold.
`cross_year`: distilled on every query of the teacher's collection, tested on other collections.
`relevance_score`: the first teacher's distilled student calibrated (`hllm.model.calibration`) on the
out-of-fold matrices of the variant it ships; ECE on held-out queries (calibrated on the other folds') and cross-year.
`ship_to`: that student, fitted on every query, saved with its calibration, model card and provenance.
Writes report.json; `pipelines/recorded_recipes.py` (`hllm distilltext`) records it in MLflow.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hllm.config import to_dict
from hllm.data.cache import fields_key, fingerprint
from hllm.eval.evaluation import first_stage_order
from hllm.eval.metrics import kendall_tau, share_kept, top10_by_query
from hllm.job.config import recipe_config, start_recipe
from hllm.model.backbones import ModelConfig, file_sha256
from hllm.model.calibration import Calibrator, ReliabilitySums, calibration_sums, fit_calibrator
from hllm.model.card import ModelCard, PromptCard, ship_student
from hllm.model.confidence import CascadeThresholds
from hllm.model.heads import HeadConfig
from hllm.model.item_states import POOLINGS
from hllm.model.prompts import PromptConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.train.head_fit import decode_orders, query_folds
from hllm.train.loop import TrainConfig
from hllm.train.probes import FOLD_SALT, CachedQuery, TeacherRun, Variant, VariantFitter, load_queries, oof_thresholds

log = logging.getLogger("hllm")


@dataclass
class DistillTextConfig:
    output_dir: str = "runs/distilltext"
    device: str = "auto"
    threads: int | None = None
    # the frozen backbone, cut after the deepest of `layers`, and the prompt; the heads come from the variants
    ranker: RankerConfig = field(default_factory=lambda: RankerConfig(
        model=ModelConfig(preset="smollm2-135m", context_length=8192), adapt=AdaptConfig(mode="frozen"),
        head=HeadConfig(kind="utility", positions=20, prior="logrank"),
        prompt=PromptConfig(template="rankgpt-query", max_doc_tokens=48), state_layer=20, pooling="last+mean"))
    layers: list[int] = field(default_factory=lambda: [12, 16, 20])
    collection: str = "../shared/data/trec-dl19-passage-bm25top100"  # the teacher's queries (BEIR folder + run)
    teachers: list[TeacherRun] = field(default_factory=list)
    top_n: int = 100
    folds: int = 5  # teacher-folds: every query tested once
    cv_folds: int = 5  # inside each fold's training queries
    variants: list[Variant] = field(default_factory=list)
    ridge_lambdas: list[float] = field(default_factory=lambda: [1000.0, 10000.0, 100000.0])
    prior_scales: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    teacher_depth: int = 20  # ridge target: the teacher's rank r <= depth graded depth + 1 - r, the rest 0
    sgd_head: HeadConfig = field(default_factory=lambda: HeadConfig(kind="attention", positions=20, width=128,
                                                                   num_heads=4, prior="rank"))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=300, batch_size=8, lr=1e-3, warmup_steps=20,
                                                                   log_every=25, weight_decay=0.01))
    cross_year: list[str] = field(default_factory=list)  # tested with the students distilled on every query
    ship_to: str | None = None  # the first teacher's distilled student, fitted on every query, saved here
    bootstrap: int = 2000  # resamples of the queries for the share-of-gain interval
    rel: int = 2  # MRR@10's relevance threshold (TREC DL: 2)
    seed: int = 0
    shard_slates: int = 4

    def __post_init__(self) -> None:
        if self.ranker.adapt.mode != "frozen":
            raise ValueError("ranker.adapt.mode must be frozen: the item states are computed once and cached")
        if not self.teachers:
            raise ValueError("teachers: at least one TeacherRun {name, rankings}")
        if not self.variants:
            raise ValueError("variants: at least one")
        if self.ranker.state_layer != max(self.layers):
            raise ValueError(f"ranker.state_layer ({self.ranker.state_layer}) must be the deepest of layers {self.layers}")
        cached = set(POOLINGS[self.ranker.pooling])
        for v in self.variants:
            if v.layer not in self.layers:
                raise ValueError(f"variant {v.name}: layer {v.layer} is not among layers {self.layers}")
            if v.teacher_depth is not None and v.teacher_depth < 1:
                raise ValueError(f"variant {v.name}: teacher_depth must be >= 1")
            if not set(POOLINGS[v.pooling]) <= cached:
                raise ValueError(f"variant {v.name}: pooling {v.pooling!r} is not part of ranker.pooling {self.ranker.pooling!r}")
        if len({v.name for v in self.variants}) != len(self.variants):
            raise ValueError("variant names must be unique")


def trials(cfg: DistillTextConfig) -> list[tuple[Variant, str | None]]:
    """Every (variant, teacher) to fit: a judgments-only variant once, the others once per teacher."""
    return [(v, None) if v.target == "judgments" else (v, t.name) for v in cfg.variants
            for t in (cfg.teachers[:1] if v.target == "judgments" else cfg.teachers)]


def trial_name(v: Variant, teacher: str | None) -> str:
    return v.name if teacher is None else f"{v.name}@{teacher}"


METHODS = {"student_distilled": "teacher", "student_both": "both", "student_judged": "judgments"}


def choose(records: dict[str, dict], cfg: DistillTextConfig, method: str, teacher: str | None) -> str | None:
    """The trial a method keeps: the best cross-validated score among its target's (ties: the earlier one)."""
    target = METHODS[method]
    names = [trial_name(v, None if target == "judgments" else teacher) for v in cfg.variants if v.target == target]
    names = [n for n in names if n in records]
    return max(names, key=lambda n: (round(records[n]["cv_score"], 6), -names.index(n))) if names else None


FOLD_FIELDS = ("ranker", "layers", "collection", "teachers", "top_n", "folds", "cv_folds", "variants", "ridge_lambdas",
               "prior_scales", "teacher_depth", "sgd_head", "train", "rel", "seed")  # what a fold's results depend on


def fold_key(cfg: DistillTextConfig) -> str:
    return fields_key(cfg, FOLD_FIELDS)


def method_key(method: str, teacher: str) -> str:
    """How a method's figures are named in the report: `student_distilled@rankvicuna-7b`."""
    return f"{method}@{teacher}"


@dataclass
class TeacherFolds:
    """Every trial fitted on each teacher-fold's training queries and tested on its test queries (every query once)."""

    trial_orders: dict[str, list[list[int]]]  # trial -> per query its out-of-fold order
    trial_matrices: dict[str, list[np.ndarray]]  # trial -> per query its out-of-fold (N, K) matrix
    chosen: list[dict[str, str]]  # per fold: method@teacher -> the trial its CV chose
    cv: list[dict[str, dict[str, float]]]  # per fold: trial -> its CV record
    method_orders: dict[str, list[list[int]]]  # method@teacher -> per query the order of its fold's choice
    method_matrices: dict[str, list[np.ndarray]]
    fold_of: list[int]  # per query the fold that tests it


@dataclass
class AllQueriesFit:
    """Every trial fitted on all of the teacher's queries (settings by CV over them), tested on the other collections."""

    chosen: dict[str, str]  # method@teacher -> trial
    cv: dict[str, dict[str, float]]  # trial -> its CV record
    tests: dict[str, dict[str, Any]]  # collection -> {"queries", "methods", "trials"}: means over its queries
    heads: dict[str, tuple[RankerConfig, dict[str, torch.Tensor]]]  # trial -> its ranker config and head weights
    matrices: dict[str, dict[str, list[np.ndarray]]]  # collection -> trial -> per query its (N, K) matrix
    orders: dict[str, dict[str, list[list[int]]]]  # the same matrices' Hungarian orders

    def report(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "cv": self.cv, "tests": self.tests}


def teacher_folds(cfg: DistillTextConfig, fitter: VariantFitter, queries: list[CachedQuery]) -> TeacherFolds:
    """Every trial fitted on each fold's training queries and tested on its test queries; the methods'
    choices per fold. A finished fold is kept in `output_dir/folds` (under `fold_key`): a stopped run
    resumes at the next fold."""
    names = [trial_name(v, t) for v, t in trials(cfg)]
    orders: dict[str, list] = {n: [None] * len(queries) for n in names}
    matrices: dict[str, list] = {n: [None] * len(queries) for n in names}
    chosen, cv, fold_of = [], [], {}
    store = Path(cfg.output_dir) / "folds"
    store.mkdir(parents=True, exist_ok=True)
    key = fold_key(cfg)
    splits = query_folds(len(queries), [q.slate.slate_id for q in queries], cfg.folds, FOLD_SALT)
    for f, (train_idx, test_idx) in enumerate(splits):
        fold_of |= {i: f for i in test_idx}
        saved = store / f"fold-{f}-{key}.npz"
        if saved.is_file():
            with np.load(saved, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                fold_matrices = {n: [z[f"{n}/{i}"] for i in test_idx] for n in names}
            log.info("fold %d/%d: read from %s", f + 1, cfg.folds, saved)
        else:
            train, test = [queries[i] for i in train_idx], [queries[i] for i in test_idx]
            records, fold_matrices = {}, {}
            for v, t in trials(cfg):
                t0 = time.perf_counter()
                name = trial_name(v, t)
                records[name] = rec = fitter.fit(v, t, train)
                fold_matrices[name] = fitter.matrices(v, test)
                log.info("fold %d/%d %s: CV nDCG@10 %.4f (first stage %.4f) %.0fs", f + 1, cfg.folds, name,
                         rec["cv_score"], rec["cv_first_stage"], time.perf_counter() - t0)
            picks = {method_key(m, t.name): choose(records, cfg, m, t.name) for m in METHODS for t in cfg.teachers}
            meta = {"chosen": {k: p for k, p in picks.items() if p},
                    "cv": {n: {k: r[k] for k in ("cv_score", "cv_first_stage", "ridge_lambda", "prior_scale", "best_step") if k in r}
                           for n, r in records.items()}}
            tmp = store / f".tmp-{saved.name}"
            with tmp.open("wb") as fh:
                np.savez(fh, meta=json.dumps(meta), **{f"{n}/{i}": m for n, ms in fold_matrices.items() for i, m in zip(test_idx, ms)})
            tmp.replace(saved)  # a fold is whole or absent
        for n in names:
            for i, m in zip(test_idx, fold_matrices[n]):
                matrices[n][i], orders[n][i] = m, decode_orders([m])[0]
        chosen.append(meta["chosen"])
        cv.append(meta["cv"])
        log.info("fold %d/%d chose %s", f + 1, cfg.folds, chosen[-1])
    methods = [key for key in chosen[0] if all(key in c for c in chosen)]
    return TeacherFolds(orders, matrices, chosen, cv,
                        {k: [orders[chosen[fold_of[i]][k]][i] for i in range(len(queries))] for k in methods},
                        {k: [matrices[chosen[fold_of[i]][k]][i] for i in range(len(queries))] for k in methods},
                        [fold_of[i] for i in range(len(queries))])


def calibration(cfg: DistillTextConfig, queries: list[CachedQuery], folds: TeacherFolds, trial: str) -> tuple[Calibrator, dict]:
    """P(relevant) for the student `trial` ships, from that trial's out-of-fold matrices (each query scored
    by the trial fitted on the other folds: a head that never saw it, of the variant shipped — not the mix of
    variants the folds chose, whose matrices differ in scale): the ECE on each fold's queries of a
    calibrator fitted on the other folds' (summed over the folds: every query held out once), and the
    calibrator fitted on all of them (the shipped one)."""
    mats, perms = folds.trial_matrices[trial], folds.trial_orders[trial]
    grades = [q.slate.grades for q in queries]
    sums = ReliabilitySums(10, cfg.rel)
    for f in sorted(set(folds.fold_of)):
        fit = [i for i, g in enumerate(folds.fold_of) if g != f]
        held = [i for i, g in enumerate(folds.fold_of) if g == f]
        cal = fit_calibrator([mats[i] for i in fit], [perms[i] for i in fit], [grades[i] for i in fit], cfg.rel)
        sums.merge(calibration_sums(cal, [mats[i] for i in held], [perms[i] for i in held], [grades[i] for i in held]))
    return fit_calibrator(mats, perms, grades, cfg.rel), sums.report()


def summarize(cfg: DistillTextConfig, queries: list[CachedQuery], folds: TeacherFolds) -> dict[str, Any]:
    """Per method and per trial: means over queries, Kendall tau to each teacher, and the share of each
    teacher's gain over the first stage that each student keeps (with its bootstrap interval)."""
    slates = [q.slate for q in queries]
    runs = {"first_stage": first_stage_order(slates)} | {method_key("teacher", t.name): [q.perms[t.name] for q in queries] for t in cfg.teachers}
    runs |= folds.method_orders
    table = {}
    for name, orders in list(runs.items()) + [(f"trial:{k}", v) for k, v in folds.trial_orders.items()]:
        pq = top10_by_query(slates, orders, cfg.rel)
        table[name] = {m: float(np.mean(list(v.values()))) for m, v in pq.items()} | {"per_query_nDCG@10": pq["nDCG@10"]}
        for t in cfg.teachers:
            table[name][f"tau_to_{t.name}"] = float(np.mean([kendall_tau(o, q.perms[t.name]) for o, q in zip(orders, queries)]))
    qids = list(table["first_stage"]["per_query_nDCG@10"])
    vec = {name: np.array([row["per_query_nDCG@10"][q] for q in qids]) for name, row in table.items()}
    shares = {method_key(m, t.name): share_kept(vec[method_key(m, t.name)], vec["first_stage"], vec[method_key("teacher", t.name)],
                                                cfg.bootstrap, cfg.seed)
              for t in cfg.teachers for m in METHODS if method_key(m, t.name) in vec}
    return {"queries": len(qids), "table": table, "share_kept": shares}


def fit_everything(cfg: DistillTextConfig, fitter: VariantFitter, queries: list[CachedQuery], others: dict[str, list[CachedQuery]]) -> AllQueriesFit:
    """Every trial fitted on every query of the teacher's collection (settings by CV over them) and tested
    on each of `others` (never trained on); each method's choice by the same CV score."""
    records, heads, orders, matrices = {}, {}, {name: {} for name in others}, {name: {} for name in others}
    for v, t in trials(cfg):
        name = trial_name(v, t)
        records[name] = fitter.fit(v, t, queries)
        heads[name] = (fitter.ranker.cfg, {k: x.detach().clone() for k, x in fitter.ranker.head.state_dict().items()})
        for other, qs in others.items():
            matrices[other][name] = fitter.matrices(v, qs)
            orders[other][name] = decode_orders(matrices[other][name])
        log.info("all %d queries %s: CV nDCG@10 %.4f (first stage %.4f)", len(queries), name, records[name]["cv_score"],
                 records[name]["cv_first_stage"])
    picks = {method_key(m, t.name): choose(records, cfg, m, t.name) for m in METHODS for t in cfg.teachers}
    picks = {k: p for k, p in picks.items() if p}
    tests = {}
    for other, qs in others.items():
        slates = [q.slate for q in qs]
        mean = lambda o: {m: float(np.mean(list(v.values()))) for m, v in top10_by_query(slates, o, cfg.rel).items()}  # noqa: E731
        tests[other] = {"queries": len(slates), "methods": {"first_stage": mean(first_stage_order(slates))} |
                        {k: mean(orders[other][p]) for k, p in picks.items()},
                        "trials": {n: mean(o) for n, o in orders[other].items()}}
    cv = {n: {k: r[k] for k in ("cv_score", "cv_first_stage", "ridge_lambda", "prior_scale", "best_step") if k in r}
          for n, r in records.items()}
    return AllQueriesFit(picks, cv, tests, heads, matrices, orders)


def ship(cfg: DistillTextConfig, everything: AllQueriesFit, folds_summary: dict[str, Any], coverage: dict,
         calibrator: Calibrator, calibrated: dict[str, Any], thresholds: CascadeThresholds) -> ModelCard:
    """The first teacher's distilled student (the trial its CV chose, fitted on every query) saved to
    `ship_to` with its calibration (`relevance_score`), its cascade thresholds and a model card that names the
    teacher and the data."""
    teacher = cfg.teachers[0]
    trial = everything.chosen[method_key("student_distilled", teacher.name)]
    rcfg, weights = everything.heads[trial]
    ranker = SinglePassRanker.build(rcfg)
    ranker.head.load_state_dict(weights)
    cv = everything.cv[trial]
    card = ModelCard(
        base_model=f"{rcfg.model.preset} (frozen, cut after decoder layer {rcfg.state_layer})",
        pooling=rcfg.pooling,
        teacher={"name": teacher.name, "rankings": Path(teacher.rankings).name, "format": teacher.format,
                 "coverage": coverage[teacher.name],
                 "what": "distilled from the teacher's rankings alone (no relevance labels in the loss)"},
        training_data={"collection": Path(cfg.collection).name, "queries": folds_summary["queries"], "top_n": cfg.top_n},
        positions=rcfg.head.positions, window=cfg.top_n, adapt="frozen",
        prompt=PromptCard(rcfg.prompt.template, rcfg.prompt.max_doc_tokens, rcfg.model.context_length),
        head=f"{rcfg.head.kind} with the first-stage prior ({rcfg.head.prior})",
        input="candidates in first-stage order, best first: the prior reads their ranks",
        figures={
            "variant": trial, "fit": cv, "chosen_by": f"{cfg.cv_folds}-fold CV over the training queries (nDCG@10 on their qrels)",
            "teacher_folds": {k: folds_summary["table"][k]["nDCG@10"] for k in ("first_stage", method_key("teacher", teacher.name),
                                                                                 method_key("student_distilled", teacher.name))},
            "cross_year": {c: t["methods"].get(method_key("student_distilled", teacher.name)) for c, t in everything.tests.items()},
            "relevance_score": {"what": f"calibrated P(grade >= {cfg.rel}), fitted on this variant's out-of-fold matrices of "
                                        "the teacher-folds",
                                "fitted_on": calibrator.fitted_on, "ece_held_out_queries": calibrated["oof"]["ece"],
                                "ece_cross_year": {c: r["ece"] for c, r in calibrated["cross_year"].items()}}},
    )
    ship_student(cfg.ship_to, ranker, card, thresholds, "hllm distilltext --config <the recipe below>", to_dict(cfg),
                 calibrator, fit=cv, teacher_folds=card.figures["teacher_folds"], cross_year=card.figures["cross_year"],
                 teacher_rankings_sha256={t.name: file_sha256(Path(t.rankings)) for t in cfg.teachers})
    return card


def run(cfg: DistillTextConfig) -> dict[str, Any]:
    """Teacher-folds, then every query for the cross-year tests and the shipped student. -> the report."""
    out = Path(cfg.output_dir)
    ranker = start_recipe(cfg)
    queries, coverage = load_queries(cfg, ranker, cfg.collection, cfg.teachers)
    others = {Path(p).name: load_queries(cfg, ranker, p, [])[0] for p in cfg.cross_year}
    width = queries[0].states[cfg.layers[0]].shape[1] // len(POOLINGS[cfg.ranker.pooling])
    fitter = VariantFitter(cfg, ranker, width)
    t0 = time.perf_counter()
    folds = teacher_folds(cfg, fitter, queries)
    summary = summarize(cfg, queries, folds)
    log.info("teacher-folds done in %.0fs", time.perf_counter() - t0)
    everything = fit_everything(cfg, fitter, queries, others)
    method = method_key("student_distilled", cfg.teachers[0].name)
    shipped = everything.chosen[method]
    calibrator, oof = calibration(cfg, queries, folds, shipped)
    calibrated = {"method": method, "trial": shipped, "fitted_on": calibrator.fitted_on, "oof": oof, "cross_year": {
        c: calibration_sums(calibrator, everything.matrices[c][shipped], everything.orders[c][shipped],
                            [q.slate.grades for q in qs]).report() for c, qs in others.items()}}
    report = {"config": fingerprint(cfg), "collection": Path(cfg.collection).name, "coverage": coverage,
              "teacher_folds": summary | {"chosen": folds.chosen, "cv": folds.cv},
              "cross_year": everything.report(),
              "calibration": calibrated}
    if cfg.ship_to:
        report["shipped"] = ship(cfg, everything, summary, coverage, calibrator, calibrated,
                                 oof_thresholds(folds.trial_matrices[shipped], folds.trial_orders[shipped],
                                                Path(cfg.collection).name)).to_json()
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> None:
    cfg = recipe_config(DistillTextConfig, __doc__, argv, "configs/distilltext/smollm2-dl19-rankvicuna.yaml")
    t0 = time.perf_counter()
    report = run(cfg)
    print("\n".join(summary_lines(cfg, report)))
    print(f"total {time.perf_counter() - t0:.0f}s; report: {Path(cfg.output_dir) / 'report.json'}")


def summary_lines(cfg: DistillTextConfig, report: dict[str, Any]) -> list[str]:
    """The report's headline: each method's teacher-folds figures and share kept, then cross-year."""
    folds, lines = report["teacher_folds"], []
    for name in ["first_stage"] + [method_key("teacher", t.name) for t in cfg.teachers] + list(folds["share_kept"]):
        row = folds["table"][name]
        share = folds["share_kept"].get(name)
        lines.append(f"teacher-folds {name} ({folds['queries']} queries): nDCG@10 {row['nDCG@10']:.4f}"
                     + "".join(f", tau to {t.name} {row['tau_to_' + t.name]:.3f}" for t in cfg.teachers)
                     + (f"; share of the teacher's gain kept {share['share']:.2f} [{share['ci_low']:.2f}, {share['ci_high']:.2f}]"
                        if share else ""))
    for collection, test in report["cross_year"]["tests"].items():
        lines += [f"cross-year -> {collection} ({test['queries']} queries) {name}: nDCG@10 {m['nDCG@10']:.4f}"
                  for name, m in test["methods"].items()]
    cal = report["calibration"]
    lines.append(f"relevance_score of {cal['method']}: ECE {cal['oof']['ece']:.4f} on held-out queries ({cal['oof']['items']} items, "
                 f"every query once, calibrated on the other folds' out-of-fold matrices)"
                 + "".join(f"; {c} {r['ece']:.4f} ({r['items']} items)" for c, r in cal["cross_year"].items()))
    return lines

if __name__ == "__main__":
    main()
