"""Calibrated relevance: probabilities in [0, 1], non-increasing along the ranking, fitted on
held-out slates, saved with the model; ECE against hand-computed values."""

import json

import numpy as np
import pytest

from hllm.model.calibration import (Calibrator, calibration_report, expected_calibration_error, fit_calibrator,
                                    item_features)


def _slates(rng, count, n=10, k=6):
    """Matrices whose rank-1 logit is higher for relevant items (graded 0..3), with noise."""
    matrices, perms, grades = [], [], []
    for _ in range(count):
        g = rng.integers(0, 4, size=n)
        scores = rng.normal(size=(n, k)) + (g[:, None] - 1.5) * np.linspace(1.0, 0.0, k)[None, :]
        matrices.append(scores)
        perms.append(np.argsort(-scores[:, 0]))
        grades.append(g.tolist())
    return matrices, perms, grades


def test_ece_by_hand():
    assert expected_calibration_error(np.full(5, 0.2), np.array([1, 0, 0, 0, 0.0])) == pytest.approx(0.0)
    assert expected_calibration_error(np.full(10, 0.9), np.array([1.0] * 5 + [0.0] * 5)) == pytest.approx(0.4)
    probs, labels = np.array([0.05, 0.05, 0.95, 0.95]), np.array([0, 1, 1, 1.0])
    assert expected_calibration_error(probs, labels) == pytest.approx((2 * 0.45 + 2 * 0.05) / 4)


def test_fitted_on_held_out_slates_it_is_calibrated_and_discriminates():
    rng = np.random.default_rng(0)
    calibrator = fit_calibrator(*_slates(rng, 300), rel=2)
    assert calibrator.fitted_on == {"slates": 300, "items": 3000, "positives": calibrator.fitted_on["positives"]}
    test = _slates(rng, 300)
    report = calibration_report(calibrator, *test)
    assert report["ece"] < 0.05 and report["items"] == 3000 and sum(b["count"] for b in report["bins"]) == 3000
    probs = np.concatenate([calibrator.probabilities(m, p) for m, p in zip(*test[:2])])
    labels = np.concatenate([np.array(g) >= 2 for g in test[2]])
    assert probs[labels].mean() > probs[~labels].mean() + 0.2  # it says which documents are relevant


def test_probabilities_are_in_0_1_and_non_increasing_along_any_returned_order(tmp_path):
    rng = np.random.default_rng(1)
    calibrator = fit_calibrator(*_slates(rng, 50), rel=2)
    for _ in range(50):
        n = int(rng.integers(1, 30))
        scores = rng.normal(scale=5, size=(n, min(n, 6)))
        perm = rng.permutation(n)  # any order, even one the scores disagree with
        p = calibrator.probabilities(scores, perm)
        assert p.shape == (n,) and np.all((0 <= p) & (p <= 1))
        assert np.all(np.diff(p[perm]) <= 1e-12)
    assert item_features(rng.normal(size=(7, 3)), range(7)).shape == (7, 8)
    calibrator.save(tmp_path)
    assert Calibrator.load(tmp_path) == calibrator and Calibrator.load(tmp_path / "nowhere") is None


def test_one_class_cannot_be_calibrated():
    with pytest.raises(ValueError, match="relevant and non-relevant"):
        fit_calibrator([np.zeros((3, 2))], [[0, 1, 2]], [[0, 1, None]], rel=2)


def test_a_calibrated_student_ranks_with_relevance(tiny_backbone, small_splits, tmp_path):
    from hllm import Reranker
    from hllm.model.heads import HeadConfig
    from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
    from hllm.job.stages import calibrate_student

    from conftest import TINY

    SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(lora_r=2, lora_alpha=4),
                                        head=HeadConfig(positions=4, width=32, num_heads=2))).save(tmp_path)
    assert Reranker.load(tmp_path).rank("red boots", ["a", "b"])[0].relevance is None  # not calibrated yet
    calibrate_student(tmp_path, small_splits["val"] + small_splits["train"], rel=1)
    ranked = Reranker.load(tmp_path).rank("red boots", ["red boots", "blue shirt", "acme red boots", "scarf"])
    relevance = [r.relevance for r in ranked]
    assert all(0 <= p <= 1 for p in relevance) and relevance == sorted(relevance, reverse=True)


def test_reliability_sums_of_batches_in_any_order_equal_the_whole_bit_for_bit():
    from hllm.model.calibration import calibration_sums

    rng = np.random.default_rng(2)
    calibrator = fit_calibrator(*_slates(rng, 100), rel=2)
    test = _slates(rng, 40)
    whole = calibration_report(calibrator, *test)
    parts = [calibration_sums(calibrator, *(x[i:i + 7] for x in test)) for i in range(0, 40, 7)]
    merged = parts[3]
    for p in parts[:3] + parts[4:][::-1]:
        merged.merge(p)
    assert json.dumps(merged.report()) == json.dumps(whole) and whole["slates"] == 40  # NaN bins compare as text
    probs = np.concatenate([calibrator.probabilities(m, p) for m, p in zip(*test[:2])])
    assert whole["mean_predicted"] == pytest.approx(probs.mean(), abs=1e-12)
