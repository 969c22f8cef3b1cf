"""The data stage at scale: Ray Data streams a collection from storage into slate shards; the driver holds no row.

    ray job submit --working-dir . -- python pipelines/data.py data.source=beir data.path=s3://bucket/msmarco [key=value ...]
    python pipelines/data.py data.source=beir data.path=../shared/data/trec-dl19-passage-bm25top100 data.top_n=100
    python pipelines/data.py data.synthetic.shards=16                      # the embedded generator, 16 parallel tasks

A BEIR collection (`corpus.jsonl`, `queries.jsonl`, `qrels/test.tsv`, the run `data.run_file` or
`runs/bm25_top100.tsv`; a file or a folder of parts each; a local path or any URI pyarrow's
filesystems open, `s3://`, `gs://`, ...) is read with `ray.data.read_text`; every block is parsed by
the library (`hllm.data.plane`), rows are hash-partitioned by docid to take their passage, then by qid
to make each query's slate (two shuffles, the grouping done by the library within each partition;
`Dataset.join` would be three joins and a group-by, and needs polars), split by the hash of the query id as in one process, and written as Parquet under
`output_dir/slates/<fingerprint>/split=<name>/`, one `slate` column in the rankings store's schema.
The embedded generator runs as one task per (split, shard) of `data.synthetic.shards`.

Bad input is counted per reason (`hllm.data.plane.REASONS`) in a ledger actor (keyed by batch, so a
retried task does not count twice), written to `stage.json` and MLflow; past `data.max_bad_share` of
the run's rows the stage fails with the reason, its count and an example, and writes no slates. The
driver reads back counts, never rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import resource
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `ray job submit --working-dir .`

import pyarrow as pa  # noqa: E402

from hllm.config import from_dict, to_dict  # noqa: E402
from hllm.data import plane, store  # noqa: E402
from hllm.data.cache import fingerprint, mark_done, stage_done, stage_info  # noqa: E402
from hllm.data.splits import SPLITS, DataConfig, split_of  # noqa: E402
from hllm.data.synthetic import generate, generate_shard  # noqa: E402

if TYPE_CHECKING:
    from pipelines.common import PipelineConfig

log = logging.getLogger("hllm.pipelines.data")
STAGE_VERSION = 2  # what the stage writes beside the slates (2: per-split id sums, tasks by node)
OUT_SCHEMA = pa.schema([*store.SLATES_SCHEMA, pa.field("split", pa.string())])


@dataclass
class DataStats:
    """What the data stage counted (its `stage.json` keeps it)."""

    slates: dict[str, int]  # split -> slates made
    id_sums: dict[str, int]  # split -> the multiset digest of its slate ids (store.id_sum: what the teacher checks against)
    rows_read: dict[str, int]  # source (run, qrels, corpus, queries) -> rows
    bad: dict[str, int]  # bad input: reason -> rows
    bad_examples: dict[str, str]  # reason -> an example
    tasks_by_node: dict[str, Any]  # the Ray tasks of each step, by node
    seconds: float
    slates_per_s: float
    driver_peak_mb: float


@dataclass
class SlateShards:
    """A finished data stage: where each split's slate shards are, and what it counted."""

    directory: Path
    stats: DataStats

    def split_dir(self, split: str) -> Path:
        return self.directory / f"split={split}"


class Ledger:
    """Bad input and rows read, slates made per split (count and id sum), and the node of each task,
    per batch key (a retried task overwrites its own entry)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, int, dict[str, int], dict[str, str]]] = {}
        self.slates: dict[str, dict[str, tuple[int, int]]] = {}
        self.nodes: dict[str, tuple[str, str]] = {}

    def put(self, key: str, source: str, rows: int, counts: dict[str, int], examples: dict[str, str], node: str = "") -> None:
        self.entries[key] = (source, rows, counts, examples)
        self.nodes[key] = (source, node)

    def put_slates(self, key: str, by_split: dict[str, tuple[int, int]], node: str = "") -> None:
        self.slates[key] = by_split
        self.nodes[key] = ("slates", node)

    def slate_totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """-> (slates per split, id sum per split)."""
        count, ids = {name: 0 for name in SPLITS}, {name: 0 for name in SPLITS}
        for by_split in self.slates.values():
            for name, (n, digest) in by_split.items():
                count[name] += n
                ids[name] = (ids[name] + digest) % store.ID_SUM_MOD
        return count, ids

    def tasks_by_node(self) -> dict[str, dict[str, int]]:
        """-> {task kind (a source, or "slates"): {node id: tasks}}."""
        out: dict[str, dict[str, int]] = {}
        for kind, node in self.nodes.values():
            out.setdefault(kind, {})[node] = out.setdefault(kind, {}).get(node, 0) + 1
        return out

    def totals(self) -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
        rows: dict[str, int] = {}
        bad = plane.BadRows()
        for source, n, counts, examples in self.entries.values():
            rows[source] = rows.get(source, 0) + n
            bad.merge(plane.BadRows(counts, examples))
        return rows, bad.counts, bad.examples


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _record(ledger: Any, key: str, source: str, rows: int, bad: plane.BadRows) -> None:
    import ray

    ray.get(ledger.put.remote(key, source, rows, bad.counts, bad.examples, _node()))


def _with_split(slates: list, splits: list[str], ledger: Any) -> pa.Table:
    """Slates and their splits -> the output rows; their count and id sum per split to the ledger."""
    import ray

    by_split: dict[str, list[str]] = {}
    for s, name in zip(slates, splits):
        by_split.setdefault(name, []).append(s.slate_id)
    key = store.shard_name([s.slate_id for s in slates], suffix="")
    ray.get(ledger.put_slates.remote(key, {k: (len(v), store.id_sum(v)) for k, v in by_split.items()}, _node()))
    return store.slates_table(slates).append_column("split", pa.array(splits, pa.string()))


def _parse_block(batch: pa.Table, source: str, where: str, ledger: Any) -> pa.Table:
    """A block of lines -> rows of `plane.ROW_SCHEMA` (bad lines counted in the ledger)."""
    lines = batch.column("text").to_pylist()
    rows, bad = plane.PARSERS[source](lines, where)
    key = hashlib.sha256("\n".join([source, str(len(lines)), *lines[:1], *lines[-1:]]).encode()).hexdigest()
    _record(ledger, key, source, len(rows), bad)
    return pa.Table.from_pylist(plane.tagged(rows, plane.KINDS[source]), schema=plane.ROW_SCHEMA)


def _attach_block(block: pa.Table) -> pa.Table:
    """A hash partition by docid -> its run and qrels rows with their passages."""
    return pa.Table.from_pylist(plane.attach_passages(block.to_pylist()), schema=plane.ROW_SCHEMA)


def _assemble_block(block: pa.Table, data: dict[str, Any], ledger: Any) -> pa.Table:
    """A hash partition by qid -> a slate row per query, with its split (bad input to the ledger)."""
    cfg = from_dict(DataConfig, data)
    slates, bad = plane.assemble_slates(block.to_pylist(), cfg.top_n)
    if bad.total:
        _record(ledger, "slates/" + ",".join(sorted(bad.examples.values()))[:400], "slates", 0, bad)
    return _with_split(slates, [split_of(s.slate_id, cfg) for s in slates], ledger)


def _synthetic_task(batch: dict[str, Any], data: dict[str, Any], ledger: Any) -> pa.Table:
    """One (split, shard) of the embedded generator -> its slate rows (shards = 1: the whole data set, one stream)."""
    cfg = from_dict(DataConfig, data).synthetic
    parts = []
    for split, shard in zip(batch["split"], batch["shard"]):
        slates = generate(cfg)[0] if cfg.shards == 1 else {split: generate_shard(cfg, split, int(shard))}
        for name, items in slates.items():
            parts.append(_with_split(items, [name] * len(items), ledger))
    return pa.concat_tables(parts) if parts else OUT_SCHEMA.empty_table()


def _beir_paths(cfg: DataConfig) -> dict[str, str]:
    root = cfg.path.rstrip("/")
    return {"run": cfg.run_file or f"{root}/runs/bm25_top100.tsv", "qrels": f"{root}/qrels/test.tsv",
            "corpus": f"{root}/corpus.jsonl", "queries": f"{root}/queries.jsonl"}


def partitions_for(input_bytes: int, partition_mb: float, cpus: int | None) -> int:
    """Hash partitions (or, `cpus` None, read blocks) for a collection of `input_bytes`: one per `partition_mb`, at
    least 1, at most 2 per CPU where `cpus` is given (reads scale with the data, not the cluster). Each partition of a shuffle is an aggregator actor (a worker process of its own): a collection of
    a few MB is one partition, not one per CPU."""
    by_size = max(1, math.ceil(input_bytes / (partition_mb * 2**20)))
    return by_size if cpus is None else min(2 * max(cpus, 1), by_size)


def _input_bytes(paths: Any) -> int:
    """The bytes under each path (a file or a folder of parts; local or any URI pyarrow's filesystems open)."""
    from pyarrow import fs

    total = 0
    for path in paths:
        filesystem, where = fs.FileSystem.from_uri(path) if "://" in path else (fs.LocalFileSystem(), str(Path(path).resolve()))
        info = filesystem.get_file_info(where)
        if info.type == fs.FileType.Directory:
            info = filesystem.get_file_info(fs.FileSelector(where, recursive=True))
            total += sum(i.size or 0 for i in info if i.type == fs.FileType.File)
        else:
            total += info.size or 0  # a missing path reads as 0 here: read_text says what is missing
    return total


def slates_dataset(cfg: PipelineConfig, ledger: Any) -> Any:
    """The plan (lazy): the collection's slate rows with their split; nothing runs until it is written."""
    import ray

    data = to_dict(cfg.data)
    if cfg.data.source == "synthetic":
        s = cfg.data.synthetic
        tasks = [{"split": "all", "shard": 0}] if s.shards == 1 else [
            {"split": name, "shard": i} for name in SPLITS for i in range(s.shards)]
        return ray.data.from_items(tasks, override_num_blocks=len(tasks)).map_batches(
            _synthetic_task, fn_kwargs={"data": data, "ledger": ledger}, batch_size=1, batch_format="numpy")
    if cfg.data.source != "beir":
        raise ValueError(f"the Ray data stage reads data.source=beir or synthetic, not {cfg.data.source!r} "
                         "(a rank_llm / hLLM JSONL is one slate a line: pipelines/rerank.py streams those)")
    paths = _beir_paths(cfg.data)
    size = _input_bytes(paths.values())
    partitions = cfg.cluster.data_partitions or partitions_for(size, cfg.cluster.data_partition_mb,
                                                                int(ray.cluster_resources().get("CPU", 1)))
    blocks = partitions_for(size, cfg.cluster.data_partition_mb, cpus=None)  # a block per partition_mb read, uncapped
    read = {source: ray.data.read_text(path, override_num_blocks=blocks).map_batches(
                _parse_block, fn_kwargs={"source": source, "where": path, "ledger": ledger}, batch_format="pyarrow")
            for source, path in paths.items()}
    # a hash partition holds every row of its keys: the library groups within it (one call per block, not per key)
    with_passages = read["run"].union(read["qrels"], read["corpus"]).repartition(partitions, keys=["docid"]) \
        .map_batches(_attach_block, batch_size=None, batch_format="pyarrow")
    return with_passages.union(read["queries"]).repartition(partitions, keys=["qid"]).map_batches(
        _assemble_block, fn_kwargs={"data": data, "ledger": ledger}, batch_size=None, batch_format="pyarrow")


def run(cfg: PipelineConfig, say_reused: bool = True) -> SlateShards:
    """Writes the slate shards (reused when the data config is unchanged) -> where they are and the stats.
    `say_reused`: log that they were reused (not for a later look-up of the same shards within one job)."""
    import ray

    key = fingerprint(cfg.data, STAGE_VERSION)
    directory = Path(cfg.output_dir) / "slates" / key
    if stage_done(directory, key):
        if say_reused:
            log.info("data: reusing %s", directory)
        return SlateShards(directory, DataStats(**stage_info(directory)["stats"]))
    from pipelines.common import init_ray  # the driver's: the stage's tasks import this module without the job's config

    init_ray(cfg.cluster)
    ledger = ray.remote(num_cpus=0)(Ledger).remote()
    tmp = directory.with_name(f".{key}.{uuid.uuid4().hex[:8]}")
    t0 = time.perf_counter()
    slates_dataset(cfg, ledger).write_parquet(str(tmp), partition_cols=["split"])
    seconds = time.perf_counter() - t0
    rows, counts, examples = ray.get(ledger.totals.remote())
    bad = plane.BadRows(counts, examples)
    try:
        bad.check(rows.get("run", 0), cfg.data.max_bad_share, cfg.data.path or "embedded data")
    except plane.DataFormatError:
        shutil.rmtree(tmp, ignore_errors=True)  # no slates from data past its bad-input budget
        raise
    slates, id_sums = ray.get(ledger.slate_totals.remote())
    written = {name: _count_rows(tmp / f"split={name}") for name in SPLITS}
    if written != slates:  # a task retried after writing would show here
        raise RuntimeError(f"data stage: slates written {written} differ from the slates made {slates}")
    if directory.exists():
        shutil.rmtree(directory)  # another run's leftovers: the same key, so the same slates
    tmp.rename(directory)
    stats = DataStats(slates, id_sums, rows, bad.counts, bad.examples, ray.get(ledger.tasks_by_node.remote()), round(seconds, 2),
                      round(sum(slates.values()) / max(seconds, 1e-9), 1),
                      round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    mark_done(directory, key, stats=dataclasses.asdict(stats))
    log.info("data: %s slates in %.1fs (%.0f slates/s), bad input %s, driver peak %.0f MB -> %s", slates, seconds,
             stats.slates_per_s, bad.counts or "none", stats.driver_peak_mb, directory)
    return SlateShards(directory, stats)


def _count_rows(folder: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in folder.glob("*.parquet")) if folder.is_dir() else 0


def run_logged(cfg: PipelineConfig, parent_run_id: str | None = None) -> SlateShards:
    """`run` as an MLflow run of its own: throughput, the driver's peak, slates, rows read and bad input
    per reason as metrics, an example of each reason as a tag."""
    from pipelines.common import log_metrics, mlflow_run

    with mlflow_run(cfg, "data", parent_run_id):
        result = run(cfg)
        s = result.stats
        log_metrics({"seconds": s.seconds, "slates_per_s": s.slates_per_s, "driver_peak_mb": s.driver_peak_mb, "slates": s.slates,
                     "rows_read": s.rows_read, "bad": s.bad}, prefix="data.")
        if s.bad_examples:
            import mlflow

            mlflow.set_tag("data.bad_examples", json.dumps(s.bad_examples)[:5000])
    return result


def main(argv: list[str] | None = None) -> SlateShards:
    from pipelines.common import parse_job

    cfg, _ = parse_job("The data stage: slates from a collection, streamed by Ray Data", argv)
    result = run_logged(cfg)
    s = result.stats
    print(f"data: {result.directory} | slates {s.slates} | {s.slates_per_s} slates/s | bad input {s.bad or 'none'}")
    return result


if __name__ == "__main__":
    main()
