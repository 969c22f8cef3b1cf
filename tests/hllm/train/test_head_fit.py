"""The pieces of choosing on training queries: batches of a small fold, query folds nested in folds."""

import itertools

import pytest
import torch

from hllm.records import Candidate, Query, RerankRequest
from hllm.train.head_fit import StateSlate, query_folds, ridge_utilities, ridge_utility
from hllm.train.loop import batches


def test_fewer_examples_than_a_batch_make_one_batch_of_all_of_them_not_a_hang():
    got = list(itertools.islice(batches(["a", "b"], batch_size=4, seed=0), 3))
    assert [sorted(b) for b in got] == [["a", "b"]] * 3
    with pytest.raises(ValueError, match="no training examples"):
        next(batches([], batch_size=4, seed=0))


def test_query_folds_cover_every_query_once_and_a_salt_cuts_them_otherwise():
    ids = [f"q{i}" for i in range(40)]
    folds = query_folds(len(ids), ids, 5)
    assert sorted(i for _, held in folds for i in held) == list(range(40))
    for train, held in folds:
        assert not set(train) & set(held) and len(train) + len(held) == 40
    assert query_folds(len(ids), ids, 5) == folds  # the same split on every call
    assert query_folds(len(ids), ids, 5, salt="outer/") != folds
    with pytest.raises(ValueError, match="at least 2"):
        query_folds(1, ["q0"], 5)


def test_the_ridge_path_gives_each_l2_weight_the_direct_solve():
    gen = torch.Generator().manual_seed(0)
    items = []
    for q in range(3):
        states = torch.randn(10, 6, generator=gen) * torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0, 0.1])  # (N, D)
        slate = RerankRequest(Query(f"q{q}", "text"), [Candidate(f"d{i}", "x") for i in range(10)], [i % 4 for i in range(10)])
        items.append(StateSlate(slate, states))
    x = torch.cat([i.states for i in items]).double()  # (M, D)
    y = torch.tensor([g for i in items for g in i.grades(0)], dtype=torch.float64)
    mu, sd = x.mean(0), x.std(0) + 1e-6
    xn = (x - mu) / sd
    lambdas = [0.1, 10.0, 1e4]
    for lam, (w, b) in zip(lambdas, ridge_utilities(items, lambdas)):
        want = torch.linalg.solve(xn.T @ xn + lam * torch.eye(6, dtype=x.dtype), xn.T @ (y - y.mean())) / sd
        torch.testing.assert_close(w, want.float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, -(want @ mu).float(), rtol=1e-5, atol=1e-6)
    assert torch.equal(ridge_utility(items, 10.0)[0], ridge_utilities(items, [10.0])[0][0])
    shrunk = [float(w.norm()) for w, _ in ridge_utilities(items, lambdas)]
    assert shrunk == sorted(shrunk, reverse=True)  # more L2, a smaller probe
