"""How sure the single pass is, read off what it already made: the (N, K) matrix, its decoded order, the input
(first-stage) order and the domain guard's trust. No second forward pass; numpy over one matrix.

Letters: N items, K positions (K <= N), k the top positions a signal looks at (k <= K). Every signal is
"higher = surer", per slate (`SIGNALS`):

- `margin`: the optimal top-k assignment's score minus the best one that differs from it by a single move — two of
  its items trade places (one of them in the top k), or an item in the top k gives its place to an item the
  assignment left out. 0 is a tie: the head could as well have put another passage there.
- `sharpness`: the mean over the top-k positions of the column softmax's probability of the item placed there.
- `agreement`: the share of the order's top k that the input order also has in its top k (a single pass that moved
  far from its first stage, on a query like no training query, is the case to check). Defined only for a declared
  first-stage order (None otherwise: the order of a set of documents is no ranking to agree with).
- `trust`: the domain guard's trust in the slate (1 for a model without a guard).

`confidence(matrix, order, trust)` -> `Confidence` with each of them; a cascade (`hllm rerank --cascade`) escalates
the slates whose chosen signal is lowest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

Signal = Literal["margin", "sharpness", "agreement", "trust"]
SIGNALS: tuple[str, ...] = ("margin", "sharpness", "agreement", "trust")


@dataclass(frozen=True)
class Confidence:
    margin: float
    sharpness: float
    agreement: float | None  # None: the input order was not declared a first-stage ranking
    trust: float

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)

    def value(self, signal: str) -> float | None:
        """The signal's value; None where it is undefined for this slate (`agreement` of an undeclared order)."""
        if signal not in SIGNALS:
            raise ValueError(f"unknown confidence signal {signal!r}; known: {list(SIGNALS)}")
        value = getattr(self, signal)
        return None if value is None else float(value)


def assignment_margin(scores: np.ndarray, order: np.ndarray, k: int) -> float:
    """`scores` (N, K), `order` (N,) best first whose first K are an assignment of the K positions -> the smallest
    loss of score over single moves that change the top `k` (see the module docstring); 0 when nothing can move."""
    n, kk = scores.shape
    k = min(k, kk)
    placed = order[:kk]  # (K,) the item at each position
    own = scores[placed, np.arange(kk)]  # (K,) each placed item's score at its position
    # swaps of positions r < k with any other position s: (k, K)
    cross = scores[placed[:, None], np.arange(kk)[None, :]]  # (K, K) [r, s]: the item at r scored at position s
    swap = own[:k, None] + own[None, :] - cross[:k, :] - cross[:, :k].T  # (k, K) [r, s]: loss of trading r and s
    swap[np.arange(k), np.arange(k)] = np.inf  # a position with itself is no move
    best = float(swap.min()) if swap.size else np.inf
    left_out = np.setdiff1d(np.arange(n), placed, assume_unique=False)  # items with no position
    if left_out.size:
        replace = own[:k, None] - scores[left_out[None, :], np.arange(k)[:, None]]  # (k, M)
        best = min(best, float(replace.min()))
    return 0.0 if not np.isfinite(best) else max(best, 0.0)


def sharpness(scores: np.ndarray, order: np.ndarray, k: int) -> float:
    """Mean over the top-k positions of the column softmax probability of the item placed there."""
    k = min(k, scores.shape[1])
    z = scores[:, :k] - scores[:, :k].max(axis=0, keepdims=True)  # (N, k)
    p = np.exp(z) / np.exp(z).sum(axis=0, keepdims=True)  # (N, k) each column a distribution over items
    return float(p[order[:k], np.arange(k)].mean())


def agreement(order: np.ndarray, k: int) -> float:
    """The share of `order`'s top k that are in the input order's top k (items 0..k-1)."""
    k = min(k, len(order))
    return float(np.mean(np.asarray(order[:k]) < k))


def confidence(scores: np.ndarray, order: np.ndarray, trust: float | None = None, k: int = 10,
               first_stage_order: bool = True) -> Confidence:
    """Every signal of one slate: `scores` (N, K) its matrix, `order` (N,) the decoded order, `trust` the guard's;
    `first_stage_order`: whether the input order was a declared first-stage ranking (else `agreement` is None)."""
    scores = np.asarray(scores, dtype=np.float64)
    order = np.asarray(order)
    return Confidence(margin=assignment_margin(scores, order, k), sharpness=sharpness(scores, order, k),
                      agreement=agreement(order, k) if first_stage_order else None, trust=1.0 if trust is None else float(trust))


# ---- thresholds kept with the model ---------------------------------------------------------------------
THRESHOLDS_FILE = "cascade.json"
GRID = np.linspace(0.0, 1.0, 101)  # shares 0%, 1%, ..., 100%


@dataclass(frozen=True)
class CascadeThresholds:
    """Each signal's quantiles over a model's training-side queries: `threshold(signal, share)` is the value
    below which that share of those queries fell, so escalating below it sends about `share` of like traffic."""

    quantiles: dict[str, list[float]]  # signal -> its value at each share of GRID
    fitted_on: dict[str, Any]  # queries, source

    @classmethod
    def fit(cls, confidences: Sequence[Confidence], source: str) -> "CascadeThresholds":
        if not confidences:
            raise ValueError("cascade thresholds need the confidence of at least one query")
        if any(c.agreement is None for c in confidences):
            raise ValueError("cascade thresholds are fitted on slates in their declared first-stage order (agreement defined)")
        quantiles = {s: [float(v) for v in np.quantile([c.value(s) for c in confidences], GRID)] for s in SIGNALS}
        return cls(quantiles, {"queries": len(confidences), "source": source})

    def threshold(self, signal: str, share: float) -> float:
        """The value a query's `signal` must fall below to be escalated, for about `share` of the queries
        (1: every query, +inf)."""
        if signal not in self.quantiles:
            raise ValueError(f"cascade signal {signal!r}: the thresholds have {list(self.quantiles)}")
        if not 0 <= share <= 1:
            raise ValueError(f"cascade share {share}: in [0, 1]")
        if share >= 1:
            return math.inf
        # the smallest value with at least `share` of the queries below or at it: values strictly below it are
        # at most `share` of the fitted queries (a signal with ties escalates fewer, never more)
        return float(np.interp(share, GRID, self.quantiles[signal]))

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / THRESHOLDS_FILE
        path.write_text(json.dumps({"quantiles": self.quantiles, "grid": "shares 0..1 by 0.01",
                                    "fitted_on": self.fitted_on}, indent=1))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "CascadeThresholds | None":
        """The model's thresholds, or None for a model saved without them."""
        path = Path(directory) / THRESHOLDS_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(data["quantiles"], data["fitted_on"])
