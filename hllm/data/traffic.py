"""The traffic log: what a served student answered, as Parquet, for the data flywheel.

A writer (`TrafficLog`, one per Serve replica) buffers records in memory and a background thread
writes them out — when `flush_records` are waiting or the oldest has waited `flush_seconds` — as
one closed Parquet file per flush, atomically (temp file + rename), under a folder per day:

    <path>/date=2026-12-01/part-<unix ms>-<writer>-<seq>.parquet

So a request only appends to a list (it never waits on the disk), a reader never sees half a file,
and a replica killed with SIGKILL loses at most what was not yet on disk: its buffer (fewer than
`flush_records` records, or `flush_seconds` of its traffic) and, if the kill lands during a write,
the batch being written (tests/hllm/data/test_traffic.py: 17 to 50 of 530 records lost at flush_records=50). Files are rotated by construction (closed at every
flush); retention deletes the oldest past `retention_days` or `retention_bytes`. A failed write is
retried at the next flush; a buffer past `max_buffer` drops its oldest records, counted.

The reader (`scan`, `clean_rows`) skips unreadable files (truncated, not Parquet, another schema)
and malformed records (an order with repeats or out of range), and counts both.
`model_key` binds a log to what made it: a student's prompt and vocabulary; the refresh refuses a
log written under another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hllm.data.splits import unit_hash
from hllm.records import Candidate, Query, RerankRequest

log = logging.getLogger("hllm.data.traffic")


@dataclass
class TrafficLogConfig:
    """Where and how a replica logs what it answered (`serve.common.AppArgs.traffic_log`)."""

    path: str  # a folder every replica and the refresh job see (shared disk, a mounted bucket)
    flush_records: int = 256  # a buffer this full is written out ...
    flush_seconds: float = 10.0  # ... and so is one whose oldest record waited this long
    max_buffer: int = 100_000  # records held while writes fail; past it the oldest are dropped (counted)
    retention_days: float | None = 30.0  # files older than this are deleted (None: kept)
    retention_bytes: int | None = 50 * 2**30  # the log's files beyond this total, oldest first, are deleted

    def __post_init__(self) -> None:
        if self.flush_records < 1 or self.flush_seconds <= 0 or self.max_buffer < self.flush_records:
            raise ValueError("traffic_log needs flush_records >= 1, flush_seconds > 0, max_buffer >= flush_records")


@dataclass
class TrafficRecord:
    """One answered request."""

    request_id: str
    time: float  # unix seconds, when it was answered
    model: str  # which model answered: models:/NAME/VERSION, or a folder and its weights' hash
    model_key: str  # the model's prompt and vocabulary (`model_key`): which logs can train it
    query: str
    documents: list[str]  # in the request's (first-stage) order, cut to the model's token budget
    order: list[int]  # the returned ranking: document indices, best first
    scores: list[float]  # the returned scores, along `order`
    n: int  # documents in the request
    latency_ms: float
    unknown_token_share: float
    warnings: list[str] = field(default_factory=list)
    # under Serve's cascade: who answered (hllm.serving.cascade.ANSWERED_BY; "student" without a cascade) and the
    # served teacher's ranking where it gave one (in time, or late: finish_late), else empty
    answered_by: str = "student"
    teacher_order: list[int] = field(default_factory=list)
    # in a many-student app with a rollout (hllm.serving.rollout): which arm answered ("champion", "candidate", ""
    # outside a rollout) and, for a request also ranked by the other arm off the response path (shadow, or the
    # champion beside a canary answer), that model, its full ranking, its agreement with the answer and its latency
    arm: str = ""
    shadow_model: str = ""
    shadow_order: list[int] = field(default_factory=list)
    shadow_kendall_tau: float | None = None
    shadow_top10_overlap: float | None = None
    shadow_latency_ms: float | None = None
    shadow_error: str = ""


SCHEMA = pa.schema([
    ("request_id", pa.string()), ("time", pa.float64()), ("model", pa.string()), ("model_key", pa.string()),
    ("query", pa.string()), ("documents", pa.list_(pa.string())), ("order", pa.list_(pa.int32())),
    ("scores", pa.list_(pa.float32())), ("n", pa.int32()), ("latency_ms", pa.float32()),
    ("unknown_token_share", pa.float32()), ("warnings", pa.list_(pa.string())),
    ("answered_by", pa.string()), ("teacher_order", pa.list_(pa.int32())),
    ("arm", pa.string()), ("shadow_model", pa.string()), ("shadow_order", pa.list_(pa.int32())),
    ("shadow_kendall_tau", pa.float32()), ("shadow_top10_overlap", pa.float32()), ("shadow_latency_ms", pa.float32()),
    ("shadow_error", pa.string()),
])
# columns a log written before the cascade (or the rollout) lacks: read as their defaults (`read_log`; the refresh
# reads `REQUIRED`)
OPTIONAL = {"answered_by": "student", "teacher_order": (), "arm": "", "shadow_model": "", "shadow_order": (),
            "shadow_kendall_tau": None, "shadow_top10_overlap": None, "shadow_latency_ms": None, "shadow_error": ""}
REQUIRED = [n for n in SCHEMA.names if n not in OPTIONAL]
assert SCHEMA.names == [f.name for f in dataclasses.fields(TrafficRecord)]


def model_key(prompt_config: Any, tokenizer) -> str:
    """A student's prompt settings and its tokenizer's vocabulary -> 16 hex digits. Two students
    with one key read a logged request the same way, so one's log can train the other."""
    vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    prompt = json.dumps(dataclasses.asdict(prompt_config), sort_keys=True)
    return hashlib.sha256(f"{prompt}\n{vocab}".encode()).hexdigest()[:16]


class TrafficLog:
    """A replica's buffered Parquet writer. `append` is all a request does; `cut` (documents ->
    documents cut to the model's budget) runs in the flush thread, off the request path."""

    def __init__(self, cfg: TrafficLogConfig, cut: Callable[[list[str]], list[str]] | None = None,
                 writer: str | None = None):
        self.cfg, self.cut = cfg, cut
        self.writer = writer or f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.root = Path(cfg.path)
        self.root.mkdir(parents=True, exist_ok=True)
        self._buffer: list[TrafficRecord] = []
        self._oldest = 0.0  # monotonic time the oldest buffered record arrived
        self._lock, self._wake, self._closed = threading.Lock(), threading.Event(), False
        self._seq = 0
        self.stats = {"appended": 0, "written": 0, "files": 0, "write_errors": 0, "dropped": 0, "deleted_files": 0}
        self._thread = threading.Thread(target=self._run, name="hllm-traffic-log", daemon=True)
        self._thread.start()

    def append(self, record: TrafficRecord) -> None:
        with self._lock:
            if not self._buffer:
                self._oldest = time.monotonic()
            self._buffer.append(record)
            self.stats["appended"] += 1
            full = len(self._buffer) >= self.cfg.flush_records
        if full:
            self._wake.set()

    def _due(self) -> bool:
        with self._lock:
            return bool(self._buffer) and (len(self._buffer) >= self.cfg.flush_records
                                           or time.monotonic() - self._oldest >= self.cfg.flush_seconds)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(timeout=min(self.cfg.flush_seconds / 4, 1.0))
            self._wake.clear()
            if self._due():
                self.flush()

    def flush(self) -> Path | None:
        """Writes every buffered record as one file now; -> its path (None: nothing to write, or the
        write failed: the records stay buffered for the next flush, the failure counted and logged)."""
        with self._lock:
            batch, self._buffer = self._buffer, []
            self._seq += 1
            seq = self._seq
        if not batch:
            return None
        try:
            path = self._write(batch, seq)
        except Exception as err:  # noqa: BLE001 (any I/O error: kept, counted, said; the replica keeps serving)
            self.stats["write_errors"] += 1
            log.warning("traffic log: writing %d records to %s failed (%s); kept for the next flush", len(batch), self.root, err)
            with self._lock:
                self._buffer = batch + self._buffer
                over = len(self._buffer) - self.cfg.max_buffer
                if over > 0:
                    del self._buffer[:over]
                    self.stats["dropped"] += over
                    log.warning("traffic log: buffer full, dropped the %d oldest records", over)
            return None
        self.stats["written"] += len(batch)
        self.stats["files"] += 1
        self.enforce_retention()
        return path

    def _write(self, batch: list[TrafficRecord], seq: int) -> Path:
        if self.cut is not None:
            batch = [dataclasses.replace(r, documents=self.cut(r.documents)) for r in batch]
        now = time.time()
        folder = self.root / f"date={time.strftime('%Y-%m-%d', time.gmtime(now))}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"part-{int(now * 1000):013d}-{self.writer}-{seq:06d}.parquet"
        tmp = folder / f".{path.name}.tmp"
        pq.write_table(pa.Table.from_pylist([dataclasses.asdict(r) for r in batch], schema=SCHEMA), tmp)
        os.replace(tmp, path)
        return path

    def enforce_retention(self) -> int:
        """Deletes files past `retention_days`, then the oldest past `retention_bytes`; -> files deleted."""
        files = sorted(log_files(self.root), key=lambda p: p.name)  # names start with the write time
        sizes = {p: _size(p) for p in files}
        doomed = []
        if self.cfg.retention_days is not None:
            horizon = (time.time() - self.cfg.retention_days * 86400) * 1000
            doomed = [p for p in files if _written_ms(p) < horizon]
        if self.cfg.retention_bytes is not None:
            total = sum(sizes[p] for p in files if p not in doomed)
            for p in files:
                if total <= self.cfg.retention_bytes:
                    break
                if p not in doomed:
                    doomed.append(p)
                    total -= sizes[p]
        for p in doomed:
            p.unlink(missing_ok=True)  # another replica may have deleted it first
        self.stats["deleted_files"] += len(doomed)
        return len(doomed)

    def close(self) -> None:
        """Flushes what is buffered and stops the thread."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.flush()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _written_ms(path: Path) -> int:
    try:
        return int(path.name.split("-")[1])
    except (IndexError, ValueError):
        return 0


def log_files(path: str | Path) -> list[Path]:
    """Every finished log file under `path` (temp files start with a dot)."""
    return sorted(p for p in Path(path).rglob("part-*.parquet") if not p.name.startswith("."))


@dataclass
class LogScan:
    files: list[Path]  # readable, with the log's schema
    skipped: list[tuple[str, str]]  # (file, why) unreadable or of another schema

    @property
    def rows(self) -> int:
        return sum(pq.ParquetFile(p).metadata.num_rows for p in self.files)


def scan(path: str | Path) -> LogScan:
    """The log's files, each opened once (footer and schema): a truncated file, one that is not
    Parquet or one of another schema is skipped with the reason, never fatal."""
    if not Path(path).is_dir():
        raise FileNotFoundError(f"no traffic log at {path} (serve with args.traffic_log.path={path})")
    good, skipped = [], []
    for p in log_files(path):
        try:
            schema = pq.read_schema(p)
        except (OSError, pa.ArrowException) as err:
            skipped.append((str(p), f"unreadable: {err}"))
            continue
        missing = set(REQUIRED) - set(schema.names)
        if missing:
            skipped.append((str(p), f"not a traffic log file: no column(s) {sorted(missing)}"))
            continue
        good.append(p)
    return LogScan(good, skipped)


def read_log(files: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The rows of readable log files (tests, small logs; the refresh reads with Ray Data), each with every column
    of `SCHEMA` (a file written before a column existed: its default)."""
    rows = []
    for p in files:
        names = pq.read_schema(p).names
        table = pq.read_table(p, columns=[n for n in SCHEMA.names if n in names])
        rows += [{**OPTIONAL, **row} for row in table.to_pylist()]
    return rows


def request_key(query: str, documents: Sequence[str]) -> str:
    """The same query over the same documents in the same order: one key (duplicates collapse)."""
    return hashlib.sha256(json.dumps([query, list(documents)]).encode()).hexdigest()[:24]


STATUSES = ("ok", "other_model", "warned", "malformed", "sampled_out")


def row_status(row: dict[str, Any], model_key: str, share: float = 1.0) -> tuple[str, str]:
    """-> (status, request key) of a logged row: `ok` to label, or why not: another model's prompt or
    vocabulary, a request the model warned about (unknown words), malformed (an order with repeats or
    indices out of range, N that does not match), or left out by the `share` sample."""
    docs, order = row.get("documents") or [], row.get("order") or []
    key = request_key(row.get("query") or "", docs)
    if row.get("model_key") != model_key:
        return "other_model", key
    if row.get("warnings"):
        return "warned", key
    if (not row.get("query") or len(docs) < 2 or row.get("n") != len(docs) or not order  # `order`: all, or the top_n asked
            or len(set(order)) != len(order) or not all(0 <= i < len(docs) for i in order)):
        return "malformed", key
    return ("ok" if share >= 1 or unit_hash(f"sample:{key}") < share else "sampled_out"), key


def classify_batch(batch: pa.Table, model_key: str, share: float) -> pa.Table:
    """A batch of log rows (a Ray Data block in `pipelines/refresh.py`) -> the same rows with their `status` and
    request `key` columns (`row_status`)."""
    statuses, keys = zip(*(row_status(r, model_key, share) for r in batch.to_pylist())) if batch.num_rows else ((), ())
    return batch.append_column("status", pa.array(list(statuses), pa.string())).append_column("key", pa.array(list(keys), pa.string()))


def with_empty_teacher_order(batch: pa.Table) -> pa.Table:
    """A batch from a log written before the cascade -> the same rows with an empty `teacher_order` (no label)."""
    return batch.append_column("teacher_order", pa.array([[]] * batch.num_rows, pa.list_(pa.int32())))


def clean_rows(rows: Iterable[dict[str, Any]], model_key: str, share: float = 1.0
               ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """-> (the `ok` rows, each with its `key`; the count of every status and of rows read)."""
    kept, counts = [], dict.fromkeys(("rows", *STATUSES), 0)
    for row in rows:
        status, key = row_status(row, model_key, share)
        counts["rows"] += 1
        counts[status] += 1
        if status == "ok":
            kept.append({**row, "key": key})
    return kept, counts


def teacher_label(row: dict[str, Any]) -> list[int] | None:
    """The served teacher's ranking a logged row carries (the cascade's `teacher_order`), where it is a whole
    permutation of the row's documents; else None."""
    order = list(row.get("teacher_order") or [])
    return order if order and sorted(order) == list(range(len(row.get("documents") or []))) else None


def dedupe(rows: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """One row per request key (the earliest, or the earliest carrying the served teacher's ranking: a label already
    paid for); -> (rows, duplicates dropped)."""
    first: dict[str, dict[str, Any]] = {}
    total = 0
    for row in rows:
        total += 1
        kept = first.get(row["key"])
        rank = (teacher_label(row) is None, row["time"])
        if kept is None or rank < (teacher_label(kept) is None, kept["time"]):
            first[row["key"]] = row
    return sorted(first.values(), key=lambda r: r["key"]), total - len(first)


def to_slate(row: dict[str, Any]) -> RerankRequest:
    """A logged request -> a slate to label (no grades: the teacher's ranking is the label)."""
    qid = f"traffic-{row['key']}"
    return RerankRequest(Query(qid, row["query"]), [Candidate(f"{qid}-{i}", d) for i, d in enumerate(row["documents"])])
