"""Real text: a single-pass student over a frozen LM's cached states, fitted on judged queries, on an autoregressive
teacher's rankings of them (a file: RankVicuna-7B's, gpt-3.5's), or both; its settings chosen on training queries;
measured on held-out queries and on other years; shipped.

    hllm realtext --config configs/realtext/smollm2-trec-dl.yaml [key=value ...]            # judgments, across years
    hllm realtext --config configs/realtext/smollm2-dl19-rankvicuna.yaml [key=value ...]    # a teacher's rankings
    hllm distilltext --config ...                       # the same command under its old name (an alias)

Every query's first-stage top `top_n` is one prompt (`ranker.prompt`); the frozen backbone's item states are computed
once per query for every layer of `layers` (one prefill, `hllm.train.state_cache.cached_layer_states`), kept as
`ranker.pooling` (`last+mean`: a variant reading `last` or `mean` takes its half). A variant (`hllm.train.probes.Variant`)
is one way to fit the head on them: a target (the judgments, the teacher's permutation, or both), a fit (`ridge`: a
utility probe under the first-stage prior in closed form, its L2 weight and prior scale chosen by `cv_folds`-fold
cross-validation; `sgd`: `sgd_head` trained with the target's loss, its step count chosen the same way), a layer and a
pooling. A trial is a variant on one teacher (a judgments-only variant is one trial). With `ranker.head.guard:
distance` every ridge head also fits its domain guard on its training queries, and every test reports the head without
it (`student_unguarded`) and how far the guard trusted the queries.

Methods — a trial each, chosen by the cross-validated score on the training queries (nDCG@10 on their qrels):
`student_distilled` (teacher targets), `student_both`, `student_judged`; beside them `first_stage` and each `teacher`.

- `folds` (teacher-folds): the teachers' collection's queries cut into `folds` by a hash of their id; every trial fitted
  on each fold's training queries, the methods' choices made there, the test queries read once (every query once).
  Kendall tau to each teacher and the share of its gain kept (bootstrap interval). A finished fold is kept in
  `output_dir/folds`: a stopped run resumes at the next fold.
- `cross_year`: every trial fitted on all of `train_on`'s queries, tested on `test_on` (never trained on).
- `ship_to`: the `ship_method`'s choice fitted on every query of `ship_on`, saved with its cascade thresholds (`in-sample`,
  or `out-of-fold` from the teacher-folds), its calibration (`calibrate`: on that trial's out-of-fold matrices), a model
  card and `provenance.json`; checked on the `transfer` collections (their hashed test split, never trained on).
Writes report.json; `pipelines/recorded_recipes.py` records it in MLflow (a parent run, a child per trial).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from hllm.config import to_dict
from hllm.data.cache import fields_key, fingerprint
from hllm.data.readers import collection_name
from hllm.data.splits import split_by_hash
from hllm.eval.evaluation import first_stage_order
from hllm.eval.metrics import kendall_tau, share_kept, top10_by_query
from hllm.eval.runfile import relevance_threshold
from hllm.job.config import recipe_config, start_recipe
from hllm.model.backbones import ModelConfig, file_sha256
from hllm.model.calibration import Calibrator, ReliabilitySums, calibration_sums, fit_calibrator
from hllm.model.card import ModelCard, PromptCard, ship_student
from hllm.model.heads import HeadConfig
from hllm.model.item_states import POOLINGS
from hllm.model.prompts import PromptConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.records import RerankRequest
from hllm.train.head_fit import decode_orders, query_folds
from hllm.train.loop import TrainConfig
from hllm.train.probes import FOLD_SALT, CachedQuery, TeacherRun, Variant, VariantFitter, load_queries, oof_thresholds

log = logging.getLogger("hllm")
Method = Literal["student_distilled", "student_both", "student_judged"]
METHODS: dict[str, str] = {"student_distilled": "teacher", "student_both": "both", "student_judged": "judgments"}  # -> target


@dataclass
class CrossYear:
    """Every trial fitted on these collections' queries (settings by CV over them), tested on those."""

    train_on: list[str]  # BEIR folders (named in the report by the folder's name)
    test_on: list[str]


@dataclass
class RealTextConfig:
    output_dir: str = "runs/realtext"  # cached states, finished folds, report.json
    device: str = "auto"
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    # the frozen backbone cut after the deepest of `layers`, the prompt, the cached pooling; `head`: the ridge probes'
    # (a utility head under the logrank prior: its K, and `guard: distance` for a domain guard)
    ranker: RankerConfig = field(default_factory=lambda: RankerConfig(
        model=ModelConfig(preset="smollm2-135m", context_length=8192), adapt=AdaptConfig(mode="frozen"),
        head=HeadConfig(kind="utility", positions=20, prior="logrank"),
        prompt=PromptConfig(template="rankgpt-query", max_doc_tokens=48), state_layer=16, pooling="last+mean"))
    layers: list[int] = field(default_factory=list)  # the cached layers ([]: ranker.state_layer alone)
    top_n: int = 100  # first-stage candidates per query, ranked in one pass
    variants: list[Variant] = field(default_factory=lambda: [Variant(name="judged-ridge", target="judgments")])
    teachers: list[TeacherRun] = field(default_factory=list)  # their rankings of teacher_collection's queries
    teacher_collection: str | None = None
    folds: int = 0  # teacher-folds over teacher_collection's queries (0: none)
    cross_year: list[CrossYear] = field(default_factory=list)
    cv_folds: int = 5  # inside every training set
    ridge_lambdas: list[float] = field(default_factory=lambda: [1000.0, 10000.0, 100000.0])
    prior_scales: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    teacher_depth: int = 20  # ridge target: the teacher's rank r <= depth graded depth + 1 - r, the rest 0
    sgd_head: HeadConfig = field(default_factory=lambda: HeadConfig(kind="attention", positions=20, width=128,
                                                                   num_heads=4, prior="rank"))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=300, batch_size=8, lr=1e-3, warmup_steps=20,
                                                                   log_every=25, weight_decay=0.01))
    ship_method: Method = "student_judged"  # whose choice ships (a teacher's method: the first teacher's)
    ship_on: list[str] = field(default_factory=list)  # fit the shipped student on these collections' queries
    ship_to: str | None = None  # ... and save it here (a student folder)
    cascade_from: Literal["in-sample", "out-of-fold"] = "in-sample"  # its cascade thresholds' confidences
    calibrate: bool = False  # relevance_score from the shipped trial's out-of-fold matrices (needs teacher-folds)
    transfer: list[str] = field(default_factory=list)  # never trained on: checked with the shipped student
    transfer_fraction: float = 0.2  # a transfer collection's hashed test split ...
    transfer_queries: int = 40  # ... capped at this many queries
    # which side of that split: `test`, or `rest` (the other queries: a second, independent sample, e.g. to confirm
    # on queries never looked at what was built while looking at the test split's)
    transfer_split: Literal["test", "rest"] = "test"
    bootstrap: int = 2000  # resamples of the queries for the share-of-gain interval
    rel: int = 2  # MRR@10's relevance threshold (TREC DL: 2)
    seed: int = 0  # sgd heads' initialisation and data order
    shard_slates: int = 4  # slates per state shard (a crash loses at most one shard)

    def __post_init__(self) -> None:
        if self.ranker.adapt.mode != "frozen":
            raise ValueError("ranker.adapt.mode must be frozen: the item states are computed once and cached")
        self.layers = self.layers or [self.ranker.state_layer]
        if self.ranker.state_layer != max(self.layers):
            raise ValueError(f"ranker.state_layer ({self.ranker.state_layer}) must be the deepest of layers {self.layers}")
        if self.cv_folds < 2:
            raise ValueError("cv_folds >= 2: every training set chooses its settings by cross-validation over its queries")
        if not self.variants or len({v.name for v in self.variants}) != len(self.variants):
            raise ValueError("variants: at least one, with unique names")
        cached = set(POOLINGS[self.ranker.pooling])
        for v in self.variants:
            if v.layer not in self.layers:
                raise ValueError(f"variant {v.name}: layer {v.layer} is not among layers {self.layers}")
            if v.teacher_depth is not None and v.teacher_depth < 1:
                raise ValueError(f"variant {v.name}: teacher_depth must be >= 1")
            if not set(POOLINGS[v.pooling]) <= cached:
                raise ValueError(f"variant {v.name}: pooling {v.pooling!r} is not part of ranker.pooling {self.ranker.pooling!r}")
            if v.target != "judgments" and not self.teachers:
                raise ValueError(f"variant {v.name} learns from a teacher ({v.target}): give teachers and teacher_collection")
        if bool(self.teachers) != bool(self.teacher_collection):
            raise ValueError("teachers and teacher_collection go together (the runs, and the queries they rank)")
        if self.folds and (self.folds < 2 or not self.teacher_collection):
            raise ValueError("folds (teacher-folds) >= 2 cut teacher_collection's queries: give teacher_collection")
        if bool(self.ship_on) != bool(self.ship_to):
            raise ValueError("ship_on and ship_to go together (the collections to fit the shipped student on, and where)")
        if self.transfer and not self.ship_to:
            raise ValueError("transfer collections are checked with the shipped student: set ship_on and ship_to")
        if not (self.folds or self.cross_year or self.ship_on):
            raise ValueError("nothing to do: give folds (teacher-folds), cross_year, or ship_on + ship_to")
        if self.ship_to:
            if not any(v.target == METHODS[self.ship_method] for v in self.variants):
                raise ValueError(f"ship_method {self.ship_method} chooses among {METHODS[self.ship_method]} variants: there are none")
            if (self.cascade_from == "out-of-fold" or self.calibrate) and not (self.folds and self.ship_on == [self.teacher_collection]):
                raise ValueError("cascade_from=out-of-fold and calibrate read the teacher-folds' out-of-fold matrices: they need "
                                 "folds and ship_on == [teacher_collection]")
        taught = [v.name for v in self.variants if v.target != "judgments"]
        for train_on in [c.train_on for c in self.cross_year] + ([self.ship_on] if self.ship_on else []):
            if taught and train_on != [self.teacher_collection]:
                raise ValueError(f"variants {taught} learn from the teachers' rankings of {self.teacher_collection}: a "
                                 f"training set of {train_on} has none (train on [teacher_collection], or drop them)")


# ---- trials and methods -----------------------------------------------------------------------------------------
def trials(cfg: RealTextConfig) -> list[tuple[Variant, str | None]]:
    """Every (variant, teacher) to fit: a judgments-only variant once, the others once per teacher."""
    out: list[tuple[Variant, str | None]] = []
    for v in cfg.variants:
        out += [(v, None)] if v.target == "judgments" else [(v, t.name) for t in cfg.teachers]
    return out


def trial_name(v: Variant, teacher: str | None) -> str:
    return v.name if teacher is None else f"{v.name}@{teacher}"


def method_key(method: str, teacher: str | None) -> str:
    """How a method's figures are named in the report: `student_distilled@rankvicuna-7b`, `student_judged` (no teacher)."""
    return method if teacher is None else f"{method}@{teacher}"


def methods(cfg: RealTextConfig) -> list[tuple[str, str | None]]:
    """Every (method, teacher) the variants give: per teacher each method with a variant (without teachers, the judged)."""
    return [(m, t) for m in METHODS for t in ([x.name for x in cfg.teachers] or [None])
            if any(v.target == METHODS[m] for v in cfg.variants)]


def shipped_key(cfg: RealTextConfig) -> str:
    return method_key(cfg.ship_method, cfg.teachers[0].name if cfg.teachers else None)


def choose(records: dict[str, dict], cfg: RealTextConfig, method: str, teacher: str | None) -> str | None:
    """The trial a method keeps: the best cross-validated score among its target's (ties: the earlier one)."""
    target = METHODS[method]
    names = [trial_name(v, None if target == "judgments" else teacher) for v in cfg.variants if v.target == target]
    names = [n for n in names if n in records]
    return max(names, key=lambda n: (round(records[n]["cv_score"], 6), -names.index(n))) if names else None


def picks(cfg: RealTextConfig, records: dict[str, dict]) -> dict[str, str]:
    """method key -> the trial it keeps, for every method with a trial among `records`."""
    chosen = {method_key(m, t): choose(records, cfg, m, t) for m, t in methods(cfg)}
    return {k: p for k, p in chosen.items() if p}


def cv_summary(records: dict[str, dict]) -> dict[str, dict[str, float]]:
    return {n: {k: r[k] for k in ("cv_score", "cv_first_stage", "ridge_lambda", "prior_scale", "best_step") if k in r}
            for n, r in records.items()}


def averaged(by_query: dict[str, dict[str, float]]) -> dict[str, float]:
    """`top10_by_query`'s figures -> their means over the queries."""
    return {m: float(np.mean(list(v.values()))) for m, v in by_query.items()}


def means(slates: list[RerankRequest], orders: list[list[int]], rel: int) -> dict[str, float]:
    """nDCG@10 and MRR@10, means over the queries."""
    return averaged(top10_by_query(slates, orders, rel))


# ---- the data ----------------------------------------------------------------------------------------------------
class Collections:
    """Each collection's queries with their cached states (and, for the teachers' collection, the teachers'
    permutations), read once per run."""

    def __init__(self, cfg: RealTextConfig, ranker: SinglePassRanker):
        self.cfg, self.ranker = cfg, ranker
        self._queries: dict[tuple[str, bool], list[CachedQuery]] = {}
        self.coverage: dict[str, dict] = {}

    def _load(self, path: str, transfer: bool) -> list[CachedQuery]:
        def pick(slates: list[RerankRequest]) -> list[RerankRequest]:  # a transfer collection's hashed split, capped
            rest, test = split_by_hash(slates, self.cfg.transfer_fraction)
            return (test if self.cfg.transfer_split == "test" else rest)[: self.cfg.transfer_queries]

        if (path, transfer) not in self._queries:
            teachers = self.cfg.teachers if path == self.cfg.teacher_collection and not transfer else []
            self._queries[path, transfer], coverage = load_queries(self.cfg, self.ranker, path, teachers, pick if transfer else None)
            self.coverage |= coverage
        return self._queries[path, transfer]

    def all(self, path: str) -> list[CachedQuery]:
        return self._load(path, False)

    def training(self, paths: list[str]) -> list[CachedQuery]:
        return [q for p in paths for q in self.all(p)]

    def transfer(self, path: str) -> list[CachedQuery]:
        """Its hashed test split (or the rest of it: `transfer_split`), capped at `transfer_queries`."""
        return self._load(path, True)

    def every(self) -> None:
        """Every collection the config names, its states computed where missing, before any fit."""
        for path in dict.fromkeys([*filter(None, [self.cfg.teacher_collection]), *self.cfg.ship_on,
                                   *(p for c in self.cfg.cross_year for p in [*c.train_on, *c.test_on])]):
            self.all(path)
        for path in self.cfg.transfer:
            self.transfer(path)


# ---- teacher-folds ----------------------------------------------------------------------------------------------
FOLD_FIELDS = ("ranker", "layers", "teacher_collection", "teachers", "top_n", "folds", "cv_folds", "variants",
               "ridge_lambdas", "prior_scales", "teacher_depth", "sgd_head", "train", "rel", "seed")  # what a fold depends on


@dataclass
class TeacherFolds:
    """Every trial fitted on each teacher-fold's training queries and tested on its test queries (every query once)."""

    trial_orders: dict[str, list[list[int]]]  # trial -> per query its out-of-fold order
    trial_matrices: dict[str, list[np.ndarray]]  # trial -> per query its out-of-fold (N, K) matrix
    chosen: list[dict[str, str]]  # per fold: method key -> the trial its CV chose
    cv: list[dict[str, dict[str, float]]]  # per fold: trial -> its CV record
    method_orders: dict[str, list[list[int]]]  # method key -> per query the order of its fold's choice
    fold_of: list[int]  # per query the fold that tests it


def teacher_folds(cfg: RealTextConfig, fitter: VariantFitter, queries: list[CachedQuery]) -> TeacherFolds:
    """Every trial fitted on each fold's training queries and tested on its test queries; the methods' choices per
    fold. A finished fold is kept in `output_dir/folds` (under the key of FOLD_FIELDS): a stopped run resumes at the
    next fold."""
    names = [trial_name(v, t) for v, t in trials(cfg)]
    orders: dict[str, list] = {n: [None] * len(queries) for n in names}
    matrices: dict[str, list] = {n: [None] * len(queries) for n in names}
    chosen, cv, fold_of = [], [], {}
    store = Path(cfg.output_dir) / "folds"
    store.mkdir(parents=True, exist_ok=True)
    key = fields_key(cfg, FOLD_FIELDS)
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
            meta = {"chosen": picks(cfg, records), "cv": cv_summary(records)}
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
    keys = [k for k in chosen[0] if all(k in c for c in chosen)]
    return TeacherFolds(orders, matrices, chosen, cv,
                        {k: [orders[chosen[fold_of[i]][k]][i] for i in range(len(queries))] for k in keys},
                        [fold_of[i] for i in range(len(queries))])


def summarize(cfg: RealTextConfig, queries: list[CachedQuery], folds: TeacherFolds) -> dict[str, Any]:
    """Per method and per trial: means over queries, Kendall tau to each teacher, and the share of each
    teacher's gain over the first stage that each student keeps (with its bootstrap interval)."""
    slates = [q.slate for q in queries]
    runs = {"first_stage": first_stage_order(slates)} | {method_key("teacher", t.name): [q.perms[t.name] for q in queries] for t in cfg.teachers}
    runs |= folds.method_orders
    table = {}
    for name, orders in list(runs.items()) + [(f"trial:{k}", v) for k, v in folds.trial_orders.items()]:
        pq = top10_by_query(slates, orders, cfg.rel)
        table[name] = averaged(pq) | {"per_query_nDCG@10": pq["nDCG@10"]}
        for t in cfg.teachers:
            table[name][f"tau_to_{t.name}"] = float(np.mean([kendall_tau(o, q.perms[t.name]) for o, q in zip(orders, queries)]))
    qids = list(table["first_stage"]["per_query_nDCG@10"])
    vec = {name: np.array([row["per_query_nDCG@10"][q] for q in qids]) for name, row in table.items()}
    shares = {method_key(m, t.name): share_kept(vec[method_key(m, t.name)], vec["first_stage"], vec[method_key("teacher", t.name)],
                                                cfg.bootstrap, cfg.seed)
              for t in cfg.teachers for m in METHODS if method_key(m, t.name) in vec}
    return {"queries": len(qids), "table": table, "share_kept": shares, "chosen": folds.chosen, "cv": folds.cv}


def calibration(cfg: RealTextConfig, queries: list[CachedQuery], folds: TeacherFolds, trial: str) -> tuple[Calibrator, dict]:
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


# ---- fits on whole collections: cross-year and the shipped student ---------------------------------------------
@dataclass
class FittedTrial:
    """A trial fitted on every query of a training set: its CV record and its head."""

    variant: Variant
    record: dict[str, Any]  # cv_score, settings chosen, cv_grid or cv_curve, guard thresholds
    weights: dict[str, torch.Tensor]  # its head's (the ranker config: VariantFitter.head_config(variant))


class Fits:
    """Every trial fitted at most once per training set (the cross-year fit on the shipped student's collections is
    the shipped student's), loaded back into the fitter's ranker to score."""

    def __init__(self, cfg: RealTextConfig, fitter: VariantFitter):
        self.cfg, self.fitter = cfg, fitter
        self._done: dict[tuple[str, ...], dict[str, FittedTrial]] = {}

    def on(self, train_on: list[str], queries: list[CachedQuery]) -> dict[str, FittedTrial]:
        """trial -> fitted on `queries` (every query of the `train_on` collections)."""
        key = tuple(train_on)
        if key not in self._done:
            taught = train_on == [self.cfg.teacher_collection]
            fitted = {}
            for v, t in trials(self.cfg):
                if t is not None and not taught:
                    continue
                name = trial_name(v, t)
                record = self.fitter.fit(v, t, queries)
                fitted[name] = FittedTrial(v, record, {k: x.detach().clone() for k, x in self.fitter.ranker.head.state_dict().items()})
                log.info("all %d queries of %s, %s: CV nDCG@10 %.4f (first stage %.4f)", len(queries),
                         " + ".join(map(collection_name, train_on)), name, record["cv_score"], record["cv_first_stage"])
            self._done[key] = fitted
        return self._done[key]

    def load(self, fitted: FittedTrial) -> SinglePassRanker:
        """The fitter's ranker with `fitted`'s head."""
        self.fitter.new_head(fitted.variant)
        self.fitter.ranker.head.load_state_dict(fitted.weights)
        return self.fitter.ranker


def trust_figures(trust: np.ndarray) -> dict[str, float]:
    """How far a domain guard trusted some queries: its mean, the shares of queries fully and partly fallen back."""
    return {"mean": float(trust.mean()), "fallback_share": float((trust == 0).mean()),
            "partial_share": float(((trust > 0) & (trust < 1)).mean())}


@dataclass
class Measured:
    """Some fitted trials on one collection they were not trained on."""

    queries: int
    methods: dict[str, dict[str, float]]  # first_stage and each method key -> means over the queries
    trials: dict[str, dict[str, float]]  # trial -> means over the queries
    guard: dict[str, dict[str, Any]]  # trial -> {"student_unguarded", "trust"} (heads with a domain guard)
    matrices: dict[str, list[np.ndarray]]  # trial -> per query its (N, K) matrix
    orders: dict[str, list[list[int]]]

    def report(self) -> dict[str, Any]:
        return {"queries": self.queries, "methods": self.methods, "trials": self.trials,
                **({"guard": self.guard} if self.guard else {})}


def measure(fits: Fits, fitted: dict[str, FittedTrial], chosen: dict[str, str],
            queries: list[CachedQuery], rel: int) -> Measured:
    """Each of `fitted` ranks `queries` once (whole lists, one pass each), with and without its guard."""
    slates = [q.slate for q in queries]
    matrices, orders, results, guard = {}, {}, {}, {}
    for name, f in fitted.items():
        fits.load(f)
        matrices[name] = fits.fitter.matrices(f.variant, queries)
        orders[name] = decode_orders(matrices[name])
        results[name] = means(slates, orders[name], rel)
        unguarded = fits.fitter.unguarded(f.variant, queries)
        if unguarded is not None:
            guard[name] = {"student_unguarded": means(slates, decode_orders(unguarded[0]), rel), "trust": trust_figures(unguarded[1])}
    return Measured(len(slates), {"first_stage": means(slates, first_stage_order(slates), rel)} |
                   {k: results[p] for k, p in chosen.items()}, results, guard, matrices, orders)


@dataclass
class CrossYearFit:
    """Every trial fitted on one training set, tested on other collections."""

    trained_on: list[str]  # collection names
    queries: int
    chosen: dict[str, str]  # method key -> trial
    cv: dict[str, dict[str, Any]]  # trial -> its CV record (settings chosen, guard thresholds)
    tests: dict[str, Measured]  # collection -> ...

    def report(self) -> dict[str, Any]:
        return {"trained_on": self.trained_on, "queries": self.queries, "chosen": self.chosen, "cv": self.cv,
                "tests": {c: t.report() for c, t in self.tests.items()}}


def cross_year(cfg: RealTextConfig, data: Collections, fits: Fits, fold: CrossYear) -> CrossYearFit:
    queries = data.training(fold.train_on)
    fitted = fits.on(fold.train_on, queries)
    records = {n: f.record for n, f in fitted.items()}
    chosen = picks(cfg, records)
    tests = {collection_name(p): measure(fits, fitted, chosen, data.all(p), cfg.rel) for p in fold.test_on}
    for name, test in tests.items():
        log.info("%s -> %s (%d queries): first stage %.4f%s", " + ".join(map(collection_name, fold.train_on)), name,
                 test.queries, test.methods["first_stage"]["nDCG@10"],
                 "".join(f", {k} {m['nDCG@10']:.4f}" for k, m in test.methods.items() if k != "first_stage"))
    cv = {n: cv_summary(records)[n] | ({"guard": r["guard"]} if "guard" in r else {}) for n, r in records.items()}
    return CrossYearFit(list(map(collection_name, fold.train_on)), len(queries), chosen, cv, tests)


# ---- the shipped student ----------------------------------------------------------------------------------------
def transfer_check(cfg: RealTextConfig, fits: Fits, fitted: FittedTrial, path: str, data: Collections) -> dict[str, Any]:
    """The shipped student on a collection never trained on (MRR@10's threshold from its own grade scale)."""
    queries = data.transfer(path)
    slates = [q.slate for q in queries]
    rel, _ = relevance_threshold({s.slate_id: s.qrels() for s in slates})
    test = measure(fits, {"student": fitted}, {"student": "student"}, queries, rel)
    row = {"collection": collection_name(path), "queries": len(slates), "rel": rel, "first_stage": test.methods["first_stage"],
           "student": test.methods["student"], **test.guard.get("student", {})}
    log.info("shipped -> %s (%d queries, never trained on): first stage %.4f, student %.4f%s", row["collection"],
             row["queries"], row["first_stage"]["nDCG@10"], row["student"]["nDCG@10"], guard_note(row))
    return row


def transfer_figures(t: dict[str, Any]) -> dict[str, Any]:
    """A transfer check as the model card and provenance keep it."""
    return {"queries": t["queries"], "first_stage_nDCG@10": t["first_stage"]["nDCG@10"], "student_nDCG@10": t["student"]["nDCG@10"],
            **({"student_unguarded_nDCG@10": t["student_unguarded"]["nDCG@10"], "guard_mean_trust": t["trust"]["mean"]}
               if "trust" in t else {})}


GUARD_WHAT = ("the head's residual scaled by a per-query trust from the distance of its passages' states to the training "
              "passages' (hllm.model.heads.DomainGuard): 0 keeps the first-stage order, as does a prompt that shows each "
              "passage fewer tokens than guard_min_doc_budget (a long query)")


def teacher_card(cfg: RealTextConfig, target: str, coverage: dict) -> dict[str, Any] | str:
    if target == "judgments":
        return "none: trained on graded relevance labels (the qrels), not distilled"
    t = cfg.teachers[0]
    return {"name": t.name, "rankings": Path(t.rankings).name, "format": t.format, "coverage": coverage[t.name],
            "what": "distilled from the teacher's rankings alone (no relevance labels in the loss)" if target == "teacher"
            else "fitted on the teacher's rankings and the relevance labels together"}


def ship(cfg: RealTextConfig, data: Collections, fits: Fits, summary: dict[str, Any] | None, folds: TeacherFolds | None,
         cross: list[CrossYearFit], queries: list[CachedQuery]) -> tuple[dict[str, Any], list[dict[str, Any]], dict | None]:
    """The `ship_method`'s choice fitted on every `ship_on` query, saved to `ship_to` with its cascade thresholds, its
    calibration (`calibrate`) and a model card; checked on `transfer`. -> (what shipped, transfer rows, calibration)."""
    fitted = fits.on(cfg.ship_on, data.training(cfg.ship_on))
    key = shipped_key(cfg)
    trial = picks(cfg, {n: f.record for n, f in fitted.items()})[key]
    chosen = fitted[trial]
    ranker = fits.load(chosen)
    names = list(map(collection_name, cfg.ship_on))
    calibrator, calibrated = None, None
    if cfg.calibrate:
        calibrator, oof = calibration(cfg, data.all(cfg.teacher_collection), folds, trial)
        calibrated = {"method": key, "trial": trial, "fitted_on": calibrator.fitted_on, "oof": oof, "cross_year": {
            collection_name(p): calibration_sums(calibrator, t.matrices[trial], t.orders[trial],
                                                 [q.slate.grades for q in data.all(p)]).report()
            for fit, fold in zip(cross, cfg.cross_year) if fit.trained_on == names  # fitted as shipped, tested on other years
            for t, p in zip(fit.tests.values(), fold.test_on)}}
    thresholds = (oof_thresholds(folds.trial_matrices[trial], folds.trial_orders[trial], names[0])
                  if cfg.cascade_from == "out-of-fold" else fits.fitter.confidence_thresholds(chosen.variant, queries, names))
    transfer = [transfer_check(cfg, fits, chosen, p, data) for p in cfg.transfer]
    fits.load(chosen)
    rcfg, record = ranker.cfg, chosen.record
    fit = ({"method": "ridge probe (closed form)", "l2": record["ridge_lambda"], "prior_scale": record["prior_scale"]}
           if chosen.variant.fit == "ridge" else {"method": "sgd", "steps": record["best_step"]})
    cross_figures = {c: t.methods.get(key) for x in cross if x.trained_on == names for c, t in x.tests.items()}
    figures = {
        "variant": trial, "fit": fit | cv_summary({trial: record})[trial],
        "chosen_by": f"{cfg.cv_folds}-fold CV over the training queries (nDCG@10 on their qrels)",
        **({"teacher_folds": {k: summary["table"][k]["nDCG@10"] for k in ("first_stage", method_key("teacher", cfg.teachers[0].name), key)
                              if k in summary["table"]}} if summary else {}),
        **({"cross_year": cross_figures} if cross_figures else {}),
        **({"transfer": {t["collection"]: transfer_figures(t) for t in transfer}} if transfer else {}),
        **({"guard": {"what": GUARD_WHAT, **record["guard"],
                      "transfer_fallback_share": {t["collection"]: t["trust"]["fallback_share"] for t in transfer}}}
           if "guard" in record else {}),
        **({"relevance_score": {"what": f"calibrated P(grade >= {cfg.rel}), fitted on this variant's out-of-fold matrices of "
                                        "the teacher-folds", "fitted_on": calibrator.fitted_on,
                                "ece_held_out_queries": calibrated["oof"]["ece"],
                                "ece_cross_year": {c: r["ece"] for c, r in calibrated["cross_year"].items()}}}
           if calibrator is not None else {})}
    card = ModelCard(
        base_model=f"{rcfg.model.preset} (frozen, cut after decoder layer {rcfg.state_layer})", pooling=rcfg.pooling,
        teacher=teacher_card(cfg, chosen.variant.target, data.coverage),
        training_data={"collections": names, "queries": len(queries), "top_n": cfg.top_n},
        vocabulary="the base model's", positions=rcfg.head.positions, window=cfg.top_n, adapt="frozen",
        prompt=PromptCard(rcfg.prompt.template, rcfg.prompt.max_doc_tokens, rcfg.model.context_length),
        head=f"{rcfg.head.kind} with the first-stage prior ({rcfg.head.prior})",
        input="candidates in first-stage order, best first: the prior reads their ranks", figures=figures)
    ship_student(cfg.ship_to, ranker, card, thresholds, "hllm realtext (hllm.recipes.realtext) --config <the recipe below>", to_dict(cfg), calibrator,
                 fit={k: v for k, v in record.items() if k not in ("cv_grid", "cv_curve")},
                 **({"teacher_folds": figures["teacher_folds"]} if "teacher_folds" in figures else {}),
                 **({"cross_year": cross_figures} if cross_figures else {}),
                 transfer=[{"collection": t["collection"], **transfer_figures(t)} for t in transfer],
                 **({"teacher_rankings_sha256": {t.name: file_sha256(Path(t.rankings)) for t in cfg.teachers}} if cfg.teachers else {}))
    shipped = {"method": key, "trial": trial, "trained_on": names, "queries": len(queries), **{k: v for k, v in record.items() if k != "cv_grid"}}
    return shipped, transfer, calibrated


# ---- the run ----------------------------------------------------------------------------------------------------
def run(cfg: RealTextConfig) -> dict[str, Any]:
    """Teacher-folds, the cross-year fits, the shipped student and its transfer checks. -> the report (report.json)."""
    out = Path(cfg.output_dir)
    ranker = start_recipe(cfg)
    data = Collections(cfg, ranker)
    data.every()
    first = data.all(cfg.teacher_collection or (cfg.cross_year[0].train_on[0] if cfg.cross_year else cfg.ship_on[0]))
    fitter = VariantFitter(cfg, ranker, first[0].states[cfg.layers[0]].shape[1] // len(POOLINGS[cfg.ranker.pooling]))
    fits = Fits(cfg, fitter)
    report: dict[str, Any] = {"config": fingerprint(cfg), "collection": cfg.teacher_collection and collection_name(cfg.teacher_collection)}
    folds = summary = None
    if cfg.folds:
        t0 = time.perf_counter()
        folds = teacher_folds(cfg, fitter, data.all(cfg.teacher_collection))
        summary = summarize(cfg, data.all(cfg.teacher_collection), folds)
        log.info("teacher-folds done in %.0fs", time.perf_counter() - t0)
    cross = [cross_year(cfg, data, fits, fold) for fold in cfg.cross_year]
    report |= {"coverage": data.coverage, "teacher_folds": summary, "cross_year": [c.report() for c in cross]}
    report |= {"shipped": None, "transfer": [], "calibration": None}
    if cfg.ship_to:
        report["shipped"], report["transfer"], report["calibration"] = ship(cfg, data, fits, summary, folds, cross,
                                                                            data.training(cfg.ship_on))
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def guard_note(row: dict[str, Any]) -> str:
    if "trust" not in row:
        return ""
    return (f" (unguarded {row['student_unguarded']['nDCG@10']:.4f}; guard: mean trust {row['trust']['mean']:.2f}, "
            f"{row['trust']['fallback_share']:.0%} of queries fell back to the first stage, {row['trust']['partial_share']:.0%} partly)")


def summary_lines(cfg: RealTextConfig, report: dict[str, Any]) -> list[str]:
    """The report's headline: each method's teacher-folds figures and share kept, cross-year, transfer, calibration."""
    lines, folds = [], report["teacher_folds"]
    if folds:
        for name in ["first_stage"] + [method_key("teacher", t.name) for t in cfg.teachers] + list(folds["share_kept"]):
            row, share = folds["table"][name], folds["share_kept"].get(name)
            lines.append(f"teacher-folds {name} ({folds['queries']} queries): nDCG@10 {row['nDCG@10']:.4f}"
                         + "".join(f", tau to {t.name} {row['tau_to_' + t.name]:.3f}" for t in cfg.teachers)
                         + (f"; share of the teacher's gain kept {share['share']:.2f} [{share['ci_low']:.2f}, {share['ci_high']:.2f}]"
                            if share else ""))
    for fit in report["cross_year"]:
        for collection, test in fit["tests"].items():
            for name, m in test["methods"].items():
                trial = fit["chosen"].get(name)
                lines.append(f"cross-year {' + '.join(fit['trained_on'])} -> {collection} ({test['queries']} queries) {name}"
                             + (f" ({trial})" if trial else "") + f": nDCG@10 {m['nDCG@10']:.4f}"
                             + (guard_note(test["guard"][trial]) if trial in test.get("guard", {}) else ""))
    for row in report["transfer"]:
        lines.append(f"shipped -> {row['collection']} ({row['queries']} queries, never trained on): first stage "
                     f"{row['first_stage']['nDCG@10']:.4f}, student {row['student']['nDCG@10']:.4f}{guard_note(row)}")
    cal = report["calibration"]
    if cal:
        lines.append(f"relevance_score of {cal['method']}: ECE {cal['oof']['ece']:.4f} on held-out queries ({cal['oof']['items']} "
                     f"items, every query once, calibrated on the other folds' out-of-fold matrices)"
                     + "".join(f"; {c} {r['ece']:.4f} ({r['items']} items)" for c, r in cal["cross_year"].items()))
    return lines


def main(argv: list[str] | None = None) -> None:
    cfg = recipe_config(RealTextConfig, __doc__, argv, "configs/realtext/smollm2-trec-dl.yaml")
    t0 = time.perf_counter()
    report = run(cfg)
    print("\n".join(summary_lines(cfg, report)))
    print(f"total {time.perf_counter() - t0:.0f}s; report: {Path(cfg.output_dir) / 'report.json'}")


if __name__ == "__main__":
    main()
