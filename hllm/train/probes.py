"""Closed-form probes over cached states on real text: what the real-text recipes share.

A recipe (`hllm.recipes.realtext`, `adaptation`, `order`) reads a collection's lists, caches each
query's item states once, and fits a utility probe (or the attention head) over them from the judgments, a teacher's
rankings or both, its settings chosen by cross-validation over training queries. This module holds the parts more than
one of them (and the benchmarks that measure them) use: the outer folds' salt, a teacher's ranking as graded targets,
the per-variant fitter over cached states, the shipped probe's own recipe read back from its folder, and the cascade
thresholds a shipped probe carries.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from hllm.config import from_dict
from hllm.data.readers import collection_name, read_slates
from hllm.model.backbones import PROVENANCE
from hllm.model.card import CONFIG_FILE
from hllm.model.confidence import CascadeThresholds, confidence
from hllm.model.heads import HeadConfig
from hllm.model.item_states import POOLINGS, Pooling
from hllm.model.ranker import RankerConfig, SinglePassRanker
from hllm.records import RerankRequest
from hllm.uris import resolve_model_uri
from hllm.teacher.external import external_rankings
from hllm.train.head_fit import (StateSlate, cv_ridge, cv_sgd, fit_guard, guard_trust, guarded_matrices, ridge_utility,
                                 score_state_slates, set_utility, state_confidence)
from hllm.train.loop import LossConfig, TrainConfig
from hllm.train.state_cache import cached_layer_states, layer_key

log = logging.getLogger("hllm")
FOLD_SALT = "teacher-folds/"  # the outer folds' hash differs from the inner CV's (hllm.train.head_fit.query_folds)
TARGET_LOSS = {"teacher": {"sinkhorn_ce": 1.0}, "judgments": {"graded_ce": 1.0}, "both": {"sinkhorn_ce": 1.0, "graded_ce": 1.0}}


@dataclass
class TeacherRun:
    name: str  # in the report, e.g. rankvicuna-7b
    rankings: str  # the teacher's rankings of the collection's queries
    format: str = "run"  # hllm.teacher.external.FORMATS: run, rank_llm, responses


@dataclass
class Variant:
    """One way to fit the student (a row of the ablation, a child run in MLflow)."""

    name: str
    target: Literal["teacher", "judgments", "both"]  # what it learns from
    fit: Literal["ridge", "sgd"] = "ridge"
    layer: int = 16  # read the states after this decoder layer (one of the cached `layers`)
    pooling: Pooling = "last+mean"  # a part of the cached pooling
    loss: dict[str, float] | None = None  # sgd: hllm.train.losses terms (None: TARGET_LOSS[target])
    sample_items: int | None = None  # sgd: sub-slates of this many candidates, the teacher's relative order
    teacher_depth: int | None = None  # ridge target: the teacher's top this many graded (None: the config's)


class ProbeSettings(Protocol):
    """What fitting a variant over cached states reads from a recipe's config (`RealTextConfig` has these fields)."""

    output_dir: str  # the states live in output_dir/states
    ranker: RankerConfig  # the frozen backbone, cut, prompt, the cached pooling; its head's K and domain guard the probes'
    layers: list[int]  # the cached layers
    top_n: int
    shard_slates: int
    cv_folds: int
    ridge_lambdas: list[float]
    prior_scales: list[float]
    teacher_depth: int
    sgd_head: HeadConfig
    train: TrainConfig
    rel: int
    seed: int


def teacher_grades(perm: list[int], depth: int) -> list[float]:
    """Input order -> the teacher's rank r (1-based) graded depth + 1 - r within its top `depth`, 0 below."""
    grades = [0.0] * len(perm)
    for rank, item in enumerate(perm[:depth]):
        grades[item] = float(depth - rank)
    return grades


def state_columns(cached: Pooling, pooling: Pooling, width: int) -> list[int]:
    """The columns of the `pooling` part of states cached with `cached` pooling (each part `width` wide)."""
    parts = POOLINGS[cached]
    return [c for part in POOLINGS[pooling] for c in range(parts.index(part) * width, (parts.index(part) + 1) * width)]


@dataclass
class CachedQuery:
    """One query of a collection: its slate, its states per layer, and each teacher's permutation."""

    slate: RerankRequest
    states: dict[int, torch.Tensor]  # layer -> (N, P * D)
    perms: dict[str, list[int]]  # teacher name -> 0-based permutation, best first


def load_queries(cfg: ProbeSettings, ranker: SinglePassRanker, path: str, teachers: list[TeacherRun],
                 pick: Callable[[list[RerankRequest]], list[RerankRequest]] | None = None) -> tuple[list[CachedQuery], dict]:
    """The collection's slates (`pick`: those it keeps, e.g. a hashed test split) with their cached states (computed
    where missing, always as `cfg.ranker` cuts and pools them: a fitted variant's head on `ranker` changes neither) and
    the teachers' rankings; -> (queries, each teacher's coverage counts). A query a teacher does not
    rank is an error here: the folds compare every method on the same queries."""
    slates = read_slates("beir", path, top_n=cfg.top_n)
    if pick is not None:
        slates = pick(slates)
    name = collection_name(path)
    dirs = {layer: Path(cfg.output_dir) / "states" / f"{name}-{layer_key(cfg.ranker, layer, slates)}" for layer in cfg.layers}
    fitted, ranker.cfg = ranker.cfg, cfg.ranker  # the states of the config's cut and pooling, whatever head `ranker` carries now
    try:
        states = cached_layer_states(ranker, slates, dirs, cfg.shard_slates, progress=lambda done, total, s: log.info(
            "  %s: %d/%d state shards (%.0fs)", name, done, total, s))
    finally:
        ranker.cfg = fitted
    perms, coverage = {}, {}
    for t in teachers:
        rankings, cov = external_rankings(t.format, t.rankings, slates)
        coverage[t.name] = cov.counts()
        if cov.uncovered or cov.missing_ids:
            raise ValueError(f"teacher {t.name}: {cov.uncovered} of {len(slates)} queries unranked, {cov.missing_ids} "
                             f"candidates left out ({cov.examples}); the folds need every query ranked whole")
        perms[t.name] = [r.permutation for r in rankings]
    return [CachedQuery(s, {layer: states[layer][i] for layer in cfg.layers}, {t: p[i] for t, p in perms.items()})
            for i, s in enumerate(slates)], coverage


class VariantFitter:
    """Fits one `Variant` on some queries and ranks others, over the cached states."""

    def __init__(self, cfg: ProbeSettings, ranker: SinglePassRanker, width: int):
        self.cfg, self.ranker, self.width = cfg, ranker, width

    def judged(self, v: Variant, queries: list[CachedQuery]) -> list[StateSlate]:
        """The queries as the variant's head reads them, graded by their qrels (no teacher)."""
        cols = state_columns(self.cfg.ranker.pooling, v.pooling, self.width)
        return [StateSlate(q.slate, q.states[v.layer][:, cols]) for q in queries]  # states (N, P' * D)

    def views(self, v: Variant, teacher: str | None, queries: list[CachedQuery]) -> tuple[list[StateSlate], list[StateSlate]]:
        """-> (what the variant trains on, the same queries as the choice judges them: their qrels)."""
        judge = self.judged(v, queries)
        items = []
        for q, j in zip(queries, judge):
            x = j.states
            perm = q.perms[teacher] if teacher else None
            grades = j.grades(0)  # unjudged as 0, as trec_eval scores them
            utility = None
            depth = v.teacher_depth or self.cfg.teacher_depth
            if v.target == "teacher":
                utility = teacher_grades(perm, depth)
            elif v.target == "both":  # the judged grade (0-3) and the teacher's grade scaled to 0-3
                utility = [g + 3.0 * t / depth for g, t in zip(grades, teacher_grades(perm, depth))]
            items.append(StateSlate(q.slate, x, perm if v.target != "judgments" else None, utility))
        return items, judge

    def head_config(self, v: Variant) -> RankerConfig:
        """A ridge variant's head: `ranker.head` as a utility probe under the logrank prior (its K and domain guard kept)."""
        head = dataclasses.replace(self.cfg.ranker.head, kind="utility", prior="logrank") if v.fit == "ridge" else self.cfg.sgd_head
        return dataclasses.replace(self.cfg.ranker, state_layer=v.layer, pooling=v.pooling, head=head, window=self.cfg.top_n)

    def new_head(self, v: Variant) -> None:
        torch.manual_seed(self.cfg.seed)
        self.ranker.cfg = self.head_config(v)
        self.ranker.head = self.ranker.new_head().to(self.ranker.device)

    def fit(self, v: Variant, teacher: str | None, queries: list[CachedQuery]) -> dict[str, Any]:
        """Fits `ranker.head` on `queries`, its settings chosen by CV over them, then its domain guard (where the head
        has one) on the same queries' states (`fit_guard`: thresholds from their own held-out distances). -> the CV
        record (with `guard`: the guard's thresholds)."""
        items, judge = self.views(v, teacher, queries)
        self.new_head(v)
        if v.fit == "ridge":
            record = cv_ridge(self.ranker, items, judge, self.cfg.cv_folds, self.cfg.ridge_lambdas, self.cfg.prior_scales, self.cfg.rel)
        else:
            loss = LossConfig(v.loss or TARGET_LOSS[v.target])
            train = dataclasses.replace(self.cfg.train, seed=self.cfg.seed)
            record = cv_sgd(self.ranker, items, judge, self.cfg.cv_folds, train, loss, self.cfg.rel, lambda: self.new_head(v),
                            0, v.sample_items)
        if getattr(self.ranker.head, "guard", None) is not None:
            record["guard"] = fit_guard(self.ranker, judge, max(self.cfg.cv_folds, 2))
        return record

    def matrices(self, v: Variant, queries: list[CachedQuery]) -> list[np.ndarray]:
        """The fitted head's (N, K) score matrices of `queries` (whole lists, one pass each), as `Reranker` scores them
        (through the domain guard's support where the head has one)."""
        return guarded_matrices(self.ranker, self.judged(v, queries))

    def unguarded(self, v: Variant, queries: list[CachedQuery]) -> tuple[list[np.ndarray], np.ndarray] | None:
        """With a domain guard: the same head's matrices without it (the ablation) and the trust it gave each query
        ((Q,) in [0, 1]); None without one."""
        guard = getattr(self.ranker.head, "guard", None)
        if guard is None:
            return None
        judged = self.judged(v, queries)
        trust = guard_trust(self.ranker, judged)
        with guard.suspended():
            return score_state_slates(self.ranker, judged), trust

    def confidence_thresholds(self, v: Variant, queries: list[CachedQuery], collections: list[str]) -> CascadeThresholds:
        """The cascade's thresholds of the fitted head from its confidence on `queries` (the ones it was fitted on)."""
        return in_sample_thresholds(self.ranker, self.judged(v, queries), collections)


@dataclass(frozen=True)
class ShippedProbe:
    """How the shipped `smollm2-dl19-rankvicuna` was made, read back from its folder: its ranker config (backbone,
    cut, pooling, prompt, utility head) and the ridge weight and prior scale its recipe's CV chose."""

    ranker: RankerConfig
    ridge_lambda: float
    prior_scale: float

    @classmethod
    def load(cls, name: str = "smollm2-dl19-rankvicuna") -> "ShippedProbe":
        folder = resolve_model_uri(name)
        fit = json.loads((folder / PROVENANCE).read_text())["fit"]
        return cls(from_dict(RankerConfig, json.loads((folder / CONFIG_FILE).read_text())), fit["ridge_lambda"], fit["prior_scale"])

    def fit(self, ranker: SinglePassRanker, items: list[StateSlate]) -> None:
        """Its closed-form probe, refitted on `items`, into `ranker`'s utility head."""
        w, b = ridge_utility(items, self.ridge_lambda)
        set_utility(ranker, w.to(ranker.device), b.to(ranker.device), self.prior_scale)


def oof_thresholds(matrices: list[np.ndarray], orders: list[list[int]], collection: str) -> CascadeThresholds:
    """The cascade's thresholds of a shipped student from its out-of-fold matrices and orders: each query scored by a
    head fitted on the other folds (one that never saw it: like traffic, not like its training queries)."""
    return CascadeThresholds.fit([confidence(m, np.array(o)) for m, o in zip(matrices, orders)],
                                 f"{collection}, out of fold ({len(matrices)} queries, each scored by the heads of the other teacher-folds)")


def in_sample_thresholds(ranker: SinglePassRanker, items: list[StateSlate], collections: list[str]) -> CascadeThresholds:
    """The cascade's thresholds of a student fitted on `items`: its confidence on those very queries. In sample it
    is surer than on new queries, so a share asked of it escalates more of new traffic than that share."""
    return CascadeThresholds.fit(state_confidence(ranker, items), f"{' + '.join(collections)}: the queries it was fitted on (in sample)")
