"""The head alone, trained on cached item states (a frozen backbone), its steps chosen on held-out queries.

Once the states are cached (`hllm.train.state_cache`) a step costs the head's forward and backward only
(~10 ms for 8 slates of 100 candidates on 2 cores), so the head trains for thousands of steps in
minutes, where a LoRA step through a 135M backbone costs seconds. Every `TrainConfig.log_every`
steps the head ranks the validation queries (never the test ones) and the best head so far (by
`select_metric`, nDCG@10 by default) is kept: early stopping chosen by held-out queries.

Sub-slates (`sample_items`) make many training slates of one query from its cached states: m
of its candidates, kept in input order (the prior then reads their ranks within the sub-slate).
The states were computed in the context of the whole list, so sub-slates are an augmentation of
the head's input, not new prefills.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from hllm.data.splits import unit_hash
from hllm.eval.evaluation import quality
from hllm.model.confidence import Confidence, confidence
from hllm.model.decoding import DECODERS
from hllm.model.heads import within_support
from hllm.model.ranker import SinglePassRanker
from hllm.records import RerankRequest
from hllm.train.loop import LossConfig, TorchOptimizer, TrainConfig, batches, padded_targets, train_loop
from hllm.train.losses import mixed_loss


@dataclass
class StateSlate:
    """A slate with its cached item states and, where a teacher ranked it, the teacher's permutation."""

    slate: RerankRequest
    states: torch.Tensor  # (N, D) float32, input order
    perm: list[int] | None = None  # 0-based, best first
    utility: list[float] | None = None  # the ridge probe's target per item, input order (None: the grades)

    def grades(self, unjudged: int | None) -> list[int]:
        """Grades in input order; unjudged candidates as `unjudged` (None: -1, left out of graded losses)."""
        fill = -1 if unjudged is None else unjudged
        return [fill if g is None else g for g in (self.slate.grades or [None] * len(self.slate.candidates))]


def sub_slate(item: StateSlate, m: int, rng: random.Random) -> StateSlate:
    """m of the slate's candidates, in input order (the whole slate when it has <= m)."""
    n = len(item.slate.candidates)
    if n <= m:
        return item
    keep = sorted(rng.sample(range(n), m))
    s = item.slate
    slate = RerankRequest(s.query, [s.candidates[i] for i in keep],
                          [s.grades[i] for i in keep] if s.grades else None, s.extra_qrels)
    perm = None
    if item.perm is not None:
        where = {old: new for new, old in enumerate(keep)}
        perm = [where[i] for i in item.perm if i in where]
    utility = None if item.utility is None else [item.utility[i] for i in keep]
    return StateSlate(slate, item.states[keep], perm, utility)


def state_batch(items: Sequence[StateSlate], unjudged: int | None, device: torch.device | str) -> dict[str, torch.Tensor]:
    """-> states (B, N, D), item_mask (B, N), perm (B, N) and grades (B, N), both padded with -1."""
    b, n, d = len(items), max(len(i.slate.candidates) for i in items), items[0].states.shape[1]
    states = torch.zeros((b, n, d))  # (B, N, D)
    mask = torch.zeros((b, n), dtype=torch.bool)  # (B, N)
    for row, item in enumerate(items):
        states[row, : len(item.states)], mask[row, : len(item.states)] = item.states, True
    perm, grades = padded_targets([i.perm for i in items], [i.grades(unjudged) for i in items], n)
    return {k: v.to(device) for k, v in
            {"states": states, "item_mask": mask, "perm": perm, "grades": grades}.items()}


@torch.no_grad()
def score_state_slates(ranker: SinglePassRanker, items: Sequence[StateSlate], batch_size: int = 16, *,
                       first_stage_order: bool = True) -> list[np.ndarray]:
    """Per slate its (n, min(K, n)) score matrix from cached states: what `Reranker.score_encoded`
    returns for the same prompts, without the prefill (`first_stage_order`: whether the slates' order is declared
    a first-stage ranking, as `EncodedPrompt.first_stage_order`)."""
    was_training = ranker.training
    ranker.eval()
    out: list[np.ndarray] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start: start + batch_size]
        batch = state_batch(chunk, None, ranker.device)
        declared = torch.full((len(chunk),), first_stage_order, device=ranker.device)  # (B,)
        logits = ranker.score_states(batch["states"], batch["item_mask"], declared).float().cpu().numpy()  # (B, N, K)
        for row, item in enumerate(chunk):
            n = len(item.slate.candidates)
            out.append(logits[row, :n, : min(n, logits.shape[2])])
    ranker.train(was_training)
    return out


def state_orders(ranker: SinglePassRanker, items: Sequence[StateSlate], decoder: str = "hungarian", *,
                 first_stage_order: bool = True) -> list[list[int]]:
    return decode_orders(score_state_slates(ranker, items, first_stage_order=first_stage_order), decoder)


def decode_orders(matrices: Sequence[np.ndarray], decoder: str = "hungarian") -> list[list[int]]:
    """Per (N, K) matrix its decoded order, best first."""
    return [DECODERS[decoder](m).permutation.tolist() for m in matrices]


def _batches(items: list[StateSlate], cfg: TrainConfig, sample_items: int | None) -> Iterator[list[StateSlate]]:
    """The training loop's shuffled batches, each slate cut to a sub-slate when `sample_items` is set."""
    chunks = batches(items, cfg.batch_size, cfg.seed)
    if not sample_items:
        return chunks
    rng = random.Random(cfg.seed)
    return ([sub_slate(i, sample_items, rng) for i in chunk] for chunk in chunks)


def fit_head(ranker: SinglePassRanker, train: list[StateSlate], val: list[StateSlate], cfg: TrainConfig,
             loss: LossConfig, rel: int, *, unjudged: int | None = 0, sample_items: int | None = None,
             select_metric: str = "nDCG@10", decoder: str = "hungarian", stop_at: int | None = None,
             log: Callable[[int, dict], None] | None = None) -> dict:
    """Trains `ranker.head` (the backbone is not touched) and keeps the head of the step with the best
    `select_metric` on `val` (with no `val`: the last step; `stop_at` ends the run at that step of the
    schedule, e.g. one chosen by cross-validation). -> {"history", "best_step", "best_val", "val_at_start"}."""
    if not train:
        raise ValueError("no training slates")
    torch.manual_seed(cfg.seed)
    ranker.requires_grad_(False)
    ranker.head.requires_grad_(True)
    best = {"step": 0, "value": -1.0, "state": copy.deepcopy(ranker.head.state_dict())}

    def validate() -> dict[str, float]:
        if not val:
            return {}
        value = quality([i.slate for i in val], state_orders(ranker, val, decoder), rel)[select_metric]
        return {f"val_{select_metric}": value}

    start = validate()
    if start:
        best["value"] = start[f"val_{select_metric}"]
    step = {"n": 0}

    def loss_fn(chunk: list[StateSlate]):
        step["n"] += 1
        batch = state_batch(chunk, unjudged, ranker.device)
        logits = ranker.score_states(batch["states"], batch["item_mask"])  # (B, N, K)
        return mixed_loss(logits, batch["item_mask"], loss.terms, perm=batch["perm"], grades=batch["grades"])

    def keep_best() -> dict[str, float]:
        row = validate()
        if row and row[f"val_{select_metric}"] > best["value"]:
            best.update(step=step["n"], value=row[f"val_{select_metric}"], state=copy.deepcopy(ranker.head.state_dict()))
        return row

    ranker.head.train()
    if stop_at == 0:  # the untrained head: the input order
        ranker.eval()
        return {"history": [], "best_step": 0, "best_val": start.get(f"val_{select_metric}"), "val_at_start": start.get(f"val_{select_metric}")}
    history = train_loop(loss_fn, _batches(train, cfg, sample_items),
                         TorchOptimizer([(list(ranker.head.parameters()), cfg.head_lr or cfg.lr)], cfg),
                         cfg, ranker.device.type, validate=keep_best if val else None, log=log,
                         agree=lambda stop: stop or (stop_at is not None and step["n"] >= stop_at))
    if val:
        ranker.head.load_state_dict(best["state"])
    ranker.eval()
    return {"history": history, "best_step": best["step"] if val else len(history),
            "best_val": best["value"] if val else None, "val_at_start": start.get(f"val_{select_metric}")}


def ridge_utility(items: Sequence[StateSlate], lam: float, unjudged: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The closed-form fit of a linear probe: ridge regression from each item's state to its target
    (`StateSlate.utility`, else its grade) over every item of `items` (features standardised, L2
    weight `lam`). -> (w (D,), b ()), the standardisation folded in, for a `utility` head's linear map."""
    return ridge_utilities(items, [lam], unjudged)[0]


def ridge_utilities(items: Sequence[StateSlate], lambdas: Sequence[float], unjudged: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`ridge_utility` for every L2 weight of `lambdas` from one eigendecomposition of the Gram matrix
    (the ridge path: w(lam) = V diag(1 / (e + lam)) V^T X^T y). -> per weight (w (D,), b ())."""
    x = torch.cat([i.states for i in items]).double()  # (M, D)
    y = torch.tensor([g for i in items for g in (i.utility if i.utility is not None else i.grades(unjudged))],
                     dtype=torch.float64)  # (M,)
    if (y < 0).any():
        raise ValueError("ridge_utility needs every item graded (set unjudged)")
    mu, sd = x.mean(0), x.std(0) + 1e-6  # (D,) each
    xn = (x - mu) / sd  # (M, D)
    e, v = torch.linalg.eigh(xn.T @ xn)  # (D,), (D, D)
    proj = v.T @ (xn.T @ (y - y.mean()))  # (D,)
    out = []
    for lam in lambdas:
        w = (v @ (proj / (e.clamp_min(0) + lam))) / sd  # (D,)
        out.append((w.float(), -(w @ mu).float()))
    return out


@torch.no_grad()
def set_utility(ranker: SinglePassRanker, w: torch.Tensor, b: torch.Tensor, prior_scale: float) -> None:
    """Loads a probe into a `utility` head under the `logrank` prior: the ranking is then by
    z(u) - prior_scale * log(1 + first-stage rank), the gate at 1."""
    head = ranker.head
    if ranker.cfg.head.kind != "utility" or ranker.cfg.head.prior != "logrank":
        raise ValueError("a closed-form probe needs head.kind=utility and head.prior=logrank")
    head.residual.net.weight.copy_(w[None, :])
    head.residual.net.bias.copy_(b.reshape(1))
    head.log_beta.fill_(math.log(prior_scale))
    head.gate.weight.zero_()
    head.gate.bias.zero_()


# ---- choosing on the training queries: k-fold cross-validation by query ---------------------------
def query_folds(n: int, ids: Sequence[str], k: int, salt: str = "") -> list[tuple[list[int], list[int]]]:
    """k (train, held-out) splits of `n` items by a hash of their query id (`ids`, prefixed with `salt`:
    folds nested in folds take another salt, or the inner ones would follow the outer), as index lists;
    empty folds left out. The same split on every machine."""
    fold_of = [min(int(unit_hash(salt + q) * k), k - 1) for q in ids]
    folds = sorted(set(fold_of))
    if len(folds) < 2:
        raise ValueError(f"cross-validation needs queries in at least 2 of its {k} folds; {n} queries fill {len(folds)}")
    return [([i for i in range(n) if fold_of[i] != f], [i for i in range(n) if fold_of[i] == f]) for f in folds]


def _pick(items: Sequence[StateSlate], index: Sequence[int]) -> list[StateSlate]:
    return [items[i] for i in index]


@dataclass
class HeadFit:
    """What fitting a head chose and measured. Ridge: the (L2 weight, prior scale) chosen by CV over the training
    queries; SGD: the step; each with its held-out nDCG@10 and the first stage's on the same folds. LoRA: its loss
    rows, and the ridge probe its head started from. `guard`: the domain guard's thresholds where the head has one."""

    ridge_lambda: float | None = None
    prior_scale: float | None = None
    best_step: int | None = None
    cv_score: float | None = None  # mean held-out nDCG@10 of the choice (None: not cross-validated, a LoRA fit)
    cv_first_stage: float | None = None  # the first stage's on the same held-out folds
    cv_grid: dict[str, float] | None = None  # "L2/scale" -> mean held-out nDCG@10
    cv_curve: dict[int, float] | None = None  # step -> mean held-out nDCG@10
    guard: dict[str, float] | None = None  # fit_guard's thresholds
    head_init: HeadFit | None = None  # a LoRA student's starting probe (its grid left out)
    history: list[dict[str, Any]] | None = None  # a LoRA student's loss rows

    @property
    def cross_validated(self) -> bool:
        return self.cv_score is not None

    def to_json(self, without: Sequence[str] = ()) -> dict[str, Any]:
        """The fields that are set (and not in `without`), as JSON values."""
        return {f.name: (v.to_json() if isinstance(v, HeadFit) else v) for f in fields(self)
                if (v := getattr(self, f.name)) is not None and f.name not in without}

    def summary(self, guard: bool = False) -> dict[str, Any]:
        """The choice and its CV scores (no grid, curve or loss rows); with `guard`, the guard's thresholds too."""
        keys = ("cv_score", "cv_first_stage", "ridge_lambda", "prior_scale", "best_step", "head_init") + (("guard",) if guard else ())
        got = self.to_json()
        return {k: got[k] for k in keys if k in got}


def cv_ridge(ranker: SinglePassRanker, items: Sequence[StateSlate], judge: Sequence[StateSlate], k: int,
             lambdas: Sequence[float], scales: Sequence[float], rel: int, unjudged: int = 0) -> HeadFit:
    """The closed-form probe under the logrank prior: (L2 weight, prior scale) by k-fold CV over the
    queries of `items` (fitted on their targets), each held-out fold scored by nDCG@10 on `judge`
    (the same queries, in the same order, graded as the choice should be judged: the qrels, or the
    teacher's order); then fitted on every query and loaded into `ranker.head`."""
    grid: dict[tuple[float, float], list[float]] = {}
    folds = query_folds(len(items), [i.slate.slate_id for i in items], k)
    for train, held in folds:
        for lam, (w, b) in zip(lambdas, ridge_utilities(_pick(items, train), lambdas, unjudged)):
            for scale in scales:
                set_utility(ranker, w, b, scale)
                grid.setdefault((lam, scale), []).append(judged_ndcg(ranker, _pick(judge, held), rel))
    mean = {key: float(np.mean(v)) for key, v in grid.items()}
    lam, scale = max(mean, key=lambda key: (round(mean[key], 6), key[0], key[1]))  # ties: more shrinkage, more prior
    set_utility(ranker, *ridge_utility(items, lam, unjudged), scale)
    first = float(np.mean([first_stage_ndcg(_pick(judge, held), rel) for _, held in folds]))
    return HeadFit(ridge_lambda=lam, prior_scale=scale, cv_score=mean[lam, scale], cv_first_stage=first,
                   cv_grid={f"{key[0]:g}/{key[1]:g}": v for key, v in mean.items()})


def cv_sgd(ranker: SinglePassRanker, items: Sequence[StateSlate], judge: Sequence[StateSlate], k: int, cfg: TrainConfig,
           loss: LossConfig, rel: int, new_head: Callable[[], None], unjudged: int | None = 0,
           sample_items: int | None = None) -> HeadFit:
    """The head by SGD, its step count chosen by k-fold CV over the queries of `items` (trained on their
    targets; held-out folds scored every `cfg.log_every` steps by nDCG@10 on `judge`, aligned with
    `items`): the step with the best mean held-out score, then one head trained on every query up to
    that step of the same schedule. `new_head()` puts a fresh head in `ranker`."""
    curves = []  # per fold: {step: held-out nDCG@10}
    for train, held in query_folds(len(items), [i.slate.slate_id for i in items], k):
        new_head()
        view = [StateSlate(j.slate, i.states, i.perm, i.utility) for i, j in zip(_pick(items, held), _pick(judge, held))]
        out = fit_head(ranker, _pick(items, train), view, cfg, loss, rel, unjudged=unjudged, sample_items=sample_items)
        curves.append({0: out["val_at_start"], **{r["step"]: r["val_nDCG@10"] for r in out["history"] if "val_nDCG@10" in r}})
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    mean = {s: float(np.mean([c[s] for c in curves])) for s in steps}
    best = max(steps, key=lambda s: (round(mean[s], 6), -s))  # a tie goes to the earlier step
    new_head()
    fit_head(ranker, list(items), [], cfg, loss, rel, unjudged=unjudged, sample_items=sample_items, stop_at=best)
    return HeadFit(best_step=best, cv_score=mean[best], cv_first_stage=mean[0], cv_curve=mean)


# ---- the domain guard: how far a slate's states lie from the training data -------------------------
@torch.no_grad()
def guard_statistics(states: Sequence[torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """The training items' distribution as a `DomainGuard` keeps it, from per-slate (N, D) states:
    mean, the `rank` principal directions with 1 / their variances, 1 / the mean variance of the rest."""
    x = torch.cat(list(states)).double()  # (M, D)
    mean = x.mean(0)  # (D,)
    xc = x - mean
    var, vecs = torch.linalg.eigh(xc.T @ xc / max(len(x) - 1, 1))  # ascending: (D,), (D, D)
    var, vecs = var.flip(0).clamp_min(0), vecs.flip(1)
    r = min(rank, x.shape[1])
    floor = max(float(var[0]) * 1e-6, 1e-12)  # a direction the training data never moved along is not free
    rest = var[r:].mean() if r < x.shape[1] else torch.tensor(floor, dtype=var.dtype)
    return {"mean": mean.float(), "basis": vecs[:, :r].T.float(), "inv_var": (1.0 / var[:r].clamp_min(floor)).float(),
            "inv_rest": (1.0 / rest.clamp_min(floor)).float()}


@torch.no_grad()
def _per_slate(ranker: SinglePassRanker, items: Sequence[StateSlate], fn: Callable) -> np.ndarray:
    """(len(items),) `fn(states (1, N, D), mask (1, N))` of each slate's states, one slate at a time."""
    return np.array([float(fn(i.states[None].to(ranker.device),
                              torch.ones(1, len(i.states), dtype=torch.bool, device=ranker.device))) for i in items])


def guard_distances(ranker: SinglePassRanker, items: Sequence[StateSlate]) -> np.ndarray:
    """(len(items),) each slate's distance to the training data under the ranker's fitted guard."""
    return _per_slate(ranker, items, _guard(ranker).distance)


def guard_trust(ranker: SinglePassRanker, items: Sequence[StateSlate]) -> np.ndarray:
    """(len(items),) the trust in [0, 1] the ranker's guard gives each slate (0 outside its support)."""
    return _per_slate(ranker, items, _guard(ranker)) * supported(ranker, items)


def _guard(ranker: SinglePassRanker):
    guard = getattr(ranker.head, "guard", None)
    if guard is None:
        raise ValueError("the ranker's head has no domain guard: set ranker.head.guard=distance (with a prior)")
    return guard


def doc_budgets(ranker: SinglePassRanker, items: Sequence[StateSlate]) -> list[int]:
    """Per slate, the tokens its prompt let each passage show (`EncodedPrompt.doc_budget`; tokenizing only)."""
    return [ranker.prompts.encode(i.slate, with_answer=False).doc_budget for i in items]


def supported(ranker: SinglePassRanker, items: Sequence[StateSlate]) -> np.ndarray:
    """(len(items),) whether each slate's prompt is within the guard's support (`DomainGuard.supports`)."""
    guard = _guard(ranker)
    return np.array([guard.supports(b) for b in doc_budgets(ranker, items)])


def guarded_matrices(ranker: SinglePassRanker, items: Sequence[StateSlate]) -> list[np.ndarray]:
    """`score_state_slates` as `Reranker.score_with_trust` scores: each matrix through `within_support` (a slate
    outside the guard's support is scored by the prior alone: its input order)."""
    matrices = score_state_slates(ranker, items)
    if getattr(ranker.head, "guard", None) is not None:
        matrices = [within_support(ranker.head, m, b)[0] for m, b in zip(matrices, doc_budgets(ranker, items))]
    return matrices


def guarded_orders(ranker: SinglePassRanker, items: Sequence[StateSlate], decoder: str = "hungarian") -> list[list[int]]:
    """Each slate's order as `Reranker` ranks it (`guarded_matrices`, decoded)."""
    return decode_orders(guarded_matrices(ranker, items), decoder)


def state_confidence(ranker: SinglePassRanker, items: Sequence[StateSlate]) -> list[Confidence]:
    """Each slate's confidence as `Reranker.rank_assessed` reads it, from cached states: the guarded matrix, its
    order, the guard's trust (none without a guard)."""
    matrices = guarded_matrices(ranker, items)
    trust = guard_trust(ranker, items) if getattr(ranker.head, "guard", None) is not None else [None] * len(items)
    return [confidence(m, np.array(o), None if t is None else float(t)) for m, o, t in zip(matrices, decode_orders(matrices), trust)]


@torch.no_grad()
def fit_guard(ranker: SinglePassRanker, items: Sequence[StateSlate], k: int) -> dict[str, float]:
    """Fits the head's `DomainGuard` on the training slates `items`, its thresholds set by their own
    held-out distances: k-fold over queries, each fold's slates measured against the others' statistics.
    Trust is 1 up to the largest held-out distance (every training query, held out, would have been
    trusted), 0 beyond it by as much again as it lies above their median. Then the statistics of every
    slate are kept, and the smallest per-passage token budget of their prompts as the guard's support.
    -> {"guard_low", "guard_high", "guard_heldout_median", "guard_heldout_max", "guard_min_doc_budget"}."""
    guard = _guard(ranker)

    def load(stats: dict[str, torch.Tensor]) -> None:
        for name, value in stats.items():
            getattr(guard, name).copy_(value.to(getattr(guard, name)))

    held_out = np.empty(len(items))
    for train, held in query_folds(len(items), [i.slate.slate_id for i in items], k, salt="guard"):
        load(guard_statistics([items[i].states for i in train], guard.basis.shape[0]))
        held_out[held] = guard_distances(ranker, _pick(items, held))
    load(guard_statistics([i.states for i in items], guard.basis.shape[0]))
    median, top = float(np.median(held_out)), float(held_out.max())
    guard.low.fill_(top)
    guard.high.fill_(top + max(top - median, 1e-6))
    guard.min_doc_budget.fill_(min(doc_budgets(ranker, items)))
    return {"guard_low": top, "guard_high": float(guard.high), "guard_heldout_median": median, "guard_heldout_max": top,
            "guard_min_doc_budget": int(guard.min_doc_budget)}


def judged_ndcg(ranker: SinglePassRanker, items: Sequence[StateSlate], rel: int) -> float:
    return quality([i.slate for i in items], state_orders(ranker, items), rel)["nDCG@10"]


def first_stage_ndcg(items: Sequence[StateSlate], rel: int) -> float:
    return quality([i.slate for i in items], [list(range(len(i.slate.candidates))) for i in items], rel)["nDCG@10"]
