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
from hllm.eval.blend import BLENDED, Blend, blended
from hllm.eval.evaluation import first_stage_order
from hllm.eval.metrics import kendall_tau, ndcg10_per_list, share_kept, top10_by_query
from hllm.eval.results_table import merge_rows, write_rows
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
from hllm.train.head_fit import HeadFit, decode_orders, query_folds
from hllm.train.loop import TrainConfig
from hllm.train.prefix_lora import SubSlateConfig
from hllm.train.probes import (FOLD_SALT, CachedQuery, PrefixLayout, TeacherRun, Variant, VariantFitter, load_queries,
                               oof_thresholds)

log = logging.getLogger("hllm")
Method = Literal["student_distilled", "student_both", "student_judged"]
METHODS: dict[str, str] = {"student_distilled": "teacher", "student_both": "both", "student_judged": "judgments"}  # -> target


@dataclass
class CrossYear:
    """Every trial fitted on these collections' queries (settings by CV over them), tested on those."""

    train_on: list[str]  # BEIR folders (named in the report by the folder's name)
    test_on: list[str]
    variants: list[str] | None = None  # the variants fitted (None: every one)


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
    # teacher_collection's lists from these first stages (`runs/<stage>_top100.tsv`; the teachers' `rankings` with
    # `{stage}`): a list per (stage, query), folds by query; []: its own run. Other collections: their own run.
    first_stages: list[str] = field(default_factory=list)
    folds: int = 0  # teacher-folds over teacher_collection's queries (0: none)
    # the first-stage blend (hllm.eval.blend): each trial's out-of-fold matrices leaning on the first stage by a weight
    # chosen per fold and first stage on the other folds' lists of that stage (rows `trial:NAME+first-stage`); []: none
    first_stage_weights: list[float] = field(default_factory=list)
    in_sample: int = 0  # each fold's trial also ranks this many of its training lists (of the first stage): a bound
    sub_slates: SubSlateConfig = field(default_factory=SubSlateConfig)  # lora variants train on these
    methods: list[Method] | None = None  # the methods chosen by CV among the variants (None: every one with a variant)
    headline: str | None = None  # the trial whose blended rows the report's `over <stage>` lines give (named before the folds run)
    notes: list[str] = field(default_factory=list)  # variants tried and stopped, said in the report (never silently dropped)
    report_to: str | None = None  # the report's markdown is also written here (e.g. reports/multistage-smollm2.md)
    csv_to: str | None = None  # its per-stage rows (split `stage-<stage>`) replace their earlier ones in this CSV
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
        self._check_stages()
        taught = [v.name for v in self.variants if v.target != "judgments"]
        for train_on in [c.train_on for c in self.cross_year] + ([self.ship_on] if self.ship_on else []):
            if taught and train_on != [self.teacher_collection]:
                raise ValueError(f"variants {taught} learn from the teachers' rankings of {self.teacher_collection}: a "
                                 f"training set of {train_on} has none (train on [teacher_collection], or drop them)")

    def _check_stages(self) -> None:
        stages = set(self.first_stages)
        if self.first_stages and not self.teacher_collection:
            raise ValueError("first_stages are teacher_collection's: give teacher_collection")
        for v in self.variants:
            unknown = sorted((set(v.train_stages or []) | set(v.test_stages or [])) - stages)
            if unknown:
                raise ValueError(f"variant {v.name}: train or test stages {unknown} are not among first_stages {self.first_stages}")
            if self.first_stages and self.first_stages[0] not in (v.test_stages or self.first_stages):
                raise ValueError(f"variant {v.name}: test_stages must include {self.first_stages[0]} (the first of first_stages: "
                                 "the teacher-folds table, the in-sample bound and other collections' lists are its)")
        lora = [v for v in self.variants if v.fit == "lora"]
        if lora:
            if self.layers != [self.ranker.state_layer]:
                raise ValueError(f"lora variants read prefix states cut at ranker.state_layer: layers must be [{self.ranker.state_layer}]")
            if len(self.teachers) != 1:
                raise ValueError("lora variants train on the teacher's order of sub-slates: give exactly one teacher")
            if len({v.lora_layers for v in lora}) > 1:
                raise ValueError(f"lora variants adapt {sorted({v.lora_layers for v in lora})} top layers: one prefix cache needs one lora_layers")
        for v in lora:
            if v.target != "teacher" or v.layer != self.ranker.state_layer or not 1 <= v.lora_layers < v.layer:
                raise ValueError(f"variant {v.name}: a lora variant learns from the teacher (target: teacher), at layer "
                                 f"ranker.state_layer ({self.ranker.state_layer}), adapting 1..layer-1 top layers")
        if self.first_stage_weights and not self.folds:
            raise ValueError("first_stage_weights are chosen on the other teacher-folds: give folds")
        names = {v.name for v in self.variants}
        for c in self.cross_year:
            if c.variants and not set(c.variants) <= names:
                raise ValueError(f"cross_year variants {sorted(set(c.variants) - names)} are not variants")
        if self.headline and len([n for v, t in trials(self) if self.headline in (v.name, n := trial_name(v, t))]) != 1:
            raise ValueError(f"headline {self.headline!r} is not one trial (a variant's name; NAME@teacher where it has several)")
        if self.methods is not None and self.ship_to and self.ship_method not in self.methods:
            raise ValueError(f"ship_method {self.ship_method} is not among methods {self.methods}")

    def prefix(self) -> PrefixLayout | None:
        """Where a config with a LoRA variant keeps its states (None: layer states, no LoRA variant)."""
        lora = [v for v in self.variants if v.fit == "lora"]
        if not lora:
            return None
        stages = None if any(v.train_stages is None for v in lora) else sorted({s for v in lora for s in v.train_stages})
        return PrefixLayout(self.ranker.state_layer - lora[0].lora_layers, self.sub_slates, stages, self.seed)

    def headline_trial(self) -> str | None:
        return next((n for v, t in trials(self) if self.headline in (v.name, n := trial_name(v, t))), None)

    def stage(self) -> str:
        """The stage whose lists other collections' lists compare with (their own run): the first of first_stages."""
        return self.first_stages[0] if self.first_stages else ""


def trains(v: Variant, q: CachedQuery) -> bool:
    return v.train_stages is None or q.stage in v.train_stages


def ranks(v: Variant, q: CachedQuery) -> bool:
    return v.test_stages is None or q.stage in v.test_stages


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
            if any(v.target == METHODS[m] and v.fit != "lora" for v in cfg.variants) and (cfg.methods is None or m in cfg.methods)]


def shipped_key(cfg: RealTextConfig) -> str:
    return method_key(cfg.ship_method, cfg.teachers[0].name if cfg.teachers else None)


def choose(scores: dict[str, float | None], cfg: RealTextConfig, method: str, teacher: str | None) -> str | None:
    """The trial a method keeps: the best cross-validated score (`scores`: trial -> its CV score) among its target's
    (ties: the earlier one)."""
    target = METHODS[method]
    names = [trial_name(v, None if target == "judgments" else teacher) for v in cfg.variants if v.target == target]
    names = [n for n in names if scores.get(n) is not None]  # a LoRA trial has no CV score: not a method's choice
    return max(names, key=lambda n: (round(scores[n], 6), -names.index(n))) if names else None


def picks(cfg: RealTextConfig, scores: dict[str, float | None]) -> dict[str, str]:
    """method key -> the trial it keeps, for every method with a cross-validated trial among `scores` (trial -> CV score)."""
    chosen = {method_key(m, t): choose(scores, cfg, m, t) for m, t in methods(cfg)}
    return {k: p for k, p in chosen.items() if p}


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
            taught = path == self.cfg.teacher_collection and not transfer
            self._queries[path, transfer], coverage = load_queries(
                self.cfg, self.ranker, path, self.cfg.teachers if taught else [], pick if transfer else None,
                self.cfg.first_stages if taught else None, self.cfg.prefix())
            for q in self._queries[path, transfer]:
                q.stage = q.stage or self.cfg.stage()  # another collection's own run stands for the first of first_stages
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
FOLD_FIELDS = ("ranker", "layers", "teacher_collection", "first_stages", "teachers", "top_n", "folds", "cv_folds",
               "ridge_lambdas", "prior_scales", "teacher_depth", "sgd_head", "train", "sub_slates", "in_sample", "rel",
               "seed")  # what a trial's fold depends on, beside the variant itself


@dataclass
class TeacherFolds:
    """Every trial fitted on each teacher-fold's training lists and tested on its test lists (every query once, its
    lists from every first stage together)."""

    trial_orders: dict[str, list[list[int] | None]]  # trial -> per list its out-of-fold order (None: a stage it does not rank)
    trial_matrices: dict[str, list[np.ndarray | None]]  # trial -> per list its out-of-fold (N, K) matrix
    chosen: list[dict[str, str]]  # per fold: method key -> the trial its CV chose
    cv: list[dict[str, dict[str, float]]]  # per fold: trial -> its CV record
    method_orders: dict[str, list[list[int]]]  # method key -> per list the order of its fold's choice
    fold_of: list[int]  # per list the fold that tests it
    fits: dict[str, list[dict[str, Any]]]  # trial -> per fold: seconds, losses, last history row, in-sample figures
    blended: dict[str, list[list[int] | None]] = field(default_factory=dict)  # trial -> per list its blended order
    weights: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # trial -> stage -> per fold the weight chosen
    blends: dict[str, Blend] = field(default_factory=dict)  # trial -> its out-of-fold lists blended at every weight
    blend_lists: dict[str, list[int]] = field(default_factory=dict)  # trial -> the lists its Blend holds, in order


def in_sample_figures(cfg: RealTextConfig, seen: list[CachedQuery], matrices: list[np.ndarray], teacher: str | None) -> dict[str, Any]:
    """A fitted trial on some of its own training lists: nDCG@10 beside the first stage's and the teacher's, tau."""
    if not seen:
        return {"lists": 0}
    slates, orders = [q.slate for q in seen], decode_orders(matrices)
    out = {"lists": len(seen), "nDCG@10": means(slates, orders, cfg.rel)["nDCG@10"],
           "first_stage": means(slates, first_stage_order(slates), cfg.rel)["nDCG@10"]}
    if teacher:
        out |= {"teacher": means(slates, [q.perms[teacher] for q in seen], cfg.rel)["nDCG@10"],
                "tau_to_teacher": float(np.mean([kendall_tau(o, q.perms[teacher]) for o, q in zip(orders, seen)]))}
    return out


def fold_trial(cfg: RealTextConfig, fitter: VariantFitter, v: Variant, teacher: str | None, f: int, train: list[CachedQuery],
               test: list[CachedQuery]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """One trial on one fold: fitted on `train`, ranking `test` -> (its record, its test lists' matrices); kept in
    `output_dir/folds` under the key of FOLD_FIELDS and the variant (a stopped run resumes at the next trial)."""
    name = trial_name(v, teacher)
    store = Path(cfg.output_dir) / "folds"
    store.mkdir(parents=True, exist_ok=True)
    saved = store / f"fold{f}-{name}-{fields_key(cfg, FOLD_FIELDS, to_dict(v), teacher)}.npz"
    if saved.is_file():
        with np.load(saved, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            got = [z[q.key] for q in test]
        log.info("fold %d/%d %s: read from %s", f + 1, cfg.folds, name, saved)
        return meta, got
    t0 = time.perf_counter()
    record = fitter.fit(v, teacher, train, cfg.seed + f)
    seen = [q for q in train if q.stage == cfg.stage()][: cfg.in_sample]
    got = fitter.matrices(v, test + seen)
    history = record.history or []
    meta = {"record": record.summary(guard=True),
            "seconds": time.perf_counter() - t0, "train_lists": len(train), "test_lists": len(test),
            "losses": [row["loss"] for row in history], "last": history[-1] if history else {},
            "in_sample": in_sample_figures(cfg, seen, got[len(test):], teacher)}
    tmp = store / f".tmp-{saved.name}"
    with tmp.open("wb") as fh:
        np.savez(fh, meta=json.dumps(meta), **{q.key: m for q, m in zip(test, got)})
    tmp.replace(saved)  # a trial's fold is whole or absent
    if record.cross_validated:
        log.info("fold %d/%d %s: CV nDCG@10 %.4f (first stage %.4f) %.0fs", f + 1, cfg.folds, name, record.cv_score,
                 record.cv_first_stage, meta["seconds"])
    else:
        log.info("fold %d/%d %s: %d training lists, %d test lists, %.0f s", f + 1, cfg.folds, name, len(train), len(test), meta["seconds"])
    return meta, got[: len(test)]


def teacher_folds(cfg: RealTextConfig, fitter: VariantFitter, queries: list[CachedQuery]) -> TeacherFolds:
    """Every trial fitted on each fold's training lists (of its train_stages) and tested on its test lists (of its
    test_stages); the methods' choices per fold; the first-stage blend of every trial (`first_stage_weights`)."""
    names = [trial_name(v, t) for v, t in trials(cfg)]
    orders: dict[str, list] = {n: [None] * len(queries) for n in names}
    matrices: dict[str, list] = {n: [None] * len(queries) for n in names}
    chosen, cv, fold_of, fits = [], [], {}, {n: [] for n in names}
    splits = query_folds(len(queries), [q.slate.slate_id for q in queries], cfg.folds, FOLD_SALT)  # a query's lists together
    for f, (train_idx, test_idx) in enumerate(splits):
        fold_of |= {i: f for i in test_idx}
        records = {}
        for v, t in trials(cfg):
            name = trial_name(v, t)
            test = [i for i in test_idx if ranks(v, queries[i])]
            meta, got = fold_trial(cfg, fitter, v, t, f, [queries[i] for i in train_idx if trains(v, queries[i])],
                                   [queries[i] for i in test])
            for i, m in zip(test, got):
                matrices[name][i], orders[name][i] = m, decode_orders([m])[0]
            records[name] = meta["record"]
            fits[name].append({k: meta[k] for k in ("seconds", "losses", "last", "in_sample")})
        chosen.append(picks(cfg, {n: r.get("cv_score") for n, r in records.items()}))
        cv.append({n: {k: x for k, x in r.items() if k != "guard"} for n, r in records.items()})
        log.info("fold %d/%d%s", f + 1, cfg.folds, f" chose {chosen[-1]}" if chosen[-1] else " done")
    keys = [k for k in chosen[0] if all(k in c for c in chosen)]
    out = TeacherFolds(orders, matrices, chosen, cv, {k: [orders[chosen[fold_of[i]][k]][i] for i in range(len(queries))] for k in keys},
                       [fold_of[i] for i in range(len(queries))], fits)
    if cfg.first_stage_weights:
        blend_folds(cfg, queries, out)
    return out


def blend_folds(cfg: RealTextConfig, queries: list[CachedQuery], folds: TeacherFolds) -> None:
    """Every trial's out-of-fold matrices blended with the first stage (hllm.eval.blend), the weight of each fold's lists
    of a stage chosen on the other folds' lists of that stage (their judgments; the fold's own are never read)."""
    for name, mats in folds.trial_matrices.items():
        have = [i for i, m in enumerate(mats) if m is not None]
        blend = Blend([mats[i] for i in have], cfg.first_stage_weights, lambda idx, o: ndcg10_per_list([queries[have[r]].slate for r in idx], o))
        row_of = {i: r for r, i in enumerate(have)}
        folds.blends[name], folds.blend_lists[name] = blend, have
        folds.blended[name] = [None] * len(queries)
        for stage in dict.fromkeys(queries[i].stage for i in have):
            for f in sorted(set(folds.fold_of)):
                others = [row_of[i] for i in have if queries[i].stage == stage and folds.fold_of[i] != f]
                mine = [i for i in have if queries[i].stage == stage and folds.fold_of[i] == f]
                if not others or not mine:
                    continue
                w = blend.best(others)
                folds.weights.setdefault(name, {}).setdefault(stage or "own", []).append(w)
                for i in mine:
                    folds.blended[name][i] = blend.orders[w][row_of[i]]


def stage_weight(cfg: RealTextConfig, queries: list[CachedQuery], folds: TeacherFolds, name: str) -> float:
    """The first-stage weight a trial fitted on every list takes to other collections: the best over all its
    out-of-fold lists of the first of first_stages (their own run's stage)."""
    have = folds.blend_lists[name]
    return folds.blends[name].best([r for r, i in enumerate(have) if queries[i].stage == cfg.stage()])


def summarize(cfg: RealTextConfig, queries: list[CachedQuery], folds: TeacherFolds, stage: str | None = None) -> dict[str, Any]:
    """Over the lists of `stage` (None: every list; a collection read with one run), per method and per trial (raw,
    and blended with the first stage): means over queries, Kendall tau to each teacher, and the share of each
    teacher's gain over the first stage that each student keeps (with its bootstrap interval)."""
    index = [i for i, q in enumerate(queries) if stage is None or q.stage == stage]
    lists = [queries[i] for i in index]
    slates = [q.slate for q in lists]
    runs = {"first_stage": first_stage_order(slates)} | {method_key("teacher", t.name): [q.perms[t.name] for q in lists] for t in cfg.teachers}
    ranked = list(folds.method_orders.items()) + [(f"trial:{n}", o) for n, o in folds.trial_orders.items()]
    for name, o in ranked + [(f"trial:{n}{BLENDED}", o) for n, o in folds.blended.items()]:
        got = [o[i] for i in index]
        if all(x is not None for x in got):  # a trial (or a method's choice) that ranks these lists: its test_stages
            runs[name] = got
    table = {}
    for name, orders in runs.items():
        pq = top10_by_query(slates, orders, cfg.rel)
        table[name] = averaged(pq) | {"per_query_nDCG@10": pq["nDCG@10"]}
        for t in cfg.teachers:
            table[name][f"tau_to_{t.name}"] = float(np.mean([kendall_tau(o, q.perms[t.name]) for o, q in zip(orders, lists)]))
    qids = list(table["first_stage"]["per_query_nDCG@10"])
    vec = {name: np.array([row["per_query_nDCG@10"][q] for q in qids]) for name, row in table.items()}
    shares = {method_key(m, t.name): share_kept(vec[method_key(m, t.name)], vec["first_stage"], vec[method_key("teacher", t.name)],
                                                cfg.bootstrap, cfg.seed)
              for t in cfg.teachers for m in METHODS if method_key(m, t.name) in vec}
    for v, t in trials(cfg):
        for name in (f"trial:{trial_name(v, t)}", f"trial:{trial_name(v, t)}{BLENDED}"):
            if t is not None and name in table:
                table[name]["share_kept"] = share_kept(vec[name], vec["first_stage"], vec[method_key("teacher", t)], cfg.bootstrap, cfg.seed)
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
    record: HeadFit  # the settings chosen and their CV scores, the guard's thresholds
    weights: dict[str, torch.Tensor]  # its head's (the ranker config: VariantFitter.head_config(variant))
    lora: SinglePassRanker | None = None  # a LoRA variant's whole student (its adapters are not the fitter's head)


class Fits:
    """Every trial fitted at most once per training set (the cross-year fit on the shipped student's collections is
    the shipped student's), loaded back into the fitter's ranker to score."""

    def __init__(self, cfg: RealTextConfig, fitter: VariantFitter):
        self.cfg, self.fitter = cfg, fitter
        self._done: dict[tuple[str, ...], dict[str, FittedTrial]] = {}

    def on(self, train_on: list[str], queries: list[CachedQuery], variants: list[str] | None = None) -> dict[str, FittedTrial]:
        """trial -> fitted on `queries` (every list of the `train_on` collections of its train_stages); `variants`:
        those fitted (None: every one; a trial fitted before on the same collections is not fitted again)."""
        done = self._done.setdefault(tuple(train_on), {})
        taught = train_on == [self.cfg.teacher_collection]
        for v, t in trials(self.cfg):
            name = trial_name(v, t)
            if (t is not None and not taught) or (variants is not None and v.name not in variants) or name in done:
                continue
            t0 = time.perf_counter()
            mine = [q for q in queries if trains(v, q)]
            record = self.fitter.fit(v, t, mine)
            done[name] = FittedTrial(v, record, {k: x.detach().clone() for k, x in self.fitter.ranker.head.state_dict().items()},
                                     self.fitter.lora if v.fit == "lora" else None)
            log.info("all %d lists of %s, %s: %s (%.0fs)", len(mine), " + ".join(map(collection_name, train_on)), name,
                     f"CV nDCG@10 {record.cv_score:.4f} (first stage {record.cv_first_stage:.4f})" if record.cross_validated
                     else "trained", time.perf_counter() - t0)
        return {n: f for n, f in done.items() if variants is None or f.variant.name in variants}

    def load(self, fitted: FittedTrial) -> SinglePassRanker:
        """The fitter's ranker with `fitted`'s head (a LoRA variant: its own student, now the fitter's)."""
        if fitted.lora is not None:
            self.fitter.lora = fitted.lora
            return fitted.lora
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
            queries: list[CachedQuery], rel: int, weights: dict[str, float] | None = None) -> Measured:
    """Each of `fitted` ranks `queries` once (whole lists, one pass each), with and without its guard; a trial with a
    first-stage weight (`weights`, chosen on the teacher-folds) also blended with the first stage (`NAME+first-stage`)."""
    slates = [q.slate for q in queries]
    matrices, orders, results, guard = {}, {}, {}, {}
    for name, f in fitted.items():
        fits.load(f)
        matrices[name] = fits.fitter.matrices(f.variant, queries)
        orders[name] = decode_orders(matrices[name])
        results[name] = means(slates, orders[name], rel)
        if weights and name in weights:
            results[name + BLENDED] = means(slates, decode_orders([blended(m, weights[name]) for m in matrices[name]]), rel) | {
                "first_stage_weight": weights[name]}
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


def cross_year(cfg: RealTextConfig, data: Collections, fits: Fits, fold: CrossYear, folds: TeacherFolds | None) -> CrossYearFit:
    """Every trial (of `fold.variants`) fitted on all of `fold.train_on`, tested on each of `fold.test_on`; a trial of
    the teacher-folds with a first-stage blend also blended, its weight the best over its out-of-fold lists."""
    queries = data.training(fold.train_on)
    fitted = fits.on(fold.train_on, queries, fold.variants)
    chosen = picks(cfg, {n: f.record.cv_score for n, f in fitted.items()})
    weights = ({n: stage_weight(cfg, data.all(cfg.teacher_collection), folds, n) for n in fitted if n in folds.blends}
               if folds and folds.blends else None)
    tests = {collection_name(p): measure(fits, fitted, chosen, data.all(p), cfg.rel, weights) for p in fold.test_on}
    for name, test in tests.items():
        log.info("%s -> %s (%d queries): first stage %.4f%s", " + ".join(map(collection_name, fold.train_on)), name,
                 test.queries, test.methods["first_stage"]["nDCG@10"],
                 "".join(f", {k} {m['nDCG@10']:.4f}" for k, m in test.methods.items() if k != "first_stage"))
    cv = {n: f.record.summary(guard=True) for n, f in fitted.items()}
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
    trial = picks(cfg, {n: f.record.cv_score for n, f in fitted.items()})[key]
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
    fit = ({"method": "ridge probe (closed form)", "l2": record.ridge_lambda, "prior_scale": record.prior_scale}
           if chosen.variant.fit == "ridge" else {"method": "sgd", "steps": record.best_step})
    cross_figures = {c: t.methods.get(key) for x in cross if x.trained_on == names for c, t in x.tests.items()}
    figures = {
        "variant": trial, "fit": fit | record.summary(),
        "chosen_by": f"{cfg.cv_folds}-fold CV over the training queries (nDCG@10 on their qrels)",
        **({"teacher_folds": {k: summary["table"][k]["nDCG@10"] for k in ("first_stage", method_key("teacher", cfg.teachers[0].name), key)
                              if k in summary["table"]}} if summary else {}),
        **({"cross_year": cross_figures} if cross_figures else {}),
        **({"transfer": {t["collection"]: transfer_figures(t) for t in transfer}} if transfer else {}),
        **({"guard": {"what": GUARD_WHAT, **record.guard,
                      "transfer_fallback_share": {t["collection"]: t["trust"]["fallback_share"] for t in transfer}}}
           if record.guard is not None else {}),
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
                 fit=record.to_json(without=("cv_grid", "cv_curve")),
                 **({"teacher_folds": figures["teacher_folds"]} if "teacher_folds" in figures else {}),
                 **({"cross_year": cross_figures} if cross_figures else {}),
                 transfer=[{"collection": t["collection"], **transfer_figures(t)} for t in transfer],
                 **({"teacher_rankings_sha256": {t.name: file_sha256(Path(t.rankings)) for t in cfg.teachers}} if cfg.teachers else {}))
    shipped = {"method": key, "trial": trial, "trained_on": names, "queries": len(queries), **record.to_json(without=("cv_grid",))}
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
    t0 = time.perf_counter()
    if cfg.folds:
        queries = data.all(cfg.teacher_collection)
        folds = teacher_folds(cfg, fitter, queries)
        summary = summarize(cfg, queries, folds, cfg.stage() if cfg.first_stages else None)
        if cfg.first_stages:  # a table per first stage, and how each trial's folds went
            report["by_stage"] = {stage: summarize(cfg, queries, folds, stage) for stage in cfg.first_stages}
            report["fits"] = folds.fits
        if folds.weights:
            report["first_stage_weights"] = folds.weights
        log.info("teacher-folds done in %.0fs", time.perf_counter() - t0)
    cross = [cross_year(cfg, data, fits, fold, folds) for fold in cfg.cross_year]
    report |= {"coverage": data.coverage, "teacher_folds": summary, "cross_year": [c.report() for c in cross]}
    report |= {"shipped": None, "transfer": [], "calibration": None}
    if cfg.ship_to:
        report["shipped"], report["transfer"], report["calibration"] = ship(cfg, data, fits, summary, folds, cross,
                                                                            data.training(cfg.ship_on))
    report["seconds"] = time.perf_counter() - t0
    (out / "report.json").write_text(json.dumps(report, indent=2))
    if "by_stage" in report:
        text = stage_markdown(cfg, report)
        (out / "report.md").write_text(text)
        if cfg.report_to:
            Path(cfg.report_to).write_text(text)
        if cfg.csv_to:
            write_stage_rows(cfg, report, Path(cfg.csv_to))
    return report


# ---- a report per first stage (teacher_collection read over several) ----------------------------------------------
def shown(cfg: RealTextConfig, trial: str) -> str:
    """A trial as a one-teacher report names it: its variant's name alone."""
    blend = BLENDED if trial.endswith(BLENDED) else ""
    base = trial.removesuffix(BLENDED)
    return (base.removesuffix(f"@{cfg.teachers[0].name}") if len(cfg.teachers) == 1 else base) + blend


def stage_rows(cfg: RealTextConfig, report: dict[str, Any], stage: str) -> list[tuple[str, dict[str, Any]]]:
    """A stage's table as the report shows it: the first stage, the teacher, then each trial raw and blended (config
    order), then each method -> [(row name, row)]."""
    table, teacher = report["by_stage"][stage]["table"], method_key("teacher", cfg.teachers[0].name)
    names = ["first_stage", teacher] + [f"trial:{trial_name(v, t)}{b}" for v, t in trials(cfg) for b in ("", BLENDED)]
    names += [k for k in report["by_stage"][stage]["share_kept"]]
    return [("teacher" if n == teacher else shown(cfg, n.removeprefix("trial:")), table[n]) for n in names if n in table]


def write_stage_rows(cfg: RealTextConfig, report: dict[str, Any], path: Path) -> None:
    """One row per (first stage, row) under split `stage-<stage>` (and `stage-cross-year`) into the results table
    `path`, replacing the rows of the same collection, split, name and teacher (`merge_rows`; another config's rows of the
    same collection stay)."""
    teacher = cfg.teachers[0].name
    rows, collection = [], report["collection"]
    for stage in report["by_stage"]:
        for name, row in stage_rows(cfg, report, stage):
            share = row.get("share_kept") or report["by_stage"][stage]["share_kept"].get(name)
            rows.append({"collection": collection, "queries": report["by_stage"][stage]["queries"], "split": f"stage-{stage}",
                         "method": name, "nDCG@10": f"{row['nDCG@10']:.4f}", "MRR@10": f"{row['MRR@10']:.4f}", "teacher": teacher,
                         "tau_to_teacher": f"{row[f'tau_to_{teacher}']:.4f}", "share_kept": f"{share['share']:.4f}" if share else "",
                         "share_kept_ci95": f"{share['ci_low']:.4f}..{share['ci_high']:.4f}" if share else ""})
    for fit in report["cross_year"]:
        for other, test in fit["tests"].items():
            for name, m in [("first_stage", test["methods"]["first_stage"]), *test["trials"].items()]:
                rows.append({"collection": other, "queries": test["queries"], "split": "stage-cross-year", "method": name,
                             "nDCG@10": f"{m['nDCG@10']:.4f}", "MRR@10": f"{m['MRR@10']:.4f}"})
    write_rows(merge_rows(rows, path), path)


def stage_markdown(cfg: RealTextConfig, r: dict[str, Any]) -> str:
    """The report of a run over several first stages: a table per stage, the headline, cross-year, the in-sample bound."""
    teacher = cfg.teachers[0].name
    tau = f"tau_to_{teacher}"
    stages = r["by_stage"]
    queries = stages[cfg.stage()]["queries"]
    over = f"{len(stages)} first stages" if len(stages) > 1 else f"{next(iter(stages))}'s lists"
    lines = [f"# {r['collection']}: {queries} queries x {over}, {cfg.ranker.model.preset}", "",
             f"nDCG@10 means over the {queries} queries (each tested once: {cfg.folds} teacher-folds by query, a query's lists "
             f"from every first stage held out together); teacher: {teacher}; tau: Kendall's tau to the teacher's order; "
             f"`+first-stage`: blended with the first stage, the weight chosen per fold and first stage on the other folds' lists.", ""]
    for stage in stages:
        rows = stage_rows(cfg, r, stage)
        first = dict(rows)["first_stage"]["nDCG@10"]
        lines += [f"## {stage}", "", "| method | nDCG@10 | Δ first stage | tau to teacher | share of the teacher's gain [95% CI] |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, row in rows:
            share = row.get("share_kept") or stages[stage]["share_kept"].get(name)
            delta = 0.0 if name in ("first_stage", "teacher") else row["nDCG@10"] - first
            lines.append(f"| {name} | {row['nDCG@10']:.4f} | {delta:+.4f} | {row[tau]:.3f} | "
                         + (f"{share['share']:.2f} [{share['ci_low']:.2f}, {share['ci_high']:.2f}]" if share else "") + " |")
        lines.append("")
    if cfg.notes:
        lines += ["## Variants tried and stopped", ""] + [f"- {n}" for n in cfg.notes] + [""]
    lines += ["## Headline", ""]
    table = stages[cfg.stage()]["table"]
    for fit in dict.fromkeys(v.fit for v in cfg.variants):  # the best of each fit on the first stage's lists, raw or blended
        names = [f"trial:{trial_name(v, t)}{b}" for v, t in trials(cfg) if v.fit == fit for b in ("", BLENDED)]
        names = [n for n in names if "share_kept" in table.get(n, {})]
        if names:
            best = max(names, key=lambda n: table[n]["nDCG@10"])
            lines.append(f"share kept, {cfg.ranker.model.preset} {fit} ({cfg.stage()}): {table[best]['share_kept']['share']:.2f} "
                         f"({shown(cfg, best.removeprefix('trial:'))})")
    if cfg.headline:
        head = f"trial:{cfg.headline_trial()}{BLENDED if cfg.first_stage_weights else ''}"
        for stage in stages:
            t = stages[stage]["table"]
            if head in t:
                lines.append(f"over {stage}: student {t[head]['nDCG@10']:.4f} | first stage {t['first_stage']['nDCG@10']:.4f} "
                             f"| teacher {t[method_key('teacher', teacher)]['nDCG@10']:.4f}")
    for fit in r["cross_year"]:
        for other, test in fit["tests"].items():
            lines += ["", f"Cross-year: trained on every list of {' + '.join(fit['trained_on'])}, ranking {other}'s lists "
                      f"({test['queries']} queries, never trained on): first stage {test['methods']['first_stage']['nDCG@10']:.4f}"
                      + "".join(f", {shown(cfg, n)} {m['nDCG@10']:.4f}" + (f" (w = {m['first_stage_weight']}, chosen on the out-of-fold lists)"
                                                               if "first_stage_weight" in m else "")
                                for n, m in test["trials"].items()) + "."]
    if cfg.in_sample:
        lines += ["", "## In sample (a bound on what limits each student)", "",
                  f"Each fold's student also ranked up to {cfg.in_sample} {cfg.stage()} lists of its own training queries; means over the folds.", "",
                  "| student | its training lists: nDCG@10 | first stage | teacher | tau to teacher | out of fold: nDCG@10 |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for name, folds in r["fits"].items():
            got = [f["in_sample"] for f in folds if f["in_sample"]["lists"]]
            if got:
                mean = lambda k: float(np.mean([f[k] for f in got]))  # noqa: E731
                lines.append(f"| {shown(cfg, name)} | {mean('nDCG@10'):.4f} | {mean('first_stage'):.4f} | {mean('teacher'):.4f} | "
                             f"{mean('tau_to_teacher'):.3f} | {table[f'trial:{name}']['nDCG@10']:.4f} |")
    for name, folds in r["fits"].items():
        curves = [f["losses"] for f in folds if len(f["losses"]) >= 10]
        if curves:
            per_step = np.mean([f["last"]["elapsed_s"] / f["last"]["step"] for f in folds if f["last"]])
            lines.append(f"\n{shown(cfg, name)}: training loss (mean over folds) {np.mean([c[:5] for c in curves]):.4f} over its first 5 steps, "
                         f"{np.mean([c[-5:] for c in curves]):.4f} over its last 5 ({len(curves[0])} steps a fold, {per_step:.1f} s a step).")
    lines += ["", "Seconds a fold: " + "; ".join(f"{shown(cfg, n)} {np.mean([f['seconds'] for f in folds]):.0f}" for n, folds in r["fits"].items())
              + f"; {sum(f['seconds'] for folds in r['fits'].values() for f in folds):.0f} s of folds in all"
              + f" ({r['seconds']:.0f} s this run: a finished fold is read back, not fitted again).", ""]
    return "\n".join(lines) + "\n"


def guard_note(row: dict[str, Any]) -> str:
    if "trust" not in row:
        return ""
    return (f" (unguarded {row['student_unguarded']['nDCG@10']:.4f}; guard: mean trust {row['trust']['mean']:.2f}, "
            f"{row['trust']['fallback_share']:.0%} of queries fell back to the first stage, {row['trust']['partial_share']:.0%} partly)")


def summary_lines(cfg: RealTextConfig, report: dict[str, Any]) -> list[str]:
    """The report's headline: each method's teacher-folds figures and share kept (with no methods: each trial's), cross-year,
    transfer, calibration."""
    lines, folds, by_method = [], report["teacher_folds"], bool(methods(cfg))
    if folds:
        shown_rows = list(folds["share_kept"]) if by_method else [k for k in folds["table"] if k.startswith("trial:")]
        for name in ["first_stage"] + [method_key("teacher", t.name) for t in cfg.teachers] + shown_rows:
            row = folds["table"][name]
            share = folds["share_kept"].get(name) or row.get("share_kept")
            lines.append(f"teacher-folds {name} ({folds['queries']} queries): nDCG@10 {row['nDCG@10']:.4f}"
                         + "".join(f", tau to {t.name} {row['tau_to_' + t.name]:.3f}" for t in cfg.teachers)
                         + (f"; share of the teacher's gain kept {share['share']:.2f} [{share['ci_low']:.2f}, {share['ci_high']:.2f}]"
                            if share else ""))
    for fit in report["cross_year"]:
        for collection, test in fit["tests"].items():
            shown_rows = test["methods"] if by_method else {"first_stage": test["methods"]["first_stage"], **test["trials"]}
            for name, m in shown_rows.items():
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
