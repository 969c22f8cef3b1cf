"""The teacher-rankings store: `RankedSlate` rows in Parquet shards, one typed schema, one reader.

The Arrow schema is derived from the records' type hints (`arrow_type`), so a field added to
`TeacherRanking` or `RerankRequest` is a column without further code: strings, numbers, lists,
nested dataclasses (struct columns), `dict[str, int]` (map columns), `X | None` (nullable). No
column holds JSON.

A split's rankings live in one directory of shards `part-<hash of its slate ids>.parquet`. Each
shard is written atomically (temp file + rename), so a reader never sees half a shard and a
restarted generation skips the slates already written. A shard's footer carries its summary (an
additive dict: slates, the ids' multiset sum, parse counts, token totals, ...), so `index` totals a
store from the footers alone, and a split is known complete — exactly one row per slate — when its
count and id sum equal the split's (`SplitSlates`), without a list of ids anywhere.

`SplitSlates` is the work to hand out: a split's slates held in this process (small data) or the
data stage's slate shards on disk (any size), read a batch at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import types
import typing
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pyarrow as pa
import pyarrow.parquet as pq

from hllm.records import Candidate, ParseCounts, Query, RankedSlate, RerankRequest, TeacherRanking

_SCALARS = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}


def arrow_type(tp: Any) -> pa.DataType:
    """A Python type hint -> its Arrow type (dataclasses become structs)."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return arrow_type(inner)  # Arrow columns are nullable
    if origin is list:
        return pa.list_(arrow_type(get_args(tp)[0]))
    if origin is dict:
        key, value = get_args(tp)
        return pa.map_(arrow_type(key), arrow_type(value))
    if dataclasses.is_dataclass(tp):
        hints = get_type_hints(tp)
        return pa.struct([pa.field(f.name, arrow_type(hints[f.name])) for f in dataclasses.fields(tp)])
    if tp in _SCALARS:
        return _SCALARS[tp]
    raise TypeError(f"no Arrow type for {tp!r}")


SCHEMA = pa.schema(list(arrow_type(RankedSlate)))  # columns: slate (struct), ranking (struct)
SLATES_SCHEMA = pa.schema([pa.field("slate", arrow_type(RerankRequest))])  # slates alone (work to hand out)


def _slate_row(slate: RerankRequest) -> dict[str, Any]:
    row = dataclasses.asdict(slate)
    row["extra_qrels"] = list(row["extra_qrels"].items())  # map column: key/value pairs
    return row


def _slate(s: dict[str, Any]) -> RerankRequest:
    return RerankRequest(Query(**s["query"]), [Candidate(**c) for c in s["candidates"]], s["grades"],
                         dict(s["extra_qrels"] or []))


def _row(item: RankedSlate) -> dict[str, Any]:
    return {"slate": _slate_row(item.slate), "ranking": dataclasses.asdict(item.ranking)}


def _from_row(row: dict[str, Any]) -> RankedSlate:
    r = row["ranking"]
    return RankedSlate(_slate(row["slate"]), TeacherRanking(**{**r, "counts": ParseCounts(**r["counts"])}))


def slates_table(slates: Sequence[RerankRequest]) -> pa.Table:
    return pa.Table.from_pylist([{"slate": _slate_row(s)} for s in slates], schema=SLATES_SCHEMA)


def slates_from_rows(rows: Iterable[dict[str, Any]]) -> list[RerankRequest]:
    return [_slate(r["slate"]) for r in rows]


def to_table(items: Sequence[RankedSlate]) -> pa.Table:
    return pa.Table.from_pylist([_row(i) for i in items], schema=SCHEMA)


def from_rows(rows: Iterable[dict[str, Any]]) -> list[RankedSlate]:
    """Rows as Arrow gives them (`Table.to_pylist()`, a Ray Data batch) -> records."""
    return [_from_row(r) for r in rows]


def shard_name(slate_ids: Sequence[str], suffix: str = ".parquet") -> str:
    """A shard's file name: a hash of its slate ids (any order), so a re-run finds it again."""
    return "part-" + hashlib.sha256("\n".join(sorted(slate_ids)).encode()).hexdigest()[:20] + suffix


ID_SUM_MOD = 2**64
SUMMARY_KEY = b"hllm.summary"
SUMMARIZED_KEY = b"hllm.summarized"  # "1": the footer holds the writer's summary too, not the count and id sum alone
Summary = dict[str, Any]  # additive: numbers and nested dicts of numbers; `merge` sums them key by key
Summarize = Callable[[Sequence[RankedSlate]], Summary]


def id_sum(ids: Iterable[str]) -> int:
    """A multiset digest of slate ids: the sum of their hashes mod 2^64. Order-free and additive across
    shards, so the store's total equals the split's exactly when each slate has one row (a missing row
    and a repeated one change it unless 64-bit hashes collide)."""
    return sum(int.from_bytes(hashlib.sha256(i.encode()).digest()[:8], "big") for i in ids) % ID_SUM_MOD


def merge(a: Summary, b: Summary) -> Summary:
    """Adds two summaries key by key (id sums mod 2^64)."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict):
            out[k] = merge(out.get(k, {}), v)
        elif k == "id_sum":
            out[k] = (out.get(k, 0) + v) % ID_SUM_MOD
        else:
            out[k] = out.get(k, 0) + v
    return out


def base_summary(items: Sequence[RankedSlate]) -> Summary:
    return {"slates": len(items), "id_sum": id_sum(i.slate.slate_id for i in items)}


def write_shard(items: Sequence[RankedSlate], directory: str | Path, summary: Summary | None = None) -> Path:
    """Writes one shard atomically; -> its path. The name depends only on the slate ids; the footer
    holds `summary` (what the caller adds: parse counts, tokens, ...) with the slate count and id sum."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / shard_name([i.slate.slate_id for i in items])
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    table = to_table(items)
    table = table.replace_schema_metadata({SUMMARY_KEY: json.dumps({**(summary or {}), **base_summary(items)}),
                                           SUMMARIZED_KEY: b"1" if summary else b"0"})
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


@dataclass
class StoreIndex:
    """A store folder's totals, from its shards' footers."""

    shards: int
    summary: Summary  # merged over the shards; "slates" and "id_sum" always present

    @property
    def slates(self) -> int:
        return self.summary["slates"]

    @property
    def id_sum(self) -> int:
        return self.summary["id_sum"]


def index(directory: str | Path, summarize: Summarize = base_summary) -> StoreIndex:
    """Totals a store from its footers; a shard whose footer lacks `summarize`'s figures (written
    without them, or before footers) is read and summarised."""
    total: Summary = {"slates": 0, "id_sum": 0}
    paths = shards(directory) if Path(directory).is_dir() else []
    for path in paths:
        meta = pq.read_schema(path).metadata or {}
        if SUMMARY_KEY in meta and (summarize is base_summary or meta.get(SUMMARIZED_KEY) == b"1"):
            part = json.loads(meta[SUMMARY_KEY])
        else:
            items = from_rows(pq.read_table(path, schema=SCHEMA).to_pylist())
            part = {**summarize(items), **base_summary(items)}
        total = merge(total, part)
    return StoreIndex(len(paths), total)


def drop_shards(directory: str | Path, predicate: Callable[[Summary], bool]) -> int:
    """Deletes the shards whose footer summary satisfies `predicate` (e.g. shards with failed slates, to be
    ranked again); -> the slates they held."""
    dropped = 0
    for path in shards(directory):
        meta = pq.read_schema(path).metadata or {}
        summary = json.loads(meta[SUMMARY_KEY]) if SUMMARY_KEY in meta else {}
        if predicate(summary):
            dropped += summary.get("slates", 0)
            path.unlink()
    return dropped


def shards(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).glob("part-*.parquet"))  # temp files start with "."


def finished_ids(directory: str | Path) -> list[str]:
    """Slate ids in the complete shards of `directory` (with repeats, if any were written twice)."""
    ids: list[str] = []
    for path in shards(directory):
        ids += [q["query"]["qid"] for q in pq.read_table(path, columns=["slate"]).column("slate").to_pylist()]
    return ids


def arrow_bytes(directory: str | Path) -> int:
    """The store's size once decoded (Parquet's uncompressed sizes, from the footers)."""
    return sum(pq.ParquetFile(p).metadata.row_group(g).total_byte_size
               for p in shards(directory) for g in range(pq.ParquetFile(p).metadata.num_row_groups))


def read_rankings(directory: str | Path) -> list[RankedSlate]:
    """Every row of a directory's shards, sorted by slate id."""
    items: list[RankedSlate] = []
    for path in shards(directory):
        items += from_rows(pq.read_table(path, schema=SCHEMA).to_pylist())
    return sorted(items, key=lambda i: i.slate.slate_id)


def shard_rows(shard: str | Path | bytes) -> list[RankedSlate]:
    """One shard's rows: a path, or the file's bytes (as `ray.data.read_binary_files` hands them out)."""
    source = pa.BufferReader(shard) if isinstance(shard, bytes) else str(shard)
    return from_rows(pq.read_table(source, schema=SCHEMA).to_pylist())


def slate_batches(folder: str | Path, size: int) -> Iterator[list[RerankRequest]]:
    """The slates of a folder of Parquet files with a `slate` column (slate shards or a rankings store),
    file by file in name order, at most `size` at a time, a batch read at a time."""
    for path in sorted(Path(folder).glob("*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=size, columns=["slate"]):
            yield slates_from_rows(batch.to_pylist())


def head(folder: str | Path, n: int = 1) -> list[RerankRequest]:
    """The first `n` slates of such a folder, reading no more than it needs."""
    out: list[RerankRequest] = []
    for batch in slate_batches(folder, n):
        out += batch[: n - len(out)]
        if len(out) >= n:
            break
    return out


@dataclass
class SplitSlates:
    """A split's slates as work to hand out: held in this process (`slates`) or the data stage's slate
    shards (`folder`, Parquet with a `slate` column), with their count and id sum, so a stage can check
    its output against them without a list of ids."""

    split: str
    count: int
    id_sum: int
    slates: list[RerankRequest] | None = None
    folder: Path | None = None

    @classmethod
    def held(cls, split: str, slates: Sequence[RerankRequest]) -> "SplitSlates":
        return cls(split, len(slates), id_sum(s.slate_id for s in slates), list(slates))

    def batches(self, size: int) -> Iterator[list[RerankRequest]]:
        """The slates in order, `size` at a time (from disk a batch at a time when in shards)."""
        if self.slates is not None:
            for start in range(0, len(self.slates), size):
                yield self.slates[start: start + size]
            return
        yield from slate_batches(self.folder, size)

    def load(self) -> list[RerankRequest]:
        """All of them in this process: for stages that need the split whole and small (a bootstrap)."""
        return self.slates if self.slates is not None else [s for b in self.batches(1024) for s in b]
