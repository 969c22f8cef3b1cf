"""The whole flywheel at tiny scale, for real: a job registers the champion; Serve (started on a busy
machine) answers from `models:/NAME@champion` and writes the traffic log; the refresh job reads it
with Ray Data, labels it with the teacher (Ray Data), fine-tunes the champion (Ray Train +
DeepSpeed), gates, registers and moves the alias on a sqlite MLflow; the running deployment then
answers from the new version with no failed request. Then a cycle the gate refuses, and bad logs."""

import json
import multiprocessing
import os
import time
from pathlib import Path

import mlflow
import pytest
import requests

from hllm.config import load_config
from hllm.data.synthetic import SyntheticConfig, generate
from hllm.data.traffic import request_key
from hllm.job.refresh import NothingToRefresh
from pipelines import refresh
from pipelines.common import PipelineConfig
from pipelines.registry import pin, promote

from conftest import SERVE_PORT, copy_job
from builders import PIPELINE_TINY_JOB as TINY_JOB

pytestmark = pytest.mark.slow
URL = f"http://127.0.0.1:{SERVE_PORT}/flywheel/v1/rerank"


def _burn(stop, nice):  # a busy core
    os.nice(nice)
    while not stop.is_set():
        sum(i * i for i in range(10_000))


class BusyMachine:
    """Keeps every core busy while in the `with` block: `nice=0` as a plain process would (Ray's own
    workers run at nice 15, so they get a few percent of the CPU), `nice=15` as another Ray job."""

    def __init__(self, nice: int = 0):
        self.nice = nice

    def __enter__(self):
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_burn, args=(self.stop, self.nice), daemon=True) for _ in range(os.cpu_count() or 2)]
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def traffic_bodies(n: int, seed: int = 11) -> list[dict]:
    """Requests unlike the job's slates: another draw of the catalogue (new queries)."""
    splits, _ = generate(SyntheticConfig(catalogue_size=300, slate_size=6, train_slates=n, val_slates=1, test_slates=1, seed=seed))
    return [{"query": s.query.text, "documents": [c.text for c in s.candidates]} for s in splits["train"]]


@pytest.fixture(scope="module")
def job(tiny_job, tmp_path_factory):
    """The main job's distillation at tiny scale (the session's, conftest.tiny_job, in a copy of its own: the cycles
    here add versions and move aliases): the champion, version 1 of hllm-student."""
    out = copy_job(tiny_job[3], tmp_path_factory.mktemp("flywheel"))
    tracking = f"sqlite:///{out / 'mlflow.db'}"
    overrides = TINY_JOB + [f"output_dir={out}", f"refresh.log_path={out / 'traffic'}", "refresh.steps=4",
                            "refresh.min_slates=6", "refresh.lr=0.001", "refresh.tolerance=1.0", "refresh.min_gain=-1.0"]
    cfg = load_config(PipelineConfig, None, overrides)
    mlflow.set_tracking_uri(tracking)
    promote("hllm-student", 1, "champion")
    return cfg, overrides, out, tracking


def test_served_traffic_refreshes_the_champion_and_the_deployment_swaps_with_no_failed_request(job):
    from ray import serve

    from serve.app import RerankDeployment
    from serve.common import AppArgs, start_serve
    from serve.faults import swap_under_load

    cfg, _, out, tracking = job
    args = AppArgs(model="models:/hllm-student@champion", tracking_uri=tracking, threads=1, alias_poll_s=1.0,
                   traffic_log={"path": str(out / "traffic"), "flush_records": 16, "flush_seconds": 0.5})
    deployment = RerankDeployment.options(name="Flywheel", num_replicas=2, ray_actor_options={"num_cpus": 0.5})
    with BusyMachine(nice=0):  # Serve's proxy must come up while plain processes keep every core busy
        t0 = time.time()
        start_serve({"host": "127.0.0.1", "port": SERVE_PORT})
        print(f"Serve started, proxies healthy, after {time.time() - t0:.0f} s on a busy machine")
    serve.run(deployment.bind(args.model_dump()), name="flywheel", route_prefix="/flywheel")
    try:
        bodies = traffic_bodies(40)
        answers = [requests.post(URL, json=b, timeout=60) for b in bodies + bodies[:5]]  # 5 repeated requests
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        assert {a.json()["meta"]["model_version"] for a in answers} == {"models:/hllm-student/1"}
        foreign = requests.post(URL, json={"query": "quantum gluon", "documents": ["lattice qcd", "gluon field"]}, timeout=60)
        assert foreign.json()["meta"]["warnings"]  # logged with its warning; the refresh leaves it out

        time.sleep(2)  # the replicas' time flush (0.5 s)
        record = refresh.run(cfg)
        counts = record.counts
        distinct = len({request_key(b["query"], b["documents"]) for b in bodies})  # the draw may repeat a query
        assert counts["warned"] == 1 and counts["duplicates"] == 45 - distinct and counts["slates"] == distinct, counts
        assert counts["train"] + counts["test"] == distinct and counts["files_skipped"] == 0
        assert record.promoted and record.challenger == "models:/hllm-student/2"
        assert pin("models:/hllm-student@champion") == "models:/hllm-student/2"
        figures = record.figures
        assert set(figures) == {"champion", "challenger", "first_stage"}
        assert {"original.nDCG@10", "original.kendall_tau", "traffic.kendall_tau", "traffic.top1_agreement",
                "traffic.nDCG@10_vs_teacher"} <= set(figures["challenger"])
        run = mlflow.get_run(record.mlflow_run_id)
        assert run.data.tags["champion_version"] == "models:/hllm-student/1"
        assert run.data.tags["challenger_version"] == "models:/hllm-student/2"
        assert run.data.tags["verdict"].startswith("PROMOTE") and run.data.metrics["promoted"] == 1.0
        assert run.data.metrics["log.warned"] == 1.0 and "challenger.traffic.kendall_tau" in run.data.metrics
        assert json.loads((Path(record.cycle_dir) / "cycle.json").read_text())["challenger"] == record.challenger

        # the alias already moved: the running deployment follows it, under load, on a busy machine
        promote("hllm-student", 1, "champion")  # back, so that the drill sees the move happen
        with BusyMachine(nice=15):  # as busy as another Ray job makes it
            swap = swap_under_load(URL, bodies, lambda: promote("hllm-student", 2, "champion"), "models:/hllm-student/2",
                                   before_s=4.0, timeout_s=120)
        summary = swap.summary()
        print("swap under load:", summary)
        assert summary["failed"] == 0 and summary["requests"] > 20, summary
        assert swap.swap_s is not None and set(swap.versions) == {"models:/hllm-student/1", "models:/hllm-student/2"}, summary
        card = requests.get(URL.replace("/v1/rerank", "/v1/models"), timeout=30).json()["data"][0]
        assert card["model_version"] == "models:/hllm-student/2"
    finally:
        serve.delete("flywheel")


def escalated_rows(out: Path, n: int) -> dict[str, list[int]]:
    """n logged requests again, as the online cascade logs an escalation (new queries: new requests), each with the
    served teacher's ranking (`teacher_order`, here the input order turned round) -> request key -> that ranking."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hllm.data.traffic import log_files

    table = pq.read_table(log_files(out / "traffic")[0]).slice(0, n)
    rows = table.to_pylist()
    for r in rows:
        r["query"] += " escalated"
        r["answered_by"], r["teacher_order"] = "teacher", list(range(len(r["documents"])))[::-1]
    folder = out / "traffic" / "date=2026-12-06"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), folder / "part-9999999999999-cascade-000001.parquet")
    return {request_key(r["query"], r["documents"]): r["teacher_order"] for r in rows}


def test_a_cycle_the_gate_refuses_leaves_the_alias(job):
    """Also, with `refresh.rollout_alias`: the refused gate moves no alias, and the served teacher's rankings in the log
    (escalated requests) label their slates instead of the job's teacher."""
    from hllm.data import store

    cfg, overrides, out, _ = job
    assert pin("models:/hllm-student@champion") == "models:/hllm-student/2"  # after the first cycle
    escalated = escalated_rows(out, 4)
    strict = load_config(PipelineConfig, None, overrides + ["refresh.min_gain=1.0",  # no challenger gains a whole point
                                                            "refresh.rollout_alias=challenger"])
    record = refresh.run(strict)
    assert not record.promoted and "no gain" in record.verdict and record.moved is None
    assert record.champion == "models:/hllm-student/2" and record.challenger == "models:/hllm-student/3"
    assert pin("models:/hllm-student@champion") == "models:/hllm-student/2"  # unchanged
    with pytest.raises(mlflow.exceptions.MlflowException):  # and no challenger alias was made
        pin("models:/hllm-student@challenger")
    assert record.counts["teacher_labelled"] == len(escalated), record.counts
    labelled = {i.slate.slate_id: i.ranking.permutation for d in record.rankings.values()
                for i in store.read_rankings(d)}
    assert {k: labelled[f"traffic-{k}"] for k in escalated} == escalated  # the served teacher's, not asked again
    run = mlflow.get_run(record.mlflow_run_id)
    assert run.data.metrics["promoted"] == 0.0 and "KEEP" in run.data.tags["verdict"]


def test_bad_logs_make_no_new_version(job, tmp_path):
    cfg, overrides, out, _ = job
    versions = len(mlflow.MlflowClient().search_model_versions("name='hllm-student'"))

    def cycle(log_path):
        return refresh.run(load_config(PipelineConfig, None, overrides + [f"refresh.log_path={log_path}"]))

    with pytest.raises(FileNotFoundError, match="no traffic log"):
        cycle(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "part-0000000000001-x-000001.parquet").write_text("truncated")
    with pytest.raises(NothingToRefresh, match=r"no records \(1 unreadable file\(s\) skipped\)"):
        cycle(tmp_path / "empty")
    # another model's log: the same requests, answered by a model of another prompt / vocabulary
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hllm.data.traffic import log_files
    foreign = tmp_path / "foreign" / "date=2026-12-01"
    foreign.mkdir(parents=True)
    for k, f in enumerate(log_files(out / "traffic")):
        table = pq.read_table(f)
        table = table.set_column(table.schema.get_field_index("model_key"), "model_key",
                                 pa.array(["0123456789abcdef"] * table.num_rows, pa.string()))
        pq.write_table(table, foreign / f"part-{k:013d}-x-000001.parquet")
    with pytest.raises(NothingToRefresh, match="another prompt or vocabulary"):
        cycle(tmp_path / "foreign")
    assert len(mlflow.MlflowClient().search_model_versions("name='hllm-student'")) == versions
    assert Path(out / "traffic").is_dir()


def test_files_before_and_after_the_cascade_columns_read_together_through_ray_data(ray_local, tmp_path):
    """The refresh reads `teacher_order` where a file has it and an empty one where a file was written before the
    cascade: one dataset of both, every row counted, the label kept where there is one."""
    import pyarrow.parquet as pq

    from hllm.data.traffic import OPTIONAL, TrafficLog, TrafficLogConfig
    from builders import traffic_record as record

    log = TrafficLog(TrafficLogConfig(str(tmp_path), flush_records=100, flush_seconds=60))
    escalated = record(1)
    escalated.teacher_order = [2, 0, 1]
    log.append(record(0))
    log.append(escalated)
    new = log.flush()
    log.close()
    old = new.with_name("part-0000000000001-x-000001.parquet")  # as a replica wrote it before the cascade
    pq.write_table(pq.read_table(new).drop_columns(list(OPTIONAL)), old)
    rows, counts, _ = refresh.read_traffic(str(tmp_path), "k1", 1.0)
    assert counts["rows"] == 4 and counts["files"] == 2
    assert sorted((r["request_id"], list(r["teacher_order"])) for r in rows) == \
        [("r0", []), ("r0", []), ("r1", []), ("r1", [2, 0, 1])]
