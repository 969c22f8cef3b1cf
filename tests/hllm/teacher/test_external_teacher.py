"""Teacher rankings read from a file: run TSV / TREC run, rank_llm JSONL, raw sliding-window answers;
what does not fit the slates is counted, never dropped."""

import json

import pytest

from hllm.data.plane import DataFormatError
from hllm.records import Candidate, ParseCounts, Query, RerankRequest
from hllm.teacher.external import external_rankings
from hllm.teacher.parsing import format_ranking, parse_ranking

from conftest import gold_run

WORDS = "apple river stone cloud maple ember quartz willow harbor lantern cedar meadow falcon copper tundra".split()


def _slate(qid: str, n: int, query: str | None = None) -> RerankRequest:
    return RerankRequest(Query(qid, query or f"query number {qid}"),
                         [Candidate(f"{qid}-d{i}", f"{WORDS[i % len(WORDS)]} passage {i} of query {qid} " * 3) for i in range(n)])


def test_run_file_rankings_and_everything_that_did_not_fit_is_counted(tmp_path):
    slates = [_slate("1", 4), _slate("2", 3), _slate("3", 2)]
    run = tmp_path / "teacher.tsv"
    run.write_text("query-id\tcorpus-id\trank\tscore\n"
                   "1\t1-d2\t1\t9\n1\t1-d0\t2\t8\n1\tfar-away\t3\t7\n1\t1-d3\t4\t6\n1\t1-d1\t5\t5\n"  # one id the slate lacks
                   "2\t2-d1\t1\t9\n2\t2-d1\t2\t8\n2\t2-d0\t3\t7\n"  # repeated, and 2-d2 missing
                   "9\tx\t1\t1\n")  # a query of no slate; query 3 not ranked at all
    rankings, cov = external_rankings("run", run, slates)
    assert [r.permutation for r in rankings] == [[2, 0, 3, 1], [1, 0, 2], None]
    assert (cov.slates, cov.ranked, cov.uncovered, cov.outside_slate, cov.repeated_ids, cov.missing_ids, cov.other_queries) \
        == (3, 2, 1, 1, 1, 1, 1)
    assert "'far-away'" in cov.examples["outside_slate"] and "'3'" in cov.examples["uncovered"]
    assert rankings[0].counts == ParseCounts(total=1, ok=1)
    assert rankings[1].counts == ParseCounts(total=1, ok=0, repeated=1, missing=1)  # flagged as a parsed answer would be
    # the TREC six-column form reads the same
    trec = tmp_path / "teacher.trec"
    trec.write_text("1 Q0 1-d3 1 4 t\n1 Q0 1-d2 2 3 t\n1 Q0 1-d1 3 2 t\n1 Q0 1-d0 4 1 t\n")
    assert external_rankings("run", trec, slates[:1])[0][0].permutation == [3, 2, 1, 0]


def test_rank_llm_output_jsonl(tmp_path):
    slate = _slate("7", 3)
    reranked = [slate.candidates[i] for i in (2, 0, 1)]
    path = tmp_path / "rank_llm.jsonl"
    path.write_text(json.dumps({"query": {"qid": "7", "text": slate.query.text},
                                "candidates": [{"docid": c.docid, "score": 1.0, "doc": {"contents": c.text}} for c in reranked]}))
    (ranking,), cov = external_rankings("rank_llm", path, [slate])
    assert ranking.permutation == [2, 0, 1] and cov.ranked == 1 and ranking.counts.ok == 1


def _windows(slate: RerankRequest, teacher_order: list[int], window: int, step: int, answers=None
             ) -> tuple[list[dict], list[int]]:
    """RankGPT's sliding windows, back to front, over `slate` for a teacher whose true order is
    `teacher_order`; each window's answer sorts its passages by that order (or `answers[j]` as given).
    -> (the prompt/response lines, the list the procedure ends with)."""
    current, rank = list(range(len(slate.candidates))), {c: r for r, c in enumerate(teacher_order)}
    lines, end, j = [], len(current), 0
    while True:
        start = max(0, end - window)
        stretch = current[start:end]
        body = "\n".join(f"[{k + 1}] {slate.candidates[c].text}" for k, c in enumerate(stretch))
        prompt = (f"USER: I will provide you with {len(stretch)} passages. Rank the passages based on their relevance to "
                  f"the search query: {slate.query.text}.\n\n{body}\nSearch Query: {slate.query.text}.\nRank the passages.")
        order = sorted(range(len(stretch)), key=lambda k: rank[stretch[k]])
        answer = answers[j] if answers and j in answers else format_ranking(order)
        lines.append({"prompt": prompt, "response": answer})
        current[start:end] = [stretch[k] for k in parse_ranking(answer, len(stretch), repair=True).permutation]
        j += 1
        if start == 0:
            return lines, current
        end -= step


def test_raw_sliding_window_answers_replay_to_the_teachers_final_list(tmp_path):
    slates = [_slate("1", 12), _slate("2", 9)]
    first, first_list = _windows(slates[0], [5, 11, 0, 7, 3, 9, 1, 10, 2, 8, 4, 6], 6, 3)
    second, second_list = _windows(slates[1], [8, 7, 6, 5, 4, 3, 2, 1, 0], 4, 2, answers={1: "[2] > [1] > [2]"})
    path = tmp_path / "responses.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in first + second))
    rankings, cov = external_rankings("responses", path, slates)
    assert rankings[0].permutation == first_list and first_list[:3] == [5, 11, 0]  # the procedure's list, recovered
    assert rankings[0].counts == ParseCounts(total=3, ok=3)
    assert rankings[1].permutation == second_list and rankings[1].counts.total == 4
    assert rankings[1].counts.ok == 3 and rankings[1].counts.repeated == 1 and rankings[1].counts.missing == 1  # repaired
    assert (cov.ranked, cov.uncovered, cov.missing_ids, cov.outside_slate) == (2, 0, 0, 0)
    assert rankings[0].raw_text.count("\n") == 2  # every window's raw answer kept


def test_bad_files_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "no query here", "response": "[1]"}\n')
    with pytest.raises(DataFormatError, match="bad.jsonl:1: no 'search query"):
        external_rankings("responses", path, [_slate("1", 2)])
    with pytest.raises(ValueError, match="known"):
        external_rankings("trec_eval", path, [])
    with pytest.raises(FileNotFoundError, match="not a file"):
        external_rankings("run", tmp_path / "nowhere.tsv", [])


def test_rankvicuna_raw_answers_replay_to_its_published_run(shared_data):
    """RankVicuna-7B's 387 prompts and answers on DL19 (windows of 20, stride 10, over the BM25 top 100),
    replayed here, give its published run exactly, on every query."""
    from hllm.data.readers import read_beir

    root = shared_data / "trec-dl19-passage-bm25top100"
    slates = read_beir(root, top_n=100)
    published, _ = external_rankings("run", root / "teacher-runs" / "rankvicuna-7b_top100.tsv", slates)
    replayed, cov = external_rankings("responses", root / "teacher-runs" / "rankvicuna-7b_prompts_and_responses.jsonl", slates)
    assert [r.permutation for r in replayed] == [r.permutation for r in published]
    assert (cov.ranked, cov.uncovered, cov.missing_ids, cov.outside_slate) == (43, 0, 0, 0)
    total = ParseCounts()
    for r in replayed:
        total.add(r.counts)
    assert total.total == 387 and total.ok == 387  # its answers were all well formed


FILE_JOB = [
    "data.synthetic.catalogue_size=300", "data.synthetic.slate_size=6", "data.synthetic.train_slates=16",
    "data.synthetic.val_slates=2", "data.synthetic.test_slates=6", "teacher.bootstrap=false",
    "student.init_from_teacher=false", "student.model.hidden_size=32", "student.model.layers=1", "student.model.heads=2",
    "student.model.intermediate_size=64", "student.model.context_length=256",
    "student.head.positions=6", "student.head.width=32", "student.adapt.lora_r=2",
    "student.train.steps=3", "student.train.batch_size=4", "eval.latency_requests=2", "eval.latency_warmup=1",
]


def test_a_job_distils_from_a_rankings_file_counting_what_it_lacks(tmp_path):
    from hllm.config import ConfigError, load_config
    from hllm.data.splits import load_splits
    from hllm.eval.evaluation import quality
    from hllm.job.config import JobConfig
    from hllm.job.stages import summary_lines
    from hllm.recipes.local_job import run

    splits = load_splits(load_config(JobConfig, None, FILE_JOB + ["teacher.rankings=/dev/null"]).data)
    test = splits["test"]
    gold_run([s for name in splits for s in splits[name]], tmp_path / "teacher.tsv", skip={test[0].slate_id},
             foreign={test[1].slate_id})
    cfg = load_config(JobConfig, None, FILE_JOB + [f"output_dir={tmp_path / 'out'}", f"teacher.rankings={tmp_path / 'teacher.tsv'}"])
    report = run(cfg)
    assert report.teacher_decoding == "file" and "ar_teacher" not in report.latency and report.teacher_free is None
    (stage,) = (tmp_path / "out" / "rankings").glob("test-*/stage.json")
    coverage = json.loads(stage.read_text())["coverage"]
    assert coverage["uncovered"] == 1 and coverage["outside_slate"] == 1 and coverage["ranked"] == 5
    # the teacher's figures are its file's: the gold order (the uncovered slate scores in first-stage order)
    gold = [sorted(range(len(s.candidates)), key=lambda i: -(s.grades[i] or 0)) for s in test]
    gold[0] = list(range(len(test[0].candidates)))
    assert report.teacher["nDCG@10"] == pytest.approx(quality(test, gold, 2)["nDCG@10"], abs=1e-12)
    assert report.teacher["unparsed_scored_as_input_order"] == 1
    assert any("came from a file" in line for line in summary_lines(report, "hungarian"))
    card = json.loads((tmp_path / "out" / "student" / "model_card.json").read_text())
    assert card["teacher"].startswith("rankings read from teacher.tsv (run, sha256 ")
    # exclusive with generation, and the error says what to change
    with pytest.raises(ConfigError, match="exclusive with generation.*teacher.bootstrap=false"):
        load_config(JobConfig, None, [f"teacher.rankings={tmp_path / 'teacher.tsv'}"])
    with pytest.raises(ConfigError, match="no weights to start the student from"):
        load_config(JobConfig, None, ["teacher.bootstrap=false", f"teacher.rankings={tmp_path / 'teacher.tsv'}"])
