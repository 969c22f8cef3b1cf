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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

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

    def __post_init__(self) -> None:
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


class RankPriorHead(nn.Module):
    """scores = beta * prior + gate * residual: the input order until training says otherwise.

    beta (the prior's sharpness) is learned, from `prior_strength`; the gate, 2 * sigmoid of a
    linear map of the slate's mean item state, lets a slate trust the residual more or less
    (1 at initialisation); the residual head's read-out starts at zero."""

    def __init__(self, residual: nn.Module, hidden: int, cfg: HeadConfig):
        super().__init__()
        self.kind = cfg.prior
        self.residual = residual
        nn.init.zeros_(residual.readout.weight)
        nn.init.zeros_(residual.readout.bias)
        self.log_beta = nn.Parameter(torch.tensor(math.log(cfg.prior_strength)))
        self.gate_norm = nn.LayerNorm(hidden)
        self.gate = nn.Linear(hidden, 1)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)

    def forward(self, items: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
        residual = self.residual(items, item_mask)  # (B, N, K)
        b, n, k = residual.shape
        mask = item_mask[:, :, None].to(items.dtype)  # (B, N, 1)
        pooled = (self.gate_norm(items) * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # (B, D) mean over real items
        gate = 2 * torch.sigmoid(self.gate(pooled))[:, :, None]  # (B, 1, 1)
        prior = PRIOR_MATRICES[self.kind](n, k, items.device).to(residual.dtype)  # (N, K)
        return self.log_beta.exp().to(residual.dtype) * prior + gate * residual  # (B, N, K)


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
