"""The Ray data stage on a local Ray: the slates it streams to storage equal the one-process reader's, bad input is
counted and stops the stage past its budget, the embedded generator's shards are the same whoever draws them."""

import json

import pyarrow.parquet as pq
import pytest

from hllm.config import load_config
from hllm.data import store
from hllm.data.plane import DataFormatError
from hllm.data.splits import SPLITS, load_splits
from pipelines import data
from pipelines.common import PipelineConfig

pytestmark = pytest.mark.slow


def _collection(root, queries=12, per_query=6, missing=0):
    """A BEIR folder: `queries` queries of `per_query` candidates; the first `missing` run rows name no passage."""
    (root / "qrels").mkdir(parents=True)
    (root / "runs").mkdir()
    docs = [{"_id": f"d{i}", "title": f"t{i}", "text": f"passage {i}"} for i in range(40)]
    (root / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    (root / "queries.jsonl").write_text("\n".join(json.dumps({"_id": f"q{q}", "text": f"query {q}"}) for q in range(queries)))
    run = [f"q{q}\td{(q * 7 + k) % 40}\t{k + 1}\t{10 - k}" for q in range(queries) for k in range(per_query)]
    run[:missing] = [line.replace(line.split("\t")[1], f"gone{i}", 1) for i, line in enumerate(run[:missing])]
    (root / "runs" / "bm25_top100.tsv").write_text("query-id\tcorpus-id\trank\tscore\n" + "\n".join(run) + "\n")
    (root / "qrels" / "test.tsv").write_text("".join(f"q{q}\td{(q * 7) % 40}\t2\nq{q}\td39\t1\n" for q in range(queries)))
    return root


def _read(result, split):
    rows = [r for f in sorted(result.split_dir(split).glob("*.parquet")) for r in pq.read_table(f, columns=["slate"]).to_pylist()]
    return sorted(store.slates_from_rows(rows), key=lambda s: s.slate_id)


def test_streamed_slates_equal_the_one_process_reader_and_are_reused(ray_local, tmp_path):
    root = _collection(tmp_path / "beir")
    cfg = load_config(PipelineConfig, None, [f"output_dir={tmp_path / 'out'}", "data.source=beir",
                                             f"data.path=file://{root}", "data.top_n=4", "cluster.data_partitions=3"])
    result = data.run(cfg)
    local = load_splits(load_config(PipelineConfig, None, ["data.source=beir", f"data.path={root}", "data.top_n=4"]).data)
    for split in SPLITS:
        assert _read(result, split) == sorted(local[split], key=lambda s: s.slate_id)
        assert result.stats.id_sums[split] == store.id_sum(s.slate_id for s in local[split])  # what the teacher checks against
    assert set(result.stats.tasks_by_node) == {"run", "qrels", "corpus", "queries", "slates"}
    assert sum(result.stats.slates.values()) == 12 and result.stats.bad == {}
    assert result.stats.rows_read == {"run": 72, "qrels": 24, "corpus": 40, "queries": 12}
    assert data.run(cfg).stats == result.stats  # the same data config: the stage is reused


def test_bad_input_past_the_budget_stops_the_stage_and_writes_no_slates(ray_local, tmp_path):
    root = _collection(tmp_path / "beir", missing=2)
    job = [f"output_dir={tmp_path / 'out'}", "data.source=beir", f"data.path={root}"]
    with pytest.raises(DataFormatError, match=r"2 rows with missing passage .*e\.g\. query 'q0', document 'gone0'"):
        data.run(load_config(PipelineConfig, None, job))
    assert not any((tmp_path / "out" / "slates").glob("*/split=*"))
    result = data.main(job + ["data.max_bad_share=0.05"])  # 2 of 72 rows: within 5%; the entry point, with MLflow
    assert result.stats.bad == {"missing passage": 2} and sum(result.stats.slates.values()) == 12
    import mlflow

    (run,) = mlflow.search_runs(experiment_names=["hllm"], output_format="list")
    assert run.data.metrics["data.bad.missing passage"] == 2 and run.data.metrics["data.rows_read.run"] == 72
    assert "gone0" in run.data.tags["data.bad_examples"] and run.data.metrics["data.slates_per_s"] > 0


def test_embedded_shards_run_as_parallel_tasks_and_equal_the_one_process_data(ray_local, tmp_path):
    job = ["data.synthetic.catalogue_size=200", "data.synthetic.slate_size=6", "data.synthetic.train_slates=9",
           "data.synthetic.val_slates=3", "data.synthetic.test_slates=4", "data.synthetic.shards=3"]
    cfg = load_config(PipelineConfig, None, job + [f"output_dir={tmp_path}"])
    result = data.run(cfg)
    local = load_splits(cfg.data)
    for split in SPLITS:
        assert _read(result, split) == sorted(local[split], key=lambda s: s.slate_id)
