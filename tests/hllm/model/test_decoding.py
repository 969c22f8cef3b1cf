import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from hllm.model.decoding import DECODERS, hungarian, is_permutation, rank1_energy, sort_first_column, argmax_repair


def brute_force_value(scores: np.ndarray) -> float:
    n, k = scores.shape
    return max(sum(scores[items[j], j] for j in range(k)) for items in itertools.permutations(range(n), k))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))).flatmap(
    lambda nk: arrays(np.float64, nk, elements=st.floats(-5, 5, allow_nan=False))))
def test_hungarian_equals_brute_force(scores):
    perm = hungarian(scores).permutation
    k = scores.shape[1]
    value = sum(scores[perm[j], j] for j in range(k))
    assert value == pytest.approx(brute_force_value(scores), abs=1e-9)
    assert is_permutation(perm, scores.shape[0])


matrices = st.integers(1, 200).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, min(n, 40)))).flatmap(
    lambda nk: arrays(np.float64, nk, elements=st.sampled_from([0.0, 1.0, -1.0, 2.5, 1e6, -1e6, np.inf, -np.inf])
                      | st.floats(-50, 50, allow_nan=False)))


@settings(max_examples=120, deadline=None)
@given(matrices, st.sampled_from(sorted(DECODERS)))
def test_every_decoder_returns_valid_permutation_with_decreasing_scores(scores, name):
    out = DECODERS[name](scores)
    assert is_permutation(out.permutation, scores.shape[0])
    ordered = out.item_scores[out.permutation]
    assert np.all(np.diff(ordered) < 0)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_constant_and_tied_matrices(name):
    for scores in (np.zeros((7, 7)), np.ones((9, 3)), np.tile(np.arange(5.0), (5, 1))):
        assert is_permutation(DECODERS[name](scores).permutation, len(scores))


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_nan_is_a_clear_error(name):
    scores = np.random.randn(4, 4)
    scores[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        DECODERS[name](scores)


def test_inf_ranks_first():
    scores = np.random.randn(5, 5)
    scores[3, 0] = np.inf
    assert hungarian(scores).permutation[0] == 3
    assert sort_first_column(scores).permutation[0] == 3


def test_rectangular_hungarian_orders_the_tail_by_score():
    # items 0..5, K = 2; item 4 is best at rank 1, item 1 at rank 2; the tail by column mass
    scores = np.full((6, 2), -5.0)
    scores[4, 0], scores[1, 1] = 5.0, 5.0
    scores[2] = [1.0, 1.0]
    perm = hungarian(scores).permutation
    assert list(perm[:3]) == [4, 1, 2]


def test_argmax_repair_flags_collisions():
    scores = np.array([[3.0, 2.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # item 0 wins every column
    out = argmax_repair(scores)
    assert out.repaired and list(out.permutation) == [0, 1, 2]
    assert hungarian(scores).permutation[0] == 0


def test_rank1_energy():
    u, v = np.random.rand(10), np.linspace(1, 0, 10)
    assert rank1_energy(np.outer(u, v)) == pytest.approx(1.0)
    # additive row/column effects change no assignment and carry no energy
    assert rank1_energy(np.add.outer(u, v) + np.outer(u, v)) == pytest.approx(1.0)
    assert rank1_energy(np.random.randn(20, 20)) < 0.5
    # on a rank-1 matrix with monotone columns, sort and Hungarian agree
    scores = np.outer(np.random.rand(12), np.linspace(2, 1, 12))
    assert list(sort_first_column(scores).permutation) == list(hungarian(scores).permutation)


def test_shape_errors():
    with pytest.raises(ValueError, match="exceed"):
        hungarian(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="non-empty"):
        hungarian(np.zeros((0, 0)))


def test_one_column_matrix_is_sorting_by_score():
    scores = np.array([[0.1], [2.0], [-1.0], [0.7], [0.7]])  # a scalar head: K = 1
    expected = [1, 3, 4, 0, 2]  # by score, ties in input order
    for name in ("hungarian", "sort", "expected_position", "greedy"):
        assert DECODERS[name](scores).permutation.tolist() == expected, name
