import math

import numpy as np
import pytest

from hllm.data.readers import read_beir
from hllm.eval.metrics import (agreement, input_order_agreement, ir_metrics, ir_metrics_by_query, kendall_tau, ndcg10_per_list,
                               validity_rate)
from hllm.records import Candidate, Query, RerankRequest


def slate(grades, extra=None):
    cands = [Candidate(f"d{i}", f"text {i}") for i in range(len(grades))]
    return RerankRequest(Query("q1", "query"), cands, list(grades), dict(extra or {}))


def dcg(gains):
    return sum(g / math.log2(i + 2) for i, g in enumerate(gains))


def test_ndcg_by_hand():
    req = slate([0, 3, 1, 2])
    perm = [0, 1, 2, 3]  # gains 0, 3, 1, 2
    expected = dcg([0, 3, 1, 2]) / dcg([3, 2, 1, 0])
    assert ir_metrics([req], [perm], ["nDCG@10"])["nDCG@10"] == pytest.approx(expected)
    assert ir_metrics([req], [[1, 3, 2, 0]], ["nDCG@10"])["nDCG@10"] == pytest.approx(1.0)


def test_judged_documents_outside_the_slate_count_in_the_ideal():
    req = slate([0, 2], extra={"unretrieved": 3})
    expected = dcg([2, 0]) / dcg([3, 2])
    assert ir_metrics([req], [[1, 0]], ["nDCG@10"])["nDCG@10"] == pytest.approx(expected)


def test_a_query_with_two_lists_is_scored_list_by_list_and_refused_by_query():
    """trec_eval keys by query id: two lists of q1 (two first stages) in one run would be scored as one merged list."""
    first, second = slate([0, 3]), slate([2, 0])
    mean = ir_metrics([first, second], [[0, 1], [0, 1]], ["nDCG@10"])["nDCG@10"]
    assert mean == pytest.approx((dcg([0, 3]) / dcg([3, 0]) + 1.0) / 2)
    with pytest.raises(ValueError, match="ranked more than once"):
        ir_metrics_by_query([first, second], [[0, 1], [0, 1]], ["nDCG@10"])


def test_ndcg10_per_list_scores_each_list_of_a_query_with_its_own_judgments():
    first, second = slate([0, 3, 1]), slate([2, 0])  # one query id, two candidate sets (two first stages)
    other = RerankRequest(Query("q2", "query"), [Candidate("d0", "x")])  # no judgments: nDCG undefined
    got = ndcg10_per_list([first, second, other, slate([1])], [[0, 1, 2], [1, 0], [0], [0]])
    assert got[0] == pytest.approx(dcg([0, 3, 1]) / dcg([3, 1, 0]))
    assert got[1] == pytest.approx(dcg([0, 2]) / dcg([2, 0]))
    assert math.isnan(got[2]) and got[3] == pytest.approx(1.0)
    assert np.array_equal(ndcg10_per_list([first], [[1, 2, 0]]), [1.0])


def test_mrr_and_recall_with_threshold():
    req = slate([1, 0, 2, 2])
    out = ir_metrics([req], [[0, 1, 2, 3]], ["RR(rel=2)@10", "R(rel=2)@2", "RR(rel=1)@10"])
    assert out["RR(rel=2)@10"] == pytest.approx(1 / 3)
    assert out["R(rel=2)@2"] == pytest.approx(0.0)
    assert out["RR(rel=1)@10"] == pytest.approx(1.0)


def test_agreement_and_validity():
    assert kendall_tau([0, 1, 2, 3], [0, 1, 2, 3]) == pytest.approx(1.0)
    assert kendall_tau([3, 2, 1, 0], [0, 1, 2, 3]) == pytest.approx(-1.0)
    out = agreement([[0, 1, 2], [2, 1, 0], None], [[0, 2, 1], [0, 1, 2], [0, 1, 2]])
    assert out["pairs"] == 2 and out["top1_agreement"] == pytest.approx(0.5)
    assert validity_rate([[0, 1], [1, 1], None], [2, 2, 2]) == pytest.approx(1 / 3)


def test_input_order_agreement_counts_copies_of_the_first_stage_order():
    out = input_order_agreement([[0, 1, 2, 3], [1, 0, 2, 3], [3, 2, 1, 0], None])
    assert out["rankings"] == 3 and out["same_as_input"] == pytest.approx(1 / 3)
    assert out["tau_to_input"] == pytest.approx((1.0 + kendall_tau([1, 0, 2, 3], [0, 1, 2, 3]) - 1.0) / 3)
    assert math.isnan(input_order_agreement([None])["same_as_input"])


@pytest.mark.data
def test_bm25_on_trec_dl19_matches_published(shared_data):
    slates = read_beir(shared_data / "trec-dl19-passage-bm25top100", top_n=100)
    assert len(slates) == 43
    perms = [list(range(len(s.candidates))) for s in slates]
    assert ir_metrics(slates, perms, ["nDCG@10"])["nDCG@10"] == pytest.approx(0.5058, abs=5e-5)
