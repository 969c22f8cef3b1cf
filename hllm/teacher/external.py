"""Teacher rankings from outside: what an autoregressive teacher already wrote, read from a file instead
of generated. Formats, by name in `FORMATS`:

- `run`: a TREC run (`qid Q0 docid rank score tag`) or a BEIR run TSV (`query-id corpus-id rank score`,
  a header allowed): the teacher's list per query, by rank;
- `rank_llm`: rank_llm's reranked JSONL (`{"query": {"qid", "text"}, "candidates": [...]}` a line, the
  candidates in the teacher's order);
- `responses`: the raw prompts and generated answers of a sliding-window run (`{"prompt", "response"}`
  a line, a query's windows in the order they were run, RankGPT's prompt): each answer is parsed by
  `hllm.teacher.parsing` (repaired, its flags counted) and the windows are replayed over the list, so
  the result is the teacher's final list, with the validity counts of every window it wrote.

`FileTeacher(fmt, path)` stands where an `ARTeacher` would: its `rank(slates)` looks the rankings up (no
model runs), so every stage that ranks with a teacher (in one process, or on Ray's actor pool) takes a
file as well; `rank_covered(slates)` -> one `TeacherRanking` per slate, in the slates' order, and a
`Coverage` counting what did not fit; nothing is dropped silently:
- a slate the file does not rank gets no permutation (the student stage's filter then skips it, and
  counts it): `uncovered`;
- a candidate of the slate that the teacher's list omits is appended in first-stage order and the
  ranking flagged `missing`: `missing_ids`;
- ids the list names that the slate lacks are counted (`outside_slate`): expected when the teacher
  ranked a top 100 and the slate is its top N — the permutation is then the teacher's relative order of
  the slate's candidates; a repeated id keeps its first place and flags `repeated`;
- queries of the file that none of the slates has: `other_queries` (another split's, or a mismatch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hllm.data.plane import DataFormatError
from hllm.data.readers import read_rank_llm, read_run
from hllm.records import ParseCounts, RerankRequest, TeacherRanking
from hllm.teacher.parsing import parse_ranking


@dataclass
class Coverage:
    """How the file's rankings met the slates (see the module docstring)."""

    slates: int = 0
    ranked: int = 0
    uncovered: int = 0
    missing_ids: int = 0
    outside_slate: int = 0
    repeated_ids: int = 0
    other_queries: int = 0
    examples: dict[str, str] = field(default_factory=dict)  # reason -> an example

    def note(self, reason: str, example: str, n: int = 1) -> None:
        setattr(self, reason, getattr(self, reason) + n)
        self.examples.setdefault(reason, example[:200])

    def counts(self) -> dict[str, int]:
        """The additive counts (a rankings store's shard footer sums them)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "examples"}


# ---- raw sliding-window answers --------------------------------------------------------------------
_QUERY = re.compile(r"search query: (.*?)\.?\n", re.IGNORECASE)
_PASSAGE = re.compile(r"^\[(\d+)\] (.*)$", re.MULTILINE)


def _norm(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".")


def _signatures(text: str) -> tuple[str, str]:
    """Two keys of a passage's first 40 ASCII letters and digits, so that a prompt's copy matches the
    collection's though one was cut short or had its encoding repaired (MS MARCO's "70Â° ... artiï¬\x81cial"
    is "70° ... artificial" in rank_llm's prompts): after undoing UTF-8-read-as-Latin-1 and NFKC, and
    (where that repair cannot be undone) with every non-ASCII character dropped."""
    repaired = text
    try:
        repaired = text.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        pass
    alnum = lambda t: re.sub(r"[^a-z0-9]", "", t.lower())[:40]  # noqa: E731
    return alnum(unicodedata.normalize("NFKC", repaired)), alnum(text.encode("ascii", "ignore").decode())


@dataclass
class _Replay:
    """One query's sliding-window run so far: the ranked tail of its list (key, the prompt's text) and
    where the next window's new passages end in the first-stage order."""

    slate: RerankRequest
    tail: list[tuple[str, str]] = field(default_factory=list)
    next_end: int = 0
    used: set = field(default_factory=set)
    signatures: list[tuple[str, str]] | None = None  # the slate candidates', computed once

    def key(self, text: str, expected: int) -> str:
        """A new passage -> the slate candidate with its text (of several, the unused one nearest to where
        the window procedure puts it), else a key of its own (ranked, but not in the slate)."""
        strong, weak = _signatures(text)
        if self.signatures is None:
            self.signatures = [_signatures(c.text) for c in self.slate.candidates]
        matches = [i for i, (a, b) in enumerate(self.signatures)
                   if i not in self.used and ((strong and a == strong) or (weak and b == weak))]
        if matches:
            best = min(matches, key=lambda i: abs(i - expected))
            self.used.add(best)
            return self.slate.candidates[best].docid
        return "text:" + hashlib.sha1(_norm(text).encode()).hexdigest()[:16]

    def window(self, passages: list[str], order: list[int]) -> None:
        """A window's passages (prompt order) and the teacher's order of them (0-based) -> the new tail.
        The passages already ranked are the window's bottom: the longest run of the prompt's last
        passages that repeats the tail's first, text for text."""
        overlap = next(m for m in range(min(len(passages), len(self.tail)), -1, -1)
                       if [t for _, t in self.tail[:m]] == passages[len(passages) - m:])
        fresh = len(passages) - overlap
        start = self.next_end - fresh
        keys = [self.key(t, start + i) for i, t in enumerate(passages[:fresh])] + [k for k, _ in self.tail[:overlap]]
        self.next_end = start
        self.tail = [(keys[i], passages[i]) for i in order] + self.tail[overlap:]


def _windows_by_query(path: Path) -> dict[str, list[tuple[str, str, str]]]:
    """A raw answers file -> {normalised query text: [(prompt, response, where), ...] in file order}."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
                prompt, response = str(obj["prompt"]), str(obj["response"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DataFormatError(f"{where}: not a {{prompt, response}} JSON object ({err})") from None
            found = _QUERY.search(prompt)
            if not found:
                raise DataFormatError(f"{where}: no 'search query: ...' in the prompt (RankGPT's prompt expected)")
            if not _PASSAGE.search(prompt):
                raise DataFormatError(f"{where}: no '[i] passage' lines in the prompt")
            out.setdefault(_norm(found.group(1)), []).append((prompt, response, where))
    return out


def _replay(slate: RerankRequest, windows: list[tuple[str, str, str]]) -> tuple[list[str], ParseCounts, str]:
    """A query's windows in the order they were run: each shows a stretch of the current list (its new
    passages above the ones already ranked) and its parsed answer (repaired) reorders that stretch.
    -> (the final list of keys, the windows' parse counts, their raw answers)."""
    replay, counts = _Replay(slate, next_end=len(slate.candidates)), ParseCounts()
    for prompt, response, _ in windows:
        passages = [m.group(2) for m in _PASSAGE.finditer(prompt)]
        parsed = parse_ranking(response, len(passages), repair=True)
        counts.add(parsed.counts)
        replay.window(passages, parsed.permutation)
    return [k for k, _ in replay.tail], counts, "\n".join(r for _, r, _ in windows)


def _lists(fmt: str, path: Path) -> dict[str, list[str]]:
    if fmt == "run":
        return {qid: [docid for docid, _ in hits] for qid, hits in read_run(path).items()}
    return {r.query.qid: [c.docid for c in r.candidates] for r in read_rank_llm(path)}


FORMATS = ("run", "rank_llm", "responses")  # see the module docstring


class FileTeacher:
    """A teacher whose rankings were written beforehand: a file in one of `FORMATS`, read once (when first
    asked), looked up per slate — by query id (`run`, `rank_llm`) or by query text (`responses`). It
    answers what the stages ask of an `ARTeacher` (`rank`, `rank_summarized`, `decoding`); nothing generates."""

    decoding = "file"

    def __init__(self, fmt: str, path: str | Path):
        if fmt not in FORMATS:
            raise ValueError(f"teacher rankings format {fmt!r}: known {list(FORMATS)}")
        self.fmt, self.path = fmt, Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"teacher rankings: {self.path} is not a file")
        self._index: dict[str, Any] | None = None

    @property
    def index(self) -> dict[str, Any]:
        if self._index is None:
            self._index = _windows_by_query(self.path) if self.fmt == "responses" else _lists(self.fmt, self.path)
        return self._index

    def queries(self) -> int:
        """How many queries the file ranks."""
        return len(self.index)

    def _told(self, slate: RerankRequest) -> tuple[list[str] | None, ParseCounts | None, str]:
        if self.fmt == "responses":
            windows = self.index.get(_norm(slate.query.text))
            return _replay(slate, windows) if windows else (None, None, "")
        return self.index.get(slate.slate_id), None, ""

    def rank(self, slates: Sequence[RerankRequest]) -> list[TeacherRanking]:
        return self.rank_covered(slates)[0]

    def rank_summarized(self, slates: Sequence[RerankRequest]) -> tuple[list[TeacherRanking], dict]:
        """`rank`, and how the file fit these slates (`Coverage` counts) for the store's shard footer."""
        rankings, cov = self.rank_covered(slates)
        return rankings, {"coverage": cov.counts()}

    def rank_covered(self, slates: Sequence[RerankRequest]) -> tuple[list[TeacherRanking], Coverage]:
        """The file's rankings of `slates` (in their order) and how they fit (see the module docstring)."""
        cov, out = Coverage(slates=len(slates)), []
        for s in slates:
            listed, counts, raw = self._told(s)
            if listed is None:
                cov.note("uncovered", f"slate {s.slate_id!r}")
                out.append(TeacherRanking(s.slate_id, None, "", ParseCounts(total=1, missing=1)))
                continue
            index = {c.docid: i for i, c in enumerate(s.candidates)}
            seen: dict[int, None] = {}
            repeated = 0
            for docid in listed:
                i = index.get(docid)
                if i is None:
                    cov.note("outside_slate", f"slate {s.slate_id!r}: {docid!r}")
                elif i in seen:
                    repeated += 1
                    cov.note("repeated_ids", f"slate {s.slate_id!r}: {docid!r}")
                else:
                    seen[i] = None
            missing = [i for i in range(len(s.candidates)) if i not in seen]
            if missing:
                cov.note("missing_ids", f"slate {s.slate_id!r}: {s.candidates[missing[0]].docid!r}", len(missing))
            # a list is one answer, flagged as a parsed one would be; raw answers keep their windows' own flags
            counts = counts or ParseCounts(total=1, ok=int(not (missing or repeated)), repeated=int(bool(repeated)),
                                           missing=int(bool(missing)))
            cov.ranked += 1
            out.append(TeacherRanking(s.slate_id, list(seen) + missing, raw, counts))
        return out, cov


def external_rankings(fmt: str, path: str | Path, slates: Sequence[RerankRequest]
                      ) -> tuple[list[TeacherRanking], Coverage]:
    """`FileTeacher(fmt, path).rank_covered(slates)`, plus the file's queries that none of `slates` has."""
    teacher = FileTeacher(fmt, path)
    rankings, cov = teacher.rank_covered(slates)
    keys = {s.slate_id if fmt != "responses" else _norm(s.query.text) for s in slates}
    others = sorted(q for q in teacher.index if q not in keys)
    if others:
        cov.note("other_queries", f"e.g. {others[0]!r}", len(others))
    return rankings, cov
