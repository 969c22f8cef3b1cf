"""The paper's recipe on real text, sized to 2 CPU cores: LoRA students distilled from RankVicuna-7B's rankings of
five first stages' lists, beside the frozen probe, on two backbone families, never below a strong first stage.

    python -m hllm.recipes.adaptation --config configs/adaptation/dl19-multistage.yaml [key=value ...]
    hllm adaptation --config configs/adaptation/dl19-multistage.yaml

Data: DL19's 43 judged queries over every first stage of `stages` (`data`: BEIR folder with `runs/<stage>_top100.tsv`
and the teacher's ranking of each list in `teacher-runs/<teacher>_<stage>_top100.tsv`). Folds are by query — the same
5 teacher-folds by query hash as `hllm realtext`'s teacher-folds (`FOLD_SALT`) — so a test query's lists from every stage are held
out together; every query is tested once.

What makes LoRA affordable here: each student adapts only the top `lora_layers` decoder layers of a backbone cut after
`state_layer` (C); the layers below (1..F, F = C - lora_layers) never change, so their output at every token of a
prompt is computed once (`hllm.train.state_cache.cached_prefix_states`) — for every list's whole prompt (what a test
fold ranks, one pass, N = 100, K = 20: rectangular Hungarian) and for `subs_per_list` sub-slates of `sub_items`
candidates per list (what training reads, in first-stage order, the teacher's relative order as target; fixed per
list by a seed). The same prefill keeps the frozen model's item states at C: the probe's input. A training step then
runs layers F+1..C with LoRA, the attention head, the Sinkhorn CE and AdamW — the project's loop
(`hllm.train.loop.train_loop`), no second one.

Students (`students`): `lora` (LoRA r on the top layers + the paper's 2-layer attention head under the rank prior, or
with `head_init: probe` the probe's head started at its closed-form fit on the fold's training lists), `probe` (the
shipped `smollm2-dl19-rankvicuna`'s closed-form probe — its pooling, ridge weight and prior scale read from its folder —
refitted on each fold's training lists). Settings are a rule fixed in the config before any test fold is read (steps
and learning rates sized by the measured seconds a step); nothing is chosen on test queries; a variant stopped is said
in the report (`notes`).

The first-stage blend (`first_stage_weights`): a list's (N, K) matrix, standardised, plus w times the rank prior (whose
unique optimum is the first-stage order); w = inf is the first stage itself. For each fold and each first stage, w is
the grid value with the best nDCG@10 over the *other* folds' queries on that stage (their out-of-fold matrices; the
fold's own judgments are never read; ties: the larger w) — a deployment knows its first stage, so it keeps one w per
stage. Both the raw and the blended student are reported (`NAME` and `NAME+first-stage`).

A finished (student, fold) is kept in `output_dir/folds`: a stopped run resumes there. Writes `output_dir/report.json`
and `report.md` (and `report_to`, when set).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from hllm.config import to_dict
from hllm.data.cache import fields_key
from hllm.data.order import InputOrder
from hllm.data.readers import read_beir
from hllm.eval.metrics import kendall_tau, share_kept, top10_by_query
from hllm.model.backbones import ModelConfig, resolve_device
from hllm.model.heads import HeadConfig, rank_prior
from hllm.model.prompts import PromptConfig, collate
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.job.config import recipe_config
from hllm.records import RerankRequest
from hllm.teacher.external import external_rankings
from hllm.train.head_fit import StateSlate, decode_orders, query_folds, score_state_slates
from hllm.train.loop import LossConfig, TorchOptimizer, TrainConfig, batches, padded_targets, param_groups, train_loop
from hllm.train.losses import mixed_loss
from hllm.train.probes import FOLD_SALT, ShippedProbe, teacher_grades
from hllm.train.state_cache import PrefixStates, cached_prefix_states, prefix_key

log = logging.getLogger("hllm")
BLENDED = "+first-stage"  # a student's row blended with the first stage (its weight chosen on other folds)


@dataclass
class StudentSpec:
    """One student of the ablation: a backbone, cut and adapted so, trained on these stages' lists."""

    name: str
    model: ModelConfig = field(default_factory=lambda: ModelConfig(preset="smollm2-135m", context_length=8192))
    kind: Literal["lora", "probe"] = "lora"
    state_layer: int = 16  # the backbone is cut after this decoder layer (C)
    lora_layers: int = 4  # lora: the top layers adapted; the C - lora_layers below are cached
    lora_r: int = 64
    train_stages: list[str] | None = None  # the first stages whose lists it trains on (None: all of `stages`)
    test_stages: list[str] | None = None  # the first stages whose lists it ranks (None: all of `stages`)
    head: HeadConfig = field(default_factory=lambda: HeadConfig(kind="attention", positions=20, layers=2, width=128,
                                                               num_heads=4, prior="rank"))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=40, batch_size=8, lr=2e-4, head_lr=1e-3,
                                                                   warmup_steps=5, log_every=10, autocast_bf16=False))
    loss: dict[str, float] = field(default_factory=lambda: {"sinkhorn_ce": 1.0})
    # lora: "probe" starts from the shipped probe's fit on the fold's training lists (its utility head, pooling and
    # closed-form weights over the frozen states), then LoRA and that head train on; "none": `head` from scratch
    head_init: Literal["none", "probe"] = "none"

    def __post_init__(self) -> None:
        if self.kind == "lora" and not 1 <= self.lora_layers <= self.state_layer:
            raise ValueError(f"student {self.name}: lora_layers must lie in 1..state_layer ({self.state_layer})")


@dataclass
class AdaptationConfig:
    output_dir: str = "runs/adaptation"
    device: str = "auto"
    threads: int | None = None
    data: str = "../shared/data/trec-dl19-passage-multistage"
    stages: list[str] = field(default_factory=lambda: ["bm25", "bm25_rm3", "tasb", "ada2", "splade_pp_ed"])
    strong_stages: list[str] = field(default_factory=lambda: ["tasb", "ada2", "splade_pp_ed"])  # held within `margin`
    margin: float = 0.005
    teacher: str = "rankvicuna-7b"  # teacher-runs/<teacher>_<stage>_top100.tsv
    prompt: PromptConfig = field(default_factory=lambda: PromptConfig(template="rankgpt-query", max_doc_tokens=48))
    top_n: int = 100
    folds: int = 5
    sub_items: int = 20  # training sub-slates: this many candidates of a list, in first-stage order
    subs_per_list: int = 2
    # permutation augmentation: a list's j-th sub-slate is read in sub_orders[j % len] (hllm.data.order; the seed of a
    # `shuffled` entry is ignored: each sub-slate its own shuffle); only the first stage's order is declared to the prior
    sub_orders: list[str] = field(default_factory=lambda: ["first-stage"])
    first_stage_weights: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, math.inf])
    students: list[StudentSpec] = field(default_factory=list)
    only: Literal["all", "cache"] = "all"  # cache: compute the prefix caches, then stop
    # a bound on what limits a student: it also ranks this many of its fold's training lists (BM25, whole), in sample
    in_sample: int = 10
    rel: int = 2
    bootstrap: int = 2000
    seed: int = 0
    report_to: str | None = None  # the report's markdown is also written here (e.g. reports/adaptation.md)
    # the student the `over <stage>` lines report, blended with the first stage: named before the test folds are read
    headline: str = "smollm2-lora"
    # another year's BEIR folder (its BM25 run): the headline student, trained on every query here, ranks it once
    cross_year: str | None = None
    notes: list[str] = field(default_factory=list)  # variants tried and stopped, said in the report (never silently dropped)
    csv_to: str | None = None  # its rows (split `adaptation-<stage>`) replace their earlier ones in this CSV (reports/real_data.csv)

    def __post_init__(self) -> None:
        if not self.students:
            raise ValueError("students: at least one")
        if len({s.name for s in self.students}) != len(self.students):
            raise ValueError("student names must be unique")
        for s in self.students:
            unknown = sorted((set(s.train_stages or []) | set(s.test_stages or [])) - set(self.stages))
            if unknown:
                raise ValueError(f"student {s.name}: train or test stages {unknown} are not among stages {self.stages}")
            if "bm25" not in (s.test_stages or self.stages):
                raise ValueError(f"student {s.name}: test_stages must include bm25 (the share of the teacher's gain)")
        for s in self.students:
            same = [t for t in self.students if t.kind == "lora" and t.model == s.model and t.state_layer == s.state_layer]
            if len({t.lora_layers for t in same}) > 1:
                raise ValueError(f"students of {s.model.preset} cut at {s.state_layer} adapt {sorted({t.lora_layers for t in same})} "
                                 "top layers: one cache per backbone and cut needs one lora_layers")
        if self.headline not in {s.name for s in self.students}:
            raise ValueError(f"headline {self.headline!r} is not a student's name")
        if not set(self.strong_stages) <= set(self.stages):
            raise ValueError(f"strong_stages {self.strong_stages} must be among stages {self.stages}")
        if "bm25" not in self.stages:
            raise ValueError("stages must include bm25: the share of the teacher's gain is read on its lists")
        if not self.sub_orders:
            raise ValueError("sub_orders: at least one order (first-stage: the sub-slates as drawn)")
        [InputOrder.parse(o) for o in self.sub_orders]


@dataclass
class Lists:
    """Every (stage, query) list: its slate and the teacher's permutation of it, stage-major."""

    keys: list[tuple[str, str]]  # (stage, query id)
    slates: list[RerankRequest]
    perms: list[list[int]]

    def of(self, stages: list[str], qids: set[str]) -> list[int]:
        return [i for i, (s, q) in enumerate(self.keys) if s in stages and q in qids]


def read_lists(cfg: AdaptationConfig) -> Lists:
    """Each stage's top `top_n` per query with the teacher's ranking of exactly that list; a query missing from a
    stage or a list the teacher did not rank whole is an error (the folds compare every stage on the same queries)."""
    root = Path(cfg.data)
    keys, slates, perms, qids = [], [], [], None
    for stage in cfg.stages:
        got = read_beir(root, root / "runs" / f"{stage}_top100.tsv", top_n=cfg.top_n)
        rankings, cov = external_rankings("run", root / "teacher-runs" / f"{cfg.teacher}_{stage}_top100.tsv", got)
        if cov.uncovered or cov.missing_ids:
            raise ValueError(f"{stage}: the teacher left {cov.uncovered} lists unranked and {cov.missing_ids} candidates out")
        ids = [s.slate_id for s in got]
        if qids is not None and set(ids) != set(qids):
            raise ValueError(f"{stage}: its queries differ from {cfg.stages[0]}'s; the folds need every stage on the same queries")
        qids = qids or ids
        keys += [(stage, q) for q in ids]
        slates += got
        perms += [r.permutation for r in rankings]
    return Lists(keys, slates, perms)


def sub_slates(lists: Lists, index: list[int], m: int, count: int, seed: int, orders: list[str] | None = None
               ) -> tuple[list[RerankRequest], list[list[int]]]:
    """`count` sub-slates of `m` candidates of each list in `index`, the j-th in `orders[j % len(orders)]` (the first
    stage's, or a shuffle of its own), each with the teacher's relative order; drawn by a seed of the list's own (the
    same sub-slates whichever lists are asked)."""
    kinds = [InputOrder.parse(o).kind for o in orders or ["first-stage"]]
    slates, perms = [], []
    for i in index:
        slate, perm = lists.slates[i], lists.perms[i]
        rng = random.Random(f"{seed}/{lists.keys[i][0]}/{lists.keys[i][1]}")
        n = len(slate.candidates)
        for j in range(count):
            keep = sorted(rng.sample(range(n), min(m, n)))
            if kinds[j % len(kinds)] == "shuffled":
                rng.shuffle(keep)
            elif kinds[j % len(kinds)] == "reversed":
                keep.reverse()
            where = {c: j for j, c in enumerate(keep)}
            slates.append(dataclasses.replace(slate, candidates=[slate.candidates[c] for c in keep],
                                              grades=[slate.grades[c] for c in keep] if slate.grades else None))
            perms.append([where[c] for c in perm if c in where])
    return slates, perms


def lora_config(cfg: AdaptationConfig, s: StudentSpec) -> RankerConfig:
    head, pooling = s.head, "last+mean"
    if s.head_init == "probe":  # the shipped probe's head and pooling, K as the student's
        shipped = ShippedProbe.load().ranker
        head, pooling = dataclasses.replace(shipped.head, positions=s.head.positions), shipped.pooling
    return RankerConfig(model=s.model, adapt=AdaptConfig(mode="lora", lora_r=s.lora_r, lora_alpha=2 * s.lora_r,
                                                         lora_layers=s.lora_layers),
                        head=head, prompt=cfg.prompt, state_layer=s.state_layer, pooling=pooling, window=cfg.top_n)


def cache_config(cfg: AdaptationConfig, s: StudentSpec) -> RankerConfig:
    """The frozen backbone the caches come from: the student's cut, its items read `last+mean` (the probe takes the mean)."""
    return dataclasses.replace(lora_config(cfg, s), adapt=AdaptConfig(mode="frozen"), pooling="last+mean", head=s.head)


def prefix_layer(cfg: AdaptationConfig, s: StudentSpec) -> int:
    """The layer whose output is cached for `s`: one per backbone and cut, under the deepest LoRA of its students
    (a probe reads the items at the cut from the same prefill)."""
    same = [t for t in cfg.students if t.model == s.model and t.state_layer == s.state_layer]
    return min([t.state_layer - t.lora_layers for t in same if t.kind == "lora"], default=s.state_layer)


@dataclass
class Caches:
    lists: PrefixStates  # the whole prompts of the lists its students rank or the probes train on
    at: dict[int, int]  # a list's index -> its prompt in `lists`
    subs: PrefixStates | None  # the training sub-slates of the lists its lora students train on
    sub_perms: list[list[int]]
    sub_of: list[int]  # the list each sub-slate comes from


def group(cfg: AdaptationConfig, s: StudentSpec) -> list[StudentSpec]:
    """The students sharing `s`'s caches: the same backbone and cut."""
    return [t for t in cfg.students if t.model == s.model and t.state_layer == s.state_layer]


def prefix_states(cfg: AdaptationConfig, s: StudentSpec, frozen: SinglePassRanker, slates: list[RerankRequest],
                  label: str) -> PrefixStates:
    """`slates`' prefix cache for `s` (its backbone, cut and prefix layer) from the `frozen` cache ranker, in
    `output_dir/prefix/<preset>-C<cut>-F<layer>-<label>-<key>`, with a progress line every 5%."""
    layer = prefix_layer(cfg, s)
    name = f"{s.model.preset}-C{s.state_layer}-F{layer}"
    every = max(1, len(slates) // 20)
    folder = Path(cfg.output_dir) / "prefix" / f"{name}-{label}-{prefix_key(frozen.cfg, layer, slates)}"
    return cached_prefix_states(frozen, slates, layer, folder, lambda done, total, sec: (done % every == 0 or done == total) and log.info(
        "  %s %s: %d/%d prompts (%.0fs, %.1f s a prompt)", name, label, done, total, sec, sec / done))


def caches(cfg: AdaptationConfig, s: StudentSpec, lists: Lists, device: torch.device) -> Caches:
    """The student's prefix caches (shared by every student of the same backbone, cut and prefix layer)."""
    ranker = SinglePassRanker.build(cache_config(cfg, s)).to(device).eval()
    everyone = {q for _, q in lists.keys}
    whole_stages = {st for t in group(cfg, s) for st in (t.test_stages or cfg.stages)}
    whole_stages |= {st for t in group(cfg, s) if t.kind == "probe" for st in (t.train_stages or cfg.stages)}
    index = lists.of(sorted(whole_stages), everyone)
    slates = [lists.slates[i] for i in index]
    whole = prefix_states(cfg, s, ranker, slates, "lists")
    subs, sub_perms, sub_of = None, [], []
    sub_stages = {st for t in group(cfg, s) if t.kind == "lora" for st in (t.train_stages or cfg.stages)}
    if sub_stages:
        sub_of = [i for i in lists.of(sorted(sub_stages), everyone) for _ in range(cfg.subs_per_list)]
        slates, sub_perms = sub_slates(lists, sorted(set(sub_of)), cfg.sub_items, cfg.subs_per_list, cfg.seed, cfg.sub_orders)
        subs = prefix_states(cfg, s, ranker, slates, "subs")
    del ranker
    return Caches(whole, {i: j for j, i in enumerate(index)}, subs, sub_perms, sub_of)


def prefix_batch(ranker: SinglePassRanker, cache: PrefixStates, index: list[int]) -> dict[str, torch.Tensor]:
    """Prompts `index` of a prefix cache -> the ranker's batch with `hidden` (B, T, D): each prompt's cached layer-F
    states, right-padded (the padding masked out)."""
    encoded = [cache.encoded(i) for i in index]
    batch = collate(encoded, ranker.tokenizer.pad_token_id)
    states = [cache.hidden(i) for i in index]  # each (T_i, D), T_i: up to the prompt's last candidate
    t = max(len(h) for h in states)
    hidden = torch.zeros(len(index), t, states[0].shape[1])  # (B, T, D)
    mask = torch.zeros(len(index), t, dtype=batch["attention_mask"].dtype)  # (B, T)
    for row, h in enumerate(states):
        hidden[row, : len(h)], mask[row, : len(h)] = h, 1
    batch |= {"hidden": hidden, "attention_mask": mask}
    return {k: v.to(ranker.device) for k, v in batch.items()}


def prefix_logits(ranker: SinglePassRanker, batch: dict[str, torch.Tensor], declared: torch.Tensor | None = None) -> torch.Tensor:
    """(B, N, K) the ranker's logits from cached layer-F states: only its adapted layers run. `declared` (B,): whether
    each prompt's order is a declared first-stage ranking (None: all are)."""
    items = ranker.item_states_from(batch["hidden"], batch["attention_mask"], batch["item_positions"], batch["item_spans"],
                                    ranker.frozen_below)
    return ranker.score_states(items, batch["item_mask"], declared)


def train_lora(cfg: AdaptationConfig, s: StudentSpec, c: Caches, lists: Lists, train_lists: list[int], device: torch.device,
               seed: int) -> tuple[SinglePassRanker, list[dict]]:
    """A LoRA student trained on the sub-slates of `train_lists` over their cached prefix states."""
    torch.manual_seed(seed)
    ranker = SinglePassRanker.build(lora_config(cfg, s)).to(device)
    if s.head_init == "probe":  # the probe's closed-form fit over the frozen states: LoRA starts where the probe ends
        with torch.no_grad():
            ShippedProbe.load().fit(ranker, probe_items(c, lists.slates, lists.perms, train_lists))
    wanted = set(train_lists)
    examples = [j for j, i in enumerate(c.sub_of) if i in wanted]
    loss_cfg = LossConfig(dict(s.loss))
    train = dataclasses.replace(s.train, seed=seed)

    def loss_fn(chunk: list[int]):
        batch = prefix_batch(ranker, c.subs, chunk)
        perm, grades = padded_targets([c.sub_perms[j] for j in chunk], [c.subs.slates[j].grades for j in chunk],
                                      batch["item_mask"].shape[1])
        kinds = [InputOrder.parse(cfg.sub_orders[j % cfg.subs_per_list % len(cfg.sub_orders)]) for j in chunk]
        declared = torch.tensor([o.declared for o in kinds], device=device)  # (B,) a shuffled sub-slate: no prior
        return mixed_loss(prefix_logits(ranker, batch, declared), batch["item_mask"], loss_cfg.terms, perm=perm.to(device),
                          grades=grades.to(device))

    def progress(step: int, row: dict) -> None:
        log.info("    %s step %d/%d: loss %.4f, %.1f s a step", s.name, step, train.steps, row["loss"], row["elapsed_s"] / step)

    ranker.train()
    history = train_loop(loss_fn, batches(examples, train.batch_size, seed), TorchOptimizer(param_groups(ranker, train), train),
                         train, device.type, log=progress)
    return ranker.eval(), history


@torch.inference_mode()
def lora_matrices(ranker: SinglePassRanker, c: Caches, index: list[int]) -> list[np.ndarray]:
    """Whole lists, one pass each from their cached prefix: (N, K) matrices."""
    out = []
    for i in index:
        logits = prefix_logits(ranker, prefix_batch(ranker, c.lists, [c.at[i]]))[0].float().cpu().numpy()  # (N, K)
        out.append(logits[:, : min(logits.shape[0], logits.shape[1])])
    return out


def probe_items(c: Caches, slates: list[RerankRequest], perms: list[list[int]] | None, index: list[int]) -> list[StateSlate]:
    """Lists `index` as the probe reads them: the mean half of the frozen item states at the cut, with the teacher's
    whole order graded as the shipped recipe does (where `perms` are given)."""
    items = []
    for i in index:
        states = c.lists.items(c.at[i])  # (N, 2D): last | mean
        perm = perms[i] if perms is not None else None
        items.append(StateSlate(slates[i], states[:, states.shape[1] // 2:], perm,
                                None if perm is None else teacher_grades(perm, len(perm))))
    return items


def probe_matrices(cfg: AdaptationConfig, s: StudentSpec, train: list[StateSlate], test: list[StateSlate]) -> list[np.ndarray]:
    """The shipped probe's recipe (its pooling, ridge weight and prior scale, read from its folder) refitted on `train`,
    scoring `test`: a head alone, over cached states."""
    from hllm.model.heads import build_head

    shipped = ShippedProbe.load()
    rcfg = dataclasses.replace(shipped.ranker, model=s.model, state_layer=s.state_layer,
                               head=dataclasses.replace(shipped.ranker.head, positions=s.head.positions), window=cfg.top_n)
    head_only = SinglePassRanker.__new__(SinglePassRanker)  # no backbone: the head reads cached states
    torch.nn.Module.__init__(head_only)
    head_only.cfg, head_only.head = rcfg, build_head(train[0].states.shape[1], rcfg.head)
    shipped.fit(head_only, train)
    return score_state_slates(head_only, test)


def fold_key(cfg: AdaptationConfig, s: StudentSpec) -> str:
    return fields_key(cfg, ("data", "stages", "teacher", "prompt", "top_n", "folds", "sub_items", "subs_per_list", "sub_orders",
                            "seed"), to_dict(s))


def run_student(cfg: AdaptationConfig, s: StudentSpec, lists: Lists, splits: list[tuple[set[str], set[str]]],
                device: torch.device) -> dict[str, Any]:
    """Every fold of one student (read back where finished) -> {"matrices": per list its out-of-fold (N, K) matrix,
    "seconds": per fold, "history": per fold its loss rows}."""
    c = caches(cfg, s, lists, device)
    if cfg.only == "cache":
        return {}
    store = Path(cfg.output_dir) / "folds"
    store.mkdir(parents=True, exist_ok=True)
    key = fold_key(cfg, s)
    matrices: list[np.ndarray | None] = [None] * len(lists.keys)
    seconds, histories, in_sample = [], [], []
    train_stages = s.train_stages or cfg.stages
    for f, (train_q, test_q) in enumerate(splits):
        saved = store / f"{s.name}-fold{f}-{key}.npz"
        test_lists = lists.of(s.test_stages or cfg.stages, test_q)
        if saved.is_file():
            with np.load(saved, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                got = [z[str(i)] for i in test_lists]
            log.info("%s fold %d/%d: read from %s", s.name, f + 1, len(splits), saved)
        else:
            t0 = time.perf_counter()
            train_lists = lists.of(train_stages, train_q)
            seen = [i for i in train_lists if lists.keys[i][0] == "bm25"][: cfg.in_sample]
            if s.kind == "lora":
                ranker, history = train_lora(cfg, s, c, lists, train_lists, device, cfg.seed + f)
                t_train = time.perf_counter() - t0
                got = lora_matrices(ranker, c, test_lists + seen)
                del ranker
            else:
                history, got = [], probe_matrices(cfg, s, probe_items(c, lists.slates, lists.perms, train_lists),
                                                  probe_items(c, lists.slates, None, test_lists + seen))
                t_train = time.perf_counter() - t0
            got, seen_got = got[: len(test_lists)], got[len(test_lists):]
            seen_orders = decode_orders(seen_got)
            meta = {"seconds": time.perf_counter() - t0, "train_seconds": t_train, "train_lists": len(train_lists),
                    "test_lists": len(test_lists), "history": history,
                    "in_sample": {"lists": len(seen), "nDCG@10": float(ndcg10(lists, seen, seen_orders, cfg.rel).mean()) if seen else None,
                                  "first_stage": float(ndcg10(lists, seen, [list(range(len(lists.slates[i].candidates))) for i in seen],
                                                              cfg.rel).mean()) if seen else None,
                                  "teacher": float(ndcg10(lists, seen, [lists.perms[i] for i in seen], cfg.rel).mean()) if seen else None,
                                  "tau_to_teacher": float(np.mean([kendall_tau(o, lists.perms[i]) for o, i in zip(seen_orders, seen)]))
                                  if seen else None}}
            tmp = store / f".tmp-{saved.name}"
            with tmp.open("wb") as fh:
                np.savez(fh, meta=json.dumps(meta), **{str(i): m for i, m in zip(test_lists, got)})
            tmp.replace(saved)  # a fold is whole or absent
            log.info("%s fold %d/%d: %d training lists, %d test lists, %.0f s (training %.0f s)", s.name, f + 1, len(splits),
                     len(train_lists), len(test_lists), meta["seconds"], t_train)
        for i, m in zip(test_lists, got):
            matrices[i] = m
        seconds.append(meta["seconds"])
        histories.append(meta["history"])
        in_sample.append(meta["in_sample"])
    return {"matrices": matrices, "seconds": seconds, "history": histories, "in_sample": in_sample}


def blended(matrix: np.ndarray, weight: float) -> np.ndarray:
    """(N, K) scores leaning on the first stage: standardised, plus `weight` times the rank prior (the first-stage
    order its unique optimum); inf: the first-stage order's own matrix."""
    prior = rank_prior(*matrix.shape).numpy()  # (N, K)
    prior = prior / (prior.std() or 1.0)
    if math.isinf(weight):
        return prior
    return (matrix - matrix.mean()) / (matrix.std() or 1.0) + weight * prior


def ndcg10(lists: Lists, index: list[int], orders: list[list[int]], rel: int) -> np.ndarray:
    """Per list its nDCG@10 (trec_eval-style, ir_measures) for `orders` of lists `index`."""
    got = top10_by_query([lists.slates[i] for i in index], orders, rel)["nDCG@10"]
    return np.array([got[lists.keys[i][1]] for i in index])


def blend_scores(cfg: AdaptationConfig, lists: Lists, matrices: list[np.ndarray | None], index: list[int]
                 ) -> tuple[dict[float, dict[int, list[int]]], dict[float, dict[int, float]]]:
    """For each first-stage weight, lists `index`' blended orders and their nDCG@10: {w: {list: order}}, {w: {list: nDCG@10}}."""
    orders = {w: dict(zip(index, decode_orders([blended(matrices[i], w) for i in index]))) for w in cfg.first_stage_weights}
    return orders, {w: dict(zip(index, ndcg10(lists, index, [o[i] for i in index], cfg.rel))) for w, o in orders.items()}


def best_weight(cfg: AdaptationConfig, score: dict[float, dict[int, float]], index: list[int]) -> float:
    """The first-stage weight with the best mean nDCG@10 over lists `index` (ties: the larger, nearer the first stage)."""
    return max(cfg.first_stage_weights, key=lambda w: (round(float(np.mean([score[w][i] for i in index])), 6), w))


def blend(cfg: AdaptationConfig, lists: Lists, splits: list[tuple[set[str], set[str]]], matrices: list[np.ndarray | None]
          ) -> tuple[list[list[int] | None], dict[str, list[float]]]:
    """Per list its blended order, w chosen per fold and stage on the other folds' queries of that stage (lists the
    student did not rank: None). -> (orders, {stage: per fold the weight chosen})."""
    by_weight, score = blend_scores(cfg, lists, matrices, [i for i, m in enumerate(matrices) if m is not None])
    orders: list[list[int] | None] = [None] * len(lists.keys)
    chosen: dict[str, list[float]] = {}
    for stage in cfg.stages:
        for train_q, test_q in splits:
            others = [i for i in lists.of([stage], train_q) if matrices[i] is not None]
            if not others:
                continue
            w = best_weight(cfg, score, others)
            chosen.setdefault(stage, []).append(w)
            for i in lists.of([stage], test_q):
                orders[i] = by_weight[w][i]
    return orders, chosen


def summarize(cfg: AdaptationConfig, lists: Lists, results: dict[str, dict], splits) -> dict[str, Any]:
    """Per stage: first stage, teacher and each student (raw and blended with the first stage) on the stages it ranked: nDCG@10 over the
    queries, tau to the teacher, the change from the first stage, and the share of the teacher's gain kept (with a
    bootstrap CI over queries)."""
    first_orders = [list(range(len(s.candidates))) for s in lists.slates]
    methods: dict[str, list[list[int] | None]] = {"first_stage": first_orders, "teacher": lists.perms}
    weights = {}
    for name, r in results.items():
        methods[name] = [None if m is None else decode_orders([m])[0] for m in r["matrices"]]
        methods[f"{name}{BLENDED}"], weights[name] = blend(cfg, lists, splits, r["matrices"])
    table: dict[str, dict[str, Any]] = {}
    for stage in cfg.stages:
        index = lists.of([stage], {q for _, q in lists.keys})
        rows = {}
        for name, orders in methods.items():
            got = [orders[i] for i in index]
            if any(o is None for o in got):
                continue  # a student that did not rank this stage's lists
            pq = top10_by_query([lists.slates[i] for i in index], got, cfg.rel)
            nd = np.array([pq["nDCG@10"][lists.keys[i][1]] for i in index])
            rows[name] = {"nDCG@10": float(nd.mean()), "MRR@10": float(np.mean(list(pq["MRR@10"].values()))), "per_query": nd.tolist(),
                          "tau_to_teacher": float(np.mean([kendall_tau(o, lists.perms[i]) for o, i in zip(got, index)]))}
        first, teach = np.array(rows["first_stage"]["per_query"]), np.array(rows["teacher"]["per_query"])
        for name in rows:
            if name not in ("first_stage", "teacher"):
                rows[name]["share_kept"] = share_kept(np.array(rows[name]["per_query"]), first, teach, cfg.bootstrap, cfg.seed)
                rows[name]["delta_first_stage"] = rows[name]["nDCG@10"] - rows["first_stage"]["nDCG@10"]
        table[stage] = rows
    return {"queries": len({q for _, q in lists.keys}), "table": table, "first_stage_weights": weights,
            "fold_seconds": {n: r["seconds"] for n, r in results.items()},
            "history": {n: [h[-1] if h else {} for h in r["history"]] for n, r in results.items()},
            "losses": {n: [[row["loss"] for row in h] for h in r["history"]] for n, r in results.items()},
            "in_sample": {n: r["in_sample"] for n, r in results.items()}}


def cross_year(cfg: AdaptationConfig, lists: Lists, oof: list[np.ndarray | None], device: torch.device) -> dict[str, Any]:
    """The headline student trained on every query's lists, ranking `cfg.cross_year`'s BM25 lists (never trained on);
    its first-stage weight the one the BM25 lists' out-of-fold matrices chose over all folds."""
    s = next(t for t in cfg.students if t.name == cfg.headline)
    c = caches(cfg, s, lists, device)
    other = read_beir(Path(cfg.cross_year), top_n=cfg.top_n)
    frozen = SinglePassRanker.build(cache_config(cfg, s)).to(device).eval()
    away = Caches(prefix_states(cfg, s, frozen, other, Path(cfg.cross_year).name), {i: i for i in range(len(other))}, None, [], [])
    del frozen
    everything = lists.of(s.train_stages or cfg.stages, {q for _, q in lists.keys})
    t0 = time.perf_counter()
    if s.kind == "lora":
        ranker, _ = train_lora(cfg, s, c, lists, everything, device, cfg.seed)
        mats = lora_matrices(ranker, away, list(range(len(other))))
    else:
        mats = probe_matrices(cfg, s, probe_items(c, lists.slates, lists.perms, everything),
                              probe_items(away, other, None, list(range(len(other)))))
    bm25 = [i for i in lists.of(["bm25"], {q for _, q in lists.keys}) if oof[i] is not None]
    w = best_weight(cfg, blend_scores(cfg, lists, oof, bm25)[1], bm25)
    every = list(range(len(other)))
    mean = lambda orders: float(np.mean(list(top10_by_query(other, orders, cfg.rel)["nDCG@10"].values())))  # noqa: E731
    got = {"collection": Path(cfg.cross_year).name, "student": s.name, "queries": len(other), "seconds": time.perf_counter() - t0,
           "first_stage": mean([list(range(len(o.candidates))) for o in other]), "raw": mean(decode_orders(mats)),
           "first_stage_weight": w, "blended": mean(decode_orders([blended(m, w) for m in mats])), "trained_on_lists": len(everything)}
    log.info("cross-year %s (%d queries): first stage %.4f, %s %.4f, blended with the first stage (w=%s) %.4f", got["collection"], len(every),
             got["first_stage"], s.name, got["raw"], w, got["blended"])
    return got


def run(cfg: AdaptationConfig) -> dict[str, Any]:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    device = resolve_device(cfg.device)
    lists = read_lists(cfg)
    qids = [q for s, q in lists.keys if s == cfg.stages[0]]
    splits = [({qids[i] for i in tr}, {qids[i] for i in te}) for tr, te in query_folds(len(qids), qids, cfg.folds, FOLD_SALT)]
    log.info("%d lists (%d stages x %d queries), %d folds by query", len(lists.keys), len(cfg.stages), len(qids), len(splits))
    t0 = time.perf_counter()
    results = {s.name: run_student(cfg, s, lists, splits, device) for s in cfg.students}
    if cfg.only == "cache":
        log.info("caches ready in %.0f s", time.perf_counter() - t0)
        return {}
    report = {"config": to_dict(cfg)} | summarize(cfg, lists, results, splits)
    if cfg.cross_year:
        report["cross_year"] = cross_year(cfg, lists, results[cfg.headline]["matrices"], device)
    report["seconds"] = time.perf_counter() - t0
    (out / "report.json").write_text(json.dumps(report, indent=2))
    text = markdown(cfg, report)
    (out / "report.md").write_text(text)
    if cfg.report_to:
        Path(cfg.report_to).write_text(text)
    if cfg.csv_to:
        write_rows(cfg, report, Path(cfg.csv_to))
    return report


CSV_HEADER = ["collection", "queries", "split", "method", "nDCG@10", "MRR@10", "teacher", "tau_to_teacher", "share_kept", "share_kept_ci95"]


def write_rows(cfg: AdaptationConfig, report: dict[str, Any], path: Path) -> None:
    """One row per (stage, method) under split `adaptation-<stage>`, replacing that split's earlier rows in `path`."""
    import csv

    rows = []
    for stage, table in report["table"].items():
        for name, row in table.items():
            share = row.get("share_kept")
            rows.append([Path(cfg.data).name, report["queries"], f"adaptation-{stage}", name, f"{row['nDCG@10']:.4f}",
                         f"{row['MRR@10']:.4f}", cfg.teacher, f"{row['tau_to_teacher']:.4f}",
                         f"{share['share']:.4f}" if share else "", f"{share['ci_low']:.4f}..{share['ci_high']:.4f}" if share else ""])
    if "cross_year" in report:
        x = report["cross_year"]
        for name, value in (("first_stage", x["first_stage"]), (x["student"], x["raw"]), (x["student"] + BLENDED, x["blended"])):
            rows.append([x["collection"], x["queries"], "adaptation-cross-year", name, f"{value:.4f}", "", "", "", "", ""])
    kept = [r for r in csv.reader(path.open()) if r and not r[2].startswith("adaptation-")] if path.exists() else [CSV_HEADER]
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows(kept + rows)


def best(cfg: AdaptationConfig, report: dict, kind: str, gemma: bool = False) -> str | None:
    """The student of `kind` (Gemma 3's, or the others') with the best nDCG@10 on the BM25 lists, raw or blended with the first stage."""
    names = [f"{s.name}{g}" for s in cfg.students if (kind == "any" or s.kind == kind)
             and (s.model.preset == "gemma3-270m") == gemma for g in ("", BLENDED)]
    return max(names, key=lambda n: report["table"]["bm25"][n]["nDCG@10"]) if names else None


def markdown(cfg: AdaptationConfig, r: dict) -> str:
    t = r["table"]
    lines = [f"# Backbone adaptation on 2 CPU cores: DL19, {r['queries']} queries x {len(cfg.stages)} first stages", "",
             f"nDCG@10 means over the {r['queries']} queries (each tested once: {cfg.folds} teacher-folds by query, a query's lists "
             f"from every stage held out together); teacher: {cfg.teacher}; tau: Kendall's tau to the teacher's order.", ""]
    for stage in cfg.stages:
        rows = t[stage]
        lines += [f"## {stage}", "", "| method | nDCG@10 | Δ first stage | tau to teacher | share of the teacher's gain [95% CI] |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for n, row in rows.items():
            share = row.get("share_kept")
            lines.append(f"| {n} | {row['nDCG@10']:.4f} | {row.get('delta_first_stage', 0.0):+.4f} | {row['tau_to_teacher']:.3f} | "
                         + (f"{share['share']:.2f} [{share['ci_low']:.2f}, {share['ci_high']:.2f}]" if share else "") + " |")
        lines.append("")
    lora, probe = best(cfg, r, "lora"), best(cfg, r, "probe")
    if cfg.notes:
        lines += ["## Variants tried and stopped", ""] + [f"- {n}" for n in cfg.notes] + [""]
    lines += ["## Headline", ""]
    if lora:
        lines.append(f"share kept, lora: {t['bm25'][lora]['share_kept']['share']:.2f}")
    if probe:
        lines.append(f"share kept, frozen probe: {t['bm25'][probe]['share_kept']['share']:.2f}")
    gemma = best(cfg, r, "any", gemma=True)
    if gemma:
        kind = next(s.kind for s in cfg.students if s.name == gemma.split("+")[0])
        lines.append(f"share kept, gemma3-270m {kind}: {t['bm25'][gemma]['share_kept']['share']:.2f}")
    overall = f"{cfg.headline}{BLENDED}"
    for stage in cfg.strong_stages + [s for s in cfg.stages if s not in cfg.strong_stages]:
        if overall in t[stage]:
            lines.append(f"over {stage}: student {t[stage][overall]['nDCG@10']:.4f} | first stage {t[stage]['first_stage']['nDCG@10']:.4f} "
                         f"| teacher {t[stage]['teacher']['nDCG@10']:.4f}")
    if "cross_year" in r:
        x = r["cross_year"]
        lines += ["", f"Cross-year: {x['student']} trained on every DL19 query's lists ({x['trained_on_lists']}), ranking "
                  f"{x['collection']}'s BM25 top {cfg.top_n} ({x['queries']} queries, never trained on): first stage "
                  f"{x['first_stage']:.4f}, student {x['raw']:.4f}, blended with the first stage (w = {x['first_stage_weight']}, chosen on DL19's "
                  f"out-of-fold BM25 lists) {x['blended']:.4f}."]
    lines += ["", "## In sample (a bound on what limits each student)", "",
              f"Each fold's student also ranked up to {cfg.in_sample} BM25 lists of its own training queries; means over the folds.", "",
              "| student | its training lists: nDCG@10 | first stage | teacher | tau to teacher | out of fold (BM25): nDCG@10 |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for n, folds in r["in_sample"].items():
        got = [f for f in folds if f["lists"]]
        if got:
            mean = lambda k: float(np.mean([f[k] for f in got]))  # noqa: E731
            lines.append(f"| {n} | {mean('nDCG@10'):.4f} | {mean('first_stage'):.4f} | {mean('teacher'):.4f} | "
                         f"{mean('tau_to_teacher'):.3f} | {t['bm25'][n]['nDCG@10']:.4f} |")
    for n, folds in r["losses"].items():
        curves = [f for f in folds if len(f) >= 10]
        if curves:
            per_step = np.mean([h["elapsed_s"] / h["step"] for h in r["history"][n] if h])
            lines.append(f"\n{n}: training loss (mean over folds) {np.mean([f[:5] for f in curves]):.4f} over its first 5 steps, "
                         f"{np.mean([f[-5:] for f in curves]):.4f} over its last 5 ({len(curves[0])} steps a fold, {per_step:.1f} s a step).")
    lines += ["", f"student in the `over` lines: {overall} (named in the config before the test folds were read). Seconds a fold: "
              + "; ".join(f"{n} {np.mean(sec):.0f}" for n, sec in r["fold_seconds"].items()) + f"; {r['seconds']:.0f} s in all.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cfg = recipe_config(AdaptationConfig, __doc__, argv, "configs/adaptation/dl19-multistage.yaml")
    report = run(cfg)
    if report:
        print(markdown(cfg, report))


if __name__ == "__main__":
    main()
