"""The cascade: the single pass answers every query, the AR teacher only those it is unsure of.

Offline (`hllm rerank --cascade`): `CascadeRule` picks the least confident queries of a ranked collection (a share of
them, or those below a threshold) and `cascade` hands them to a teacher (a rankings file, a job's teacher, a served
LLM), marking who answered each query.

Online (Serve's `cascade` args): `OnlineCascade` asks a served teacher (`hllm.teacher.endpoint.EndpointTeacher`) for
a request whose confidence is below the threshold, within a deadline. Past the deadline, on any teacher error, when
the replica's teacher slots are full or while the circuit breaker is open, the student's answer stands: a teacher
outage never fails a request. `Escalation.answered_by` says which happened (`ANSWERED_BY`).

Thresholds: `CascadeThresholds` keeps each signal's quantiles over training-side queries (a job's val split, out-of-fold
queries, or those the model was fitted on), in the model's folder (`cascade.json`), so "about 25% of traffic" is one
lookup (`threshold(signal, 0.25)`), not a refit.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hllm.model.confidence import SIGNALS, THRESHOLDS_FILE, CascadeThresholds, Confidence
from hllm.model.prompts import PromptConfig
from hllm.records import RerankRequest
from hllm.teacher.endpoint import EndpointConfig


@dataclass(frozen=True)
class CascadeRule:
    """Which queries go to the teacher: the `share` least confident by `signal`, or those below `threshold`."""

    signal: str = "margin"  # hllm.model.confidence.SIGNALS
    share: float | None = None  # in (0, 1]
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"cascade signal {self.signal!r}: known {list(SIGNALS)}")
        if (self.share is None) == (self.threshold is None):
            raise ValueError("a cascade takes a share of the queries or a threshold on the signal, one of them")
        if self.share is not None and not 0 < self.share <= 1:
            raise ValueError(f"cascade share {self.share}: in (0, 1] (e.g. 25%)")

    @classmethod
    def parse(cls, text: str, signal: str = "margin", thresholds: CascadeThresholds | None = None) -> "CascadeRule":
        """`25%` -> the least confident quarter of these queries; `~25%` -> those below the model's own threshold for
        about 25% (`thresholds`, fitted on its training-side queries: each query decided alone, as Serve does);
        `0.8` -> every query whose signal is below 0.8."""
        about = text.startswith("~")
        try:
            if not text.endswith("%"):
                if about:
                    raise ValueError("~ goes with a share")
                return cls(signal, threshold=float(text))
            share = float(text.removeprefix("~")[:-1]) / 100
            rule = cls(signal, share=share)
        except ValueError as err:
            raise ValueError(f"--cascade {text!r}: a share such as 25%, about a share (~25%, the model's thresholds) or a "
                             f"threshold such as 0.8 ({err})") from None
        if not about:
            return rule
        if thresholds is None:
            raise ValueError(f"--cascade {text!r}: this model has no {THRESHOLDS_FILE} (the thresholds fitted on its "
                             "training queries): give a share of these queries (25%) or a threshold")
        return cls(signal, threshold=thresholds.threshold(signal, share))

    def escalate(self, notes: Sequence[dict[str, Any]]) -> set[str]:
        """The query ids to hand to the teacher."""
        # least confident first, ties by id; a signal undefined for a query (agreement of an undeclared order) counts lowest
        values = sorted((-math.inf if n["confidence"][self.signal] is None else n["confidence"][self.signal], n["qid"])
                        for n in notes)
        if self.share is not None:
            return {q for _, q in values[: math.ceil(self.share * len(values))]}
        return {q for v, q in values if v < self.threshold}


@dataclass(frozen=True)
class CascadeRun:
    """What an offline cascade did to a student's run."""

    queries: int
    escalated: int  # chosen by the rule for the teacher
    teacher: int  # of those, answered by the teacher
    teacher_missing: int  # of those, no teacher ranking: the student's order stands
    signal: str  # the rule's confidence signal
    teacher_figures: dict[str, Any]  # the teacher's own counts (`rank_summarized`), e.g. a served one's `endpoint`


def cascade(student_run: str | Path, notes_path: str | Path, slates: Sequence[RerankRequest], teacher, rule: CascadeRule,
            out: str | Path, tag: str = "hllm-cascade") -> CascadeRun:
    """The student's run, with the queries `rule` escalates ranked by `teacher` (any teacher's `rank_summarized`: a
    rankings file, a job's AR teacher, a served one) instead -> `out` (atomically), and the notes rewritten with who
    answered each query (`student`, `teacher`, or `student_teacher_missing` where the teacher had no ranking).
    -> the counts (`CascadeRun`)."""
    from hllm.data.readers import read_run
    from hllm.eval.runfile import atomic_write, run_lines

    notes = [json.loads(line) for line in Path(notes_path).read_text(encoding="utf-8").splitlines() if line.strip()]
    chosen = rule.escalate(notes)
    by_id = {s.slate_id: s for s in slates}
    escalated = [by_id[q] for q in sorted(chosen)]
    rankings, figures = teacher.rank_summarized(escalated) if escalated else ([], {})
    teacher_order = {s.slate_id: r.permutation for s, r in zip(escalated, rankings) if r.permutation is not None}
    student = read_run(student_run)
    orders, answered = [], {}
    for s in slates:
        index = {c.docid: i for i, c in enumerate(s.candidates)}
        if s.slate_id in teacher_order:
            orders.append(teacher_order[s.slate_id])
            answered[s.slate_id] = "teacher"
        else:
            orders.append([index[d] for d, _ in student[s.slate_id]])
            answered[s.slate_id] = "student_teacher_missing" if s.slate_id in chosen else "student"
    atomic_write(out, "\n".join(run_lines(slates, orders, tag)) + "\n")
    for n in notes:
        n["escalated"], n["answered_by"] = n["qid"] in chosen, answered[n["qid"]]
    atomic_write(notes_path, "".join(json.dumps(n) + "\n" for n in notes))
    return CascadeRun(len(slates), len(chosen), len(teacher_order), len(chosen) - len(teacher_order), rule.signal, figures)


def fit_thresholds(reranker, slates: Sequence[RerankRequest], source: str) -> CascadeThresholds:
    """A loaded `hllm.Reranker` ranks `slates` (its training or validation queries; never test ones) -> the
    quantiles of its confidence on them. A reranker without a window gets its default one (as Serve ranks)."""
    from hllm.model.prompts import document_text

    reranker.window = reranker.window or reranker.default_window  # as it serves: longer lists in windows, the top one's confidence
    ranked = reranker.windowed_orders([s.query.text for s in slates], [[document_text(c) for c in s.candidates] for s in slates],
                                      first_stage_order=True)  # slates: first-stage order by definition
    return CascadeThresholds.fit(ranked.confidence, source)


# ---- online: the teacher within a deadline -------------------------------------------------------------
class CircuitBreaker:
    """Closed: every escalation may ask. After `failures` failures in a row (errors, deadline misses) it opens:
    nothing is asked for `reset_s`; then one trial request is let through (half-open): a success closes it,
    a failure opens it for another `reset_s`."""

    def __init__(self, failures: int = 5, reset_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if failures < 1 or reset_s <= 0:
            raise ValueError("circuit breaker: need failures >= 1 and reset_s > 0")
        self.failures, self.reset_s, self.clock = failures, reset_s, clock
        self.failed = 0  # in a row
        self.opened_at: float | None = None
        self.trial = False  # the half-open trial is out
        self.opens = 0  # times it opened

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.trial or self.clock() - self.opened_at >= self.reset_s else "open"

    def allow(self) -> bool:
        if self.opened_at is None:
            return True
        if self.trial or self.clock() - self.opened_at < self.reset_s:
            return False
        self.trial = True
        return True

    def record(self, ok: bool) -> None:
        if ok:
            self.failed, self.opened_at, self.trial = 0, None, False
            return
        self.failed += 1
        if self.trial or (self.opened_at is None and self.failed >= self.failures):
            self.opened_at, self.trial = self.clock(), False
            self.opens += 1


@dataclass
class CascadeConfig:
    """Serve's online cascade (`serve.common.AppArgs.cascade`): which requests go to the served teacher, and how long
    a request may wait for it."""

    teacher: EndpointConfig = field(default_factory=EndpointConfig)  # the served AR teacher (url and model required)
    prompt: PromptConfig = field(default_factory=PromptConfig)  # the teacher's prompt (RankGPT's; words per passage)
    signal: str = "margin"  # hllm.model.confidence.SIGNALS
    share: float | None = None  # about this share of requests, through the model's thresholds (cascade.json) ...
    threshold: float | None = None  # ... or every request whose signal is below this
    deadline_ms: float = 2000.0  # the teacher's answer must come within this; past it the student's stands
    window: int = 20  # the teacher's windows (RankGPT: 20 by 10)
    stride: int = 10
    breaker_failures: int = 5  # failures in a row that open the circuit breaker ...
    breaker_reset_s: float = 30.0  # ... for this long, then one trial request
    finish_late: bool = True  # a teacher answer past the deadline still goes to the traffic log (the slot stays busy)

    def __post_init__(self) -> None:
        if isinstance(self.teacher, dict):
            self.teacher = EndpointConfig(**self.teacher)
        if isinstance(self.prompt, dict):
            self.prompt = PromptConfig(**self.prompt)
        if self.teacher.url is None:
            raise ValueError("cascade.teacher.url: the served teacher's base URL (e.g. http://host:8000/v1) is required")
        CascadeRule(self.signal, self.share, self.threshold)  # the same checks as offline
        if self.deadline_ms <= 0 or self.window < 2 or not 1 <= self.stride <= self.window:
            raise ValueError("cascade: need deadline_ms > 0, window >= 2, 1 <= stride <= window")


ANSWERED_BY = ("student", "teacher", "student_after_teacher_timeout", "student_after_teacher_error",
               "student_breaker_open", "student_teacher_busy")


@dataclass
class Escalation:
    """What the cascade did for one request."""

    answered_by: str  # ANSWERED_BY
    order: list[int] | None = None  # the teacher's ranking, when it answered in time
    teacher_ms: float | None = None  # how long the request waited on the teacher
    reason: str = ""  # the teacher's failure (hllm.teacher.endpoint.FAILURE_REASONS, auth) when it failed
    late: "asyncio.Task | None" = None  # past the deadline, the teacher's answer still on its way (finish_late)


class OnlineCascade:
    """`wants(confidence, threshold)` -> escalate? `await ask(query, documents)` -> an `Escalation`, never an exception: see
    the module docstring. At most `teacher.concurrency` teacher requests are in flight per replica (late ones
    included); an escalation finding them all busy is answered by the student at once."""

    def __init__(self, cfg: CascadeConfig):
        import dataclasses

        from hllm.teacher.endpoint import EndpointTeacher
        from hllm.teacher.generation import TeacherConfig

        self.cfg = cfg
        generation = TeacherConfig(window=cfg.window, stride=cfg.stride, repair=True)
        # a long-running replica keeps no answers (an unbounded cache); the deadline bounds the wait, the endpoint's
        # timeout_s and max_retries how long a late answer may still come
        self.teacher = EndpointTeacher(dataclasses.replace(cfg.teacher, cache=False), cfg.prompt, generation)
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s)
        self.in_flight = 0

    def threshold_for(self, thresholds: CascadeThresholds | None) -> float:
        """The threshold on `cfg.signal` for a model: `cfg.threshold`, or its saved quantile for `cfg.share`."""
        if self.cfg.threshold is not None:
            return self.cfg.threshold
        if thresholds is None:
            raise ValueError(f"cascade.share {self.cfg.share}: this model has no {THRESHOLDS_FILE} (thresholds fitted on "
                             "its training queries); give cascade.threshold, or fit them (hllm.serving.cascade.fit_thresholds)")
        return thresholds.threshold(self.cfg.signal, self.cfg.share)

    def wants(self, confidence: dict[str, float | None] | Confidence, threshold: float) -> bool:
        """Whether to escalate: the signal below the threshold, or undefined for this request (`agreement` of an
        undeclared input order: the student cannot vouch for its answer by a signal it does not have)."""
        value = confidence.value(self.cfg.signal) if isinstance(confidence, Confidence) else confidence[self.cfg.signal]
        return value is None or value < threshold

    async def ask(self, query: str, documents: Sequence[str]) -> Escalation:
        from hllm.records import Candidate, Query

        if self.in_flight >= self.cfg.teacher.concurrency:  # late answers hold slots too
            return Escalation("student_breaker_open" if self.breaker.state == "open" else "student_teacher_busy")
        if not self.breaker.allow():
            return Escalation("student_breaker_open")
        slate = RerankRequest(Query("request", query), [Candidate(str(i), d) for i, d in enumerate(documents)])
        self.in_flight += 1
        t0 = time.perf_counter()
        task = asyncio.ensure_future(self._rank(slate))
        try:
            order, reason = await asyncio.wait_for(asyncio.shield(task), self.cfg.deadline_ms / 1000)
        except asyncio.TimeoutError:
            self.breaker.record(False)
            if not self.cfg.finish_late:
                task.cancel()
            return Escalation("student_after_teacher_timeout", teacher_ms=1000 * (time.perf_counter() - t0),
                              reason="deadline", late=task if self.cfg.finish_late else None)
        ms = 1000 * (time.perf_counter() - t0)
        self.breaker.record(order is not None)
        if order is None:
            return Escalation("student_after_teacher_error", teacher_ms=ms, reason=reason)
        return Escalation("teacher", order, ms)

    async def _rank(self, slate: RerankRequest) -> tuple[list[int] | None, str]:
        """-> (the teacher's order, "") or (None, why): never raises (an auth error, a bug in a reply included)."""
        try:
            rankings, _ = await self.teacher.arank([slate])
            ranking = rankings[0]
            return ranking.permutation, ranking.failure or ("" if ranking.permutation is not None else "unparseable")
        except Exception as err:  # noqa: BLE001 — a teacher outage must never fail a request; the reason is counted
            return None, type(err).__name__
        finally:
            self.in_flight -= 1
