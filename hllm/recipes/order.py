"""Students that read: the shipped real-text probes measured under shuffled input orders, re-fitted with
permutation augmentation, and re-shipped.

    python -m hllm.recipes.order --config configs/order/smollm2.yaml [key=value ...]     # or: hllm order --config ...

Every collection's top-`top_n` list is read in each order of `orders` (`hllm.data.order.InputOrder`: the
first stage's, fixed shuffles per query, reversed), one prompt per (query, order) and its item states computed
once (`hllm.train.state_cache`: the frozen SmolLM2 cut after layer 16, each passage's last token beside its
tokens' mean). A state depends on where its passage sat in the causal prompt, so the orders are different
inputs, not relabelled copies.

Each student of `students` (a shipped closed-form probe: its target, pooling, grids) is fitted on `train_on`'s
queries seen in the orders of an `augmentations` entry (each list's target — its qrels, or the teacher's
ranking read by document id — stays with its documents), and measured two ways: with no declared order
(the prior off: the ranking is the text's alone) on each shuffle — as served, every arrival order read in its
canonical order (`hllm.data.order.canonical_order`), and, for the ablation, read as it arrived — and with the
first-stage order declared (the prior on). On the training queries, by `cv_folds`-fold cross-validation: the augmentation and the L2
weight that rank best with no declared order (the mean over the shuffles), then the prior's scale that ranks
best with the order declared. Out of fold (`train_on`'s queries by `folds` query folds) and cross-year
(`test_on`, read once at the end), every augmentation is reported (the ablation); the chosen one is shipped:
fitted on `ship_on` with its calibration (`calibrate`), domain guard and cascade thresholds refitted the same
way, the model card giving both figures. Writes `report.json` and `report_to` (markdown).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hllm.config import to_dict
from hllm.data.order import CANONICAL, FIRST_STAGE, InputOrder, reorder
from hllm.data.readers import collection_name, read_slates
from hllm.eval.metrics import mean_ci, ndcg10_per_list
from hllm.job.config import recipe_config, start_recipe
from hllm.model.backbones import ModelConfig
from hllm.model.calibration import fit_calibrator
from hllm.model.card import read_model_card, ship_student
from hllm.model.confidence import CascadeThresholds, confidence
from hllm.model.heads import HeadConfig
from hllm.model.item_states import POOLINGS
from hllm.model.prompts import PromptConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.records import RerankRequest
from hllm.teacher.external import external_rankings
from hllm.train.head_fit import (StateSlate, decode_orders, fit_guard, query_folds, ridge_utilities, score_state_slates,
                                 set_utility, state_confidence)
from hllm.train.probes import FOLD_SALT, state_columns, teacher_grades
from hllm.train.state_cache import cached_states, states_key

log = logging.getLogger("hllm")


@dataclass
class StudentSpec:
    """A shipped closed-form probe (`hllm/assets/NAME`, a utility head under the logrank prior over these states)."""

    name: str  # as `Reranker.load` takes it
    folder: str  # where it is shipped
    target: Literal["judgments", "teacher"] = "judgments"
    teacher_rankings: str | None = None  # target teacher: the rankings file of train_on (and ship_on) queries
    teacher_depth: int = 100  # the teacher's rank r graded depth + 1 - r within its top `depth`
    ridge_lambdas: list[float] = field(default_factory=lambda: [1000.0, 10000.0])
    prior_scales: list[float] = field(default_factory=lambda: [0.5, 1.0])
    ship_on: list[str] = field(default_factory=list)  # the collections the shipped head is fitted on
    calibrate: bool = False  # calibration.json from out-of-fold matrices of train_on's folds
    cascade_from: Literal["in-sample", "out-of-fold"] = "in-sample"  # cascade.json's queries
    # its cross-year figure on test_on before this recipe (first-stage order, declared): the row of the config's
    # `recorded_in` CSV with this split and method (and teacher, after a "/"), e.g. "cross-year/student_distilled/rankvicuna-7b"
    recorded: str | None = None

    def __post_init__(self) -> None:
        if (self.target == "teacher") != (self.teacher_rankings is not None):
            raise ValueError(f"student {self.name}: target teacher goes with teacher_rankings, and only it")


@dataclass
class OrderConfig:
    output_dir: str = "runs/order"
    device: str = "auto"
    threads: int | None = None
    ranker: RankerConfig = field(default_factory=lambda: RankerConfig(
        model=ModelConfig(preset="smollm2-135m", context_length=8192), adapt=AdaptConfig(mode="frozen"),
        head=HeadConfig(kind="utility", positions=20, prior="logrank"),
        prompt=PromptConfig(template="rankgpt-query", max_doc_tokens=48), state_layer=16, pooling="last+mean"))
    top_n: int = 100
    collections: list[str] = field(default_factory=list)  # BEIR folders whose states are computed, in this order
    orders: list[str] = field(default_factory=lambda: ["first-stage", "shuffled:0", "shuffled:1", "shuffled:2"])
    extra: list[str] = field(default_factory=list)  # "COLLECTION@ORDER" computed after the rest (e.g. a reversal)
    shard_slates: int = 4
    train_on: str = ""  # the training year: CV, the out-of-fold figures, the cross-year student
    test_on: str = ""  # the test year: read once, at the end
    # the candidates: name -> the orders each training list is seen in (the first stage's alone: the students as shipped)
    augmentations: dict[str, list[str]] = field(default_factory=lambda: {
        "first-stage only": ["first-stage"], "first-stage + 3 shuffles": ["first-stage", "shuffled:0", "shuffled:1", "shuffled:2"]})
    shuffles: list[str] = field(default_factory=lambda: ["shuffled:0", "shuffled:1", "shuffled:2"])  # measured, undeclared
    students: list[StudentSpec] = field(default_factory=list)
    cv_folds: int = 5
    folds: int = 5  # out-of-fold figures on train_on
    rel: int = 2
    bootstrap: int = 2000
    seed: int = 0
    ship: bool = True  # re-make each student's folder (hllm/assets/NAME) with the chosen augmentation
    recorded_in: str | None = "reports/real_data.csv"  # where each student's `recorded` figure is read
    report_to: str | None = "reports/order.md"

    def __post_init__(self) -> None:
        for name, orders in self.augmentations.items():
            [InputOrder.parse(o) for o in orders]
            if not orders:
                raise ValueError(f"augmentation {name!r}: at least one order")
        if any(InputOrder.parse(o).declared for o in self.shuffles):
            raise ValueError("shuffles: orders that are not the first stage's (they are measured undeclared)")


class OrderedStates:
    """Each (collection, order)'s slates and cached item states, computed once."""

    def __init__(self, cfg: OrderConfig, ranker: SinglePassRanker):
        self.cfg, self.ranker = cfg, ranker
        self._slates: dict[str, list[RerankRequest]] = {}
        self._items: dict[tuple[str, InputOrder], list[StateSlate]] = {}

    def slates(self, path: str) -> list[RerankRequest]:
        if path not in self._slates:
            self._slates[path] = read_slates("beir", path, top_n=self.cfg.top_n)
        return self._slates[path]

    def items(self, path: str, order: InputOrder) -> list[StateSlate]:
        if (path, order) not in self._items:
            slates = [reorder(s, order) for s in self.slates(path)]
            name = collection_name(path)
            directory = Path(self.cfg.output_dir) / "states" / f"{name}-{order.kind}{order.seed if order.kind == 'shuffled' else ''}-{states_key(self.ranker.cfg, slates)}"
            t0 = time.perf_counter()
            computed: list[int] = []

            def progress(done: int, total: int, seconds: float) -> None:
                computed.append(done)
                log.info("  %s %s: %d/%d state shards (%.0fs)", name, order, done, total, seconds)

            states = cached_states(self.ranker, slates, directory, self.cfg.shard_slates, progress=progress)
            seconds = time.perf_counter() - t0
            log.info("%s in %s order: %d queries, states ready in %.0fs", name, order, len(slates), seconds)
            if computed:  # what computing them cost, kept for the report (a later run reads them from the cache)
                record_seconds(Path(self.cfg.output_dir) / "states" / SECONDS_FILE, directory.name, len(slates), len(computed), seconds)
            self._items[path, order] = [StateSlate(s, x) for s, x in zip(slates, states)]
        return self._items[path, order]


SECONDS_FILE = "seconds.json"


def record_seconds(path: Path, folder: str, prompts: int, shards: int, seconds: float) -> None:
    """Adds what one states folder's computation cost to `path` ({folder: {prompts, shards, seconds}}), summed over resumes."""
    table = json.loads(path.read_text()) if path.is_file() else {}
    old = table.get(folder, {"shards": 0, "seconds": 0.0})
    table[folder] = {"prompts": prompts, "shards": old["shards"] + shards, "seconds": old["seconds"] + seconds}
    path.write_text(json.dumps(table, indent=2))


def compute_all(cfg: OrderConfig, data: OrderedStates) -> None:
    for order in cfg.orders:
        for path in cfg.collections:
            data.items(path, InputOrder.parse(order))
    for entry in cfg.extra:
        path, _, order = entry.rpartition("@")
        data.items(path, InputOrder.parse(order))


class StudentViews:
    """A student's view of the cached states: its pooling's columns, its target (the teacher's ranking, by id)."""

    def __init__(self, cfg: OrderConfig, spec: StudentSpec, data: OrderedStates, student: SinglePassRanker):
        self.cfg, self.spec, self.data = cfg, spec, data
        self.pooling = student.cfg.pooling
        mine, cached = student.cfg, cfg.ranker
        if (mine.model, mine.state_layer, mine.prompt) != (cached.model, cached.state_layer, cached.prompt) \
                or not set(POOLINGS[self.pooling]) <= set(POOLINGS[cached.pooling]):
            raise ValueError(f"student {spec.name} ({spec.folder}) reads other states than these: its model, cut "
                             f"(layer {mine.state_layer}), prompt and pooling ({self.pooling}) must be the recipe's ranker's "
                             f"(layer {cached.state_layer}, pooling {cached.pooling})")
        self._views: dict[tuple[str, InputOrder], list[StateSlate]] = {}

    def items(self, path: str, order: InputOrder) -> list[StateSlate]:
        if (path, order) not in self._views:
            base = self.data.items(path, order)
            width = base[0].states.shape[1] // len(POOLINGS[self.cfg.ranker.pooling])
            cols = state_columns(self.cfg.ranker.pooling, self.pooling, width)
            utility: list[list[float] | None] = [None] * len(base)
            if self.spec.target == "teacher" and path in {self.cfg.train_on, *self.spec.ship_on}:  # fitted on: its target
                rankings, cov = external_rankings("run", self.spec.teacher_rankings, [i.slate for i in base])
                if cov.uncovered or cov.missing_ids:
                    raise ValueError(f"student {self.spec.name}: the teacher leaves {cov.uncovered} queries unranked and "
                                     f"{cov.missing_ids} candidates out in {collection_name(path)}")
                utility = [teacher_grades(r.permutation, self.spec.teacher_depth) for r in rankings]
            self._views[path, order] = [StateSlate(i.slate, i.states[:, cols], None, u) for i, u in zip(base, utility)]
        return self._views[path, order]


def ndcg_by_query(items: list[StateSlate], orders: list[list[int]]) -> np.ndarray:
    """(judged queries,) nDCG@10 of each judged list, in the items' order."""
    values = ndcg10_per_list([i.slate for i in items], orders)
    return values[~np.isnan(values)]


@dataclass(frozen=True)
class Choice:
    """What cross-validation over training queries chose for one augmentation."""

    augmentation: str
    ridge_lambda: float
    prior_scale: float
    cv_undeclared: float  # mean held-out nDCG@10 over the shuffles, no declared order
    cv_declared: float  # mean held-out nDCG@10, the first-stage order declared
    cv_first_stage: float


class AugmentedFitter:
    """Fits a student's closed-form probe on some queries in some orders, and ranks others, from cached states."""

    def __init__(self, cfg: OrderConfig, spec: StudentSpec, views: StudentViews, student: SinglePassRanker):
        self.cfg, self.spec, self.views, self.student = cfg, spec, views, student
        self.shuffles = [InputOrder.parse(o) for o in cfg.shuffles]

    def training(self, path: str, index: list[int], augmentation: str) -> list[StateSlate]:
        return [self.views.items(path, InputOrder.parse(o))[i] for o in self.cfg.augmentations[augmentation] for i in index]

    def ranked(self, items: list[StateSlate], declared: bool) -> tuple[list[np.ndarray], list[list[int]]]:
        matrices = score_state_slates(self.student, items, first_stage_order=declared)
        return matrices, decode_orders(matrices)

    def score(self, path: str, index: list[int], order: InputOrder, declared: bool) -> np.ndarray:
        items = [self.views.items(path, order)[i] for i in index]
        return ndcg_by_query(items, self.ranked(items, declared)[1])

    def choose(self, path: str, index: list[int], augmentation: str, rule: str) -> Choice:
        """(L2 weight, prior scale) by CV over the queries `index` of `path`. rule `text`: the L2 weight that ranks best
        with no declared order (mean over the shuffles), then the prior scale best with the order declared; rule
        `declared`: both by the declared order's score (how the students were chosen before)."""
        ids = [self.views.items(path, FIRST_STAGE)[i].slate.slate_id for i in index]
        lams, scales = self.spec.ridge_lambdas, self.spec.prior_scales
        undeclared: dict[float, list[float]] = {lam: [] for lam in lams}
        declared: dict[tuple[float, float], list[float]] = {(lam, sc): [] for lam in lams for sc in scales}
        first: list[float] = []
        with self.unguarded():
            for train, held in query_folds(len(index), ids, self.cfg.cv_folds):
                tr, he = [index[i] for i in train], [index[i] for i in held]
                first.append(float(ndcg_by_query([self.views.items(path, FIRST_STAGE)[i] for i in he],
                                                 [list(range(len(self.views.items(path, FIRST_STAGE)[i].slate.candidates))) for i in he]).mean()))
                for lam, (w, b) in zip(lams, ridge_utilities(self.training(path, tr, augmentation), lams)):
                    set_utility(self.student, w, b, 1.0)
                    undeclared[lam].append(float(np.mean([self.score(path, he, o, False).mean() for o in self.shuffles])))
                    for sc in scales:
                        set_utility(self.student, w, b, sc)
                        declared[lam, sc].append(float(self.score(path, he, FIRST_STAGE, True).mean()))
        mean_u = {lam: float(np.mean(v)) for lam, v in undeclared.items()}
        mean_d = {key: float(np.mean(v)) for key, v in declared.items()}
        if rule == "text":  # ties: more shrinkage; then more prior
            lam = max(lams, key=lambda x: (round(mean_u[x], 6), x))
            sc = max(scales, key=lambda x: (round(mean_d[lam, x], 6), x))
        else:
            lam, sc = max(mean_d, key=lambda key: (round(mean_d[key], 6), key[0], key[1]))
        return Choice(augmentation, lam, sc, mean_u[lam], mean_d[lam, sc], float(np.mean(first)))

    def fit(self, training: list[StateSlate], choice: Choice) -> None:
        w, b = ridge_utilities(training, [choice.ridge_lambda])[0]
        set_utility(self.student, w, b, choice.prior_scale)

    def unguarded(self):
        guard = getattr(self.student.head, "guard", None)
        return guard.suspended() if guard is not None else contextlib.nullcontext()


SERVED = "shuffled, as served"  # undeclared: read in the canonical order, whatever the arrival order
ARRIVED = "shuffled, read as they arrived"  # the ablation: each shuffle's causal prompt in its own order


def served_orders(fitter: AugmentedFitter, path: str, index: list[int], order: InputOrder) -> list[list[int]]:
    """The queries `index` of `path` arriving in `order`, undeclared, as the served path ranks them: each list read in
    its canonical order (one prompt per set: the canonical order's cached states) -> orders as indices into the list as
    it arrived. Checks that the list's canonical reading is the cached prompt's, text for text (documents of identical
    text keep their arrival order among themselves: the same prompt, their ids in other places)."""
    canonical = [fitter.views.items(path, CANONICAL)[i] for i in index]
    ranked = fitter.ranked(canonical, False)[1]
    out = []
    for i, c, o in zip(index, canonical, ranked):
        arrived = fitter.views.items(path, order)[i].slate
        texts = [d.shown for d in arrived.candidates]
        read = CANONICAL.permutation(len(texts), arrived.slate_id, texts)  # prompt position -> index as it arrived
        if [texts[k] for k in read] != [d.shown for d in c.slate.candidates]:
            raise RuntimeError(f"{collection_name(path)} {arrived.slate_id}: its {order} list reads as another prompt")
        out.append([read[j] for j in o])
    return out


def robustness(fitter: AugmentedFitter, path: str, index: list[int], orders: list[InputOrder], cfg: OrderConfig) -> dict[str, Any]:
    """The fitted student on the queries `index` of `path`, each figure with its bootstrap interval: the first stage's
    own; the first stage's order declared; undeclared as served (every order read in its canonical order), per order
    and over the shuffles (mean, spread); and, for the ablation, each order read as it arrived (the causal prompt in
    the arrival order, what the reading in the canonical order replaces)."""
    first_items = [fitter.views.items(path, FIRST_STAGE)[i] for i in index]
    rows: dict[str, Any] = {}

    def row(values: np.ndarray) -> dict[str, Any]:
        lo, hi = mean_ci(values, cfg.bootstrap, cfg.seed)
        return {"nDCG@10": float(values.mean()), "ci95": [lo, hi], "queries": len(values)}

    def itself(items: list[StateSlate]) -> np.ndarray:
        return ndcg_by_query(items, [list(range(len(i.slate.candidates))) for i in items])

    scored: dict[tuple[InputOrder, str], np.ndarray] = {}  # (order, how) -> (queries,) nDCG@10, each computed once

    def served(order: InputOrder) -> np.ndarray:
        if (order, "as served") not in scored:
            items = [fitter.views.items(path, order)[i] for i in index]
            scored[order, "as served"] = ndcg_by_query(items, served_orders(fitter, path, index, order))
        return scored[order, "as served"]

    def arrived(order: InputOrder) -> np.ndarray:
        if (order, "read as it arrived") not in scored:
            scored[order, "read as it arrived"] = fitter.score(path, index, order, False)
        return scored[order, "read as it arrived"]

    rows["first stage"] = row(itself(first_items))
    rows["first-stage, declared"] = row(fitter.score(path, index, FIRST_STAGE, True))
    rows["first-stage, as served"] = row(served(FIRST_STAGE))
    rows["first-stage, read as it arrived"] = row(arrived(FIRST_STAGE))
    for order in orders:
        if order not in (FIRST_STAGE, CANONICAL):
            rows[f"{order} (the order itself)"] = row(itself([fitter.views.items(path, order)[i] for i in index]))
            rows[f"{order}, as served"] = row(served(order))
            rows[f"{order}, read as it arrived"] = row(arrived(order))
    for name, how in ((SERVED, "as served"), (ARRIVED, "read as it arrived")):
        figures = [rows[f"{o}, {how}"]["nDCG@10"] for o in fitter.shuffles]
        per_query = np.mean([(served if how == "as served" else arrived)(o) for o in fitter.shuffles], axis=0)  # (queries,)
        rows[f"{name} (mean of the shuffles)"] = {**row(per_query), "spread": max(figures) - min(figures)}
    return rows


def available(data: OrderedStates, path: str, cfg: OrderConfig) -> list[InputOrder]:
    """The orders whose states `path` has (computed or configured)."""
    orders = [InputOrder.parse(o) for o in cfg.orders]
    orders += [InputOrder.parse(e.rpartition("@")[2]) for e in cfg.extra if e.rpartition("@")[0] == path]
    return orders


RULES = {"text": "L2 by the undeclared CV score, prior scale by the declared", "declared": "both by the declared CV score (as shipped before)"}


def recorded_figure(cfg: OrderConfig, spec: StudentSpec) -> dict[str, Any] | None:
    """The student's cross-year nDCG@10 on test_on as recorded before this recipe (`spec.recorded` in `cfg.recorded_in`)."""
    if not (spec.recorded and cfg.recorded_in):
        return None
    split, method, teacher = (spec.recorded.split("/") + [""])[:3]
    want = {"collection": collection_name(cfg.test_on), "split": split, "method": method, "teacher": teacher}
    with open(cfg.recorded_in, newline="") as f:
        rows = [r for r in csv.DictReader(f) if all((r.get(k) or "") == v for k, v in want.items())]
    if len(rows) != 1:
        raise ValueError(f"student {spec.name}: {len(rows)} rows of {cfg.recorded_in} match {want} (want one)")
    return {"nDCG@10": float(rows[0]["nDCG@10"]), "queries": int(rows[0]["queries"]),
            "source": f"{cfg.recorded_in}: " + ", ".join(v for v in want.values() if v)}


def student_report(cfg: OrderConfig, spec: StudentSpec, data: OrderedStates) -> dict[str, Any]:
    """One student: every (augmentation, rule) chosen on train_on by CV, out of fold on train_on and cross-year on
    test_on; the shipped choice; the in-sample bound on test_on's shuffles; the student re-made (`cfg.ship`)."""
    student = SinglePassRanker.load(spec.folder)
    student.eval()
    views = StudentViews(cfg, spec, data, student)
    fitter = AugmentedFitter(cfg, spec, views, student)
    n_train, n_test = len(data.slates(cfg.train_on)), len(data.slates(cfg.test_on))
    train_all, test_all = list(range(n_train)), list(range(n_test))
    ids = [s.slate_id for s in data.slates(cfg.train_on)]
    outer = query_folds(n_train, ids, cfg.folds, FOLD_SALT)
    variants = [(a, r) for a in cfg.augmentations for r in (("text", "declared") if len(cfg.augmentations[a]) == 1 else ("text",))]
    out: dict[str, Any] = {"student": spec.name, "variants": {}, "recorded": recorded_figure(cfg, spec)}
    guard = getattr(student.head, "guard", None) is not None
    for aug, rule in variants:
        key = f"{aug} / {rule}"
        t0 = time.perf_counter()
        oof_matrices: dict[str, list] = {}
        oof = {"first stage": [], "declared": [], "as served": [], "read as it arrived": []}
        for f, (train, held) in enumerate(outer):
            choice = fitter.choose(cfg.train_on, train, aug, rule)
            fitter.fit(fitter.training(cfg.train_on, train, aug), choice)
            if guard:
                fit_guard(student, fitter.training(cfg.train_on, train, aug), max(cfg.cv_folds, 2))
            first = [views.items(cfg.train_on, FIRST_STAGE)[i] for i in held]
            oof["first stage"].append(ndcg_by_query(first, [list(range(len(i.slate.candidates))) for i in first]))
            oof["declared"].append(fitter.score(cfg.train_on, held, FIRST_STAGE, True))
            served = [views.items(cfg.train_on, CANONICAL)[i] for i in held]  # any arrival order reads as this
            oof["as served"].append(ndcg_by_query(served, fitter.ranked(served, False)[1]))
            oof["read as it arrived"].append(np.mean([fitter.score(cfg.train_on, held, o, False) for o in fitter.shuffles], axis=0))
            for order, declared in [(FIRST_STAGE, True)] + [(o, False) for o in fitter.shuffles]:
                items = [views.items(cfg.train_on, order)[i] for i in held]
                mats, orders = fitter.ranked(items, declared)
                bucket = oof_matrices.setdefault(f"{order}/{declared}", [None] * n_train)
                for i, m, o in zip(held, mats, orders):
                    bucket[i] = (m, o, views.items(cfg.train_on, order)[i].slate.grades)
        choice = fitter.choose(cfg.train_on, train_all, aug, rule)
        fitter.fit(fitter.training(cfg.train_on, train_all, aug), choice)
        if guard:
            fit_guard(student, fitter.training(cfg.train_on, train_all, aug), max(cfg.cv_folds, 2))
        cross = robustness(fitter, cfg.test_on, test_all, available(data, cfg.test_on, cfg), cfg)
        out["variants"][key] = {
            "augmentation": aug, "orders": cfg.augmentations[aug], "rule": RULES[rule], "choice": dataclasses.asdict(choice),
            "out_of_fold": {k: float(np.concatenate(v).mean()) for k, v in oof.items()}, "cross_year": cross,
            "seconds": time.perf_counter() - t0}
        out["variants"][key]["_oof_matrices"] = oof_matrices
        log.info("%s, %s: CV undeclared %.4f declared %.4f (L2 %g, prior %g) | out of fold: first stage %.4f, declared %.4f, "
                 "as served %.4f, read as it arrived %.4f | cross-year: shuffled as served %.4f (spread %.4f), read as they "
                 "arrived %.4f (spread %.4f), declared %.4f, first stage %.4f (%.0fs)",
                 spec.name, key, choice.cv_undeclared, choice.cv_declared, choice.ridge_lambda, choice.prior_scale,
                 *(out["variants"][key]["out_of_fold"][k] for k in ("first stage", "declared", "as served", "read as it arrived")),
                 *(cross[f"{name} (mean of the shuffles)"][k] for name in (SERVED, ARRIVED) for k in ("nDCG@10", "spread")),
                 cross["first-stage, declared"]["nDCG@10"], cross["first stage"]["nDCG@10"], time.perf_counter() - t0)
    # the shipped choice, on training-query CV alone: the best undeclared CV score among the augmentations whose declared
    # CV score stays within 0.005 of the students as shipped before (first stage only, declared rule)
    before = out["variants"][f"{next(iter(cfg.augmentations))} / declared"]["choice"]["cv_declared"]
    eligible = [k for k, v in out["variants"].items() if v["choice"]["cv_declared"] >= before - 0.005] or list(out["variants"])
    chosen = max(eligible, key=lambda k: out["variants"][k]["choice"]["cv_undeclared"])
    out["chosen"] = chosen
    out["before"] = f"{next(iter(cfg.augmentations))} / declared"
    # what limits it: the probe fitted on test_on's own lists in the chosen orders, to their own judgments (whatever the
    # student's target: the measure's), scored on them as served (in sample, every L2 of the grid: the most a linear
    # read-out of these frozen states reaches on these very lists)
    v = out["variants"][chosen]
    canonical = [views.items(cfg.test_on, CANONICAL)[i] for i in test_all]
    judged = [StateSlate(i.slate, i.states) for i in fitter.training(cfg.test_on, test_all, v["augmentation"])]
    bound = {}
    for lam in spec.ridge_lambdas:
        fitter.fit(judged, Choice(**{**v["choice"], "ridge_lambda": lam}))
        bound[lam] = float(ndcg_by_query(canonical, fitter.ranked(canonical, False)[1]).mean())
    best = max(bound, key=bound.get)
    out["in_sample_bound"] = {"what": f"fitted on every {collection_name(cfg.test_on)} query in the orders of {v['augmentation']!r} "
                                      "to its judgments, scored on the same queries as served (undeclared), the best L2 of the grid "
                                      f"({best:g}; by L2: " + ", ".join(f"{k:g} {x:.4f}" for k, x in bound.items()) + ")",
                              "nDCG@10": bound[best]}
    if cfg.ship:
        out["shipped"] = ship(cfg, spec, fitter, out)
    for v in out["variants"].values():
        v.pop("_oof_matrices")
    return out


def ship(cfg: OrderConfig, spec: StudentSpec, fitter: AugmentedFitter, out: dict[str, Any]) -> dict[str, Any]:
    """The chosen variant fitted on `spec.ship_on` and saved over the student's folder: its head (and guard), cascade
    thresholds, calibration; its model card's figures and provenance rewritten (the run before it kept in provenance)."""
    student, views = fitter.student, fitter.views
    v = out["variants"][out["chosen"]]
    aug = v["augmentation"]
    training = [i for path in spec.ship_on for i in fitter.training(path, list(range(len(fitter.views.data.slates(path)))), aug)]
    first = [i for path in spec.ship_on for i in views.items(path, FIRST_STAGE)]
    if spec.ship_on == [cfg.train_on]:
        choice = Choice(**v["choice"])
    else:  # CV over the shipped queries, grouped by collection (query ids are unique across the TREC years)
        choice = _choose_many(fitter, spec.ship_on, aug, "text" if out["chosen"].endswith("/ text") else "declared")
    fitter.fit(training, choice)
    record: dict[str, Any] = {"augmentation": aug, "orders": cfg.augmentations[aug], **dataclasses.asdict(choice),
                              "train_queries": len(first), "train_lists": len(training)}
    if getattr(student.head, "guard", None) is not None:
        record["guard"] = fit_guard(student, training, max(cfg.cv_folds, 2))
    folder = Path(spec.folder)
    old_provenance = json.loads((folder / "provenance.json").read_text())
    if spec.cascade_from == "in-sample":
        thresholds = CascadeThresholds.fit(state_confidence(student, first), f"{' + '.join(collection_name(p) for p in spec.ship_on)}: "
                                           f"the queries it was fitted on (in sample, first-stage order declared)")
    else:
        mats = v["_oof_matrices"][f"{FIRST_STAGE}/True"]
        thresholds = CascadeThresholds.fit([confidence(m, np.array(o)) for m, o, _ in mats],
                                           f"{collection_name(cfg.train_on)}, out of fold ({len(mats)} queries, first-stage order "
                                           f"declared, each scored by the head of the other folds)")
    calibrator = None
    if spec.calibrate:  # from out-of-fold matrices of every order measured: declared first stage and undeclared shuffles
        rows = [r for bucket in v["_oof_matrices"].values() for r in bucket]
        calibrator = fit_calibrator([m for m, _, _ in rows], [o for _, o, _ in rows], [g for _, _, g in rows], cfg.rel)
    cross = v["cross_year"]
    figures = {"trained_on": collection_name(cfg.train_on), "measured_on": collection_name(cfg.test_on),
               "queries": cross["first stage"]["queries"],
               "shuffled_input_nDCG@10": cross[f"{SERVED} (mean of the shuffles)"]["nDCG@10"],
               "shuffled_input_spread": cross[f"{SERVED} (mean of the shuffles)"]["spread"],
               "read_as_arrived_nDCG@10": cross[f"{ARRIVED} (mean of the shuffles)"]["nDCG@10"],
               "read_as_arrived_spread": cross[f"{ARRIVED} (mean of the shuffles)"]["spread"],
               "declared_order_nDCG@10": cross["first-stage, declared"]["nDCG@10"],
               "first_stage_nDCG@10": cross["first stage"]["nDCG@10"],
               "what": "cross-year: the same recipe fitted on the training year only, measured on the test year's BM25 top "
                       f"{cfg.top_n}; shuffled input = mean over {len(cfg.shuffles)} fixed shuffles per query, no order declared "
                       "(each read in its canonical order, as served); read as arrived = the same shuffles' prompts in their "
                       "own order (the ablation)"}
    card = read_model_card(folder)
    kept = {k: v for k, v in card.figures.items() if k not in STALE}
    figures_now = {**kept, "fit": {"method": "ridge probe (closed form)", "l2": choice.ridge_lambda, "prior_scale": choice.prior_scale,
                                   "augmentation": cfg.augmentations[aug]},
                   "input_order": figures, "out_of_fold": {"collection": collection_name(cfg.train_on), **v["out_of_fold"]},
                   "measured_before_augmentation": {k: card.figures[k] for k in STALE if k in card.figures},
                   **({"guard": record["guard"]} if "guard" in record else {})}
    card = dataclasses.replace(card, figures=figures_now, input=(
        "a set of documents in any order (ranked by their text); or, declared (first_stage_order=true), a first-stage "
        "ranking, best first, whose ranks the head's prior then reads"))
    ship_student(folder, student, card, thresholds, "python -m hllm.recipes.order --config <the recipe below>", to_dict(cfg),
                 calibrator, fit=record, input_order=figures, refined_from={"made_by": old_provenance.get("made_by"),
                                                                           "recipe": old_provenance.get("recipe")})
    log.info("shipped %s to %s: %s, L2 %g, prior %g", spec.name, folder, aug, choice.ridge_lambda, choice.prior_scale)
    return record


# figures of the head before it was re-made, kept in its card under measured_before_augmentation (not re-measured here)
STALE = ("transfer", "guard", "teacher_folds", "cross_year", "relevance_score", "cv_nDCG@10", "cv_first_stage_nDCG@10")


def _choose_many(fitter: AugmentedFitter, paths: list[str], aug: str, rule: str) -> Choice:
    """`AugmentedFitter.choose` over several collections' queries at once (their items concatenated under one path key)."""
    joint = "+".join(paths)
    for order in {InputOrder.parse(o) for o in fitter.cfg.augmentations[aug]} | {FIRST_STAGE, *fitter.shuffles}:
        fitter.views._views[joint, order] = [i for p in paths for i in fitter.views.items(p, order)]
    n = sum(len(fitter.views.data.slates(p)) for p in paths)
    return fitter.choose(joint, list(range(n)), aug, rule)


def run(cfg: OrderConfig) -> dict[str, Any]:
    ranker = start_recipe(cfg)
    data = OrderedStates(cfg, ranker)
    compute_all(cfg, data)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"config": to_dict(cfg), "date": time.strftime("%Y-%m-%d"),
                              "students": [student_report(cfg, spec, data) for spec in cfg.students]}
    report["seconds"] = time.perf_counter() - t0
    seconds_file = Path(cfg.output_dir) / "states" / SECONDS_FILE
    report["states_seconds"] = json.loads(seconds_file.read_text()) if seconds_file.is_file() else {}
    (Path(cfg.output_dir) / "report.json").write_text(json.dumps(report, indent=2))
    if cfg.report_to:
        Path(cfg.report_to).write_text(markdown(cfg, report))
    return report


def main(argv: list[str] | None = None) -> None:
    cfg = recipe_config(OrderConfig, __doc__, argv, "configs/order/smollm2.yaml")
    t0 = time.perf_counter()
    report = run(cfg)
    for line in headline(report):
        print(line)
    print(f"total {time.perf_counter() - t0:.0f}s; report: {cfg.report_to or Path(cfg.output_dir) / 'report.json'}")


def headline(report: dict[str, Any]) -> list[str]:
    """The issue's lines, one pair per student: its shipped choice, cross-year, as served."""
    lines = []
    for st in report["students"]:
        cross = st["variants"][st["chosen"]]["cross_year"]
        shuffled = cross[f"{SERVED} (mean of the shuffles)"]
        lines.append(f"shuffled input, {st['student']}: {shuffled['nDCG@10']:.4f} | first stage {cross['first stage']['nDCG@10']:.4f} "
                     f"| declared order {cross['first-stage, declared']['nDCG@10']:.4f}")
        lines.append(f"order spread, {st['student']}: {shuffled['spread']:.4f}")
    return lines


def markdown(cfg: OrderConfig, report: dict[str, Any]) -> str:
    """reports/order.md: the issue's lines, the goals met or not, per student the shipped variant's figures by input
    order, the ablation over every variant, what limits it; how the states were made and what they cost."""
    train, test = collection_name(cfg.train_on), collection_name(cfg.test_on)
    r = cfg.ranker
    f4 = lambda x: f"{x:.4f}"  # noqa: E731
    cell = lambda row: f"{row['nDCG@10']:.4f} [{row['ci95'][0]:.4f}, {row['ci95'][1]:.4f}]"  # noqa: E731
    yes = lambda ok: "yes" if ok else "**no**"  # noqa: E731
    seconds = report.get("states_seconds", {})
    prompts, spent = sum(v["prompts"] for v in seconds.values()), sum(v["seconds"] for v in seconds.values())
    n_test = report["students"][0]["variants"][report["students"][0]["chosen"]]["cross_year"]["first stage"]["queries"]
    served, arrived = f"{SERVED} (mean of the shuffles)", f"{ARRIVED} (mean of the shuffles)"
    lines = [
        "# Students that read: the candidates' input order (issue #54)", "",
        f"One run of `python -m hllm.recipes.order --config configs/order/smollm2.yaml` on {report['date']} "
        f"({report['seconds']:.0f} s on this machine's 2 CPU cores after the states). {r.model.preset} frozen, cut after "
        f"decoder layer {r.state_layer}, prompt `{r.prompt.template}` with each query's whole first-stage top {cfg.top_n} in "
        f"one prompt (passages cut to {r.prompt.max_doc_tokens} tokens); each student is its closed-form probe over the "
        "cached item states, so only its head is re-fitted. A state depends on where its passage sat in the causal prompt: "
        f"every order is its own prefill. States: {prompts} prompts (every query of "
        f"{', '.join(map(collection_name, cfg.collections))} in {len(cfg.orders)} orders"
        + "".join(f", {collection_name(e.rpartition('@')[0])} {e.rpartition('@')[2]}" for e in cfg.extra)
        + f"), computed once in {spent / 60:.0f} min ({spent / max(prompts, 1):.1f} s a prompt; "
        f"`{Path(cfg.output_dir) / 'states'}`).", "",
        "**How a set is read.** With no order declared, the served path (`Reranker.encode`, every HTTP route, `hllm "
        "rerank --undeclared`) puts the documents in their *canonical order* — sorted by a hash of each text "
        "(`hllm.data.order.canonical_order`) — builds the one prompt from that and maps the answer back. Every arrival "
        "order of the same documents is the same prompt, so the same ranking: the order it arrived in cannot leak into "
        "the answer, not even through the causal reading. *As served* figures rank each shuffle that way (checked per "
        "query: its canonical reading is the cached prompt, text for text); *read as it arrived* figures rank the "
        "causal prompt of the arrival order itself — the ablation, what the canonical reading replaces. One thing still "
        "follows the arrival order: passages of identical text (MS MARCO v2 holds exact duplicates under different ids, "
        "not always judged alike) keep their arrival order among themselves — the same prompt and the same ranking of "
        "texts, but which copy's id sits higher can change, and with it nDCG@10. That is the whole of the spread as "
        "served below.", "",
        f"Every figure is nDCG@10 (graded qrels, rel >= {cfg.rel}), the mean over the judged queries stated, with a 95% "
        f"percentile bootstrap interval over queries ({cfg.bootstrap} resamples, scipy.stats.bootstrap). **Shuffled**: the "
        f"mean over {len(cfg.shuffles)} fixed shuffles per query ({', '.join(cfg.shuffles)}: `hllm.data.order.InputOrder`, "
        "a per-query permutation seeded by the query id), no order declared (the first-stage prior is off; the ranking is "
        "the text's alone). **Declared**: the BM25 order, declared (`first_stage_order=true`: the prior reads the ranks). "
        f"**First stage**: the BM25 order itself. Cross-year: fitted on {train} (its queries choose every setting by "
        f"{cfg.cv_folds}-fold CV), measured on {test} ({n_test} queries), read once at the end. Out of fold: {train}'s "
        f"queries in {cfg.folds} folds by query hash (the teacher-folds of `hllm.recipes.realtext`), every query tested "
        "once by a head fitted on the others.", "",
        "## The lines", "", "```text", *headline(report), "```", "",
        f"(cross-year: the student fitted on {train}, measured on {test}, shuffled input as served; the name as "
        "`Reranker.load` takes it.)", "",
        "## The goals", "",
        "| student | shuffled, as served | first stage − 0.005 | met | spread over the shuffles | ≤ 0.01 | declared | "
        "before − 0.005 | met | shuffled, read as it arrived (spread) |",
        "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | --- | ---: |"]
    for st in report["students"]:
        cross = st["variants"][st["chosen"]]["cross_year"]
        sh, first, dec = cross[served], cross["first stage"]["nDCG@10"], cross["first-stage, declared"]["nDCG@10"]
        before = (st["recorded"] or {}).get("nDCG@10", st["variants"][st["before"]]["cross_year"]["first-stage, declared"]["nDCG@10"])
        lines.append(f"| {st['student']} | {sh['nDCG@10']:.4f} | {first - 0.005:.4f} | {yes(sh['nDCG@10'] >= first - 0.005)} | "
                     f"{sh['spread']:.4f} | {yes(sh['spread'] <= 0.01)} | {dec:.4f} | {before - 0.005:.4f} | "
                     f"{yes(dec >= before - 0.005)} | {cross[arrived]['nDCG@10']:.4f} ({cross[arrived]['spread']:.4f}) |")
    lines += ["", "*before*: the student's cross-year figure as recorded before this recipe (named under each student "
              "below), first-stage order declared.", ""]
    for st in report["students"]:
        spec = next(s for s in cfg.students if s.name == st["student"])
        v = st["variants"][st["chosen"]]
        c, cross = v["choice"], v["cross_year"]
        target = "its qrels (graded judgments)" if spec.target == "judgments" else \
            f"the teacher's ranking (`{Path(spec.teacher_rankings).name}`, rank r graded {spec.teacher_depth} + 1 − r)"
        lines += [f"## {st['student']}", "",
                  f"Target: {target}, which moves with its documents in every order. Shipped variant: **{st['chosen']}** "
                  f"(each {train} list seen in {', '.join(v['orders'])}; L2 {c['ridge_lambda']:g}, prior scale "
                  f"{c['prior_scale']:g}), chosen on {train}'s queries alone: the best CV score with no declared order "
                  f"({c['cv_undeclared']:.4f}, the mean over the shuffles read as they arrived) among the variants whose "
                  "declared CV score is within 0.005 of the students as shipped before "
                  f"(`{st['before']}`: {st['variants'][st['before']]['choice']['cv_declared']:.4f}). "
                  + (f"Before: {st['recorded']['nDCG@10']:.4f} on {test} ({st['recorded']['source']}). " if st["recorded"] else "")
                  + (f"Re-shipped to `{spec.folder}`, fitted on {st['shipped']['train_queries']} queries "
                     f"({st['shipped']['train_lists']} lists) with L2 {st['shipped']['ridge_lambda']:g}, prior scale "
                     f"{st['shipped']['prior_scale']:g}." if st.get("shipped") else "Not shipped (ship=false)."), "",
                  f"### Cross-year, {test} ({cross['first stage']['queries']} queries): the shipped variant by input order", "",
                  "| input order | the order itself | student, declared | student, as served (undeclared) | "
                  "student, read as it arrived |", "| --- | ---: | ---: | ---: | ---: |",
                  f"| first stage (BM25) | {cell(cross['first stage'])} | {cell(cross['first-stage, declared'])} | "
                  f"{cell(cross['first-stage, as served'])} | {cell(cross['first-stage, read as it arrived'])} |"]
        for key, row in cross.items():
            if key.endswith("(the order itself)"):
                order = key.removesuffix(" (the order itself)")
                lines.append(f"| {order} | {cell(row)} | | {cell(cross[f'{order}, as served'])} | "
                             f"{cell(cross[f'{order}, read as it arrived'])} |")
        lines += [f"| shuffled, mean of {len(cfg.shuffles)} (spread as served {cross[served]['spread']:.4f}, as arrived "
                  f"{cross[arrived]['spread']:.4f}) | | | {cell(cross[served])} | {cell(cross[arrived])} |", "",
                  "### Ablation: every variant, chosen by the same CV", "",
                  f"| variant (orders / choice rule) | L2 | prior | CV undeclared | CV declared | out of fold: first stage | "
                  f"declared | as served | read as it arrived | {test}: declared | shuffled as served | read as they arrived "
                  "(spread) | reversed, as served | s |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for key, var in st["variants"].items():
            ch, oof, cy = var["choice"], var["out_of_fold"], var["cross_year"]
            rev = cy.get("reversed, as served", {}).get("nDCG@10")
            lines.append(f"| {key}{' (shipped)' if key == st['chosen'] else ''} | {ch['ridge_lambda']:g} | {ch['prior_scale']:g} | "
                         f"{f4(ch['cv_undeclared'])} | {f4(ch['cv_declared'])} | {f4(oof['first stage'])} | {f4(oof['declared'])} | "
                         f"{f4(oof['as served'])} | {f4(oof['read as it arrived'])} | {f4(cy['first-stage, declared']['nDCG@10'])} | "
                         f"{f4(cy[served]['nDCG@10'])} | {f4(cy[arrived]['nDCG@10'])} ({f4(cy[arrived]['spread'])}) | "
                         f"{'' if rev is None else f4(rev)} | {var['seconds']:.0f} |")
        rules = "; ".join(f"`{k}`: {v}" for k, v in RULES.items())
        bound = st["in_sample_bound"]
        lines += ["", f"Choice rules: {rules}. CV undeclared: the mean over the shuffles, read as they arrived ({len(cfg.shuffles)} "
                  "draws of a reading order per held-out query; the canonical order is one more such draw). Out of fold: "
                  f"{train}, {cfg.folds} folds, the mean over every query.", "",
                  "### What limits it", "",
                  f"In-sample bound: {bound['what']}: **{bound['nDCG@10']:.4f}** (first stage "
                  f"{cross['first stage']['nDCG@10']:.4f}, the shipped variant as served {cross[served]['nDCG@10']:.4f}): about "
                  "the most a linear read-out of these frozen states reaches on these lists, fitted on them. "
                  + ("It is below the first stage: the states carry too little of the ranking once the order is gone, and "
                     "no fit of the head can close the gap; the backbone's reading must (LoRA, a larger model)."
                     if bound["nDCG@10"] < cross["first stage"]["nDCG@10"] else
                     "It is above the first stage, so the states do hold more of these lists' ranking than BM25 does; what "
                     f"falls short is a read-out learnt on {train}'s queries carried to other queries (out of fold on "
                     f"{train}, as served: {v['out_of_fold']['as served']:.4f} against its first stage "
                     f"{v['out_of_fold']['first stage']:.4f}). A bound fitted in sample is loose (the read-out has one "
                     "weight per state dimension, 576 to 1,152), so read it as an upper limit, not a promise: more judged (or teacher-ranked) "
                     "queries and a backbone adapted to read them (LoRA) are what the gap asks for, not another head "
                     "setting."), ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
