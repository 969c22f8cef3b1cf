"""Many students behind one endpoint on a real local Ray Serve (serve/students.py): routing by `model`, 404 and
/v1/models, multiplexing with LRU eviction and unmixed batches, a shadow that fails or falls behind without touching
the primary, a canary rolled back by each guard and one promoted (the alias moved in a real MLflow registry)."""

import concurrent.futures
import shutil
import time

import numpy as np
import pytest
import requests

from hllm import Reranker
from hllm.model.heads import HeadConfig
from hllm.model.backbones import ModelConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.job.stages import calibrate_student
from hllm.train.loop import LossConfig, TrainConfig, train_student

from conftest import SERVE_PORT, TINY, graded_examples
from openapi_fuzz import fuzz

pytestmark = pytest.mark.slow
ROOT = f"http://127.0.0.1:{SERVE_PORT}"
DOCS = ["acme red leather boots", "zenith blue cotton shirt", "acme red wool boots pairs with scarf",
        "kairo green canvas backpack", "nordic red leather boots", "blue denim jacket", "red rain boots for kids",
        "leather care kit", "wool socks, red", "green hiking boots"]
QUERIES = [f"{c} {w}" for c in ("red", "blue", "green", "wool", "acme", "nordic", "kids", "canvas", "denim", "care")
           for w in ("boots", "shirt", "jacket", "socks", "backpack", "kit")]
FUZZ_EXAMPLES = 30  # per operation and mode (the one-student app's fuzz runs 60 and two seeds)
BIG = ModelConfig(hidden_size=512, layers=8, heads=8, intermediate_size=2048, context_length=512)


def in_vocabulary_bodies(n: int) -> list[dict]:
    """Requests in the tiny students' vocabulary (another draw of the synthetic catalogue): hand-written words are
    mostly unknown to them, so documents tie and float noise between a batched and a lone pass reorders them — the
    champion's own copy then "disagrees" with it."""
    from hllm.data.synthetic import SyntheticConfig, generate

    splits, _ = generate(SyntheticConfig(catalogue_size=400, slate_size=10, train_slates=n, val_slates=1, test_slates=1,
                                         seed=5))
    return [{"query": s.query.text, "documents": [c.text for c in s.candidates]} for s in splits["train"]]


def build(path, small_splits, model=TINY, steps=3, seed=0):
    import torch

    torch.manual_seed(seed)
    ranker = SinglePassRanker.build(RankerConfig(model=model, adapt=AdaptConfig(lora_r=2, lora_alpha=4),
                                                 head=HeadConfig(positions=8, width=32, num_heads=2)))
    train_student(ranker, graded_examples(ranker, small_splits["train"]),
                  TrainConfig(steps=steps, batch_size=4, warmup_steps=1), LossConfig({"graded_ce": 1.0}))
    ranker.save(path)
    calibrate_student(path, small_splits["val"] + small_splits["test"], rel=1)
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, small_splits):
    """Students: champion; good (the champion's weights in another folder: full agreement); wrong (the champion with its
    readout negated: rankings turned round); slow (an 8-layer, 512-wide backbone); crash (weights that do not load);
    other (another tiny student)."""
    root = tmp_path_factory.mktemp("fleet")
    champion = build(root / "champion", small_splits, steps=40)  # decisive scores: near-ties flip with batch padding
    good = shutil.copytree(champion, root / "good")
    wrong = SinglePassRanker.load(champion)
    wrong.head.readout.weight.data.neg_()
    wrong.head.readout.bias.data.neg_()
    wrong.save(root / "wrong")
    shutil.copy(champion / "calibration.json", root / "wrong") if (champion / "calibration.json").exists() else None
    slow = build(root / "slow", small_splits, model=BIG, steps=1)
    crash = shutil.copytree(champion, root / "crash")
    (crash / "head.safetensors").write_bytes(b"not a safetensors file")
    other = build(root / "other", small_splits, seed=1)
    return {"champion": champion, "good": good, "wrong": root / "wrong", "slow": slow, "crash": crash, "other": other}


@pytest.fixture(scope="module")
def registry(tmp_path_factory, fleet):
    """A real sqlite MLflow registry: `fleet` versions 1 champion, 2 crash, 3 slow, 4 wrong, 5 good; @champion and
    @challenger both on 1 (so no rollout runs until the challenger alias moves)."""
    import mlflow

    from pipelines.registry import log_student, promote

    tmp = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=mlflow.create_experiment("fleet", (tmp / "artifacts").as_uri()))
    versions = {}
    for label in ("champion", "crash", "slow", "wrong", "good"):
        with mlflow.start_run():
            versions[label] = log_student(fleet[label], "fleet").rsplit("/", 1)[1]
    promote("fleet", versions["champion"], "champion")
    promote("fleet", versions["champion"], "challenger")
    return uri, versions, tmp


def post(prefix, timeout=60, headers=None, **body):
    return requests.post(f"{ROOT}{prefix}/v1/rerank", json=body, timeout=timeout, headers=headers)


@pytest.fixture(scope="module")
def many(ray_local, fleet, registry, tmp_path_factory):
    """One app: main (models:/fleet@champion, the default), challenger (models:/fleet@challenger), other and slow
    (folders); Students on 2 replicas holding at most 2 students each; a canary of the challenger (no shadow phase)."""
    from ray import serve

    from serve.common import AppArgs, start_serve
    from serve.students import students_app

    uri, _, tmp = registry
    start_serve({"host": "127.0.0.1", "port": SERVE_PORT})
    args = {"students": {"main": "models:/fleet@champion", "challenger": "models:/fleet@challenger",
                         "other": str(fleet["other"]), "slow": str(fleet["slow"])},
            "default_student": "main", "tracking_uri": uri, "alias_poll_s": 0.5, "max_models_per_replica": 2,
            "threads": 1, "max_documents": 12,
            "rollout": {"canary": {"model": "challenger", "share": 0.3, "step_share": 0.3, "max_share": 0.6},
                        "guards": {"min_requests": 16, "max_error_rate": 0.05, "max_p50_ratio": 2.0, "p50_slack_ms": 10,
                                   "min_agreement": 0.5},
                        "interval_s": 1.0, "report_s": 0.25, "log_path": str(tmp / "rollout.jsonl")},
            "traffic_log": {"path": str(tmp / "traffic"), "flush_records": 8, "flush_seconds": 0.5}}
    two = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}}
    serve.run(students_app(AppArgs(**args), students_options=two), name="many", route_prefix="/many")
    yield args
    serve.delete("many")


def test_a_request_is_answered_by_the_student_it_names(many, fleet, registry):
    _, versions, _ = registry
    default = post("/many", query="red boots", documents=DOCS[:5])
    assert default.status_code == 200, default.text
    assert default.json()["model"] == "main"
    assert default.json()["meta"]["model_version"] == f"models:/fleet/{versions['champion']}"  # the alias, pinned
    other = post("/many", model="other", query="red boots", documents=DOCS[:5], top_n=2, return_documents=True,
                 first_stage_order=True)
    assert other.status_code == 200, other.text
    out = other.json()
    assert out["meta"]["first_stage_order"] is True and default.json()["meta"]["first_stage_order"] is False  # routed on
    assert out["model"] == "other" and out["meta"]["model_version"].startswith(str(fleet["other"]))
    expected = [d.index for d in Reranker.load(fleet["other"]).rank("red boots", DOCS[:5], top_k=2, first_stage_order=True)]
    assert [r["index"] for r in out["results"]] == expected and len(out["results"]) == 2
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in out["results"])
    by_version = post("/many", model=f"fleet/{versions['wrong']}", query="red boots", documents=DOCS[:5]).json()
    assert by_version["meta"]["model_version"] == f"models:/fleet/{versions['wrong']}"
    wrong = [d.index for d in Reranker.load(fleet["wrong"]).rank("red boots", DOCS[:5])]
    assert [r["index"] for r in by_version["results"]] == wrong
    assert post("/many", model="fleet@champion", query="x", documents=["a", "b"]).json()["meta"]["model_version"] == \
        default.json()["meta"]["model_version"]


def test_unknown_model_is_a_404_naming_what_is_served_and_models_lists_them(many):
    r = post("/many", model="nope", query="red boots", documents=DOCS[:3])
    assert r.status_code == 404
    body = r.json()
    assert "nope" in body["message"] and body["detail"] == body["message"]
    assert {"main", "challenger", "other", "slow", "fleet@<alias>"} <= set(body["known_models"])
    assert post("/many", model="elsewhere@champion", query="x", documents=["a"]).status_code == 404
    listed = requests.get(f"{ROOT}/many/v1/models", timeout=30).json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["main", "challenger", "other", "slow"]
    assert listed["data"][0]["role"] == "default" and listed["data"][0]["model_version"].startswith("models:/fleet/")
    card = requests.get(f"{ROOT}/many/v1/models/other", timeout=60).json()
    assert card["id"] == "other" and card["positions"] == 8 and card["card"]
    assert requests.get(f"{ROOT}/many/v1/models/nope", timeout=30).status_code == 404
    assert post("/many", query="x", documents=["a"] * 13).status_code == 422  # the schema's limits still hold


@pytest.fixture(scope="module")
def plain(ray_local, fleet):
    """A many-student app without a rollout (two folders), for the fuzz: its traffic touches no other test's rollout."""
    from ray import serve

    from serve.common import AppArgs, start_serve
    from serve.students import students_app

    start_serve({"host": "127.0.0.1", "port": SERVE_PORT})
    args = {"students": {"main": str(fleet["champion"]), "other": str(fleet["other"])}, "threads": 1, "max_documents": 12}
    light = {"ray_actor_options": {"num_cpus": 0.25}}  # beside the module's other apps in the session's 4 CPUs
    serve.run(students_app(AppArgs(**args), students_options=light), name="plain", route_prefix="/plain")
    yield args
    serve.delete("plain")


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_to_the_many_student_app_conform_to_its_openapi(plain, mode):
    """The one-student app's conformance fuzz (tests/openapi_fuzz.py) on the many-student app: every status and body as
    its OpenAPI documents, path parameters included (a model id its path pattern does not match once got the framework's
    bare `{"detail": "Not Found"}` instead of the documented 404)."""
    statuses = fuzz(f"{ROOT}/plain", mode, seed=0, examples=FUZZ_EXAMPLES)
    operations = statuses.pop("operations")
    assert operations == 7  # three rerank routes, /healthz, /v1/models, /v1/models/{name}, /v1/rollout
    assert statuses[200] > 0 if mode == "positive" else all(400 <= code < 500 for code in statuses)
    assert sum(statuses.values()) >= 3 * FUZZ_EXAMPLES


def test_every_4xx_of_the_many_student_app_has_its_documented_shape(plain):
    """Routes no path matches, methods a route does not take, a wrong model: each 4xx says what and why."""
    nowhere = requests.get(f"{ROOT}/plain/v2/models", timeout=30)  # a path no route takes: the framework's 404
    assert nowhere.status_code == 404 and set(nowhere.json()) == {"message", "detail", "known_models"}
    message = nowhere.json()["message"]
    assert {"main", "other"} <= set(nowhere.json()["known_models"]) and "GET " in message and "/v2/models" in message
    wrong_method = requests.get(f"{ROOT}/plain/v1/rerank", timeout=30)
    assert wrong_method.status_code == 405 and "GET" in wrong_method.json()["detail"]
    unknown = post("/plain", model="nope", query="x", documents=["a", "b"])
    assert unknown.status_code == 404 and "nope" in unknown.json()["message"]


def test_students_are_multiplexed_lru_evicted_and_batches_never_mix_models(many, fleet, registry):
    """5 students on 2 replicas of at most 2: Serve routes each id to a replica holding it; a third id on a full
    replica evicts its least recently used one. Concurrent requests for two students: each gets its own ranking."""
    from ray import serve

    _, versions, _ = registry
    handle = serve.get_deployment_handle("Students", "many")
    for name in ("other", "slow", "main", f"fleet/{versions['wrong']}", f"fleet/{versions['good']}", "other"):
        assert post("/many", model=name, query="boots", documents=DOCS[:4]).status_code == 200
    replicas = {h["replica"]: h for h in (handle.held.remote().result() for _ in range(12))}
    every = list(replicas.values())
    assert len(every) == 2 and all(len(h["models"]) <= 2 for h in every), every
    loads = [x for h in every for x in h["loads"]]
    assert len(loads) >= 5 and all(x["seconds"] > 0 for x in loads), loads  # 5 students, each loaded somewhere
    assert any({x["model"] for x in h["loads"]} - set(h["models"]) for h in every), every  # evicted (LRU)
    expected = {m: [d.index for d in Reranker.load(fleet[m]).rank(q, DOCS)] for m, q in
                (("other", "red boots"), ("champion", "blue shirt"))}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(post, "/many", model=m if m == "other" else "main", query=q, documents=DOCS)
                for m, q in (("other", "red boots"), ("champion", "blue shirt")) for _ in range(8)]
        outs = [j.result().json() for j in jobs]
    for out in outs:
        key = "other" if out["model"] == "other" else "champion"
        assert [r["index"] for r in out["results"]] == expected[key]
    assert max(o["meta"]["batch_size"] for o in outs) > 1  # requests did share forward passes ...
    # ... and each answer is its own model's, so no batch mixed them (Answerer.score: one pass per model)


def test_each_guard_rolls_a_canary_back_and_a_good_one_is_promoted_with_no_failed_request(many, registry, fleet):
    """Under closed-loop load: the challenger alias moves to a crashing, a slow and a wrong candidate (each rolled back
    by its guard) and then to a good one (stepped 0.3 -> 0.6, then promoted: @champion moved in the registry)."""
    import mlflow

    from hllm.serving.rollout import read_decisions, status_table
    from pipelines import cli
    from pipelines.registry import pin, promote
    from serve.faults import rollout_under_load

    uri, versions, tmp = registry
    mlflow.set_tracking_uri(uri)

    def move(version):
        promote("fleet", version, "challenger")
        return f"models:/fleet/{version}"

    bodies = in_vocabulary_bodies(60)
    result = rollout_under_load(f"{ROOT}/many", bodies, [(k, versions[k]) for k in ("crash", "slow", "wrong", "good")],
                                move, clients=3, timeout_s=150)
    summary = result.summary()
    print("rollout drill:", summary)
    outcomes = {o["label"]: o for o in result.outcomes}
    assert result.failed == 0 and result.requests >= 100, summary
    assert outcomes["crash"]["action"] == "rollback" and "error rate 1/1" in outcomes["crash"]["reason"], outcomes
    assert outcomes["slow"]["action"] == "rollback" and "p50" in outcomes["slow"]["reason"], outcomes
    assert outcomes["wrong"]["action"] == "rollback" and "agreement" in outcomes["wrong"]["reason"], outcomes
    assert outcomes["good"]["action"] == "promote", outcomes
    assert pin("models:/fleet@champion") == f"models:/fleet/{versions['good']}"  # the alias moved
    assert result.by_arm.get("candidate", 0) > 0  # the crash was rolled back at its warm-up: no user was sent to it
    # after the promotion the default answers from the new champion, once the router re-pins its alias: every
    # alias_poll_s (0.5 s here; the baseline run of 2026-12-07 asked at once and, on a loaded machine, got the old pin)
    deadline = time.monotonic() + 10
    while True:
        after = post("/many", query="red boots", documents=DOCS).json()
        if after["meta"]["model_version"] == f"models:/fleet/{versions['good']}" or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert after["meta"]["model_version"] == f"models:/fleet/{versions['good']}"
    rows = read_decisions(tmp / "rollout.jsonl")
    actions = [(r.version.rsplit("/", 1)[1], r.action) for r in rows]
    assert (versions["good"], "step") in actions and (versions["good"], "promote") in actions
    assert [a for v, a in actions if v == versions["crash"]] == ["start", "rollback"]
    assert "promote" in status_table(rows)
    assert cli.main(["rollout", "status", "--log", str(tmp / "rollout.jsonl")]) == 0


def test_the_traffic_log_and_prometheus_are_labelled_by_model_version(many, registry, ray_local):
    import re
    import time

    from hllm.data.traffic import log_files, read_log

    _, versions, tmp = registry
    for _ in range(3):
        assert post("/many", model="other", query="red boots", documents=DOCS).status_code == 200
    deadline = time.time() + 60
    rows = []
    while time.time() < deadline and not any(r["model"].startswith("/") for r in rows):
        time.sleep(1)
        rows = read_log(log_files(tmp / "traffic"))
    models = {r["model"] for r in rows}
    assert any(m.startswith("models:/fleet/") for m in models) and any(m.startswith("/") for m in models), models
    canary = [r for r in rows if r["arm"] == "candidate" and r["shadow_order"]]
    assert canary and all(r["shadow_kendall_tau"] is not None for r in canary)  # the champion ranked beside the canary
    port = ray_local.nodes()[0]["MetricsExportPort"]
    deadline, found = time.time() + 90, set()
    while time.time() < deadline and not ("decisions" in found and any(m.startswith("models:/") for m in found)):
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for line in re.findall(r'^ray_hllm_routed_requests(?:_total)?\{([^}]*)\}', text, flags=re.M):
            found |= set(re.findall(r'model="([^"]+)"', line))
        found |= {"decisions"} if re.search(r'^ray_hllm_rollout_decisions(?:_total)?\{[^}]*action="promote"', text,
                                           flags=re.M) else set()
        time.sleep(2)
    assert "decisions" in found and any(m.startswith("models:/fleet/") for m in found), \
        (found, [line for line in text.splitlines() if "rollout" in line][:10])


@pytest.fixture
def shadowed(ray_local, fleet, tmp_path):
    """A shadow-only app factory (folders, no registry): the candidate is ranked beside every answer."""
    from ray import serve

    from serve.app import app_builder
    from serve.common import start_serve

    start_serve({"host": "127.0.0.1", "port": SERVE_PORT})  # the session's Serve (a no-op once started)
    def run(candidate, min_requests=8, **shadow):
        args = {"students": {"main": str(fleet["champion"]), "candidate": str(fleet[candidate])}, "threads": 1,
                "rollout": {"shadow": {"model": "candidate", **shadow}, "interval_s": 0.5, "report_s": 0.25,
                            "guards": {"min_requests": min_requests}, "log_path": str(tmp_path / "rollout.jsonl")},
                "traffic_log": {"path": str(tmp_path / "traffic"), "flush_records": 4, "flush_seconds": 0.5}}
        serve.run(app_builder(args), name="shadowed", route_prefix="/shadowed")
        return tmp_path

    yield run
    serve.delete("shadowed")


def rollout_status(until, timeout_s=60):
    import time

    deadline, status = time.time() + timeout_s, {}
    while time.time() < deadline:
        status = requests.get(f"{ROOT}/shadowed/v1/rollout", timeout=30).json()
        if until(status):
            break
        time.sleep(0.25)
    return status


def rolled_back(status):
    return any(d["action"] == "rollback" for d in status["decisions"])


def test_a_shadow_that_cannot_load_is_rolled_back_at_its_warm_up_and_the_primary_never_notices(shadowed, fleet):
    shadowed("crash", queue=16)
    outs = [post("/shadowed", query=q, documents=DOCS) for q in QUERIES[:10]]
    status = rollout_status(rolled_back)
    outs += [post("/shadowed", query=q, documents=DOCS) for q in QUERIES[10:20]]
    assert all(o.status_code == 200 for o in outs), [o.text for o in outs if o.status_code != 200][:2]
    champion = Reranker.load(fleet["champion"])
    assert [r["index"] for r in outs[0].json()["results"]] == [d.index for d in champion.rank(QUERIES[0], DOCS)]
    (rollback,) = [d for d in status["decisions"] if d["action"] == "rollback"]
    assert rollback["reason"].startswith("error rate 1/1") and rollback["window"]["pairs"] == 0  # never shadowed


def test_failed_shadow_calls_are_counted_logged_and_roll_the_candidate_back(shadowed, fleet):
    """Every shadow call runs past its timeout (1 ms): each is the candidate's error, in the traffic log with its
    reason, until the error-rate guard rolls it back; every primary request is answered, by the champion."""
    import time

    from hllm.data.traffic import log_files, read_log

    tmp = shadowed("other", queue=16, timeout_s=0.001)
    rollout_status(lambda s: s["state"] and s["state"]["phase"] == "shadow")
    outs = [post("/shadowed", query=q, documents=DOCS) for q in QUERIES[:20]]
    assert all(o.status_code == 200 for o in outs), [o.text for o in outs if o.status_code != 200][:2]
    status = rollout_status(rolled_back)
    (rollback,) = [d for d in status["decisions"] if d["action"] == "rollback"]
    assert rollback["reason"].startswith("error rate") and rollback["window"]["candidate_errors"] >= 1, rollback
    deadline, rows = time.time() + 30, []
    while time.time() < deadline and not any(r["shadow_error"] for r in rows):
        time.sleep(0.5)
        rows = read_log(log_files(tmp / "traffic"))
    errors = [r for r in rows if r["shadow_error"]]
    assert errors and {r["shadow_error"] for r in errors} == {"timeout"} and all(not r["shadow_order"] for r in errors)
    assert {r["model"] for r in rows} == {outs[0].json()["meta"]["model_version"]}  # the champion answered them all


def test_a_slow_shadow_drops_what_it_cannot_keep_up_with_and_the_primary_is_never_failed(shadowed, fleet):
    """The shadow (an 8-layer, 512-wide model, ~20x the champion's time) cannot keep up with sequential requests: its
    queue of 2 fills and drops (counted), never waits; every primary request is answered. (What the shadow costs the
    primary on 2 shared cores is measured in benchmarks/rollout.py, not asserted here.)"""
    import time

    shadowed("slow", min_requests=10**6, queue=2, workers=1)  # never judged: the shadow runs all along
    rollout_status(lambda s: s["state"] and s["state"]["phase"] == "shadow")
    t, codes = [], []
    for q in QUERIES * 2:
        t0 = time.perf_counter()
        codes.append(post("/shadowed", query=q, documents=DOCS).status_code)
        t.append(1000 * (time.perf_counter() - t0))
    status = requests.get(f"{ROOT}/shadowed/v1/rollout", timeout=30).json()
    assert all(c == 200 for c in codes)
    assert status["state"]["phase"] == "shadow" and status["dropped_here"] > 0, status
    print(f"primary p50 with a slow shadow: {np.median(t):.1f} ms over {len(t)} requests; "
          f"{status['dropped_here']} shadow pairs dropped")
