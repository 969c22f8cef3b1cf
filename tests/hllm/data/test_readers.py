import json

import pytest

from hllm import records
from hllm.data.readers import DataFormatError, read_beir, read_hllm, read_rank_llm, read_slates, write_jsonl


def write_beir(root, run_lines):
    (root / "qrels").mkdir(parents=True)
    (root / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in [
        {"_id": "a", "title": "A", "text": "alpha"}, {"_id": "b", "title": "", "text": "beta"},
        {"_id": "c", "title": "", "text": "gamma"}]))
    (root / "queries.jsonl").write_text(json.dumps({"_id": "1", "text": "first query"}) + "\n")
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n1\ta\t2\n1\tz\t3\n1\tc\t0\n")
    (root / "run.tsv").write_text("\n".join(run_lines) + "\n")


def test_beir_with_run_file(tmp_path):
    write_beir(tmp_path, ["query-id\tcorpus-id\trank\tscore", "1\tb\t2\t5.0", "1\ta\t1\t9.0", "1\tc\t3\t1.0"])
    (slate,) = read_beir(tmp_path, tmp_path / "run.tsv", top_n=2)
    assert [c.docid for c in slate.candidates] == ["a", "b"]  # rank order, cut to top_n
    assert slate.grades == [2, None]  # b is unjudged
    assert slate.extra_qrels == {"z": 3, "c": 0}  # judged outside the slate: kept for the ideal DCG
    assert slate.candidates[0].title == "A"


def test_trec_six_column_run(tmp_path):
    write_beir(tmp_path, ["1 Q0 c 1 3.0 bm25", "1 Q0 a 2 2.0 bm25"])
    (slate,) = read_beir(tmp_path, tmp_path / "run.tsv", top_n=5)
    assert [c.docid for c in slate.candidates] == ["c", "a"]


def test_beir_unknown_document_names_the_file(tmp_path):
    write_beir(tmp_path, ["1\tnope\t1\t1.0"])
    with pytest.raises(DataFormatError, match="run.tsv.*'nope'"):
        read_beir(tmp_path, tmp_path / "run.tsv")


def test_rank_llm_jsonl(tmp_path):
    path = tmp_path / "req.jsonl"
    path.write_text(json.dumps({"query": {"text": "q", "qid": 7}, "candidates": [
        {"docid": "d1", "score": 1.5, "doc": {"title": "T", "segment": "seg"}},
        {"docid": "d2", "score": None, "doc": "plain"}]}) + "\n")
    (slate,) = read_slates("rank_llm", path)
    assert slate.query.qid == "7" and slate.candidates[0].text == "seg" and slate.candidates[0].title == "T"
    assert slate.candidates[1].text == "plain" and slate.candidates[1].score is None


@pytest.mark.parametrize("line,match", [
    ('{"query": {"text": "q"}, "candidates": []}', r"req.jsonl:2: missing field query.'qid'"),
    ('{"query": {"text": "q", "qid": "1"}}', r"req.jsonl:2: missing field 'candidates'"),
    ('{"query": {"text": "q", "qid": "1"}, "candidates": [{"docid": "x"}]}', r"req.jsonl:2: missing field candidates\[0\].'doc'"),
    ("{not json", r"req.jsonl:2: not valid JSON"),
])
def test_rank_llm_errors_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "req.jsonl"
    good = json.dumps({"query": {"text": "q", "qid": "0"}, "candidates": [{"docid": "d", "doc": "t"}]})
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(DataFormatError, match=match):
        read_rank_llm(path)


def test_hllm_round_trip(tmp_path, small_splits):
    slates = small_splits["test"]
    write_jsonl(slates, tmp_path / "s.jsonl")
    assert read_hllm(tmp_path / "s.jsonl") == slates


def test_unknown_format():
    with pytest.raises(DataFormatError, match="unknown slate format 'csv'"):
        read_slates("csv", "x.csv")


@pytest.mark.parametrize("cls", [records.Query, records.Candidate, records.ParseCounts, records.TeacherRanking])
def test_records_build_from_defaults(cls):
    # guards against rank_llm's stray-comma bug: a default that silently became a tuple
    fields = {"qid": "q", "text": "t", "docid": "d", "slate_id": "s", "permutation": None, "raw_text": "",
              "counts": records.ParseCounts()}
    import dataclasses
    names = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    obj = cls(**{k: fields[k] for k in names})
    for f in dataclasses.fields(cls):
        assert not isinstance(getattr(obj, f.name), tuple), f.name
