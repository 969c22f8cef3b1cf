"""The Ray Serve app on a local Ray: schema, ordering, validity, batching equality, bad input, auth."""

import collections
import concurrent.futures

import numpy as np
import pytest
import requests

from hllm import Reranker
from hllm.model.heads import HeadConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.job.stages import calibrate_student
from hllm.train.loop import LossConfig, TrainConfig, train_student

from conftest import SERVE_PORT, TINY, graded_examples
from openapi_fuzz import fuzz

pytestmark = pytest.mark.slow
PORT = SERVE_PORT
URL = f"http://127.0.0.1:{PORT}"
DOCS = ["acme red leather boots", "zenith blue cotton shirt", "acme red wool boots pairs with scarf",
        "kairo green canvas backpack", "nordic red leather boots"]


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory, small_splits):
    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(lora_r=2, lora_alpha=4),
                                                 head=HeadConfig(positions=8, width=32, num_heads=2)))
    train_student(ranker, graded_examples(ranker, small_splits["train"]),
                  TrainConfig(steps=3, batch_size=4, warmup_steps=1), LossConfig({"graded_ce": 1.0}))
    path = tmp_path_factory.mktemp("student")
    ranker.save(path)
    calibrate_student(path, small_splits["val"] + small_splits["test"], rel=1)  # as the job does, on held-out slates
    return path


@pytest.fixture(scope="module")
def app(ray_local, student_dir):
    from ray import serve

    from serve.app import app_builder
    from serve.common import start_serve

    start_serve({"host": "127.0.0.1", "port": PORT})
    serve.run(app_builder({"model": str(student_dir), "max_documents": 10, "max_body_bytes": 20_000}),
              name="hllm", route_prefix="/")
    yield
    serve.delete("hllm")


FUZZ_EXAMPLES = 60  # per operation and mode: bounded, and only ever sent to the loopback app


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_conform_to_the_openapi(app, mode, seed):
    """Cases generated from the served OpenAPI document (valid, and deliberately invalid), every response checked by
    schemathesis (tests/openapi_fuzz.py). Two seeds: one seed once missed a status the schema did not allow (413 for
    more documents than maxItems, now 422)."""
    statuses = fuzz(URL, mode, seed, FUZZ_EXAMPLES)  # e.g. positive {200: 71, 422: 6}, negative {400: 9, 422: 66}
    operations = statuses.pop("operations")
    assert statuses[200] > 0 if mode == "positive" else all(400 <= code < 500 for code in statuses)
    assert operations >= 5 and sum(statuses.values()) >= 3 * FUZZ_EXAMPLES  # every rerank route got its cases


def post(path="/v1/rerank", **body):
    return requests.post(URL + path, json=body, timeout=60)


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank", "/rerank"])
def test_schema_and_order(app, path, student_dir):
    r = post(path, query="red leather boots", documents=DOCS, top_n=3, return_documents=True)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"id", "model", "usage", "results", "meta"}
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > 0
    assert [res["rank"] for res in out["results"]] == [1, 2, 3]
    scores = [res["relevance_score"] for res in out["results"]]
    assert scores == sorted(scores, reverse=True)
    assert all(res["document"]["text"] == DOCS[res["index"]] for res in out["results"])
    assert out["meta"]["decoder"] == "hungarian"
    # the same ranking as the library gives for this request
    expected = Reranker.load(student_dir).rank("red leather boots", DOCS, top_k=3)  # as the app loads it
    assert [res["index"] for res in out["results"]] == [d.index for d in expected]


def test_full_ranking_is_a_valid_permutation_and_documents_may_be_objects(app):
    out = post(query="boots", documents=[{"text": d} for d in DOCS], decoder="sort").json()
    assert sorted(res["index"] for res in out["results"]) == list(range(len(DOCS)))
    assert "document" not in out["results"][0] and out["meta"]["decoder"] == "sort"


def test_batched_equals_unbatched(app):
    queries = ["red boots", "blue shirt", "green backpack", "wool scarf", "leather", "acme", "nordic", "canvas"]
    alone = [post(query=q, documents=DOCS).json() for q in queries]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda q: post(query=q, documents=DOCS).json(), queries))
    assert max(t["meta"]["batch_size"] for t in together) > 1  # they did share forward passes
    for a, t in zip(alone, together):
        assert [r["index"] for r in a["results"]] == [r["index"] for r in t["results"]]
        np.testing.assert_allclose([r["relevance_score"] for r in a["results"]],
                                   [r["relevance_score"] for r in t["results"]], atol=1e-6)


@pytest.mark.parametrize("body,status,needle", [
    ({"query": "x", "documents": []}, 422, "at least 1"),
    ({"query": "", "documents": ["a"]}, 422, "at least 1 character"),
    ({"query": "x", "documents": "not a list"}, 422, "list"),
    ({"query": "x", "documents": [1, 2]}, 422, "documents"),
    ({"query": "x", "documents": ["a"], "return_documents": 0}, 422, "valid boolean"),
    ({"query": "x", "documents": ["a"], "top_n": "1"}, 422, "valid integer"),
    ({"query": "x", "documents": ["a"], "max_tokens_per_doc": 0}, 422, "greater than or equal to 1"),
    ({"query": "x", "documents": ["a"], "top_n": 0}, 422, "greater than or equal to 1"),
    ({"documents": ["a"]}, 422, "query"),
    ({"query": "x", "documents": ["a"] * 11}, 422, "limit of 10"),
    ({"query": "x", "documents": ["a"], "decoder": "magic"}, 422, "decoder"),
])
def test_bad_input_is_a_4xx_with_a_message(app, body, status, needle):
    r = requests.post(URL + "/v1/rerank", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert needle in r.text


def test_relevance_score_is_calibrated_unless_raw_scores(app, student_dir):
    out = post(query="red leather boots", documents=DOCS).json()
    scores = [r["relevance_score"] for r in out["results"]]
    assert out["meta"]["calibrated"] and all(0 <= p <= 1 for p in scores) and scores == sorted(scores, reverse=True)
    library = Reranker.load(student_dir).rank("red leather boots", DOCS)
    np.testing.assert_allclose(scores, [d.relevance for d in library], atol=1e-6)
    raw = post(query="red leather boots", documents=DOCS, raw_scores=True).json()
    assert not raw["meta"]["calibrated"] and [r["index"] for r in raw["results"]] == [r["index"] for r in out["results"]]
    np.testing.assert_allclose([r["relevance_score"] for r in raw["results"]], [d.score for d in library], atol=1e-6)
    (card,) = requests.get(URL + "/v1/models", timeout=30).json()["data"]
    assert card["relevance_score"].startswith("calibrated P(relevant)") and card["calibration"]["items"] > 0


def test_cohere_semantics_top_n_above_n_and_max_tokens_per_doc(app):
    out = post(query="boots", documents=DOCS[:2], top_n=5).json()
    assert sorted(r["index"] for r in out["results"]) == [0, 1]  # all documents, as Cohere and vLLM
    whole = post(query="boots", documents=DOCS).json()["usage"]
    cut = post(query="boots", documents=DOCS, max_tokens_per_doc=2).json()["usage"]
    assert whole["truncated_documents"] == 0 and cut["truncated_documents"] == len(DOCS)
    assert cut["prompt_tokens"] < whole["prompt_tokens"]


def test_every_status_is_in_the_openapi_with_an_example(app):
    spec = requests.get(URL + "/openapi.json", timeout=30).json()
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "413", "422"} <= set(responses), path
        for status in ("400", "401", "413", "422"):
            assert responses[status]["content"]["application/json"]["example"]["detail"], (path, status)


def test_models_card_and_unknown_words_are_said(app, student_dir):
    (card,) = requests.get(URL + "/v1/models", timeout=30).json()["data"]
    assert card["positions"] == 8 and card["max_documents"] == 10 and card["base_model"] == "tiny"
    assert "unknown" in card["training_data"]  # saved by a test, without the job's model card
    known = post(query="red leather boots", documents=DOCS).json()["meta"]
    assert known["unknown_token_share"] == 0.0 and known["warnings"] == []
    foreign = post(query="quantum chromodynamics", documents=["gluon confinement lattice", "red boots"]).json()["meta"]
    assert foreign["unknown_token_share"] > 0.5 and "unknown to this model's vocabulary" in foreign["warnings"][0]


def test_body_limit_and_malformed_json(app):
    r = requests.post(URL + "/v1/rerank", data="x" * 30_000, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and "exceeds the limit" in r.text
    r = requests.post(URL + "/v1/rerank", data="{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 422


def test_a_path_or_method_no_route_takes_is_a_4xx_in_the_documented_shape(app):
    nowhere = requests.get(URL + "/v9/nothing", timeout=30)
    assert nowhere.status_code == 404 and nowhere.json() == {"detail": "Not Found: GET /v9/nothing"}
    wrong_method = requests.get(URL + "/v1/rerank", timeout=30)
    assert wrong_method.status_code == 405 and set(wrong_method.json()) == {"detail"}


def test_health_models_and_openapi(app):
    assert requests.get(URL + "/healthz", timeout=30).json() == {"status": "ok"}
    models = requests.get(URL + "/v1/models", timeout=30).json()
    assert models["data"][0]["max_documents"] == 10
    spec = requests.get(URL + "/openapi.json", timeout=30).json()
    assert "/v1/rerank" in spec["paths"] and requests.get(URL + "/docs", timeout=30).status_code == 200


def test_requests_reach_the_replica_through_haproxy_not_the_python_proxy(app):
    """The thin ingress (serve.common.THIN_INGRESS) is what serves: an HAProxy process listens on the
    port, and the replica's own HTTP server (direct ingress) answers on a port of its own."""
    import psutil

    listening = {c.laddr.port: c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid}
    assert psutil.Process(listening[PORT]).name() == "haproxy"
    replica_ports = [port for port in listening if 30000 <= port <= 31000]
    assert replica_ports
    direct = requests.get(f"http://127.0.0.1:{replica_ports[0]}/healthz", timeout=30)
    assert direct.json() == {"status": "ok"}


def test_bearer_auth_both_ways(app, student_dir):
    from ray import serve

    from serve.app import RerankDeployment
    from serve.common import AppArgs

    secure = RerankDeployment.options(ray_actor_options={"num_cpus": 0.5, "runtime_env": {"env_vars": {"HLLM_API_TOKEN": "s3cret"}}})
    serve.run(secure.bind(AppArgs(model=str(student_dir)).model_dump()), name="secure", route_prefix="/secure")
    try:
        body = {"query": "boots", "documents": DOCS}
        assert requests.post(URL + "/secure/v1/rerank", json=body, timeout=60).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert requests.post(URL + "/secure/v1/rerank", json=body, headers=wrong, timeout=60).status_code == 401
        right = {"Authorization": "Bearer s3cret"}
        assert requests.post(URL + "/secure/v1/rerank", json=body, headers=right, timeout=60).status_code == 200
        assert requests.get(URL + "/secure/healthz", timeout=60).status_code == 200  # probes need no token
        assert post(query="boots", documents=DOCS).status_code == 200  # the open app stays open
    finally:
        serve.delete("secure")


def test_long_lists_are_ranked_in_windows(app, student_dir):
    from ray import serve

    from serve.app import RerankDeployment
    from serve.common import AppArgs

    windowed = RerankDeployment.options(name="Windowed", ray_actor_options={"num_cpus": 0.5})
    serve.run(windowed.bind(AppArgs(model=str(student_dir), window=4, stride=2, max_documents=40,
                                    max_batch_tokens=8).model_dump()),  # each forward pass a prompt: the same order
              name="windowed", route_prefix="/windowed")
    try:
        docs = [f"{d} {i}" for i in range(6) for d in DOCS]  # 30 documents, window 4
        out = requests.post(URL + "/windowed/v1/rerank", json={"query": "red boots", "documents": docs}, timeout=60).json()
        order = [r["index"] for r in out["results"]]
        assert sorted(order) == list(range(30)) and out["meta"]["windows"] == (30 - 4) // 2 + 1
        scores = [r["relevance_score"] for r in out["results"]]
        assert scores == sorted(scores, reverse=True) and out["usage"]["prompt_tokens"] > 0
        library = Reranker.load(student_dir, window=4, stride=2).rank("red boots", docs)
        assert order == [r.index for r in library]
        short = requests.post(URL + "/windowed/v1/rerank", json={"query": "red boots", "documents": DOCS[:4]}, timeout=60).json()
        assert short["meta"]["windows"] == 1 and short["meta"]["batch_size"] >= 1
    finally:
        serve.delete("windowed")


def test_a_request_the_domain_guard_distrusts_keeps_the_input_order_and_says_so(app, tmp_path):
    import torch
    from ray import serve

    from serve.app import RerankDeployment
    from serve.common import AppArgs

    ranker = SinglePassRanker.build(RankerConfig(model=TINY, adapt=AdaptConfig(mode="frozen"), head=HeadConfig(
        kind="utility", positions=8, prior="logrank", guard="distance", guard_rank=4)))
    with torch.no_grad():
        torch.manual_seed(0)
        ranker.head.residual.net.weight.normal_(0, 10.0)  # a head with its own (random) order
        ranker.head.guard.low.fill_(-2.0)
        ranker.head.guard.high.fill_(-1.0)  # every distance (>= 0) beyond it: trust 0
    ranker.save(tmp_path / "guarded")
    library = Reranker.load(tmp_path / "guarded")
    with library.model.head.guard.suspended():
        assert [r.index for r in library.rank("red boots", DOCS, first_stage_order=True)] != list(range(len(DOCS)))  # unguarded: reorders
    assert [r.index for r in library.rank("red boots", DOCS, first_stage_order=True)] == list(range(len(DOCS)))
    own = [r.index for r in library.rank("red boots", DOCS)]  # undeclared: no order to fall back to, no prior
    assert own != list(range(len(DOCS)))
    guarded = RerankDeployment.options(name="Guarded", ray_actor_options={"num_cpus": 0.5})
    serve.run(guarded.bind(AppArgs(model=str(tmp_path / "guarded")).model_dump()), name="guarded", route_prefix="/guarded")
    try:
        for path in ("/v1/rerank", "/v2/rerank", "/rerank"):  # the declared order round-trips through every route
            out = requests.post(URL + "/guarded" + path, json={"query": "red boots", "documents": DOCS, "first_stage_order": True},
                                timeout=60).json()
            assert [r["index"] for r in out["results"]] == list(range(len(DOCS))) and out["meta"]["first_stage_order"] is True
            assert out["meta"]["trust"] == 0.0 and any("domain guard trust 0.00" in w for w in out["meta"]["warnings"])
            assert out["meta"]["confidence"]["trust"] == 0.0 and out["meta"]["confidence"]["agreement"] == 1.0  # the input order
            free = requests.post(URL + "/guarded" + path, json={"query": "red boots", "documents": DOCS}, timeout=60).json()
            assert [r["index"] for r in free["results"]] == own and free["meta"]["first_stage_order"] is False
            assert free["meta"]["trust"] == 0.0 and free["meta"]["confidence"]["agreement"] is None
            assert any("no first-stage order was declared" in w for w in free["meta"]["warnings"])
            # a set: the same documents reversed get the same answer, document for document
            back = requests.post(URL + "/guarded" + path, json={"query": "red boots", "documents": DOCS[::-1]}, timeout=60).json()
            assert [DOCS[::-1][r["index"]] for r in back["results"]] == [DOCS[i] for i in own]
            assert [r["relevance_score"] for r in back["results"]] == [r["relevance_score"] for r in free["results"]]
            assert back["meta"]["confidence"] == free["meta"]["confidence"]
        bad = requests.post(URL + "/guarded/v1/rerank", json={"query": "q", "documents": DOCS, "first_stage_order": "yes"}, timeout=60)
        assert bad.status_code == 422 and "first_stage_order" in bad.text
    finally:
        serve.delete("guarded")
    plain = requests.post(URL + "/v1/rerank", json={"query": "red boots", "documents": DOCS}, timeout=60).json()
    assert "trust" not in plain["meta"]  # a model without a guard says nothing of it
    # the single pass's confidence, read off the same matrix (hllm.model.confidence): no guard, trust 1
    assert set(plain["meta"]["confidence"]) == {"margin", "sharpness", "agreement", "trust"}
    assert plain["meta"]["confidence"]["agreement"] is None  # undeclared: no first-stage order to agree with
    assert plain["meta"]["confidence"]["trust"] == 1.0 and plain["meta"]["confidence"]["margin"] >= 0


def test_registry_round_trip_register_promote_serve(app, student_dir, tmp_path):
    import mlflow
    from ray import serve

    from pipelines.registry import log_student, promote
    from serve.app import RerankDeployment
    from serve.common import AppArgs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=mlflow.create_experiment("t", (tmp_path / "artifacts").as_uri()))
    with mlflow.start_run():
        assert log_student(student_dir, "served-student", alias="candidate") == "models:/served-student/1"
    promote("served-student", 1, "champion")  # promotion: one call
    served = RerankDeployment.options(name="Registry", ray_actor_options={"num_cpus": 0.5})
    serve.run(served.bind(AppArgs(model="models:/served-student@champion", tracking_uri=uri).model_dump()),
              name="registry", route_prefix="/registry")
    try:
        out = requests.post(URL + "/registry/v1/rerank", json={"query": "red boots", "documents": DOCS}, timeout=60)
        assert out.status_code == 200, out.text
        expected = [d.index for d in Reranker.load(student_dir).rank("red boots", DOCS)]
        assert [r["index"] for r in out.json()["results"]] == expected
    finally:
        serve.delete("registry")


def test_request_figures_reach_prometheus_through_ray_metrics(app, ray_local):
    import re
    import time

    for _ in range(3):
        assert post(query="red boots", documents=DOCS).status_code == 200
    assert post(query="red boots", documents=["a"] * 11).status_code == 422
    port = ray_local.nodes()[0]["MetricsExportPort"]
    wanted = {"latency": r'^ray_hllm_request_latency_ms_count\{[^}]*application="hllm"[^}]*\} ([0-9.]+)',
              "documents": r'^ray_hllm_request_documents_bucket\{[^}]*application="hllm"[^}]*le="5.0"[^}]*\} ([0-9.]+)',
              "batch": r'^ray_hllm_forward_batch_size_count\{[^}]*application="hllm"[^}]*\} ([0-9.]+)',
              "tokens": r'^ray_hllm_request_prompt_tokens_sum\{[^}]*application="hllm"[^}]*\} ([0-9.]+)',
              "too_many": r'^ray_hllm_requests(?:_total)?\{[^}]*status="422"[^}]*\} ([0-9.]+)'}
    found: dict[str, float] = {}
    deadline = time.time() + 90  # Ray exports metrics every few seconds
    while time.time() < deadline and len(found) < len(wanted):
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for key, pattern in wanted.items():
            values = [float(v) for v in re.findall(pattern, text, flags=re.M)]
            if values:
                found[key] = sum(values)
        time.sleep(2)
    assert set(found) == set(wanted), f"missing from the Prometheus export: {set(wanted) - set(found)}"
    # (Ray's histogram sums are bucket-midpoint estimates: counts and buckets are what to check)
    assert found["latency"] >= 3 and found["documents"] >= 3 and found["too_many"] >= 1
    assert found["tokens"] > 0 and found["batch"] >= 3


def test_replica_killed_under_load_loses_at_most_one_percent_and_recovers(app, student_dir):
    from ray import serve

    from serve.app import RerankDeployment
    from serve.common import AppArgs
    from serve.faults import kill_replica_under_load

    two = RerankDeployment.options(num_replicas=2, ray_actor_options={"num_cpus": 0.5})
    serve.run(two.bind(AppArgs(model=str(student_dir), threads=1).model_dump()), name="drill", route_prefix="/drill")
    try:
        result = kill_replica_under_load(URL + "/drill/v1/rerank", {"query": "red boots", "documents": DOCS}, "drill",
                                         "Reranker", target_replicas=2, kill_after_s=3, duration_s=12)
        summary = result.summary()
        print("replica drill:", summary)
        assert summary["requests"] > 100, summary
        assert result.failure_rate <= 0.01, summary
        assert result.recovery_s is not None and result.recovery_s < 120, summary
        assert post("/drill/v1/rerank", query="boots", documents=DOCS).status_code == 200  # serving again
    finally:
        serve.delete("drill")


def test_start_serve_outlasts_a_proxy_wait_that_runs_out(app, monkeypatch):
    """serve.start's own 60 s wait for the proxies ran out on a busy machine (TimeoutError) while the
    controller was still starting them: start_serve starts again and waits for HEALTHY proxies."""
    from ray import serve

    from serve.common import start_serve

    real, calls = serve.start, []

    def slow_then_real(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise TimeoutError("HTTP proxies not available after 60s.")
        return real(**kwargs)

    monkeypatch.setattr(serve, "start", slow_then_real)
    start_serve({"host": "127.0.0.1", "port": PORT}, timeout_s=120)
    assert len(calls) == 2
    assert all(getattr(v, "value", v) == "HEALTHY" for v in serve.status().proxies.values())
    assert post(query="red boots", documents=DOCS).status_code == 200


def prometheus(ray_local, patterns: dict[str, str], want: dict[str, float], timeout_s: float = 90) -> dict[str, float]:
    """Sums of the Prometheus export's samples matching each pattern, polled until each reaches `want` (Ray exports
    metrics every few seconds) or the time runs out."""
    import re
    import time

    port = ray_local.nodes()[0]["MetricsExportPort"]
    deadline, found = time.time() + timeout_s, {}
    while time.time() < deadline:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        found = {k: sum(float(v) for v in re.findall(p, text, flags=re.M)) for k, p in patterns.items()}
        if all(found[k] >= want.get(k, 0) for k in patterns):
            break
        time.sleep(2)
    return found


def test_the_online_cascade_answers_with_the_teacher_in_time_and_never_fails_a_request(app, student_dir, ray_local,
                                                                                       teacher_server, fault_proxy, tmp_path):
    """Serve's cascade against a real served teacher (llama.cpp + SmolLM2, through the fault proxy): a teacher that
    answers, one that fails (the breaker opens, then closes on a trial), one too slow for the deadline (its late
    answers still reach the traffic log) — under concurrent requests: no failed request, and every count agrees
    between meta, the proxy and Prometheus."""
    import time

    from ray import serve
    from teacher_server import MODEL

    from hllm.data.traffic import read_log, scan
    from serve.app import RerankDeployment
    from serve.common import AppArgs

    def cascade(deadline_ms: float, breaker_failures: int) -> dict:
        return {"teacher": {"url": fault_proxy.url, "model": MODEL, "api_key_env": "HLLM_TEST_TEACHER_KEY", "timeout_s": 30,
                            "max_retries": 0}, "prompt": {"max_doc_tokens": 24}, "threshold": 1e9,  # every request escalates
                "deadline_ms": deadline_ms, "window": 4, "stride": 2, "breaker_failures": breaker_failures, "breaker_reset_s": 3}

    def deploy(name: str, **cfg) -> None:
        d = RerankDeployment.options(name=name, ray_actor_options={"num_cpus": 0.5})
        serve.run(d.bind(AppArgs(model=str(student_dir), cascade=cascade(**cfg), traffic_log={
            "path": str(tmp_path / name), "flush_records": 4, "flush_seconds": 0.5}).model_dump()), name=name, route_prefix=f"/{name}")

    def burst(name: str, n: int) -> list[dict]:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(lambda _: requests.post(f"{URL}/{name}/v1/rerank", timeout=120, json={
                "query": "red boots", "documents": DOCS}), range(n)))
        assert [r.status_code for r in replies] == [200] * n, [r.text for r in replies]  # never a failed request
        for r in replies:
            assert sorted(x["index"] for x in r.json()["results"]) == list(range(len(DOCS)))
        return [r.json() for r in replies]

    deploy("cascade", deadline_ms=60_000, breaker_failures=3)
    deploy("slow", deadline_ms=100, breaker_failures=100)
    try:
        # 1. the teacher answers: 4 at once, each its teacher's ranking (rank-derived scores, not calibrated)
        answered = burst("cascade", 4)
        for a in answered:
            assert a["meta"]["answered_by"] == "teacher" and a["meta"]["escalated"] and not a["meta"]["calibrated"]
            assert a["meta"]["timings_ms"]["teacher"] > 0 and a["results"][0]["relevance_score"] == 1.0
        assert len(fault_proxy.posts()) == 8  # two windows of 4 over 5 passages each
        # 2. the teacher fails: 6 at once meet 500s; past 3 failures in a row the breaker opens
        fault_proxy.faults.extend(["500"] * 6)
        before = len(fault_proxy.posts())
        failing = collections.Counter(a["meta"]["answered_by"] for a in burst("cascade", 6))
        fives = sum(f == "500" for _, f, _ in fault_proxy.posts()[before:])
        fault_proxy.faults.clear()
        assert set(failing) <= {"student_after_teacher_error", "student_breaker_open"}, failing
        assert failing["student_after_teacher_error"] == fives >= 3 and sum(failing.values()) == 6
        posts = len(fault_proxy.posts())
        shut = burst("cascade", 1)[0]["meta"]
        assert shut["answered_by"] == "student_breaker_open" and len(fault_proxy.posts()) == posts  # not asked
        time.sleep(3.5)
        assert burst("cascade", 1)[0]["meta"]["answered_by"] == "teacher"  # the trial answered: closed again
        # 3. too slow for a 100 ms deadline: the student's answer at once; the teacher's later, in the traffic log
        slow = burst("slow", 3)
        assert {a["meta"]["answered_by"] for a in slow} == {"student_after_teacher_timeout"}
        waits = [a["meta"]["timings_ms"]["teacher"] for a in slow]
        # the deadline (plus the event loop's turn), not the answer; asyncio runs a timer up to its clock resolution
        # early (a wait of 99.6 ms was seen), so the bound allows 1 ms under
        assert all(99 <= w < 1000 for w in waits), waits
        deadline, rows = time.time() + 120, []
        while time.time() < deadline and len(rows) < 3:
            time.sleep(1)
            rows = read_log(scan(tmp_path / "slow").files)
        assert len(rows) == 3 and {r["answered_by"] for r in rows} == {"student_after_teacher_timeout"}
        assert all(sorted(r["teacher_order"]) == list(range(len(DOCS))) for r in rows)  # the late answers, kept
        logged = read_log(scan(tmp_path / "cascade").files)
        assert collections.Counter(r["answered_by"] for r in logged)["teacher"] == 5
        assert all(r["teacher_order"] == r["order"] for r in logged if r["answered_by"] == "teacher")
        # 4. Prometheus counts what meta said
        def sample(metric: str, **tags) -> str:  # its samples with these tags, in any order
            return rf"^ray_{metric}(?:_total)?\{{" + "".join(f'(?=[^}}]*{k}="{v}")' for k, v in tags.items()) + r"[^}]*\} ([0-9.]+)"

        patterns = {"teacher": sample("hllm_cascade_requests", application="cascade", answered_by="teacher"),
                    "errors": sample("hllm_cascade_requests", application="cascade", answered_by="student_after_teacher_error"),
                    "open": sample("hllm_cascade_requests", application="cascade", answered_by="student_breaker_open"),
                    "http_5xx": sample("hllm_cascade_teacher_errors", application="cascade", reason="http_5xx"),
                    "opens": sample("hllm_cascade_breaker_opens", application="cascade"),
                    "misses": sample("hllm_cascade_deadline_misses", application="slow"),
                    "latency": sample("hllm_cascade_teacher_latency_ms_count", application="cascade")}
        want = {"teacher": 5, "errors": fives, "open": failing["student_breaker_open"] + 1, "http_5xx": fives, "opens": 1,
                "misses": 3, "latency": 5}
        found = prometheus(ray_local, patterns, want)
        assert found == {k: float(v) for k, v in want.items()}, (found, want)
    finally:
        serve.delete("cascade")
        serve.delete("slow")
