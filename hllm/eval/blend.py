"""The first-stage blend: a student's (N, K) matrix leaning on the order its candidates arrived in, by a weight a
deployment chooses per first stage on training queries (a deployment knows its first stage).

A matrix, standardised, plus w times the rank prior (whose unique optimum is the first-stage order); w = inf is the
first stage itself, w = 0 the student alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from hllm.model.decoding import hungarian
from hllm.model.heads import rank_prior

WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
BLENDED = "+first-stage"  # a student's row blended with the first stage (its weight chosen on training queries)


def blended(matrix: np.ndarray, weight: float) -> np.ndarray:
    """(N, K) scores leaning on the first stage: standardised, plus `weight` times the rank prior (the first-stage
    order its unique optimum); inf: the first-stage order's own matrix."""
    prior = rank_prior(*matrix.shape).numpy()  # (N, K)
    prior = prior / (prior.std() or 1.0)
    if math.isinf(weight):
        return prior
    return (matrix - matrix.mean()) / (matrix.std() or 1.0) + weight * prior


class Blend:
    """Lists' matrices blended at every weight of `weights`, each blend's per-list nDCG@10 computed once."""

    def __init__(self, matrices: Sequence[np.ndarray], weights: Sequence[float],
                 ndcg10: Callable[[list[int], list[list[int]]], np.ndarray]):
        """`matrices`: per list its (N, K) matrix; `ndcg10(lists, orders)`: per list its nDCG@10 (the caller's judgments)."""
        self.weights = list(weights)
        index = list(range(len(matrices)))
        self.orders = {w: [hungarian(blended(m, w)).permutation.tolist() for m in matrices] for w in self.weights}
        self.score = {w: ndcg10(index, o) for w, o in self.orders.items()}  # w -> (L,)

    def best(self, lists: Sequence[int]) -> float:
        """The weight with the best mean nDCG@10 over `lists` (ties: the larger, nearer the first stage)."""
        return max(self.weights, key=lambda w: (round(float(np.mean(self.score[w][list(lists)])), 6), w))
