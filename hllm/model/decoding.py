"""Decoders: an N x K item-position score matrix -> a valid permutation + per-item scores.

Letters: N items, K positions (K <= N). `scores[n, k]` is the logit that item n lands at rank k.
Every decoder returns `Decoded(permutation, item_scores, repaired)` where `permutation` is a
0-based ordering of all N items (best first) and `item_scores` is strictly decreasing along it,
so clients may sort by score. Positions beyond K are filled by `tail_scores` (expected DCG
discount under the column softmax): a documented rule, not a repair.

Non-finite inputs: NaN is a `ValueError` (a broken model must not produce a ranking that looks
fine); +/-inf are clipped to the largest finite float32 magnitude, so a saturated logit still
ranks first/last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment


@dataclass
class Decoded:
    permutation: np.ndarray  # (N,) item indices, best first
    item_scores: np.ndarray  # (N,) strictly decreasing along `permutation`
    repaired: bool = False  # argmax_repair only: the raw argmax was not a permutation


def _check(scores: np.ndarray) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 2 or scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError(f"expected a non-empty (N, K) score matrix, got shape {scores.shape}")
    if scores.shape[1] > scores.shape[0]:
        raise ValueError(f"K={scores.shape[1]} positions exceed N={scores.shape[0]} items")
    if np.isnan(scores).any():
        raise ValueError("score matrix contains NaN")
    big = float(np.finfo(np.float32).max)
    return np.clip(scores, -big, big)


def _rank_scores(perm: np.ndarray) -> np.ndarray:
    """Scores from ranks: 1.0 for the first item down to 1/N for the last."""
    n = len(perm)
    out = np.empty(n)
    out[perm] = (n - np.arange(n)) / n
    return out


def column_softmax(scores: np.ndarray) -> np.ndarray:
    """(N, K) -> P(item n | position k), each column summing to 1 over items."""
    z = scores - scores.max(axis=0, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=0, keepdims=True)


def tail_scores(scores: np.ndarray) -> np.ndarray:
    """(N,) expected DCG discount sum_k P(n | k) / log2(k + 2): high = near the top."""
    k = scores.shape[1]
    return column_softmax(scores) @ (1.0 / np.log2(np.arange(k) + 2.0))


def _complete(head: list[int], scores: np.ndarray) -> np.ndarray:
    """Appends the items not in `head`, ordered by `tail_scores` (ties: input order)."""
    if len(head) == len(scores):  # K = N: nothing to append
        return np.array(head, dtype=np.int64)
    taken = set(head)
    rest = [i for i in np.lexsort((np.arange(len(scores)), -tail_scores(scores))) if i not in taken]
    return np.array(head + rest, dtype=np.int64)


def hungarian(scores: np.ndarray) -> Decoded:
    """Maximum-weight assignment of the K positions (scipy's LAPJV-style solver)."""
    scores = _check(scores)
    rows, cols = linear_sum_assignment(scores, maximize=True)  # rows: items, cols: positions
    head = [int(r) for r in rows[np.argsort(cols)]]
    perm = _complete(head, scores)
    return Decoded(perm, _rank_scores(perm))


def sort_first_column(scores: np.ndarray) -> Decoded:
    """Order by the rank-1 column; ties by input order."""
    scores = _check(scores)
    perm = np.lexsort((np.arange(len(scores)), -scores[:, 0]))
    return Decoded(perm, _rank_scores(perm))


def expected_position(scores: np.ndarray) -> Decoded:
    """Order by E[position] under each item's softmax over positions; ties by `tail_scores`, then
    input order (with one column, K = 1, every expectation is 0 and this is sorting by score)."""
    scores = _check(scores)
    z = scores - scores.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)  # (N, K) row softmax
    expected = p @ np.arange(scores.shape[1])  # (N,)
    perm = np.lexsort((np.arange(len(scores)), -tail_scores(scores), expected))
    return Decoded(perm, _rank_scores(perm))


def greedy(scores: np.ndarray) -> Decoded:
    """Position by position, the best remaining item (what AR decoding does with one matrix)."""
    scores = _check(scores)
    free = np.ones(len(scores), dtype=bool)
    head = []
    for k in range(scores.shape[1]):
        col = np.where(free, scores[:, k], -np.inf)
        best = int(np.argmax(col))  # first maximum: ties go to input order
        head.append(best)
        free[best] = False
    perm = _complete(head, scores)
    return Decoded(perm, _rank_scores(perm))


def argmax_repair(scores: np.ndarray) -> Decoded:
    """Each position's argmax item, duplicates dropped, missing items appended in input order.

    The comparator the paper beats: the raw output is often not a permutation (`repaired`).
    """
    scores = _check(scores)
    raw = [int(i) for i in np.argmax(scores, axis=0)]  # (K,) item per position
    head = list(dict.fromkeys(raw))
    taken = set(head)
    perm = np.array(head + [i for i in range(len(scores)) if i not in taken], dtype=np.int64)
    return Decoded(perm, _rank_scores(perm), repaired=len(head) < len(raw))


DECODERS: dict[str, Callable[[np.ndarray], Decoded]] = {
    "hungarian": hungarian,
    "sort": sort_first_column,
    "expected_position": expected_position,
    "greedy": greedy,
    "argmax_repair": argmax_repair,
}


def rank1_energy(scores: np.ndarray) -> float:
    """Share of the double-centred matrix's energy in its top singular value, in [0, 1].

    Adding a constant to a row or a column changes no assignment, so those effects are removed
    first; what is left near rank 1 (u v^T with v monotone in k) is where sorting one column
    and the Hungarian solve agree. A matrix with no structure left returns 1.0.
    """
    s = _check(scores)
    centred = s - s.mean(axis=0, keepdims=True) - s.mean(axis=1, keepdims=True) + s.mean()
    sv = np.linalg.svd(centred, compute_uv=False)
    total = float((sv ** 2).sum())
    return float(sv[0] ** 2 / total) if total > 1e-12 * max(1.0, float((s ** 2).sum())) else 1.0


def is_permutation(perm: np.ndarray | list[int], n: int) -> bool:
    return len(perm) == n and sorted(int(p) for p in perm) == list(range(n))
