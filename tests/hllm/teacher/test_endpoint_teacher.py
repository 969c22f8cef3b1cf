"""The served AR teacher (`hllm.teacher.endpoint`): prompt, config and figures (fast), then against a real
OpenAI-compatible server — llama.cpp serving SmolLM2-135M-Instruct — with faults injected by a proxy between
the client and the server (slow; skipped with the reason where the server cannot be installed)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from hllm.config import ConfigError, load_config
from hllm.data.synthetic import SyntheticConfig, generate
from hllm.model.prompts import PromptConfig, answer_chars, prompt_messages
from hllm.records import ParseCounts, TeacherRanking
from hllm.job.config import JobConfig
from hllm.teacher.endpoint import (EndpointAuthError, EndpointConfig, EndpointTeacher, FailureBudget, TeacherFailed,
                                   endpoint_figures, latency_bin, latency_quantile)
from hllm.teacher.generation import TeacherConfig

ENDPOINT_JOB = ["sized_for=tiny", "teacher.bootstrap=false", "teacher.endpoint.url=http://127.0.0.1:9/v1",
                "teacher.endpoint.model=smollm2", "student.init_from_teacher=false", "student.model.preset=tiny"]


# ---- fast: no server -------------------------------------------------------------------------------------
def test_prompt_messages_are_the_templates_words_with_word_caps():
    cfg = PromptConfig(template="rankgpt", max_doc_tokens=3, max_query_tokens=2)
    system, user = prompt_messages(cfg, "red leather boots", ["one two three four", "five"])
    assert system["role"] == "system" and "RankLLM" in system["content"] and user["role"] == "user"
    assert "[1] one two three\n[2] five\n" in user["content"]  # cut to 3 words, identifiers first
    assert "search query: red leather." in user["content"] and "four" not in user["content"]
    compact = prompt_messages(PromptConfig(template="compact"), "q", ["a b", "c"])[1]["content"]
    assert "a b [1]\nc [2]\n" in compact  # identifiers after their text
    restated = prompt_messages(PromptConfig(template="rankgpt-query"), "q", ["a"])[1]["content"]
    assert "[1] a Query: q\n" in restated
    with pytest.raises(ValueError):
        prompt_messages(cfg, "q", [])


def test_answer_chars_bounds_the_full_answer():
    assert answer_chars(3) == len("[1] > [2] > [3]")
    assert answer_chars(20) == len(" > ".join(f"[{i}]" for i in range(1, 21)))


def test_endpoint_config_is_checked_as_a_whole():
    cfg = load_config(JobConfig, None, ENDPOINT_JOB)
    assert cfg.teacher.endpoint.model == "smollm2" and cfg.teacher.max_failed_share == 0.05
    with pytest.raises(ConfigError, match="teacher.bootstrap"):  # bootstrapping is a local teacher's
        load_config(JobConfig, None, [a for a in ENDPOINT_JOB if a != "teacher.bootstrap=false"])
    with pytest.raises(ConfigError, match="constrained"):
        load_config(JobConfig, None, ENDPOINT_JOB + ["teacher.generation.constrained=true"])
    with pytest.raises(ConfigError, match="no weights to start the student"):
        load_config(JobConfig, None, ENDPOINT_JOB[:4] + ["student.init_from_teacher=true"])
    with pytest.raises(ConfigError, match="endpoint.model is required"):
        load_config(JobConfig, None, [a for a in ENDPOINT_JOB if "endpoint.model" not in a])
    with pytest.raises(ConfigError, match="http"):
        load_config(JobConfig, None, ENDPOINT_JOB + ["teacher.endpoint.url=host:8000"])
    with pytest.raises(ConfigError, match="max_failed_share"):
        load_config(JobConfig, None, ENDPOINT_JOB + ["teacher.max_failed_share=1.5"])
    split = cfg.teacher.endpoint.split_among(3)
    assert split.concurrency == 3 and cfg.teacher.endpoint.concurrency == 8


def test_the_key_comes_from_the_environment_only(monkeypatch):
    cfg = EndpointConfig(url="http://127.0.0.1:9/v1", model="m", api_key_env="HLLM_TEST_MISSING_KEY")
    monkeypatch.delenv("HLLM_TEST_MISSING_KEY", raising=False)
    with pytest.raises(EndpointAuthError, match="HLLM_TEST_MISSING_KEY, which is not set"):
        EndpointTeacher(cfg, PromptConfig(), TeacherConfig())
    assert "api_key" not in {f.name for f in dataclasses.fields(EndpointConfig)}  # no field could hold it


def test_extra_headers_read_their_secrets_from_the_environment(monkeypatch):
    cfg = EndpointConfig(url="http://127.0.0.1:9/v1", model="m", headers={"X-Org": "acme", "X-Token": "${HLLM_TEST_TOKEN}"})
    monkeypatch.setenv("HLLM_TEST_TOKEN", "tok-123")
    t = EndpointTeacher(cfg, PromptConfig(), TeacherConfig())
    assert t._headers() == {"X-Org": "acme", "X-Token": "tok-123"}
    assert t._mask("echoed tok-123 back") == "echoed *** back"  # a secret header is masked like the key
    monkeypatch.delenv("HLLM_TEST_TOKEN")
    with pytest.raises(ValueError, match="HLLM_TEST_TOKEN is not set"):
        t._headers()


def test_failure_budget_stops_once_the_split_cannot_end_within_it():
    budget = FailureBudget("train", slates=40, max_share=0.05)  # 2 failures allowed
    failed = lambda sid, why: TeacherRanking(sid, None, f"{why}: boom", ParseCounts(total=1), failure=why)  # noqa: E731
    budget.add([failed("a", "http_429"), TeacherRanking("b", [0], "[1]", ParseCounts(total=1, ok=1))])
    budget.add([failed("c", "timeout")])
    with pytest.raises(TeacherFailed) as err:
        budget.add([failed("d", "http_429")])
    message = str(err.value)
    assert "3 of 40 slates failed" in message and "http_429 x2" in message and "slate 'a'" in message


def test_latency_histogram_quantiles():
    hist: dict[str, int] = {}
    for s in [0.1] * 50 + [1.0] * 45 + [10.0] * 5:
        hist[latency_bin(s)] = hist.get(latency_bin(s), 0) + 1
    assert latency_quantile(hist, 0.5) == pytest.approx(0.1, rel=0.07)
    assert latency_quantile(hist, 0.95) == pytest.approx(1.0, rel=0.07)
    fig = endpoint_figures({"requests": 3, "attempts": 5, "latency_hist": hist, "prompt_tokens": 2_000_000,
                            "completion_tokens": 1_000_000}, seconds=2.0, slates=4,
                           cfg=EndpointConfig(price_prompt_per_m=0.5, price_completion_per_m=1.5))
    assert fig["retries"] == 2 and fig["slates_per_s"] == 2.0 and fig["cost"] == pytest.approx(2.5)


# ---- slow: a real server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slates():
    splits, _ = generate(SyntheticConfig(catalogue_size=300, slate_size=6, train_slates=6, val_slates=2, test_slates=2,
                                         seed=3))
    return splits["train"]


def teacher(url: str, tmp_path=None, **changes) -> EndpointTeacher:
    from teacher_server import MODEL

    cfg = EndpointConfig(url=url, model=MODEL, api_key_env="HLLM_TEST_TEACHER_KEY", timeout_s=20, max_retries=2)
    generation = TeacherConfig(window=4, stride=2, repair=True)
    return EndpointTeacher(dataclasses.replace(cfg, **changes), PromptConfig(max_doc_tokens=24), generation,
                           None if tmp_path is None else tmp_path / "answers")


@pytest.fixture(autouse=True)
def _key(monkeypatch):
    from teacher_server import API_KEY

    monkeypatch.setenv("HLLM_TEST_TEACHER_KEY", API_KEY)


@pytest.mark.slow
def test_ranks_through_a_real_server_and_pays_once(teacher_server, fault_proxy, slates, tmp_path):
    t = teacher(fault_proxy.url, tmp_path)
    rankings, extra = t.rank_summarized(slates[:3])
    tally = extra["endpoint"]
    assert len(rankings) == 3
    for slate, r in zip(slates, rankings):
        assert r.failure == "" and sorted(r.permutation) == list(range(len(slate.candidates)))
        assert len(r.windows) == 2 and r.prompt_tokens > 0 and r.output_tokens > 0  # two windows of 4 over 6
    posts = len(fault_proxy.posts())
    assert tally["requests"] == posts == 6 and tally["attempts"] == 6 and tally["cached"] == 0
    assert tally["prompt_tokens"] == sum(r.prompt_tokens for r in rankings) > 0  # the server's `usage`
    again = teacher(fault_proxy.url, tmp_path)  # a new process reading the same answer cache
    rankings2, extra2 = again.rank_summarized(slates[:3])
    assert [r.permutation for r in rankings2] == [r.permutation for r in rankings]
    assert extra2["endpoint"]["cached"] == 6 and extra2["endpoint"]["requests"] == 0 and len(fault_proxy.posts()) == posts


@pytest.mark.slow
def test_rounds_and_per_query_schedules_rank_the_same_windows(teacher_server, fault_proxy, slates):
    per_query, a = teacher(fault_proxy.url).rank_summarized(slates[:2])
    rounds, b = teacher(fault_proxy.url, schedule="rounds").rank_summarized(slates[:2])
    for p, r, slate in zip(per_query, rounds, slates):
        assert sorted(p.permutation) == sorted(r.permutation) == list(range(len(slate.candidates)))
        assert len(p.windows) == len(r.windows) == 2 and p.failure == r.failure == ""
    assert a["endpoint"]["requests"] == b["endpoint"]["requests"] == 4


@pytest.mark.slow
def test_retries_honour_retry_after_and_count_what_they_retried(teacher_server, fault_proxy, slates):
    fault_proxy.faults.extend([("429", 2), "500", "hang"])
    fault_proxy.hang_s = 12.0  # past the timeout; the timeout well past a real answer (~1-2 s here, more under load)
    t0 = time.monotonic()
    rankings, extra = teacher(fault_proxy.url, timeout_s=8, max_retries=3).rank_summarized(slates[:1])
    tally = extra["endpoint"]
    assert rankings[0].failure == "" and rankings[0].permutation is not None  # recovered
    assert tally["attempts"] == 5 and tally["requests"] == 2  # 3 failed attempts, then the 2 windows
    assert tally["retried"] == {"429": 1, "500": 1}  # the hang never answered: a timeout, retried
    posts = fault_proxy.posts()
    assert posts[1][2] - posts[0][2] >= 1.9  # Retry-After: 2 honoured
    assert time.monotonic() - t0 >= 2 + 8  # and the timeout waited out


@pytest.mark.slow
def test_each_fault_whose_retries_run_out_is_counted_by_reason(teacher_server, fault_proxy, slates):
    fault_proxy.faults.extend([("429", 1), "500", "hang", "garbage"])
    fault_proxy.hang_s = 12.0
    t = teacher(fault_proxy.url, timeout_s=8, max_retries=0, concurrency=1)
    rankings, extra = t.rank_summarized(slates[:5])  # the 5th slate meets no fault
    failures = {r.slate_id: r.failure for r in rankings}
    assert sorted(failures.values()) == ["", "http_429", "http_5xx", "timeout", "unparseable"]
    assert extra["endpoint"]["failures"] == {"http_429": 1, "http_5xx": 1, "timeout": 1, "unparseable": 1}
    garbage = next(r for r in rankings if r.failure == "unparseable")
    assert garbage.permutation is None and "cannot rank" in garbage.raw_text and garbage.counts.wrong_format == 1
    assert all(r.permutation is None for r in rankings if r.failure)  # a failed first window ends the slate
    budget = FailureBudget("train", 5, 0.5)
    with pytest.raises(TeacherFailed, match="4 of 5 slates failed"):
        budget.add(rankings)


@pytest.mark.slow
def test_a_wrong_key_stops_at_once_and_is_never_shown(teacher_server, fault_proxy, slates, monkeypatch, caplog):
    monkeypatch.setenv("HLLM_TEST_TEACHER_KEY", "sk-wrong-0000")
    with pytest.raises(EndpointAuthError) as err:
        teacher(fault_proxy.url, max_retries=5).rank(slates[:4])
    assert "401" in str(err.value) and "HLLM_TEST_TEACHER_KEY" in str(err.value) and "sk-wrong-0000" not in str(err.value)
    assert len(fault_proxy.posts()) <= 4  # no retries burnt: at most the first request of each slate went out
    assert "sk-wrong-0000" not in caplog.text


# ---- the teacher stage, in this process and on Ray; `hllm rerank --teacher-url` --------------------------
def job(url: str, out, *more: str) -> list[str]:
    from teacher_server import MODEL

    return ["sized_for=tiny", "teacher.bootstrap=false", f"teacher.endpoint.url={url}", f"teacher.endpoint.model={MODEL}",
            "teacher.endpoint.api_key_env=HLLM_TEST_TEACHER_KEY", "teacher.endpoint.max_retries=0",
            "teacher.generation.window=4", "teacher.generation.stride=2", "teacher.generation.repair=true",
            "prompt.max_doc_tokens=24",
            "student.init_from_teacher=false", "student.model.preset=tiny", f"output_dir={out}",
            "data.synthetic.catalogue_size=300", "data.synthetic.slate_size=6", "data.synthetic.train_slates=8",
            "data.synthetic.val_slates=2", "data.synthetic.test_slates=2", *more]


@pytest.mark.slow
def test_the_stage_stops_past_the_budget_then_resumes_asking_only_what_failed(teacher_server, fault_proxy, tmp_path):
    from hllm.data.splits import load_splits
    from hllm.job.stages import load_teacher, rank_in_process, teacher_model, teacher_rankings_stage

    cfg = load_config(JobConfig, None, job(fault_proxy.url, tmp_path, "teacher.max_failed_share=0.25"))
    train = load_splits(cfg.data)["train"]
    stage = lambda split, slates: teacher_rankings_stage(  # noqa: E731
        cfg, teacher_model(cfg), split, slates, rank_in_process(load_teacher(teacher_model(cfg), cfg, "cpu"), 4,
                                                                cfg.teacher.max_failed_share))
    fault_proxy.faults.extend(["500", "500", "500"])  # 3 of the first shard's 4 slates fail: 2 of 8 are allowed
    with pytest.raises(TeacherFailed, match=r"of 8 slates failed.*http_5xx x3"):
        stage("train", train)
    first = len(fault_proxy.posts())
    kept = sum(len(p.read_text().splitlines()) for p in (tmp_path / "teacher-answers").glob("*.jsonl"))
    assert first <= 3 + 2 and kept == first - 3  # the good slate's windows; the 2nd shard was never asked
    rankings = stage("train", train)  # the rerun: the failed shard again (its good slate from the cache), then the rest
    fig = rankings.stats.endpoint
    assert fig["cached"] == kept and len(fault_proxy.posts()) - first == fig["requests"]
    assert fig["requests"] + fig["cached"] == sum(max(1, len(i.ranking.windows)) for i in rankings.items)
    assert fig["failures"]["http_5xx"] == 0 and fig["prompt_tokens"] > 0
    assert fig["latency_p50_s"] > 0 and fig["latency_p95_s"] >= fig["latency_p50_s"]
    assert len(rankings.items) == 8 and sum(i.ranking.permutation is None for i in rankings.items) <= 2
    info = json.loads((rankings.directory / "stage.json").read_text())
    assert info["endpoint"]["requests"] == fig["requests"] and info["slates"] == 8
    before = len(fault_proxy.posts())
    again = stage("same-slates", train)  # a second split with the same slates: paid for already
    failed = sum(i.ranking.permutation is None for i in rankings.items)  # not kept: asked again
    assert len(fault_proxy.posts()) - before == again.stats.endpoint["requests"] <= 2 * failed
    assert [i.ranking.permutation for i in again.items if i.ranking.failure == ""] == \
        [i.ranking.permutation for i in rankings.items if i.ranking.failure == ""]


@pytest.mark.slow
def test_ray_fans_the_served_teacher_out_and_keeps_the_key_out_of_mlflow(ray_local, teacher_server, fault_proxy,
                                                                           tmp_path):
    import mlflow

    from pipelines import teacher_gen
    from pipelines.common import PipelineConfig
    from teacher_server import API_KEY

    cfg = load_config(PipelineConfig, None, job(fault_proxy.url, tmp_path, "teacher.max_failed_share=0.1",
                                                "cluster.teacher_actors=2", "cluster.teacher_cpus_per_actor=0.5",
                                                "cluster.teacher_batch_slates=4", "teacher.endpoint.concurrency=4"))
    fault_proxy.faults.extend(["500", "500"])
    with pytest.raises(TeacherFailed, match="http_5xx x2"):  # the driver stops the pool past the budget (0 of 8)
        teacher_gen.run(cfg, splits=("train",))
    done = len(fault_proxy.posts())
    _, rankings = teacher_gen.run(cfg)
    train = rankings["train"]
    assert len(train.items) == 8 and train.stats.endpoint["failures"]["http_5xx"] == 0
    assert train.stats.endpoint["cached"] >= 1  # what the stopped run had answered
    # asked again: the two failed slates' windows (their good neighbours came from the cache), then val and test
    assert len(fault_proxy.posts()) - done == 2 * 2 + sum(rankings[s].stats.endpoint["requests"] for s in ("val", "test"))
    assert {i.ranking.node for i in train.items} != {""}
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = next(r for r in mlflow.search_runs(experiment_names=["hllm"], output_format="list")
               if r.data.tags["hllm.stage"] == "teacher_generation" and r.data.metrics)
    assert run.data.metrics["teacher_gen.train.endpoint.requests"] >= 1
    assert "teacher_gen.train.endpoint.latency_p95_s" in run.data.metrics
    assert run.data.params["teacher.endpoint.api_key_env"] == "HLLM_TEST_TEACHER_KEY"
    assert not any(API_KEY in str(v) for v in run.data.params.values())
    assert not any(API_KEY in p.read_text(errors="ignore") for p in tmp_path.rglob("*") if p.is_file()
                   and p.suffix in (".json", ".jsonl", ".log", ".txt", ".yaml"))


def _dl19_subset(shared: Path, root: Path, queries: int = 3, top: int = 6) -> Path:
    """The first `queries` judged DL19 queries with their BM25 top `top`, as a BEIR folder."""
    src = shared / "trec-dl19-passage-bm25top100"
    run: dict[str, list[str]] = {}
    for line in (src / "runs" / "bm25_top100.tsv").read_text().splitlines()[1:]:
        qid, docid, *_ = line.split("\t")
        if len(run.setdefault(qid, [])) < top:
            run[qid].append(docid)
    qrels = [line for line in (src / "qrels" / "test.tsv").read_text().splitlines()[1:]]
    keep = sorted({line.split("\t")[0] for line in qrels} & set(run))[:queries]
    docs = {d for q in keep for d in run[q]}
    (root / "qrels").mkdir(parents=True)
    (root / "runs").mkdir()
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(
        line for line in qrels if line.split("\t")[0] in keep) + "\n")
    (root / "runs" / "bm25_top100.tsv").write_text("query-id\tcorpus-id\trank\tscore\n" + "\n".join(
        f"{q}\t{d}\t{r + 1}\t{100 - r}" for q in keep for r, d in enumerate(run[q])) + "\n")
    with open(src / "queries.jsonl") as fh:
        (root / "queries.jsonl").write_text("".join(line for line in fh if json.loads(line)["_id"] in keep))
    with open(src / "corpus.jsonl") as fh:
        (root / "corpus.jsonl").write_text("".join(line for line in fh if json.loads(line)["_id"] in docs))
    return root


@pytest.mark.slow
@pytest.mark.data
def test_hllm_rerank_with_a_served_teacher_writes_a_run_and_resumes(teacher_server, fault_proxy, shared_data,
                                                                    tmp_path, capsys):
    from pipelines.cli import main
    from teacher_server import MODEL

    data = _dl19_subset(shared_data, tmp_path / "dl19")
    out = tmp_path / "teacher.trec"
    argv = ["rerank", "--teacher-url", fault_proxy.url, "--teacher-model", MODEL, "--teacher-api-key-env",
            "HLLM_TEST_TEACHER_KEY", "--data", str(data), "--top-n", "6", "--window", "4", "--stride", "2",
            "--out", str(out), "--shard-size", "2", "--batch-size", "2", "--quiet"]
    fault_proxy.faults.append("500")  # retried (the CLI's default retries), never seen in the run
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and "3 queries" in printed and "6 windows" in printed
    assert "teacher endpoint: 6 requests (1 retries" in printed and "first stage (input order)" in printed
    lines = out.read_text().splitlines()
    assert len(lines) == 3 * 6 and lines[0].split()[-1] == "hllm"
    posts = len(fault_proxy.posts())
    out.unlink()
    assert main(argv) == 0  # a rerun of a finished run: every answer from OUT.answers/
    assert len(fault_proxy.posts()) == posts and "0 requests" in capsys.readouterr().out
    assert sorted(out.read_text().splitlines()) == sorted(lines)


@pytest.mark.slow
@pytest.mark.data
def test_hllm_rerank_fans_a_beir_collection_out_over_ray_actors_to_the_served_teacher(ray_local, teacher_server, fault_proxy,
                                                                                     shared_data, tmp_path, capsys):
    from pipelines.cli import main
    from teacher_server import MODEL

    data = _dl19_subset(shared_data, tmp_path / "dl19", queries=4)
    out = tmp_path / "ray.trec"
    assert main(["rerank", "--teacher-url", fault_proxy.url, "--teacher-model", MODEL, "--teacher-api-key-env",
                 "HLLM_TEST_TEACHER_KEY", "--data", str(data), "--top-n", "6", "--window", "4", "--stride", "2",
                 "--out", str(out), "--shard-size", "2", "--ray", "--actors", "2", "--cpus-per-actor", "0.5",
                 "--concurrency", "4", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "4 queries" in printed and "teacher endpoint: 8 requests" in printed and "| teacher |" in printed
    assert len(out.read_text().splitlines()) == 4 * 6 and len(fault_proxy.posts()) == 8
    assert (tmp_path / "ray.trec.answers").is_dir()  # both actors kept what they were told
