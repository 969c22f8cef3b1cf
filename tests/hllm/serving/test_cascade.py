"""Issue #43, first part: confidence read off the single pass (no second forward pass), and the offline cascade —
`hllm rerank --cascade` hands the least confident queries to a teacher given as rankings."""

import itertools
import json

import numpy as np
import pytest

from hllm.model.confidence import SIGNALS, assignment_margin, confidence
from hllm.model.decoding import DECODERS
from hllm.serving.cascade import CascadeRule

from conftest import gold_run
from builders import beir_folder as _beir


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

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
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
    assert bench.top10_change(list(range(20)), list(range(5, 25))) == 0.5 and bench.top10_change([1, 2], [2, 1]) == 0.0


# ---- thresholds kept with the model, the circuit breaker, the online cascade ----------------------------------
def test_thresholds_fitted_on_training_queries_are_saved_with_the_model_and_give_a_share(student, tmp_path):
    import shutil

    from hllm import Reranker
    from hllm.data.readers import read_beir
    from hllm.model.confidence import CascadeThresholds, Confidence
    from hllm.serving.cascade import fit_thresholds

    rng = np.random.default_rng(0)
    conf = [Confidence(float(m), 0.5, 1.0, 1.0) for m in rng.uniform(0, 10, size=400)]
    table = CascadeThresholds.fit(conf, "synthetic")
    margins = np.array([c.margin for c in conf])
    for share in (0.1, 0.25, 0.5):
        assert np.mean(margins < table.threshold("margin", share)) == pytest.approx(share, abs=0.01)
    assert table.threshold("margin", 1.0) == np.inf and np.mean(margins < table.threshold("margin", 0.0)) == 0
    assert table.threshold("agreement", 0.25) == 1.0 and not np.any(np.array([1.0]) < 1.0)  # all tied: none escalated
    with pytest.raises(ValueError):
        table.threshold("vibes", 0.25)

    data = _beir(tmp_path / "beir", queries=6, docs=6)
    model = tmp_path / "model"
    shutil.copytree(student, model)
    assert Reranker.load(model).cascade_thresholds is None
    fitted = fit_thresholds(Reranker.load(model, window=4), read_beir(data, top_n=6), "beir training queries")
    fitted.save(model)
    loaded = Reranker.load(model).cascade_thresholds
    assert loaded == fitted and loaded.fitted_on == {"queries": 6, "source": "beir training queries"}


def test_the_circuit_breaker_opens_after_failures_in_a_row_and_tries_one_request_later():
    from hllm.serving.cascade import CircuitBreaker

    now = [0.0]
    b = CircuitBreaker(failures=3, reset_s=10, clock=lambda: now[0])
    for ok in (False, False, True, False, False):  # a success resets the count
        assert b.allow()
        b.record(ok)
    assert b.state == "closed" and b.allow()
    b.record(False)  # the third in a row
    assert b.state == "open" and not b.allow() and b.opens == 1
    now[0] = 10.0
    assert b.state == "half_open" and b.allow() and not b.allow()  # one trial at a time
    b.record(False)  # the trial failed: open for another reset_s
    assert b.state == "open" and b.opens == 2 and not b.allow()
    now[0] = 20.5
    assert b.allow()
    b.record(True)
    assert b.state == "closed" and b.allow() and b.failed == 0


def test_the_online_cascade_needs_a_threshold_or_the_models_table():
    from hllm.model.confidence import CascadeThresholds, Confidence
    from hllm.serving.cascade import CascadeConfig, OnlineCascade

    teacher = {"url": "http://127.0.0.1:9/v1", "model": "m"}
    with pytest.raises(ValueError, match="url"):
        CascadeConfig(teacher={"model": "m"}, threshold=1.0)
    with pytest.raises(ValueError, match="one of them"):
        CascadeConfig(teacher=teacher)
    by_share = OnlineCascade(CascadeConfig(teacher=teacher, share=0.5))
    with pytest.raises(ValueError, match="no cascade.json"):
        by_share.threshold_for(None)
    table = CascadeThresholds.fit([Confidence(float(m), 0.5, 1.0, 1.0) for m in range(11)], "t")
    assert by_share.threshold_for(table) == pytest.approx(5.0)
    assert by_share.wants({"margin": 4.9}, 5.0) and not by_share.wants({"margin": 5.0}, 5.0)
    assert OnlineCascade(CascadeConfig(teacher=teacher, threshold=0.3, signal="sharpness")).threshold_for(table) == 0.3


@pytest.fixture
def online(teacher_server, fault_proxy, monkeypatch):
    """An online cascade against the real teacher server, through the fault proxy."""
    from teacher_server import API_KEY, MODEL

    from hllm.serving.cascade import CascadeConfig, OnlineCascade

    monkeypatch.setenv("HLLM_TEST_TEACHER_KEY", API_KEY)

    def make(**changes) -> OnlineCascade:
        teacher = {"url": fault_proxy.url, "model": MODEL, "api_key_env": "HLLM_TEST_TEACHER_KEY", "timeout_s": 20,
                   "max_retries": 0, "concurrency": changes.pop("concurrency", 4)}
        return OnlineCascade(CascadeConfig(teacher=teacher, prompt={"max_doc_tokens": 24}, threshold=1e9, window=4, stride=2,
                                           **changes))
    return make


DOCS = ["acme red leather boots", "zenith blue cotton shirt", "acme red wool boots", "kairo green canvas backpack",
        "nordic red leather boots"]


@pytest.mark.slow
def test_the_online_cascade_answers_in_time_or_lets_the_student_stand(online, fault_proxy):
    import asyncio

    async def run():
        ok = await online(deadline_ms=60_000).ask("red boots", DOCS)
        assert ok.answered_by == "teacher" and sorted(ok.order) == list(range(5)) and ok.teacher_ms > 0
        assert len(fault_proxy.posts()) == 2  # two windows of 4 over 5 passages
        slow = online(deadline_ms=50)  # a real answer takes longer than 50 ms
        late = await slow.ask("red boots", DOCS)
        assert late.answered_by == "student_after_teacher_timeout" and late.order is None and 50 <= late.teacher_ms < 1000
        order, reason = await late.late  # finish_late: the answer still comes, for the traffic log
        assert sorted(order) == list(range(5)) and reason == "" and slow.in_flight == 0
        fault_proxy.faults.extend(["500", "garbage"])
        failing = online(deadline_ms=60_000, breaker_failures=2, breaker_reset_s=1.0)
        first, second = [await failing.ask("red boots", DOCS) for _ in range(2)]
        assert (first.answered_by, first.reason) == ("student_after_teacher_error", "http_5xx")
        assert (second.answered_by, second.reason) == ("student_after_teacher_error", "unparseable")
        posts = len(fault_proxy.posts())
        shut = await failing.ask("red boots", DOCS)  # open: not asked
        assert shut.answered_by == "student_breaker_open" and len(fault_proxy.posts()) == posts
        await asyncio.sleep(1.1)
        trial = await failing.ask("red boots", DOCS)  # half-open: one trial, it answers, closed again
        assert trial.answered_by == "teacher" and failing.breaker.state == "closed"
        busy = online(deadline_ms=60_000, concurrency=1)
        both = await asyncio.gather(busy.ask("red boots", DOCS), busy.ask("red boots", DOCS))
        assert sorted(e.answered_by for e in both) == ["student_teacher_busy", "teacher"]

    asyncio.run(run())


def test_about_a_share_uses_the_models_own_thresholds():
    from hllm.model.confidence import CascadeThresholds, Confidence

    table = CascadeThresholds.fit([Confidence(float(m), 0.5, 1.0, 1.0) for m in range(101)], "t")
    rule = CascadeRule.parse("~25%", "margin", table)
    assert rule.share is None and rule.threshold == pytest.approx(25.0)
    notes = [{"qid": f"q{i}", "confidence": {"margin": float(m)}} for i, m in enumerate([1, 30, 60, 90])]
    assert rule.escalate(notes) == {"q0"}  # each query decided alone: not a quarter of these four by count
    with pytest.raises(ValueError, match="no cascade.json"):
        CascadeRule.parse("~25%", "margin", None)
    with pytest.raises(ValueError, match="~ goes with a share"):
        CascadeRule.parse("~0.8", "margin", table)


@pytest.mark.slow
def test_hllm_rerank_cascade_with_a_served_teacher(student, teacher_server, fault_proxy, tmp_path, capsys, monkeypatch):
    from teacher_server import API_KEY, MODEL

    from hllm.data.readers import read_run
    from pipelines.cli import main

    monkeypatch.setenv("HLLM_TEST_TEACHER_KEY", API_KEY)
    data = _beir(tmp_path / "beir", queries=4, docs=5)
    out = tmp_path / "cascade.trec"
    argv = ["rerank", "--model", str(student), "--data", str(data), "--top-n", "5", "--out", str(out), "--cascade", "50%",
            "--cascade-url", fault_proxy.url, "--teacher-model", MODEL, "--teacher-api-key-env", "HLLM_TEST_TEACHER_KEY",
            "--quiet"]
    fault_proxy.faults.append("500")  # the first teacher request fails once: retried
    assert main(argv) == 0
    printed = capsys.readouterr().out
    notes = [json.loads(line) for line in (tmp_path / "cascade.trec.queries.jsonl").read_text().splitlines()]
    assert sorted(n["answered_by"] for n in notes) == ["student", "student", "teacher", "teacher"]
    assert "cascade: 2 of 4 queries (50%) went to the teacher" in printed and "cascade teacher endpoint: 2 requests (1 retries" in printed
    assert len(fault_proxy.posts()) == 3 and set(read_run(out)) == {n["qid"] for n in notes}
    assert API_KEY not in printed
    assert main(argv) == 0  # a rerun: the student's run resumes, the teacher's answers come from OUT.answers/
    assert "2 answers from the cache" in capsys.readouterr().out and len(fault_proxy.posts()) == 3
