"""Issue #43, first part: confidence read off the single pass (no second forward pass), and the offline cascade —
`hllm rerank --cascade` hands the least confident queries to a teacher given as rankings."""

import itertools
import json

import numpy as np
import pytest

from hllm.model.confidence import SIGNALS, assignment_margin, confidence
from hllm.model.decoding import DECODERS
from hllm.recipes.collection import CascadeRule

from conftest import gold_run
from test_cli import _beir, student  # noqa: F401 (the module's tiny student fixture)


def brute_margin(scores: np.ndarray, order: np.ndarray, k: int) -> float:
    """The smallest score lost by one move in the top k, over every assignment of the K positions."""
    n, kk = scores.shape
    opt, best = scores[order[:kk], np.arange(kk)].sum(), np.inf
    for alt in itertools.permutations(range(n), kk):
        alt = np.array(alt)
        diff = [r for r in range(kk) if alt[r] != order[r]]
        swap = len(diff) == 2 and set(alt[diff]) == set(order[diff]) and min(diff) < k
        replace = len(diff) == 1 and diff[0] < k and alt[diff[0]] not in order[:kk]
        if swap or replace:
            best = min(best, opt - scores[alt, np.arange(kk)].sum())
    return 0.0 if not np.isfinite(best) else max(best, 0.0)


def test_the_margin_is_the_best_one_move_alternative_by_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(2, 7))
        kk = int(rng.integers(1, n + 1))
        k = int(rng.integers(1, kk + 1))
        scores = rng.normal(size=(n, kk))
        order = DECODERS["hungarian"](scores).permutation
        assert assignment_margin(scores, order, k) == pytest.approx(brute_margin(scores, order, k), abs=1e-9)


def test_signals_read_sure_and_unsure_matrices_the_right_way_round():
    sure = np.full((6, 3), -5.0)
    sure[[2, 0, 1], [0, 1, 2]] = 5.0  # each position has one clear item
    unsure = np.zeros((6, 3))  # every item equally likely everywhere
    a = confidence(sure, DECODERS["hungarian"](sure).permutation, None, k=3)
    b = confidence(unsure, DECODERS["hungarian"](unsure).permutation, 0.5, k=3)
    assert a.margin == 10.0 and b.margin == 0.0  # 5 - (-5) to put a left-out item there; a tie: any passage could be
    assert a.sharpness > 0.99 and b.sharpness == pytest.approx(1 / 6)
    assert a.agreement == 1.0 and a.trust == 1.0 and b.trust == 0.5  # {2, 0, 1} is the input's top 3
    assert confidence(sure, np.array([5, 4, 3, 2, 1, 0]), None, k=3).agreement == 0.0
    with pytest.raises(ValueError, match="unknown confidence signal"):
        a.value("loudness")


def test_a_cascade_rule_escalates_a_share_or_below_a_threshold():
    notes = [{"qid": f"q{i}", "confidence": {s: float(i) for s in SIGNALS}} for i in range(8)]
    assert CascadeRule.parse("25%").escalate(notes) == {"q0", "q1"}
    assert CascadeRule.parse("10%", "sharpness").escalate(notes) == {"q0"}  # ceil: at least one
    assert CascadeRule.parse("2.5").escalate(notes) == {"q0", "q1", "q2"}
    assert CascadeRule.parse("100%").escalate(notes) == {n["qid"] for n in notes}
    for bad in ("0%", "150%", "lots"):
        with pytest.raises(ValueError):
            CascadeRule.parse(bad)
    with pytest.raises(ValueError, match="signal"):
        CascadeRule.parse("25%", "vibes")


def test_the_reranker_assesses_short_and_windowed_lists_in_one_pass(student):
    from hllm import Reranker

    reranker = Reranker.load(student, window=4)
    docs = ["red leather boots", "blue cotton shirt", "wool backpack", "green boots", "red shirt", "acme boots"]
    short, long = reranker.rank_assessed(["red boots", "red boots"], [docs[:4], docs])
    assert short.windows == 1 and long.windows > 1 and short.trust is None
    assert [d.index for d in short.documents] == [d.index for d in reranker.rank("red boots", docs[:4])]
    for a in (short, long):
        assert set(a.confidence.as_dict()) == set(SIGNALS) and a.confidence.margin >= 0 and 0 < a.confidence.sharpness <= 1


def test_hllm_rerank_cascade_hands_the_least_confident_queries_to_the_teacher(student, tmp_path, capsys):
    from hllm.data.readers import read_beir, read_run
    from pipelines.cli import main

    data = _beir(tmp_path / "beir", queries=4, docs=6)
    slates = read_beir(data, top_n=6)
    gold_run(slates, tmp_path / "teacher.tsv", skip={"q3"})  # a perfect teacher, with no ranking of q3
    out = tmp_path / "cascade.trec"
    argv = ["rerank", "--model", str(student), "--data", str(data), "--top-n", "6", "--window", "4", "--out", str(out),
            "--cascade", "50%", "--teacher-rankings", str(tmp_path / "teacher.tsv"), "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    notes = [json.loads(line) for line in (tmp_path / "cascade.trec.queries.jsonl").read_text().splitlines()]
    escalated = {n["qid"] for n in notes if n["escalated"]}
    assert len(notes) == 4 and len(escalated) == 2 and "cascade: 2 of 4 queries (50%) went to the teacher" in printed
    least = sorted(notes, key=lambda n: (n["confidence"]["margin"], n["qid"]))[:2]
    assert escalated == {n["qid"] for n in least}  # the least confident by margin
    student_run, cascade_run = read_run(tmp_path / "cascade.trec.student"), read_run(out)
    gold = {s.slate_id: [s.candidates[i].docid for i in sorted(range(6), key=lambda i: -(s.grades[i] or 0))] for s in slates}
    for n in notes:
        got = [d for d, _ in cascade_run[n["qid"]]]
        if n["answered_by"] == "teacher":
            assert got == gold[n["qid"]]
        else:
            assert got == [d for d, _ in student_run[n["qid"]]]
            assert n["answered_by"] == ("student_teacher_missing" if n["qid"] == "q3" and n["escalated"] else "student")
    assert "| cascade (50% by margin) |" in printed and "| reranked |" in printed and "| first stage (input order) |" in printed
    # bad input: one line on stderr, exit status 2, nothing written
    assert main(["rerank", "--model", str(student), "--data", str(data), "--out", str(tmp_path / "x.trec"), "--cascade", "25%"]) == 2
    assert "--teacher-rankings FILE" in capsys.readouterr().err and not (tmp_path / "x.trec").exists()


def test_the_cascade_benchmarks_curves_bracket_random_and_oracle():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import cascade as bench

    rng = np.random.default_rng(0)
    student = rng.uniform(0.3, 0.6, 40)
    teacher = student + rng.normal(0.1, 0.1, 40)
    sure = -(teacher - student) + rng.normal(0, 0.02, 40)  # a signal that knows where the teacher gains
    table = bench.curves(student, teacher, {"sure": sure}, draws=200)
    for policy in table:
        assert table[policy][0.0]["nDCG@10"] == pytest.approx(student.mean())
        assert table[policy][1.0]["nDCG@10"] == pytest.approx(teacher.mean()) and table[policy][1.0]["recovered"] == pytest.approx(1)
    assert table["oracle"][0.25]["nDCG@10"] >= table["sure"][0.25]["nDCG@10"] > table["random"][0.25]["nDCG@10"]
    assert table["random"][0.25]["recovered"] == pytest.approx(0.25, abs=0.1)
    assert bench.auc(np.array([3.0, 2.0, 1.0, 0.0]), np.array([True, True, False, False])) == 1.0
    assert bench.auc(np.array([1.0, 1.0]), np.array([True, False])) == 0.5
