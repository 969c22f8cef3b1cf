"""Scoring heads: item hidden states (B, N, D) -> item-position logits (B, N, K).

- `attention` (the paper's): a small Transformer encoder over the N candidate states, so each
  item's row is scored in the context of the whole slate, then a linear map to K positions.
  No positional embedding: rows permute with the input (the backbone already saw the order).
- `linear`: a per-item probe to K logits; items do not see each other in the head.
- `scalar`: one score per item (K = 1); decoders then reduce to sorting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass
class HeadConfig:
    """The single-pass head."""

    kind: Literal["attention", "linear", "scalar"] = "attention"  # attention: the paper's; linear / scalar: ablations
    positions: int = 20  # K; use the slate size N for K = N, fewer for a rectangular top-K head
    layers: int = 2  # attention head: encoder layers
    width: int = 256  # attention head: model width
    num_heads: int = 4  # attention head: attention heads
    dropout: float = 0.0  # attention head: dropout while training

    def __post_init__(self) -> None:
        if self.positions < 1:
            raise ValueError("head.positions (K) must be >= 1")
        if self.kind == "attention" and self.width % self.num_heads:
            raise ValueError("head.width must be divisible by head.num_heads")

    @property
    def k(self) -> int:
        return 1 if self.kind == "scalar" else self.positions


class AttentionHead(nn.Module):
    def __init__(self, hidden: int, cfg: HeadConfig):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, cfg.width)
        layer = nn.TransformerEncoderLayer(cfg.width, cfg.num_heads, 4 * cfg.width, cfg.dropout,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.out = nn.Sequential(nn.LayerNorm(cfg.width), nn.Linear(cfg.width, cfg.k))

    def forward(self, items: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.norm(items))  # (B, N, W)
        x = self.encoder(x, src_key_padding_mask=~item_mask)  # (B, N, W); padded items attend nowhere
        return self.out(x)  # (B, N, K)


class LinearHead(nn.Module):
    def __init__(self, hidden: int, cfg: HeadConfig):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, cfg.k))

    def forward(self, items: torch.Tensor, item_mask: torch.Tensor) -> torch.Tensor:
        return self.net(items)  # (B, N, K)


HEADS: dict[str, Callable[[int, HeadConfig], nn.Module]] = {
    "attention": AttentionHead,
    "linear": LinearHead,
    "scalar": LinearHead,  # K = 1 via HeadConfig.k
}


def build_head(hidden: int, cfg: HeadConfig) -> nn.Module:
    return HEADS[cfg.kind](hidden, cfg)
