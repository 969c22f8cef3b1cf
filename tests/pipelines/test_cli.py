"""`hllm` on the command line: rerank -> TREC run -> evaluate, long lists in windows, resume,
config show, and every bad input with its message, its exit status and nothing half-written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.cli import main

from builders import WORDS, beir_folder as _beir
from conftest import TINY

def _read_run(path: Path) -> dict[str, list[str]]:
    run: dict[str, list[tuple[int, str, float]]] = {}
    for line in path.read_text().splitlines():
        qid, q0, docid, rank, score, tag = line.split()
        assert q0 == "Q0" and tag
        run.setdefault(qid, []).append((int(rank), docid, float(score)))
    for hits in run.values():
        assert [r for r, _, _ in hits] == list(range(1, len(hits) + 1))
        scores = [s for _, _, s in hits]
        assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)
    return {q: [d for _, d, _ in hits] for q, hits in run.items()}


def test_rerank_writes_a_run_that_evaluate_reads_back(student, tmp_path, capsys):
    data = _beir(tmp_path / "beir")
    out, metrics = tmp_path / "out" / "run.trec", tmp_path / "m.json"
    assert main(["rerank", "--model", str(student), "--data", str(data), "--out", str(out), "--window", "4",
                 "--json", str(metrics), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "3 queries, 30 documents" in printed and "| first stage (input order) | 3 |" in printed
    run = _read_run(out)
    assert sorted(run) == ["q0", "q1", "q2"]
    for q, docids in run.items():
        i = int(q[1:])
        assert sorted(docids) == sorted(f"d{i * 10 + d}" for d in range(10))  # every candidate once
    assert not (tmp_path / "out" / "run.trec.shards").exists() and sorted(p.name for p in out.parent.iterdir()) == \
        ["run.trec", "run.trec.queries.jsonl"]  # the run and its per-query sidecar (confidence, trust)
    reported = json.loads(metrics.read_text())
    assert set(reported) == {"first stage (input order)", "reranked"}
    again = tmp_path / "again.json"
    assert main(["evaluate", "--run", str(out), "--qrels", str(data / "qrels" / "test.tsv"), "--json", str(again)]) == 0
    assert json.loads(again.read_text())[str(out)] == reported["reranked"]
    assert set(reported["reranked"]) >= {"nDCG@10", "MRR@10", "R@100", "queries"} and reported["reranked"]["queries"] == 3


def test_a_crashed_rerank_resumes_from_its_shards(student, tmp_path, monkeypatch):
    from hllm.job import collection

    data = _beir(tmp_path / "beir", queries=4)
    args = ["rerank", "--model", str(student), "--data", str(data), "--window", "4", "--shard-size", "1", "--quiet"]
    assert main(args + ["--out", str(tmp_path / "clean.trec")]) == 0
    calls = {"n": 0}
    real = collection.ShardRanker.__call__

    def crash_on_third(self, slates, progress=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("killed")
        return real(self, slates, progress)

    monkeypatch.setattr(collection.ShardRanker, "__call__", crash_on_third)
    out = tmp_path / "run.trec"
    with pytest.raises(RuntimeError, match="killed"):
        main(args + ["--out", str(out)])
    assert not out.exists() and len(list((tmp_path / "run.trec.shards").glob("*.trec"))) == 2
    ranked = []
    monkeypatch.setattr(collection.ShardRanker, "__call__", lambda self, slates, progress=None:
                        ranked.append(len(slates)) or real(self, slates, progress))
    # resumed at 2 of 4 (the progress bar on), run otherwise: how the work runs is not what ranks
    how = ["--threads", "1", "--batch-size", "3", "--max-batch-tokens", "none", "--device", "cpu"]
    assert main(args[:-1] + how + ["--out", str(out)]) == 0
    assert ranked == [1, 1]  # only the two shards not on disk
    assert out.read_text() == (tmp_path / "clean.trec").read_text()


def test_a_shard_folder_from_other_settings_is_refused(student, tmp_path, capsys, monkeypatch):
    from hllm.job import collection

    data = _beir(tmp_path / "beir")
    out = tmp_path / "run.trec"
    args = ["rerank", "--model", str(student), "--data", str(data), "--out", str(out), "--shard-size", "1", "--quiet"]
    monkeypatch.setattr(collection.ShardRanker, "__call__", lambda self, s, progress=None: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        main(args + ["--window", "4"])
    monkeypatch.undo()
    # the failed first shard wrote nothing, so no manifest pins the settings yet: any settings start over
    assert not (tmp_path / "run.trec.shards").exists()
    assert main(args + ["--window", "4", "--top-n", "6"]) == 0
    (tmp_path / "run.trec.shards").mkdir()
    (tmp_path / "run.trec.shards" / "manifest.json").write_text(json.dumps({"window": 5}))
    assert main(args + ["--window", "4"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_a_thousand_candidates_come_back_as_one_permutation(student):
    from hllm import Reranker

    docs = [" ".join(WORDS[(d * k) % len(WORDS)] for k in (1, 2, 7)) + f" {d}" for d in range(1000)]
    # sliding: (1000 - 10) / 5 + 1 windows; blocks: 100 blocks -> their 100 winners in 10 blocks -> 10 winners in 1
    for windowing, expected in (("sliding", 199), ("blocks", 100 + 10 + 1)):
        reranker = Reranker.load(student, window=10, stride=5, windowing=windowing)
        prefills = []
        real = reranker.score_with_trust
        reranker.score_with_trust = lambda prompts: prefills.append(len(prompts)) or real(prompts)
        (ranked,) = reranker.rank_batch(["red boots"], [docs])
        assert sorted(r.index for r in ranked) == list(range(1000))
        scores = [r.score for r in ranked]
        assert scores == sorted(scores, reverse=True) and len(set(scores)) == 1000
        again = Reranker.load(student, window=10, stride=5, windowing=windowing).windowed_orders(["red boots"], [docs], first_stage_order=False)
        assert again.orders[0] == [r.index for r in ranked]
        assert sum(prefills) == again.windows[0] == expected  # one prefill per window, batched


def test_windowings_with_a_perfect_ranker_put_the_best_first():
    from hllm.model.windows import rank_in_windows

    values = [(i * 37) % 101 for i in range(100)]  # a permutation of 0..100 minus one value, shuffled

    def oracle(flat):
        return [sorted(range(len(idx)), key=lambda p: -values[idx[p]]) for _, idx in flat]

    best = sorted(range(100), key=lambda i: -values[i])
    for strategy, windows in (("sliding", 9), ("blocks", 6)):
        (order,), (count,) = rank_in_windows([100], oracle, window=20, stride=10, strategy=strategy)
        assert sorted(order) == list(range(100)) and count == windows
        assert order[:10 if strategy == "sliding" else 4] == best[:10 if strategy == "sliding" else 4]
    (order,), (count,) = rank_in_windows([15], oracle, window=20, stride=10, strategy="blocks")
    assert order == sorted(range(15), key=lambda i: -values[i]) and count == 1  # short lists: one window


def test_tsv_and_rank_llm_inputs(student, tmp_path):
    tsv = tmp_path / "in.tsv"
    tsv.write_text("".join(f"q{q}\tred boots\td{d}\t{WORDS[d]} boots\n" for q in range(2) for d in range(6)))
    assert main(["rerank", "--model", str(student), "--data", str(tsv), "--out", str(tmp_path / "a.trec"), "--quiet"]) == 0
    assert {q: len(d) for q, d in _read_run(tmp_path / "a.trec").items()} == {"q0": 6, "q1": 6}
    three, queries = tmp_path / "three.tsv", tmp_path / "queries.tsv"
    three.write_text("".join(f"q{q}\td{d}\t{WORDS[d]} boots\n" for q in range(2) for d in range(6)))
    queries.write_text("q0\tred boots\nq1\tblue shirt\n")
    assert main(["rerank", "--model", str(student), "--data", str(three), "--queries", str(queries),
                 "--out", str(tmp_path / "b.trec"), "--quiet", "--top-n", "4"]) == 0
    assert {q: len(d) for q, d in _read_run(tmp_path / "b.trec").items()} == {"q0": 4, "q1": 4}
    jsonl = tmp_path / "req.jsonl"
    jsonl.write_text(json.dumps({"query": {"qid": "7", "text": "red boots"},
                                 "candidates": [{"docid": f"d{d}", "score": 1.0 - d / 10, "doc": {"contents": WORDS[d]}}
                                                for d in range(5)]}) + "\n")
    assert main(["rerank", "--model", str(student), "--data", str(jsonl), "--out", str(tmp_path / "c.trec"), "--quiet"]) == 0
    assert len(_read_run(tmp_path / "c.trec")["7"]) == 5


@pytest.mark.parametrize("case", ["no_model", "corrupt_run", "no_candidates_jsonl", "judged_query_without_candidates",
                                  "tsv_columns", "unknown_format"])
def test_bad_input_is_one_message_and_exit_2_and_nothing_written(student, tmp_path, capsys, case):
    data, model, extra = _beir(tmp_path / "beir"), str(student), []
    if case == "no_model":
        model, needle = str(tmp_path / "nowhere"), "no trained student at"
    elif case == "corrupt_run":
        with open(data / "runs" / "bm25_top100.tsv", "a") as fh:
            fh.write("q0\td1\tfirst\t1.0\n")
        needle = "bm25_top100.tsv:32: rank/score not numeric"
    elif case == "no_candidates_jsonl":
        data = tmp_path / "req.jsonl"
        data.write_text(json.dumps({"query": {"qid": "1", "text": "q"}, "candidates": [{"docid": "a", "doc": "x"}]})
                        + "\n" + json.dumps({"query": {"qid": "2", "text": "q"}, "candidates": []}) + "\n")
        needle = "req.jsonl:2: query '2' has no candidates"
    elif case == "judged_query_without_candidates":
        data = _beir(tmp_path / "beir2", judged_extra="q99")
        needle = "1 judged queries of"
    elif case == "tsv_columns":
        data = tmp_path / "bad.tsv"
        data.write_text("q0\tred\td0\tboots\nq0\td1\tboots\n")
        needle = "bad.tsv:2: expected 4"
    else:
        data = tmp_path / "x.csv"
        data.write_text("q,d\n")
        needle = "pass --format"
    out = tmp_path / "out" / "run.trec"
    assert main(["rerank", "--model", model, "--data", str(data), "--out", str(out), "--quiet", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hllm rerank: error: ") and needle in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_evaluate_refuses_ids_that_do_not_match_and_corrupt_runs(tmp_path, capsys):
    run, qrels = tmp_path / "r.trec", tmp_path / "q.tsv"
    run.write_text("a Q0 d1 1 2 t\na Q0 d2 2 1 t\n")
    qrels.write_text("b 0 d1 2\n")
    assert main(["evaluate", "--run", str(run), "--qrels", str(qrels)]) == 2
    assert "the ids do not match" in capsys.readouterr().err
    run.write_text("a Q0 d1 one 2 t\n")
    assert main(["evaluate", "--run", str(run), "--qrels", str(qrels)]) == 2
    assert "r.trec:1: rank/score not numeric" in capsys.readouterr().err


def test_the_relevance_threshold_comes_from_the_qrels_grades(tmp_path, capsys):
    """Binary qrels (ArguAna's) count grade 1; TREC DL's 0-3 count grade >= 2; a scale without a 0
    (Cranfield's 1-4) counts every judgment; --rel overrides; the line says which and why."""
    run = tmp_path / "r.trec"
    run.write_text("a Q0 d1 1 3 t\na Q0 d2 2 2 t\na Q0 d3 3 1 t\n")

    def mrr(qrels: str, *extra: str) -> tuple[float, str]:
        (tmp_path / "q.tsv").write_text(qrels)
        assert main(["evaluate", "--run", str(run), "--qrels", str(tmp_path / "q.tsv"), "--json", str(tmp_path / "m.json"),
                     *extra]) == 0
        return json.loads((tmp_path / "m.json").read_text())[str(run)]["MRR@10"], capsys.readouterr().out

    value, printed = mrr("a 0 d2 1\n")  # binary: was 0.0000 under TREC DL's default of 2
    assert value == 0.5 and "count grade >= 1 as relevant (from the qrels graded [1]: every positive grade counts" in printed
    value, printed = mrr("a 0 d1 1\na 0 d2 0\na 0 d3 3\n")
    assert value == pytest.approx(1 / 3) and "grade >= 2 as relevant (from the graded qrels (grades [0, 1, 3])" in printed
    assert mrr("a 0 d1 4\na 0 d3 1\n")[0] == 1.0  # Cranfield-like 1-4: every judgment is some relevance
    value, printed = mrr("a 0 d1 1\na 0 d2 0\na 0 d3 3\n", "--rel", "1")
    assert value == 1.0 and "grade >= 1 as relevant (--rel)" in printed


def test_config_show_documents_every_key(capsys):
    from hllm.config import describe
    from pipelines.common import PipelineConfig

    assert all(doc for _, _, _, doc in describe(PipelineConfig)), "a config key without a doc comment"
    assert main(["config", "show"]) == 0
    shown = capsys.readouterr().out
    assert "data.top_n = 20\n    file sources: first-stage candidates per slate (N)" in shown
    config = str(Path(__file__).resolve().parents[2] / "configs" / "dl19-smollm2.yaml")
    assert main(["config", "show", "--config", config, "student.train.steps=7"]) == 0
    shown = capsys.readouterr().out
    assert 'teacher.model.preset = "smollm2-135m"  (default "tiny")' in shown and "student.train.steps = 7  (default 300)" in shown
    assert main(["config", "show", "student.nope=1"]) == 2
    assert "nope" in capsys.readouterr().err
    # a key unset by default whose value is a whole config (it once failed to print: not JSON serializable)
    assert main(["config", "show", "student.init_from_teacher=false", "student.model.preset=smollm2-135m"]) == 0
    assert 'student.model = {"preset": "smollm2-135m"' in capsys.readouterr().out


def test_the_console_script_and_every_help():
    script = Path(sys.executable).with_name("hllm")
    assert script.exists(), "pip install -e . installs the hllm console script"
    for argv in ([], ["rerank"], ["evaluate"], ["config", "show"], ["promote"], ["run"], ["serve"]):
        out = subprocess.run([str(script), *argv, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith("usage: hllm"), out.stderr
    out = subprocess.run([str(script), "rerank"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "required" in out.stderr


def test_rerank_with_the_ar_teacher_of_a_job(tmp_path, capsys):
    from hllm.config import to_dict
    from hllm.job.config import JobConfig, TeacherStageConfig

    job = tmp_path / "job"
    job.mkdir()
    cfg = JobConfig(output_dir=str(job), teacher=TeacherStageConfig(model=TINY, bootstrap=False))
    (job / "config.json").write_text(json.dumps({**to_dict(cfg), "cluster": {}}))
    data = _beir(tmp_path / "beir", queries=2, docs=7)
    out = tmp_path / "t.trec"
    assert main(["rerank", "--teacher", str(job), "--data", str(data), "--out", str(out), "--window", "4",
                 "--stride", "2", "--quiet"]) == 0
    assert "| teacher | 2 |" in capsys.readouterr().out
    assert {q: len(d) for q, d in _read_run(out).items()} == {"q0": 7, "q1": 7}


def test_rerank_and_promote_through_the_model_registry(student, tmp_path, monkeypatch, capsys):
    import mlflow

    from pipelines.registry import log_student

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=mlflow.create_experiment("t", (tmp_path / "artifacts").as_uri()))
    with mlflow.start_run():
        log_student(student, "cli-student", alias="candidate")
    assert main(["promote", "--name", "cli-student", "--version", "1", "--alias", "champion", "--tracking-uri", uri]) == 0
    assert "models:/cli-student@champion -> version 1" in capsys.readouterr().out
    data = _beir(tmp_path / "beir")
    args = ["rerank", "--data", str(data), "--window", "4", "--quiet"]
    assert main(args + ["--model", str(student), "--out", str(tmp_path / "folder.trec")]) == 0
    assert main(args + ["--model", "models:/cli-student@champion", "--out", str(tmp_path / "registry.trec")]) == 0
    assert (tmp_path / "registry.trec").read_text() == (tmp_path / "folder.trec").read_text()


@pytest.mark.slow
def test_ray_actor_pool_writes_the_same_run(student, tmp_path, ray_local):
    data = _beir(tmp_path / "beir", queries=5)
    args = ["rerank", "--model", str(student), "--data", str(data), "--window", "4", "--shard-size", "2", "--quiet"]
    assert main(args + ["--out", str(tmp_path / "local.trec")]) == 0
    assert main(args + ["--out", str(tmp_path / "ray.trec"), "--ray", "--actors", "2"]) == 0
    assert (tmp_path / "ray.trec").read_text() == (tmp_path / "local.trec").read_text()


def test_rerank_warns_once_when_the_model_does_not_know_the_words(student, tmp_path, capsys):
    data = _beir(tmp_path / "known")
    assert main(["rerank", "--model", str(student), "--data", str(data), "--out", str(tmp_path / "a.trec"), "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err  # the tiny vocabulary covers these words
    unknown = _beir(tmp_path / "unknown")
    lines = (unknown / "corpus.jsonl").read_text().splitlines()
    (unknown / "corpus.jsonl").write_text("\n".join(
        json.dumps({**json.loads(line), "text": "photosynthesis converts sunlight chlorophyll"}) for line in lines) + "\n")
    assert main(["rerank", "--model", str(student), "--data", str(unknown), "--out", str(tmp_path / "b.trec"),
                 "--shard-size", "1", "--quiet"]) == 0  # three shards: still one warning
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "unknown to this model's vocabulary" in err
    share = float(err.split("warning: ")[1].split("%")[0])
    assert 30 <= share <= 100


def test_progress_moves_per_group_of_queries_not_per_shard(student, tmp_path):
    """A shard of many queries used to show 0/N until the whole shard was done; now the bar moves per
    `--batch-size` queries (their windows share forward passes), and the totals are the shard's."""
    from hllm.data.readers import read_beir
    from hllm.job.collection import RerankSpec, ShardRanker

    slates = read_beir(_beir(tmp_path / "beir", queries=5), top_n=10)
    told: list[int] = []
    orders, stats, notes = ShardRanker(RerankSpec(model=str(student), window=4, batch_size=2, max_batch_tokens=512))(
        slates, told.append)
    assert told == [2, 2, 1] and stats["queries"] == 5 and stats["windows"] == 5 * ((10 - 4) // 2 + 1)
    assert [n["qid"] for n in notes] == [s.slate_id for s in slates] and all(n["windows"] == 4 for n in notes)
    assert set(notes[0]["confidence"]) == {"margin", "sharpness", "agreement", "trust"}
    assert [sorted(o) for o in orders] == [list(range(10))] * 5


def test_max_batch_tokens_takes_a_cap_auto_or_none(capsys):
    from pipelines.cli import build_parser

    base = ["rerank", "--model", "m", "--data", "d", "--out", "o"]
    parse = build_parser().parse_args
    assert parse(base).max_batch_tokens == "auto"  # 8192 on a CPU, no cap on a GPU (hllm.reranker.resolve_max_batch_tokens)
    assert parse(base + ["--max-batch-tokens", "none"]).max_batch_tokens is None
    assert parse(base + ["--max-batch-tokens", "4096"]).max_batch_tokens == 4096
    for bad in ("0", "lots"):
        with pytest.raises(SystemExit) as exit_:
            parse(base + ["--max-batch-tokens", bad])
        assert exit_.value.code == 2 and "expected a positive int, auto or none" in capsys.readouterr().err
