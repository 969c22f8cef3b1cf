"""The records every stage passes around, each defined once.

A *slate* (`RerankRequest`) is one query with its N first-stage candidates in first-stage order.
Permutations are 0-based lists of candidate indices, best first: `[2, 0, 1]` means candidate 2
ranks first. The teacher's text uses 1-based identifiers `[3] > [1] > [2]`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Query:
    qid: str
    text: str


@dataclass
class Candidate:
    docid: str
    text: str
    score: float | None = None  # first-stage score, if any
    title: str = ""

    @property
    def shown(self) -> str:
        """What a prompt shows of the candidate: `title: text`, or the text alone."""
        return f"{self.title}: {self.text}" if self.title else self.text


@dataclass
class RerankRequest:
    """One slate: a query and its candidates in first-stage order.

    `grades` holds graded relevance of each candidate when known (None when unjudged);
    `extra_qrels` holds judged documents *outside* the slate (trec_eval counts them in the
    ideal DCG), as {docid: grade}.
    """

    query: Query
    candidates: list[Candidate]
    grades: list[int | None] | None = None
    extra_qrels: dict[str, int] = field(default_factory=dict)

    @property
    def slate_id(self) -> str:
        return self.query.qid

    def qrels(self) -> dict[str, int]:
        """{docid: grade} for every judged document, in the slate or not."""
        judged = dict(self.extra_qrels)
        for cand, grade in zip(self.candidates, self.grades or []):
            if grade is not None:
                judged[cand.docid] = int(grade)
        return judged


@dataclass
class ParseCounts:
    """How teacher outputs parsed. One output can raise several flags; `ok` means none."""

    total: int = 0
    ok: int = 0
    wrong_format: int = 0
    repeated: int = 0
    missing: int = 0
    out_of_range: int = 0

    def add(self, other: "ParseCounts") -> "ParseCounts":
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    @property
    def validity(self) -> float:
        return self.ok / self.total if self.total else 0.0

    def rates(self) -> dict[str, float]:
        denom = max(self.total, 1)
        return {f.name: getattr(self, f.name) / denom for f in dataclasses.fields(self) if f.name != "total"}


@dataclass
class TeacherRanking:
    """The autoregressive teacher's answer for one slate."""

    slate_id: str
    permutation: list[int] | None  # 0-based, best first; None when unparseable and not repaired
    raw_text: str
    counts: ParseCounts
    prompt_tokens: int = 0
    output_tokens: int = 0
    latency_s: float = 0.0
    windows: list[list[int]] = field(default_factory=list)  # candidates (input indices) of each window ranked, if any
    node: str = ""  # provenance: the worker (Ray node id) that generated it, where one is known
    # why a served teacher gave no ranking (`hllm.teacher.endpoint.FAILURE_REASONS`: http_429, timeout, ...); "" if none
    failure: str = ""


@dataclass
class RankedSlate:
    """A slate with its teacher ranking: one row of the rankings store (`hllm.data.store`)."""

    slate: RerankRequest
    ranking: TeacherRanking


def record_to_dict(record: Any) -> dict[str, Any]:
    return dataclasses.asdict(record)


def request_from_dict(data: dict[str, Any]) -> RerankRequest:
    return RerankRequest(
        query=Query(**data["query"]),
        candidates=[Candidate(**c) for c in data["candidates"]],
        grades=data.get("grades"),
        extra_qrels=dict(data.get("extra_qrels") or {}),
    )
