"""The teacher-rankings store: `RankedSlate` rows in Parquet shards, one typed schema, one reader.

The Arrow schema is derived from the records' type hints (`arrow_type`), so a field added to
`TeacherRanking` or `RerankRequest` is a column without further code: strings, numbers, lists,
nested dataclasses (struct columns), `dict[str, int]` (map columns), `X | None` (nullable). No
column holds JSON.

A split's rankings live in one directory of shards `part-<hash of its slate ids>.parquet`. Each
shard is written atomically (temp file + rename), so a reader never sees half a shard and a
restarted generation skips the slates already written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import types
import typing
from collections.abc import Iterable, Sequence
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


def write_shard(items: Sequence[RankedSlate], directory: str | Path) -> Path:
    """Writes one shard atomically; -> its path. The name depends only on the slate ids."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / shard_name([i.slate.slate_id for i in items])
    tmp = directory / f".{path.name}.{os.getpid()}.tmp"
    pq.write_table(to_table(items), tmp)
    os.replace(tmp, path)
    return path


def shards(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).glob("part-*.parquet"))  # temp files start with "."


def finished_ids(directory: str | Path) -> list[str]:
    """Slate ids in the complete shards of `directory` (with repeats, if any were written twice)."""
    ids: list[str] = []
    for path in shards(directory):
        ids += [q["query"]["qid"] for q in pq.read_table(path, columns=["slate"]).column("slate").to_pylist()]
    return ids


def read_rankings(directory: str | Path) -> list[RankedSlate]:
    """Every row of a directory's shards, sorted by slate id."""
    items: list[RankedSlate] = []
    for path in shards(directory):
        items += from_rows(pq.read_table(path, schema=SCHEMA).to_pylist())
    return sorted(items, key=lambda i: i.slate.slate_id)
