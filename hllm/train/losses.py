"""Ranking losses: pure, tensor-in, masked. Each returns a scalar; 0 when nothing is unmasked.

Letters: B batch, N items (padded), K positions. Inputs shared by all losses:
    logits     (B, N, K)  logit that item n lands at rank k (the scalar head has K = 1)
    item_mask  (B, N)     True for real items, False for padding
Teacher losses take `perm` (B, N): the teacher's permutation, item indices best first, padded
with -1. Graded losses take `grades` (B, N): relevance grades, -1 for padding/unjudged.

References: position CE and Sinkhorn CE as in hLLM/SPD (arXiv 2609.01807); Sinkhorn operator
(Mena et al., 2018, "Learning Latent Permutations with Gumbel-Sinkhorn Networks"); ListMLE (Xia et
al., 2008); ListNet (Cao et al., 2007).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

NEG = -1e9  # a finite "minus infinity", so masked logsumexps stay NaN-free


def _position_mask(item_mask: torch.Tensor, k: int) -> torch.Tensor:
    """(B, K) True where position k < number of real items in that slate."""
    n_real = item_mask.sum(dim=1, keepdim=True)  # (B, 1)
    return torch.arange(k, device=item_mask.device)[None, :] < n_real


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def _item_log_softmax(logits: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
    """(B, N, K) log P(item n | position k), normalised over real items."""
    masked = logits.float().masked_fill(~item_mask[:, :, None], NEG)
    return torch.log_softmax(masked, dim=1)


def position_ce(logits: torch.Tensor, perm: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the teacher's item at each of the first K positions, over items."""
    k = logits.shape[2]
    log_p = _item_log_softmax(logits, item_mask)  # (B, N, K)
    target = perm[:, :k].clamp_min(0)  # (B, K) item at position k
    picked = log_p.gather(1, target[:, None, :]).squeeze(1)  # (B, K)
    valid = _position_mask(item_mask, k) & (perm[:, :k] >= 0)
    return _masked_mean(-picked, valid)


def log_sinkhorn(logits: torch.Tensor, item_mask: torch.Tensor, iters: int = 20, tau: float = 1.0) -> torch.Tensor:
    """(B, N, K) -> (B, N, N) log of a doubly-stochastic matrix over each slate's real items.

    Rectangular inputs (K < N) get N - K zero-logit slack positions ("ranked below K").
    """
    b, n, k = logits.shape
    square = torch.zeros((b, n, n), dtype=torch.float32, device=logits.device)  # (B, N, N)
    square[:, :, :k] = logits.float() / tau
    valid = item_mask[:, :, None] & _position_mask(item_mask, n)[:, None, :]  # (B, N, N)
    log_p = square.masked_fill(~valid, NEG)
    for _ in range(iters):
        log_p = (log_p - torch.logsumexp(log_p, dim=2, keepdim=True)).masked_fill(~valid, NEG)
        log_p = (log_p - torch.logsumexp(log_p, dim=1, keepdim=True)).masked_fill(~valid, NEG)
    return log_p


def sinkhorn_ce(logits: torch.Tensor, perm: torch.Tensor, item_mask: torch.Tensor,
                iters: int = 20, tau: float = 1.0) -> torch.Tensor:
    """The paper's loss: CE of the teacher's assignment under the Sinkhorn-normalised matrix."""
    k = logits.shape[2]
    log_p = log_sinkhorn(logits, item_mask, iters, tau)[:, :, :k]  # (B, N, K)
    target = perm[:, :k].clamp_min(0)
    picked = log_p.gather(1, target[:, None, :]).squeeze(1)  # (B, K)
    valid = _position_mask(item_mask, k) & (perm[:, :k] >= 0)
    return _masked_mean(-picked, valid)


def listmle(logits: torch.Tensor, perm: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
    """Plackett-Luce negative log-likelihood of the teacher's permutation, per item."""
    scores = logits[..., 0].float()  # (B, N) one score per item (column 0)
    valid = perm >= 0  # (B, N) over ranks
    ordered = scores.gather(1, perm.clamp_min(0)).masked_fill(~valid, NEG)  # (B, N) by rank
    # logsumexp over the items still unranked at each rank: reverse cumulative logsumexp
    tail = torch.logcumsumexp(ordered.flip(1), dim=1).flip(1)  # (B, N)
    return _masked_mean(tail - ordered, valid & item_mask)


def graded_ce(logits: torch.Tensor, grades: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
    """Position CE against the ideal ranking from grades, tie-aware.

    At position k the ideal order has grade g*_k; every item of that grade is a right answer,
    so the loss is -log sum_{n: grade_n = g*_k} P(n | k).
    """
    k = logits.shape[2]
    log_p = _item_log_softmax(logits, item_mask)[:, :, :k]  # (B, N, K)
    g = grades.float().masked_fill(~item_mask, -1.0)  # (B, N)
    ideal = g.sort(dim=1, descending=True).values[:, :k]  # (B, K) grade wanted at rank k
    accept = (g[:, :, None] == ideal[:, None, :]) & item_mask[:, :, None]  # (B, N, K)
    picked = torch.logsumexp(log_p.masked_fill(~accept, NEG), dim=1)  # (B, K)
    valid = _position_mask(item_mask, k) & (ideal >= 0)
    return _masked_mean(-picked, valid)


def listnet_kl(logits: torch.Tensor, grades: torch.Tensor, item_mask: torch.Tensor,
               temperature: float = 1.0) -> torch.Tensor:
    """KL(softmax(grades / T) || softmax(score)) over real items (ListNet top-1, zero at optimum)."""
    valid = item_mask & (grades >= 0)
    scores = logits[..., 0].float().masked_fill(~valid, NEG)  # (B, N)
    target = torch.softmax((grades.float() / temperature).masked_fill(~valid, NEG), dim=1)
    kl = target * (torch.log(target.clamp_min(1e-12)) - torch.log_softmax(scores, dim=1))
    per_slate = (kl * valid).sum(dim=1)  # (B,)
    has_any = valid.any(dim=1)
    return _masked_mean(per_slate, has_any)


@dataclass(frozen=True)
class LossSpec:
    fn: Callable[..., torch.Tensor]
    target: str  # "perm" (teacher permutation) or "grades"
    scalar: bool  # uses only column 0: meant for the scalar head


LOSSES: dict[str, LossSpec] = {
    "position_ce": LossSpec(position_ce, "perm", scalar=False),
    "sinkhorn_ce": LossSpec(sinkhorn_ce, "perm", scalar=False),
    "listmle": LossSpec(listmle, "perm", scalar=True),
    "graded_ce": LossSpec(graded_ce, "grades", scalar=False),
    "listnet": LossSpec(listnet_kl, "grades", scalar=True),
}


def mixed_loss(logits: torch.Tensor, item_mask: torch.Tensor, terms: dict[str, float],
               perm: torch.Tensor | None = None, grades: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """sum_i weight_i * LOSSES[name_i]; -> (total, {name: value}) for logging."""
    total = logits.new_zeros((), dtype=torch.float32)
    parts = {}
    for name, weight in terms.items():
        if weight == 0:
            continue
        spec = LOSSES[name]
        target = perm if spec.target == "perm" else grades
        if target is None:
            raise ValueError(f"loss {name!r} needs {spec.target!r}, which this batch lacks")
        value = spec.fn(logits, target, item_mask)
        parts[name] = float(value.detach())
        total = total + weight * value
    return total, parts
