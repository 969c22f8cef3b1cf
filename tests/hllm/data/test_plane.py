"""The data plane's per-batch functions, without Ray: every kind of bad input is counted, never dropped silently."""

import json

import pytest

from hllm.data.plane import (BadRows, DataFormatError, assemble_slate, attach_passage, parse_doc_lines, parse_qrels_lines,
                             parse_query_lines, parse_run_lines, slates_in_memory, tagged)
from hllm.data.readers import read_beir
from hllm.data.synthetic import SyntheticConfig, generate, generate_shard


def test_run_lines_in_both_layouts_header_skipped_bad_lines_counted():
    rows, bad = parse_run_lines(["query-id\tcorpus-id\trank\tscore", "1\ta\t1\t9.5", "1 Q0 b 2 3.0 bm25", "1\tc\tfirst\t1",
                                 "2\tx", ""], "run.tsv", first_line=1)
    assert rows == [{"qid": "1", "docid": "a", "rank": 1, "score": 9.5}, {"qid": "1", "docid": "b", "rank": 2, "score": 3.0}]
    assert bad.counts == {"unreadable line": 2}
    assert bad.examples["unreadable line"].startswith("run.tsv:4: rank/score not numeric")


def test_qrels_docs_and_queries_count_unreadable_lines():
    qrels, bad_q = parse_qrels_lines(["1 0 a 2", "1\tb\t1", "1\tc\tgood"])
    assert [r["grade"] for r in qrels] == [2, 1] and bad_q.counts == {"unreadable line": 1}
    docs, bad_d = parse_doc_lines([json.dumps({"_id": 7, "text": "t"}), "{not json", json.dumps({"text": "no id"})])
    assert docs == [{"docid": "7", "title": "", "text": "t", "has_doc": True}] and bad_d.counts == {"unreadable line": 2}
    queries, bad_u = parse_query_lines([json.dumps({"_id": "1", "text": "q"}), json.dumps({"_id": "2"})])
    assert queries == [{"qid": "1", "query": "q"}, {"qid": "2", "query": None}] and bad_u.total == 0  # counted at the slate


def _rows(run, qrels=(), docs=("a", "b", "c", "d"), query="red boots"):
    """One query's rows as the second group-by gets them: each docid's rows through `attach_passage` first."""
    rows = [*tagged([{"qid": "1", "docid": d, "rank": k, "score": 10.0 - k} for d, k in run], "run"),
            *tagged([{"qid": "1", "docid": d, "grade": g} for d, g in qrels], "qrel"),
            *tagged([{"docid": d, "title": "", "text": f"text {d}"} for d in docs], "doc")]
    attached = [r for d in sorted({r["docid"] for r in rows}) for r in attach_passage([r for r in rows if r["docid"] == d])]
    return attached + tagged([{"qid": "1", "query": query}], "query")


def test_a_slate_keeps_rank_order_top_n_grades_and_judged_documents_outside_it():
    slate, bad = assemble_slate(_rows([("b", 2), ("a", 1), ("c", 3)], qrels=[("a", 2), ("c", 1), ("z", 3)]), top_n=2)
    assert [c.docid for c in slate.candidates] == ["a", "b"] and slate.grades == [2, None]
    assert slate.extra_qrels == {"c": 1, "z": 3} and bad.total == 0


@pytest.mark.parametrize("run,docs,query,reason", [
    ([("a", 1), ("nope", 2)], ("a",), "q", "missing passage"),
    ([("a", 1), ("a", 2), ("b", 3)], ("a", "b"), "q", "duplicate candidate"),
    ([("a", 1)], ("a",), None, "query without text"),
])
def test_each_kind_of_bad_input_is_counted_with_an_example(run, docs, query, reason):
    slate, bad = assemble_slate(_rows(run, docs=docs, query=query), top_n=10)
    assert bad.counts == {reason: 1} and "'1'" in bad.examples[reason]
    if reason == "query without text":
        assert slate is None
    else:
        assert [c.docid for c in slate.candidates] == ["a"] + (["b"] if reason == "duplicate candidate" else [])


def test_the_budget_stops_past_max_bad_share_naming_reason_count_and_example():
    bad = BadRows()
    bad.add("missing passage", "query '1', document 'x' is not in the corpus", n=3)
    bad.check(rows=100, max_share=0.05, where="run.tsv")  # 3% <= 5%: goes on
    with pytest.raises(DataFormatError, match=r"run.tsv: 3 rows with missing passage \(3.00% of 100.*e.g. query '1', document 'x'"):
        bad.check(rows=100, max_share=0.0, where="run.tsv")
    with pytest.raises(ValueError, match="unknown bad-input reason"):
        bad.add("typo", "x")


def test_read_beir_counts_bad_input_and_tolerates_it_only_within_the_budget(tmp_path):
    (tmp_path / "qrels").mkdir()
    (tmp_path / "corpus.jsonl").write_text("\n".join(json.dumps({"_id": d, "text": d}) for d in "abc") + "\n")
    (tmp_path / "queries.jsonl").write_text(json.dumps({"_id": "1", "text": "q"}) + "\n")
    (tmp_path / "qrels" / "test.tsv").write_text("1\ta\t1\n")
    (tmp_path / "run.tsv").write_text("1\ta\t1\t3\n1\tgone\t2\t2\n1\tb\t3\t1\n1\tc\t4\t0\n")
    with pytest.raises(DataFormatError, match="1 rows with missing passage.*'gone'"):
        read_beir(tmp_path, tmp_path / "run.tsv")
    (slate,) = read_beir(tmp_path, tmp_path / "run.tsv", max_bad_share=0.25)
    assert [c.docid for c in slate.candidates] == ["a", "b", "c"]


def test_slates_in_memory_orders_queries_as_the_reader_did():
    run = [{"qid": q, "docid": "a", "rank": 1, "score": 1.0} for q in ("10", "9", "100")]
    slates, bad = slates_in_memory(run, [], [{"docid": "a", "title": "", "text": "t", "has_doc": True}],
                                   [{"qid": q, "query": "x"} for q in ("9", "10", "100")], top_n=5)
    assert [s.slate_id for s in slates] == ["9", "10", "100"] and bad.total == 0


def test_sharded_embedded_data_is_the_same_whoever_draws_each_shard():
    cfg = SyntheticConfig(shards=3, train_slates=7, val_slates=2, test_slates=4, catalogue_size=200)
    splits, _ = generate(cfg)
    assert {k: len(v) for k, v in splits.items()} == {"train": 7, "val": 2, "test": 4}
    assert generate_shard(cfg, "train", 2) == splits["train"][5:]  # shard 2 of 7 slates: the last 2, drawn alone
    ids = [s.slate_id for v in splits.values() for s in v]
    assert len(set(ids)) == len(ids)
    one = SyntheticConfig(train_slates=7, val_slates=2, test_slates=4, catalogue_size=200)
    assert generate(one)[0]["train"][0].slate_id == "train-00000"  # one shard: the one stream, as always


def test_the_data_stage_partitions_by_input_size_not_by_cpus(tmp_path):
    """Each hash partition is an aggregator actor: a small collection is one partition, a large one up to 2 per CPU."""
    from pipelines.data import _input_bytes, partitions_for

    assert partitions_for(0, 64, 4) == 1 and partitions_for(10 * 2**20, 64, 4) == 1
    assert partitions_for(65 * 2**20, 64, 4) == 2 and partitions_for(10 * 2**30, 64, 4) == 8
    assert partitions_for(10 * 2**30, 64, None) == 160  # read blocks: by size alone
    (tmp_path / "parts").mkdir()
    for i in range(3):
        (tmp_path / "parts" / f"p{i}.jsonl").write_bytes(b"x" * 100)
    (tmp_path / "run.tsv").write_bytes(b"y" * 50)
    assert _input_bytes([str(tmp_path / "parts"), f"file://{tmp_path / 'run.tsv'}", str(tmp_path / "absent")]) == 350
