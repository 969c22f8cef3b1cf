"""The pieces of choosing on training queries: batches of a small fold, query folds nested in folds."""

import itertools

import pytest

from hllm.train.head_fit import query_folds
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
