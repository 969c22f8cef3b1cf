"""Scoring heads: item hidden states (B, N, D) -> item-position logits (B, N, K).

- `attention` (the paper's): a small Transformer encoder over the N candidate states, so each
  item's row is scored in the context of the whole slate, then a linear map to K positions.
  No positional embedding: rows permute with the input (the backbone already saw the order).
- `linear`: a per-item probe to K logits; items do not see each other in the head.
- `scalar`: one score per item (K = 1); decoders then reduce to sorting.
- `utility`: one score u_n per item, spread over K positions by the DCG discount,
  u_n / log2(k + 2): alone it sorts by u (rearrangement), under a prior the assignment trades the
  prior against u. A probe with K-fold fewer read-out weights than `linear`, for few queries.

A first-stage prior (`prior: rank`) wraps any of them: the scores are a rank prior that puts the
n-th input item at rank n, plus the head's output as a residual scaled by a per-slate gate. The
residual's read-out starts at zero, so an untrained head returns the input (first-stage) order
exactly, and training moves away from it only as far as the loss pays for.

A domain guard (`guard: distance`, under a prior) scales that residual by a per-slate trust in
[0, 1] read off how far the slate's item states lie from the training items' (`DomainGuard`): 1 on
data like the training data, 0 (the first-stage order, exactly) on a slate farther than any held-out
training slate was by a margin. Its statistics are fitted with the head (`hllm.train.head_fit.fit_guard`)
and saved with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class HeadConfig:
    """The single-pass head."""

    kind: Literal["attention", "linear", "scalar", "utility"] = "attention"  # attention: the paper's; others: ablations
    positions: int = 20  # K; use the slate size N for K = N, fewer for a rectangular top-K head
    layers: int = 2  # attention head: encoder layers
    width: int = 256  # attention head: model width
    num_heads: int = 4  # attention head: attention heads
    dropout: float = 0.0  # attention head: dropout while training
    prior: Literal["none", "rank", "logrank"] = "none"  # first-stage rank prior + gated learned residual (hllm.model.heads.PRIORS)
    prior_strength: float = 1.0  # rank prior: initial beta of -beta * (log(1 + n) - log(1 + k))^2 (learned)
    # under a prior: scale the residual by a per-slate trust from the states' distance to the training
    # data (hllm.model.heads.DomainGuard), falling back to the first-stage order where it is far
    guard: Literal["none", "distance"] = "none"
    guard_rank: int = 64  # distance guard: principal directions of the training states kept

    def __post_init__(self) -> None:
        if self.guard != "none" and self.prior == "none":
            raise ValueError("head.guard falls back toward the first-stage order: it needs a head.prior (rank or logrank)")
        if self.guard_rank < 1:
            raise ValueError("head.guard_rank must be >= 1")
        if self.positions < 1:
            raise ValueError("head.positions (K) must be >= 1")
        if self.prior_strength <= 0:
            raise ValueError("head.prior_strength must be > 0")
        if self.kind == "attention" and self.width % self.num_heads:
            raise ValueError("head.width must be divisible by head.num_heads")

    @property
    def k(self) -> int:
        return 1 if self.kind == "scalar" else self.positions


class SelfAttention(nn.Module):
    """Multi-head self-attention over the items: one fused QKV projection and one SDPA call."""

    def __init__(self, width: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads, self.dropout = num_heads, dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, n, w = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # (B, N, 3W)
        q, k, v = qkv.view(b, n, 3, self.num_heads, w // self.num_heads).permute(2, 0, 3, 1, 4)  # (B, H, N, W/H) each
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                             dropout_p=self.dropout if self.training else 0.0)  # (B, H, N, W/H)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, w))  # (B, N, W)


class EncoderLayer(nn.Module):
    """Pre-norm Transformer encoder layer (ReLU MLP, 4x width). Parameter names are those of
    `nn.TransformerEncoderLayer`; the forward is a handful of fused ops, the same in training and
    inference (the head is a fixed cost on every request)."""

    def __init__(self, width: int, num_heads: int, dropout: float):
        super().__init__()
        self.self_attn = SelfAttention(width, num_heads, dropout)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.linear1, self.linear2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        if attn_mask is None and not (self.training or torch.is_grad_enabled()):
            return self._fused(x)  # inference on unpadded slates: one native op, the same arithmetic
        x = x + self.dropout(self.self_attn(self.norm1(x), attn_mask))  # (B, N, W)
        return x + self.dropout(self.linear2(self.dropout(F.relu(self.linear1(self.norm2(x))))))  # (B, N, W)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, W) -> (B, N, W): the whole layer as torch's native encoder-layer kernel (the one
        behind `nn.TransformerEncoderLayer`'s inference fast path, on CPU and CUDA), which spares ~15
        dispatches per layer; a per-request fixed cost at small N (tested equal to the eager path)."""
        attn = self.self_attn
        return torch._transformer_encoder_layer_fwd(
            x, x.shape[-1], attn.num_heads, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
            attn.out_proj.bias, False, True, self.norm1.eps, self.norm1.weight, self.norm1.bias,  # ReLU, pre-norm
            self.norm2.weight, self.norm2.bias, self.linear1.weight, self.linear1.bias, self.linear2.weight,
            self.linear2.bias, None, None)  # no mask


class AttentionHead(nn.Module):
    def __init__(self, hidden: int, cfg: HeadConfig):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, cfg.width)
        self.encoder = nn.Module()  # a container only: keeps the state-dict names `encoder.layers.i.*`
        self.encoder.layers = nn.ModuleList(EncoderLayer(cfg.width, cfg.num_heads, cfg.dropout) for _ in range(cfg.layers))
        self.out = nn.Sequential(nn.LayerNorm(cfg.width), nn.Linear(cfg.width, cfg.k))

    @property
    def readout(self) -> nn.Linear:
        """The last linear map (zeroed under a prior: the residual starts at 0)."""
        return self.out[1]

    def forward(self, items: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.norm(items))  # (B, N, W)
        # (B, 1, 1, N): padded items are never attended to; None when no slate of the batch is padded
        attn_mask = None if bool(item_mask.all()) else item_mask[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, attn_mask)  # (B, N, W)
        return self.out(x)  # (B, N, K)


class LinearHead(nn.Module):
    def __init__(self, hidden: int, cfg: HeadConfig):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, cfg.k))

    @property
    def readout(self) -> nn.Linear:
        return self.net[1]

    def forward(self, items: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
        return self.net(items)  # (B, N, K)


class UtilityHead(nn.Module):
    """u_n = w . x_n + b, standardised within the slate (over its real items), spread over K positions
    by the DCG discount: (B, N, K) = z(u) (B, N, 1) * 1 / log2(k + 2) (K,). A linear probe: the
    closed-form (ridge) fit of `hllm.train.head_fit.ridge_utility` sets w and b directly."""

    def __init__(self, hidden: int, cfg: HeadConfig):
        super().__init__()
        self.net = nn.Linear(hidden, 1)
        self.register_buffer("discount", dcg_discount(cfg.k), persistent=False)

    @property
    def readout(self) -> nn.Linear:
        return self.net

    def forward(self, items: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
        u = self.net(items)  # (B, N, 1)
        mask = item_mask[:, :, None].to(u.dtype)  # (B, N, 1)
        count = mask.sum(1, keepdim=True).clamp_min(1.0)  # (B, 1, 1)
        mean = (u * mask).sum(1, keepdim=True) / count
        std = (((u - mean) * mask) ** 2).sum(1, keepdim=True).div(count).sqrt()  # (B, 1, 1)
        return (u - mean) / (std + 1e-6) * self.discount.to(u.dtype)  # (B, N, K)


def dcg_discount(k: int, device: torch.device | None = None) -> torch.Tensor:
    """(K,) 1 / log2(k + 2): DCG's weight of rank k (0-based)."""
    return 1.0 / torch.log2(torch.arange(k, dtype=torch.float32, device=device) + 2.0)


HEADS: dict[str, Callable[[int, HeadConfig], nn.Module]] = {
    "attention": AttentionHead,
    "linear": LinearHead,
    "scalar": LinearHead,  # K = 1 via HeadConfig.k
    "utility": UtilityHead,
}


def logrank_prior(n: int, k: int, device: torch.device | None = None) -> torch.Tensor:
    """(N, K) -log(1 + n) / log2(k + 2): a first-stage score of -log(1 + rank) spread by the DCG
    discount, so that beta * prior + z(u) * discount assigns by -beta log(1 + rank) + z(u) (a fusion
    of the first-stage rank and the head's utility). The input order is its unique optimum
    (rearrangement: both factors strictly monotone)."""
    return -torch.log1p(torch.arange(n, dtype=torch.float32, device=device))[:, None] * dcg_discount(k, device)[None, :]


def rank_prior(n: int, k: int, device: torch.device | None = None) -> torch.Tensor:
    """(N, K) -(log(1 + n) - log(1 + k))^2: 0 on the diagonal, the first-stage order its unique
    optimal assignment (every other one has a negative term), and each row and column peaked where
    input rank = output rank, more sharply near the top, where ranks matter most."""
    f = torch.log1p(torch.arange(max(n, k), dtype=torch.float32, device=device))  # (max(N, K),)
    return -(f[:n, None] - f[None, :k]) ** 2  # (N, K)


class DomainGuard(nn.Module):
    """Per-slate trust in [0, 1] from the distance of its item states to the training items'.

    An item's distance is a Mahalanobis distance under the training states' covariance, kept as its R
    principal directions (each scaled by its variance) plus the residual's mean variance for the rest
    (the PCA-plus-residual form of Mahalanobis OOD scores), divided by D: ~1 for an item like the training
    items. A slate's distance is its items' mean. Trust is 1 up to `low`, 0 from `high`, linear between;
    an unfitted guard (low = high = inf) trusts every slate. Buffers only: fitted in closed form
    (`hllm.train.head_fit.fit_guard`), saved in the head's state dict.

    The states cannot tell that a prompt showed less of each passage than the training prompts did (a long
    query restated after every passage leaves the passages fewer tokens): `min_doc_budget`, the smallest
    per-passage budget of the training prompts, is the guard's support, and a prompt below it gets trust 0
    where the prompt is known (`supports`; `hllm.reranker.Reranker.score_with_trust`)."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        rank = min(rank, hidden)
        self.register_buffer("mean", torch.zeros(hidden))  # (D,)
        self.register_buffer("basis", torch.zeros(rank, hidden))  # (R, D) orthonormal rows
        self.register_buffer("inv_var", torch.zeros(rank))  # (R,) 1 / variance along each direction
        self.register_buffer("inv_rest", torch.zeros(()))  # 1 / mean variance off the directions
        self.register_buffer("low", torch.tensor(math.inf))
        self.register_buffer("high", torch.tensor(math.inf))
        self.register_buffer("min_doc_budget", torch.tensor(0.0))  # tokens a passage could show, at least (0: any)

    def supports(self, doc_budget: int) -> bool:
        """Whether a prompt that let each passage show `doc_budget` tokens is within the training prompts' range."""
        return doc_budget >= float(self.min_doc_budget)

    def distance(self, items: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
        """(B, N, D) states, (B, N) mask -> (B,) the mean over real items of d^2 / D."""
        x = items.float() - self.mean  # (B, N, D)
        proj = x @ self.basis.T  # (B, N, R)
        rest = (x * x).sum(-1) - (proj * proj).sum(-1)  # (B, N) squared norm off the directions
        d2 = (proj * proj * self.inv_var).sum(-1) + rest.clamp_min(0) * self.inv_rest  # (B, N)
        mask = item_mask.to(d2.dtype)
        return (d2 * mask).sum(1) / mask.sum(1).clamp_min(1.0) / items.shape[-1]  # (B,)

    def forward(self, items: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
        """-> (B,) trust in [0, 1]."""
        d = self.distance(items, item_mask)  # (B,)
        ramp = ((self.high - d) / (self.high - self.low)).clamp(0.0, 1.0)
        return torch.where(d <= self.low, torch.ones_like(d), ramp)  # an unfitted guard: 1

    @contextmanager
    @torch.no_grad()
    def suspended(self) -> Iterator[None]:
        """Trusts every slate inside the block (the unguarded head, for an ablation); restored after."""
        saved = {name: getattr(self, name).clone() for name in ("low", "high", "min_doc_budget")}
        self.low.fill_(math.inf)
        self.high.fill_(math.inf)
        self.min_doc_budget.fill_(0.0)
        try:
            yield
        finally:
            for name, value in saved.items():
                getattr(self, name).copy_(value)


class RankPriorHead(nn.Module):
    """scores = beta * prior + gate * residual: the input order until training says otherwise.

    beta (the prior's sharpness) is learned, from `prior_strength`; the gate, 2 * sigmoid of a
    linear map of the slate's mean item state, lets a slate trust the residual more or less
    (1 at initialisation); the residual head's read-out starts at zero. A `guard` (`DomainGuard`)
    multiplies the residual by its trust in the slate, so an untrusted slate keeps the input order."""

    def __init__(self, residual: nn.Module, hidden: int, cfg: HeadConfig):
        super().__init__()
        self.kind = cfg.prior
        self.guard = DomainGuard(hidden, cfg.guard_rank) if cfg.guard == "distance" else None
        self.residual = residual
        nn.init.zeros_(residual.readout.weight)
        nn.init.zeros_(residual.readout.bias)
        self.log_beta = nn.Parameter(torch.tensor(math.log(cfg.prior_strength)))
        self.gate_norm = nn.LayerNorm(hidden)
        self.gate = nn.Linear(hidden, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)

    def prior_scores(self, n: int, k: int, device: torch.device | None = None) -> torch.Tensor:
        """(N, K) the scores of a slate the head does not touch (its residual at 0): the input order's."""
        return self.log_beta.exp().detach() * PRIOR_MATRICES[self.kind](n, k, device)

    def forward(self, items: torch.Tensor, item_mask: torch.Tensor, declared: torch.Tensor | None = None) -> torch.Tensor:
        return self.scores_and_trust(items, item_mask, declared)[0]

    def scores_and_trust(self, items: torch.Tensor, item_mask: torch.Tensor, declared: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> ((B, N, K) scores, (B,) the guard's trust, or None without a guard): the guard read once.

        `declared` (B,) bool: whether each slate's input order is a declared first-stage ranking (None: all are).
        An undeclared slate's order is no ranking: its scores are the gated residual alone (no prior term), and
        the guard, whose fallback is the input order, does not scale it (its trust is still returned)."""
        residual = self.residual(items, item_mask)  # (B, N, K)
        b, n, k = residual.shape
        mask = item_mask[:, :, None].to(items.dtype)  # (B, N, 1)
        pooled = (self.gate_norm(items) * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # (B, D) mean over real items
        gate = 2 * torch.sigmoid(self.gate(pooled))[:, :, None]  # (B, 1, 1)
        trust = None if self.guard is None else self.guard(items, item_mask)  # (B,)
        on = torch.ones(b, dtype=residual.dtype, device=residual.device) if declared is None else declared.to(residual)  # (B,)
        if trust is not None:
            gate = gate * (on * trust.to(gate.dtype) + (1 - on))[:, None, None]  # (B, 1, 1)
        prior = PRIOR_MATRICES[self.kind](n, k, items.device).to(residual.dtype)  # (N, K)
        beta = self.log_beta.exp().to(residual.dtype) * on[:, None, None]  # (B, 1, 1): 0 for an undeclared order
        return beta * prior + gate * residual, trust  # (B, N, K), (B,)


def within_support(head: nn.Module, matrix: np.ndarray, doc_budget: int, declared: bool = True) -> tuple[np.ndarray, bool]:
    """An (n, k) score matrix of a prompt that let each passage show `doc_budget` tokens -> (it, True); outside
    the head's guard's support (`DomainGuard.supports`) -> (the head's prior alone, whose assignment is the
    input order, False), or, for an undeclared input order (no order to fall back to), (the matrix, False).
    The one place the support decides, for requests and cached states alike."""
    guard = getattr(head, "guard", None)
    if guard is None or guard.supports(doc_budget):
        return matrix, True
    return (head.prior_scores(*matrix.shape).float().cpu().numpy() if declared else matrix), False


PRIOR_MATRICES: dict[str, Callable[..., torch.Tensor]] = {"rank": rank_prior, "logrank": logrank_prior}
PRIORS: dict[str, Callable[[nn.Module, int, HeadConfig], nn.Module] | None] = {
    "none": None,  # the head's scores as they are
    "rank": RankPriorHead,  # -beta (log(1 + n) - log(1 + k))^2: any head
    "logrank": RankPriorHead,  # -beta log(1 + n) / log2(k + 2): the fusion form, for the utility head
}


def build_head(hidden: int, cfg: HeadConfig) -> nn.Module:
    head = HEADS[cfg.kind](hidden, cfg)
    wrap = PRIORS[cfg.prior]
    return head if wrap is None else wrap(head, hidden, cfg)
