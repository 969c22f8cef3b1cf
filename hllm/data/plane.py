"""The data plane's per-batch work: the lines of a BEIR collection in, slates out.

Pure functions over one batch of lines or one query's rows. Each returns what it parsed and the bad
input it met (`BadRows`: a count per reason and an example of each), so nothing is dropped
silently. The Ray data stage (`pipelines/data.py`) maps them over blocks that `ray.data.read_text`
reads from any filesystem pyarrow opens and hash-partitions by docid, then by qid (two shuffles); the
one-process reader (`hllm.data.readers.read_beir`) calls the same functions on whole files.

    run lines    -> parse_run_lines    -> (qid, docid, rank, score)
    qrels lines  -> parse_qrels_lines  -> (qid, docid, grade)
    corpus lines -> parse_doc_lines    -> (docid, title, text, has_doc)
    query lines  -> parse_query_lines  -> (qid, query)
    hash-partitioned by docid -> attach_passages -> by qid (with the queries) -> assemble_slates -> slates
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from hllm.records import Candidate, Query, RerankRequest


class DataFormatError(ValueError):
    """Malformed input; the message names the file (or reason), the count and an example."""


# Why an input row did not become (part of) a slate. Counted per reason; past `data.max_bad_share` the job stops.
REASONS = ("unreadable line", "missing passage", "query without text", "duplicate candidate")
HEADERS = ("query-id", "qid", "query_id")  # a TSV header's first field


@dataclass
class BadRows:
    """Bad input met by one batch (or summed over many): a count per reason, an example of each."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, example: str, n: int = 1) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown bad-input reason {reason!r}; known: {REASONS}")
        self.counts[reason] = self.counts.get(reason, 0) + n
        self.examples.setdefault(reason, example[:200])

    def merge(self, other: BadRows) -> BadRows:
        for reason, n in other.counts.items():
            self.add(reason, other.examples.get(reason, ""), n)
        return self

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def check(self, rows: int, max_share: float, where: str) -> None:
        """Stops (DataFormatError) when a reason's count exceeds `max_share` of the `rows` read."""
        for reason in REASONS:
            n = self.counts.get(reason, 0)
            if n > max_share * max(rows, 1):
                raise DataFormatError(f"{where}: {n} rows with {reason} ({n / max(rows, 1):.2%} of {rows} rows read, "
                                      f"data.max_bad_share={max_share}); e.g. {self.examples[reason]}")


def _fields(line: str) -> list[str]:
    row = line.rstrip("\r\n").split("\t")
    return row[0].split() if len(row) == 1 else row  # space-separated TREC files


def _tsv_records(lines: Iterable[str], where: str, first_line: int | None) -> Iterable[tuple[str, list[str]]]:
    """-> (where the line is, for an example; its fields), blank lines and headers skipped; numbered where the
    caller knows the line numbers."""
    for i, line in enumerate(lines):
        row = _fields(line)
        if "".join(row).strip() and row[0] not in HEADERS:
            yield (where if first_line is None else f"{where}:{first_line + i}"), row


def parse_run_lines(lines: Iterable[str], where: str = "run", first_line: int | None = None
                    ) -> tuple[list[dict[str, Any]], BadRows]:
    """Run lines, `qid docid rank score` (a header allowed) or TREC's `qid Q0 docid rank score tag`."""
    rows, bad = [], BadRows()
    for at, row in _tsv_records(lines, where, first_line):
        qid, docid, rank, score = (row[0], row[2], row[3], row[4]) if len(row) >= 6 else (row + [""] * 4)[:4]
        try:
            rows.append({"qid": qid, "docid": docid, "rank": int(rank), "score": float(score)})
        except ValueError:
            bad.add("unreadable line", f"{at}: rank/score not numeric in {row}")
    return rows, bad


def parse_qrels_lines(lines: Iterable[str], where: str = "qrels", first_line: int | None = None
                      ) -> tuple[list[dict[str, Any]], BadRows]:
    """Judgments, BEIR's `query-id corpus-id score` or TREC's `qid 0 docid grade`."""
    rows, bad = [], BadRows()
    for at, row in _tsv_records(lines, where, first_line):
        qid, docid, grade = (row[0], row[2], row[3]) if len(row) >= 4 else (row + [""] * 3)[:3]
        try:
            rows.append({"qid": qid, "docid": docid, "grade": int(float(grade))})
        except ValueError:
            bad.add("unreadable line", f"{at}: relevance {grade!r} is not a number in {row}")
    return rows, bad


def _json_objects(lines: Iterable[str], where: str, bad: BadRows) -> Iterable[dict[str, Any]]:
    for line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or obj.get("_id") is None:
            bad.add("unreadable line", f"{where}: {line.strip()[:120]!r}")
            continue
        yield obj


def parse_doc_lines(lines: Iterable[str], where: str = "corpus") -> tuple[list[dict[str, Any]], BadRows]:
    """BEIR corpus JSONL, `{"_id", "title", "text"}` -> passages (`has_doc` marks them through an outer join)."""
    bad = BadRows()
    rows = [{"docid": str(o["_id"]), "title": str(o.get("title") or ""), "text": str(o.get("text") or ""), "has_doc": True}
            for o in _json_objects(lines, where, bad)]
    return rows, bad


def parse_query_lines(lines: Iterable[str], where: str = "queries") -> tuple[list[dict[str, Any]], BadRows]:
    """BEIR queries JSONL, `{"_id", "text"}`; a query without text keeps its id (the slate counts it)."""
    bad = BadRows()
    rows = [{"qid": str(o["_id"]), "query": None if o.get("text") is None else str(o["text"])}
            for o in _json_objects(lines, where, bad)]
    return rows, bad


def attach_passage(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of one docid (run and qrels rows, its corpus row if any) -> the run and qrels rows with
    the passage's `title` and `text`, `has_doc` False where the corpus lacks it."""
    doc = next((r for r in rows if r["kind"] == "doc"), None)
    found = {"title": doc["title"], "text": doc["text"], "has_doc": True} if doc else {"has_doc": False}
    return [{**r, **found} for r in rows if r["kind"] != "doc"]


def assemble_slate(rows: Sequence[dict[str, Any]], top_n: int) -> tuple[RerankRequest | None, BadRows]:
    """One query's rows -> its slate: the run's top `top_n` in rank order, each with its passage and
    grade (None where unjudged); judged documents outside the slate go to `extra_qrels` (nDCG's ideal
    DCG counts them, as trec_eval does). Rows by `kind`: `run` (docid, rank, score, title, text,
    has_doc), `qrel` (docid, grade), `query` (its text). -> (None, bad) for a query without text or
    without a readable candidate; (None, nothing bad) for judgments of a query the run lacks."""
    bad = BadRows()
    qid = str(rows[0]["qid"])
    ranked = sorted((r for r in rows if r["kind"] == "run"), key=lambda r: (r["rank"], r["docid"]))
    if not ranked:
        return None, bad
    query = next((r["query"] for r in rows if r["kind"] == "query" and r.get("query") is not None), None)
    if query is None:
        bad.add("query without text", f"query {qid!r}")
        return None, bad
    judged = {r["docid"]: r["grade"] for r in rows if r["kind"] == "qrel"}
    cands, grades, seen = [], [], set()
    for r in ranked:
        if r["docid"] in seen:
            bad.add("duplicate candidate", f"query {qid!r}, document {r['docid']!r}")
            continue
        seen.add(r["docid"])
        if len(seen) > top_n:
            continue
        if not r.get("has_doc"):
            bad.add("missing passage", f"query {qid!r}, document {r['docid']!r} is not in the corpus")
            continue
        cands.append(Candidate(docid=r["docid"], text=r["text"], score=r["score"], title=r["title"]))
        grades.append(judged.get(r["docid"]))
    in_slate = {c.docid for c in cands}
    extra = {d: g for d, g in judged.items() if d not in in_slate}
    return (RerankRequest(Query(qid, query), cands, grades, extra) if cands else None), bad


PARSERS = {"run": parse_run_lines, "qrels": parse_qrels_lines, "corpus": parse_doc_lines, "queries": parse_query_lines}
KINDS = {"run": "run", "qrels": "qrel", "corpus": "doc", "queries": "query"}  # a source's rows, by `kind`
# every row between the parse and the slate, whatever its kind (the group-bys need one schema)
ROW_SCHEMA = pa.schema([("kind", pa.string()), ("qid", pa.string()), ("docid", pa.string()), ("rank", pa.int64()),
                        ("score", pa.float64()), ("grade", pa.int64()), ("title", pa.string()), ("text", pa.string()),
                        ("has_doc", pa.bool_()), ("query", pa.string())])


def tagged(rows: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [{**r, "kind": kind} for r in rows]


def _by(rows: Iterable[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return groups


def attach_passages(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run, qrels and corpus rows holding every row of each docid they name (a hash partition by docid,
    or all of them) -> the run and qrels rows with their passages (`attach_passage` per docid)."""
    return [row for group in _by(rows, "docid").values() for row in attach_passage(group)]


def assemble_slates(rows: Iterable[dict[str, Any]], top_n: int) -> tuple[list[RerankRequest], BadRows]:
    """Rows holding every row of each qid they name (a hash partition by qid, or all of them) -> a slate
    per query (`assemble_slate`), ordered by query id (shortest first), and the bad input met."""
    groups, slates, bad = _by(rows, "qid"), [], BadRows()
    for qid in sorted(groups, key=lambda q: (len(q), q)):
        slate, b = assemble_slate(groups[qid], top_n)
        bad.merge(b)
        if slate is not None:
            slates.append(slate)
    return slates, bad


def slates_in_memory(run: list[dict[str, Any]], qrels: list[dict[str, Any]], docs: list[dict[str, Any]],
                     queries: list[dict[str, Any]], top_n: int) -> tuple[list[RerankRequest], BadRows]:
    """The data stage in one process (small data): the same two steps the Ray stage runs on each hash
    partition — passages by docid, then slates by qid — over all the rows at once."""
    attached = attach_passages(tagged(run, "run") + tagged(qrels, "qrel") + tagged(docs, "doc"))
    return assemble_slates(attached + tagged(queries, "query"), top_n)
