"""Closed-form probes over cached states on real text: what the real-text recipes share.

A recipe (`hllm.recipes.realtext`, `order`) reads a collection's lists (one first stage's, or several: a list per
first stage and query), caches each list's item states once, and fits a student over them from the judgments, a
teacher's rankings or both: a utility probe in closed form or a head by SGD (settings chosen by cross-validation over
training queries), or LoRA on the top layers over cached prefix states (`hllm.train.prefix_lora`). This module holds
the parts more than one of them (and the benchmarks that measure them) use: the outer folds' salt, a teacher's ranking
as graded targets, the lists with their states, the per-variant fitter, the shipped probe's own recipe read back from
its folder, and the cascade thresholds a shipped probe carries.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch

from hllm.config import from_dict
from hllm.data.readers import collection_name, read_beir, read_slates
from hllm.model.backbones import PROVENANCE
from hllm.model.card import CONFIG_FILE
from hllm.model.confidence import CascadeThresholds, confidence
from hllm.model.heads import HeadConfig
from hllm.model.item_states import POOLINGS, Pooling
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.records import RerankRequest
from hllm.uris import resolve_model_uri
from hllm.teacher.external import external_rankings
from hllm.train.head_fit import (HeadFit, StateSlate, cv_ridge, cv_sgd, fit_guard, guard_trust, guarded_matrices, ridge_utility,
                                 score_state_slates, set_utility, state_confidence)
from hllm.train.loop import LossConfig, TrainConfig
from hllm.train.prefix_lora import PrefixRef, SubSlateConfig, SubSlates, lora_matrices, sub_slates, train_lora
from hllm.train.state_cache import PrefixStates, cached_layer_states, cached_prefix_states, layer_key, prefix_key

log = logging.getLogger("hllm")
FOLD_SALT = "teacher-folds/"  # the outer folds' hash differs from the inner CV's (hllm.train.head_fit.query_folds)
TARGET_LOSS = {"teacher": {"sinkhorn_ce": 1.0}, "judgments": {"graded_ce": 1.0}, "both": {"sinkhorn_ce": 1.0, "graded_ce": 1.0}}


@dataclass
class TeacherRun:
    name: str  # in the report, e.g. rankvicuna-7b
    rankings: str  # the teacher's rankings of the collection's queries (several first stages: `{stage}` in the path)
    format: str = "run"  # hllm.teacher.external.FORMATS: run, rank_llm, responses


@dataclass
class Variant:
    """One way to fit the student (a row of the ablation, a child run in MLflow)."""

    name: str
    target: Literal["teacher", "judgments", "both"]  # what it learns from
    # ridge: a utility probe in closed form; sgd: a head alone by SGD; lora: LoRA on the top `lora_layers` of the
    # backbone and a head, by SGD over cached prefix states (the teacher's relative order of sub-slates)
    fit: Literal["ridge", "sgd", "lora"] = "ridge"
    layer: int = 16  # read the states after this decoder layer (one of the cached `layers`; lora: the cut)
    pooling: Pooling = "last+mean"  # a part of the cached pooling
    loss: dict[str, float] | None = None  # sgd, lora: hllm.train.losses terms (None: TARGET_LOSS[target])
    sample_items: int | None = None  # sgd: sub-slates of this many candidates, the teacher's relative order
    teacher_depth: int | None = None  # ridge target: the teacher's top this many graded (None: the config's)
    train_stages: list[str] | None = None  # the first stages whose lists it trains on (None: every one)
    test_stages: list[str] | None = None  # ... and ranks (None: every one)
    lora_layers: int = 4  # lora: the top layers adapted (the ones below are cached)
    lora_r: int = 64
    head: HeadConfig | None = None  # lora: its head (None: the config's sgd_head); head_init=ridge: the ridge probe's
    head_init: Literal["none", "ridge"] = "none"  # lora: ridge = start from the ridge probe fitted on the same lists
    train: TrainConfig | None = None  # lora: its schedule (None: the config's train)


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
    stage: str = ""  # its first stage (a collection read with several; "" for the collection's own run)
    prefix: PrefixRef | None = None  # where its prefix states are (a config with a LoRA variant)

    @property
    def key(self) -> str:
        return f"{self.stage}/{self.slate.slate_id}" if self.stage else self.slate.slate_id


@dataclass
class PrefixLayout:
    """States from prefix caches (a config with a LoRA variant): each list's layer-`layer` output at every token (what
    LoRA on the layers above reads) and the frozen item states at the cut (what a probe reads), from one prefill;
    the teacher's lists of `sub_stages` (None: every stage) also cached as training sub-slates (`subs`, drawn by `seed`)."""

    layer: int
    subs: SubSlateConfig
    sub_stages: list[str] | None
    seed: int


def read_lists(path: str, top_n: int, stages: list[str] | None = None,
               pick: Callable[[list[RerankRequest]], list[RerankRequest]] | None = None) -> list[tuple[str, list[RerankRequest]]]:
    """A BEIR folder's lists: its own run's (stage ""), or each first stage's of `stages` (`runs/<stage>_top100.tsv`)
    over the same queries -> [(stage, slates)]. `pick`: the slates kept (e.g. a hashed test split)."""
    if not stages:
        slates = read_slates("beir", path, top_n=top_n)
        return [("", pick(slates) if pick else slates)]
    out: list[tuple[str, list[RerankRequest]]] = []
    for stage in stages:
        got = read_beir(path, Path(path) / "runs" / f"{stage}_top100.tsv", top_n=top_n)
        got = pick(got) if pick else got
        if out and {s.slate_id for s in got} != {s.slate_id for s in out[0][1]}:
            raise ValueError(f"{path}: first stage {stage}'s queries differ from {out[0][0]}'s; the folds need every "
                             "first stage over the same queries")
        out.append((stage, got))
    return out


def load_queries(cfg: ProbeSettings, ranker: SinglePassRanker, path: str, teachers: list[TeacherRun],
                 pick: Callable[[list[RerankRequest]], list[RerankRequest]] | None = None, stages: list[str] | None = None,
                 prefix: PrefixLayout | None = None) -> tuple[list[CachedQuery], dict]:
    """The collection's lists (`read_lists`: its own run, or one per first stage of `stages` and query, stage-major)
    with their cached states (computed where missing, always as `cfg.ranker` cuts and pools them: a fitted variant's
    head on `ranker` changes neither; with `prefix`, from prefix caches) and the teachers' rankings; -> (lists, each
    teacher's coverage counts, summed over the stages). A list a teacher does not rank whole is an error here: the
    folds compare every method on the same lists."""
    name = collection_name(path)
    lists = read_lists(path, cfg.top_n, stages, pick)
    perms: dict[str, list[list[int]]] = {t.name: [] for t in teachers}
    coverage: dict[str, dict] = {}
    for stage, slates in lists:
        for t in teachers:
            rankings, cov = external_rankings(t.format, t.rankings.format(stage=stage) if stage else t.rankings, slates)
            counts = cov.counts()
            coverage[t.name] = {k: coverage.get(t.name, {}).get(k, 0) + v for k, v in counts.items()}
            if cov.uncovered or cov.missing_ids:
                raise ValueError(f"teacher {t.name}{' on ' + stage if stage else ''}: {cov.uncovered} of {len(slates)} queries "
                                 f"unranked, {cov.missing_ids} candidates left out ({cov.examples}); the folds need every list ranked whole")
            perms[t.name] += [r.permutation for r in rankings]
    slates = [s for _, got in lists for s in got]
    stage_of = [stage for stage, got in lists for _ in got]
    fitted, ranker.cfg = ranker.cfg, cfg.ranker  # the states of the config's cut and pooling, whatever head `ranker` carries now
    try:
        if prefix is None:
            states = [dict(zip(cfg.layers, per_layer)) for stage, got in lists
                      for per_layer in zip(*_layer_states(cfg, ranker, f"{name}-{stage}" if stage else name, got).values())]
            refs: list[PrefixRef | None] = [None] * len(slates)
        else:
            refs = _prefix_refs(cfg, ranker, prefix, name, slates, stage_of, perms[teachers[0].name] if teachers else None)
            states = [{cfg.ranker.state_layer: r.whole.items(r.at)} for r in refs]
    finally:
        ranker.cfg = fitted
    return [CachedQuery(s, states[i], {t: p[i] for t, p in perms.items()}, stage_of[i], refs[i]) for i, s in enumerate(slates)], coverage


def _layer_states(cfg: ProbeSettings, ranker: SinglePassRanker, name: str, slates: list[RerankRequest]) -> dict[int, list[torch.Tensor]]:
    dirs = {layer: Path(cfg.output_dir) / "states" / f"{name}-{layer_key(cfg.ranker, layer, slates)}" for layer in cfg.layers}
    return cached_layer_states(ranker, slates, dirs, cfg.shard_slates, progress=lambda done, total, s: log.info(
        "  %s: %d/%d state shards (%.0fs)", name, done, total, s))


def _prefix_states(cfg: ProbeSettings, ranker: SinglePassRanker, layer: int, slates: list[RerankRequest], label: str) -> PrefixStates:
    """`slates`' prefix cache in `output_dir/prefix/<preset>-C<cut>-F<layer>-<label>-<key>`, a progress line every 5%."""
    name = f"{cfg.ranker.model.preset}-C{cfg.ranker.state_layer}-F{layer}"
    every = max(1, len(slates) // 20)
    folder = Path(cfg.output_dir) / "prefix" / f"{name}-{label}-{prefix_key(cfg.ranker, layer, slates)}"
    return cached_prefix_states(ranker, slates, layer, folder, lambda done, total, sec: (done % every == 0 or done == total) and log.info(
        "  %s %s: %d/%d prompts (%.0fs, %.1f s a prompt)", name, label, done, total, sec, sec / done))


def _prefix_refs(cfg: ProbeSettings, ranker: SinglePassRanker, prefix: PrefixLayout, name: str, slates: list[RerankRequest],
                 stage_of: list[str], perms: list[list[int]] | None) -> list[PrefixRef]:
    """Every list's prefix cache and, where it is a LoRA student's training list (the teacher ranked it, its stage in
    `prefix.sub_stages`), its sub-slates'."""
    whole = _prefix_states(cfg, ranker, prefix.layer, slates, name)
    train = [i for i in range(len(slates)) if perms is not None and (prefix.sub_stages is None or stage_of[i] in prefix.sub_stages)]
    subs, index = None, {}
    if train:
        keys = [f"{stage_of[i]}/{slates[i].slate_id}" if stage_of[i] else slates[i].slate_id for i in train]
        got, sub_perms, declared = sub_slates([slates[i] for i in train], [perms[i] for i in train], keys, prefix.subs, prefix.seed)
        subs = SubSlates(_prefix_states(cfg, ranker, prefix.layer, got, f"{name}-subs"), sub_perms, declared)
        per = prefix.subs.per_list
        index = {i: list(range(k * per, (k + 1) * per)) for k, i in enumerate(train)}
    return [PrefixRef(whole, i, subs if i in index else None, index.get(i, [])) for i in range(len(slates))]


class VariantFitter:
    """Fits one `Variant` on some queries and ranks others, over the cached states."""

    def __init__(self, cfg: ProbeSettings, ranker: SinglePassRanker, width: int):
        self.cfg, self.ranker, self.width = cfg, ranker, width
        self.lora: SinglePassRanker | None = None  # the last LoRA variant fitted (its own backbone: the cut's top layers adapted)

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

    def lora_config(self, v: Variant) -> RankerConfig:
        """A LoRA variant's ranker: the config's backbone and cut, its top `lora_layers` adapted, its head (with
        head_init=ridge the ridge probe's, to be fitted first) over `v.pooling`."""
        head = self.head_config(dataclasses.replace(v, fit="ridge")).head if v.head_init == "ridge" else v.head or self.cfg.sgd_head
        return dataclasses.replace(self.cfg.ranker, adapt=AdaptConfig(mode="lora", lora_r=v.lora_r, lora_alpha=2 * v.lora_r,
                                                                      lora_layers=v.lora_layers),
                                   head=head, pooling=v.pooling, window=self.cfg.top_n)

    def new_head(self, v: Variant) -> None:
        torch.manual_seed(self.cfg.seed)
        self.ranker.cfg = self.head_config(v)
        self.ranker.head = self.ranker.new_head().to(self.ranker.device)

    def fit(self, v: Variant, teacher: str | None, queries: list[CachedQuery], seed: int | None = None) -> HeadFit:
        """Fits `ranker.head` on `queries`, its settings chosen by CV over them, then its domain guard (where the head
        has one) on the same queries' states (`fit_guard`: thresholds from their own held-out distances). A LoRA
        variant: `fit_lora` (`seed`: its adapters' and data order's; None: the config's)."""
        if v.fit == "lora":
            return self.fit_lora(v, teacher, queries, self.cfg.seed if seed is None else seed)
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
            record.guard = fit_guard(self.ranker, judge, max(self.cfg.cv_folds, 2))
        return record

    def fit_lora(self, v: Variant, teacher: str | None, queries: list[CachedQuery], seed: int) -> HeadFit:
        """A LoRA student (`self.lora`) trained on the sub-slates of `queries` over their cached prefix states, the
        teacher's relative order its target; with head_init=ridge its head starts at the ridge probe fitted on the same
        lists (CV as a ridge variant's). -> its loss rows and the probe it started from."""
        torch.manual_seed(seed)
        self.lora = None
        ranker = SinglePassRanker.build(self.lora_config(v)).to(self.ranker.device)
        record = HeadFit()
        if v.head_init == "ridge":
            items, judge = self.views(v, teacher, queries)
            with torch.no_grad():
                probe = cv_ridge(ranker, items, judge, self.cfg.cv_folds, self.cfg.ridge_lambdas, self.cfg.prior_scales, self.cfg.rel)
            record.head_init = dataclasses.replace(probe, cv_grid=None)
        missing = [q.key for q in queries if q.prefix is None or q.prefix.subs is None]
        if missing:
            raise ValueError(f"variant {v.name}: {len(missing)} training lists have no cached sub-slates (e.g. {missing[:3]})")
        train = dataclasses.replace(v.train or self.cfg.train, seed=seed)
        record.history = train_lora(ranker, queries[0].prefix.subs, [j for q in queries for j in q.prefix.sub_index], train,
                                       LossConfig(v.loss or TARGET_LOSS[v.target]), v.name)
        self.lora = ranker
        return record

    def matrices(self, v: Variant, queries: list[CachedQuery]) -> list[np.ndarray]:
        """The fitted head's (N, K) score matrices of `queries` (whole lists, one pass each), as `Reranker` scores them
        (through the domain guard's support where the head has one); a LoRA variant's from their prefix states."""
        if v.fit == "lora":
            return lora_matrices(self.lora, [q.prefix for q in queries])
        return guarded_matrices(self.ranker, self.judged(v, queries))

    def unguarded(self, v: Variant, queries: list[CachedQuery]) -> tuple[list[np.ndarray], np.ndarray] | None:
        """With a domain guard: the same head's matrices without it (the ablation) and the trust it gave each query
        ((Q,) in [0, 1]); None without one."""
        guard = getattr(self.ranker.head, "guard", None)
        if guard is None or v.fit == "lora":
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
