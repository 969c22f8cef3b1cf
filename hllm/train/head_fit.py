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
from dataclasses import dataclass

import numpy as np
import torch

from hllm.eval.evaluation import quality
from hllm.model.decoding import DECODERS
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
    return StateSlate(slate, item.states[keep], perm)


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
def score_state_slates(ranker: SinglePassRanker, items: Sequence[StateSlate], batch_size: int = 16) -> list[np.ndarray]:
    """Per slate its (n, min(K, n)) score matrix from cached states: what `Reranker.score_encoded`
    returns for the same prompts, without the prefill."""
    was_training = ranker.training
    ranker.eval()
    out: list[np.ndarray] = []
    for start in range(0, len(items), batch_size):
        chunk = items[start: start + batch_size]
        batch = state_batch(chunk, None, ranker.device)
        logits = ranker.score_states(batch["states"], batch["item_mask"]).float().cpu().numpy()  # (B, N, K)
        for row, item in enumerate(chunk):
            n = len(item.slate.candidates)
            out.append(logits[row, :n, : min(n, logits.shape[2])])
    ranker.train(was_training)
    return out


def state_orders(ranker: SinglePassRanker, items: Sequence[StateSlate], decoder: str = "hungarian") -> list[list[int]]:
    return [DECODERS[decoder](m).permutation.tolist() for m in score_state_slates(ranker, items)]


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
    """The closed-form fit of a linear probe: ridge regression from each item's state to its grade
    over every item of `items` (features standardised, L2 weight `lam`). -> (w (D,), b ()), the
    standardisation folded in, for a `utility` head's linear map."""
    x = torch.cat([i.states for i in items]).double()  # (M, D)
    y = torch.tensor([g for i in items for g in i.grades(unjudged)], dtype=torch.float64)  # (M,)
    if (y < 0).any():
        raise ValueError("ridge_utility needs every item graded (set unjudged)")
    mu, sd = x.mean(0), x.std(0) + 1e-6  # (D,) each
    xn = (x - mu) / sd  # (M, D)
    w = torch.linalg.solve(xn.T @ xn + lam * torch.eye(x.shape[1], dtype=x.dtype), xn.T @ (y - y.mean()))  # (D,)
    w = w / sd
    return w.float(), -(w @ mu).float()


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
