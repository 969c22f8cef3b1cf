"""Many students behind one endpoint, and a rollout under load, on loopback (serve/students.py; docs/rollout.md).

    python benchmarks/rollout.py --student runs/default/student [--requests 600]

One run, one machine, four things measured:
1. students behind one endpoint — the embedded champion (a registry alias), its challenger, the two shipped real-text
   students (`smollm2-trec-dl`, `smollm2-dl19-rankvicuna`, on a real DL19 query) — each answering its own `model`,
   and each one's cold load on a Students replica;
2. the routing cost: the same champion through the one-student app (HAProxy -> replica) and through the many-student
   app (HAProxy -> Router -> Students), sequential, interleaved;
3. the shadow's cost on the primary: sequential requests with every one shadowed vs none (ABAB phases);
4. a closed-loop load during which a wrong candidate (the champion's readout negated: rankings turned round) is
   canaried and rolled back by the agreement guard, then a good one canaried, stepped up and promoted (the registry
   alias moved) — every request counted.
Bounded: a fixed number of requests, each with a timeout, only to 127.0.0.1. Writes reports/rollout.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import requests

PORT = 8133
ROOT = f"http://127.0.0.1:{PORT}"


def bodies(count: int, n_docs: int = 20) -> list[dict]:
    from hllm.data.synthetic import SyntheticConfig, generate

    splits, _ = generate(SyntheticConfig(train_slates=1, val_slates=1, test_slates=count, slate_size=n_docs, seed=7))
    return [{"query": s.query.text, "documents": [c.text for c in s.candidates]} for s in splits["test"]]


def real_body(data: Path) -> dict | None:
    """A DL19 query and its BM25 top 20 (the shipped students' own domain), where ../shared/data is present."""
    from hllm.data.readers import read_beir

    folder = data / "trec-dl19-passage-bm25top100"
    if not folder.is_dir():
        return None
    slate = read_beir(folder, top_n=20)[0]
    return {"query": slate.query.text, "documents": [c.text for c in slate.candidates]}


def ready(root: str, timeout_s: float = 120) -> None:
    """Waits until the app at `root` answers (HAProxy learns a new route a moment after serve.run returns)."""
    deadline = time.time() + timeout_s
    while requests.get(root + "/healthz", timeout=10).status_code != 200:
        if time.time() > deadline:
            raise TimeoutError(f"{root} not serving after {timeout_s:.0f} s")
        time.sleep(0.25)


def wrong_student(champion: Path, out: Path) -> Path:
    from hllm.model.ranker import SinglePassRanker

    ranker = SinglePassRanker.load(champion)
    ranker.head.readout.weight.data.neg_()
    ranker.head.readout.bias.data.neg_()
    ranker.save(out)
    for extra in ("calibration.json", "cascade.json", "model_card.json"):
        if (champion / extra).exists():
            shutil.copy(champion / extra, out / extra)
    return out


def main() -> None:
    import mlflow
    from ray import serve

    from bench import local_ray, post_all, write_report
    from pipelines.registry import log_student, pin, promote
    from serve.app import RerankDeployment
    from serve.common import AppArgs
    from serve.faults import rollout_under_load
    from serve.students import students_app

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--student", default="runs/default/student", help="the embedded champion (the main job's)")
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per latency phase")
    parser.add_argument("--data", default="../shared/data")
    parser.add_argument("--out", default="runs/rollout_bench")
    parser.add_argument("--min-requests", type=int, default=40, help="guards.min_requests of the drill")
    args = parser.parse_args()

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    champion = Path(args.student).resolve()
    good = shutil.copytree(champion, out / "good")  # the champion's weights again: a healthy challenger
    wrong = wrong_student(champion, out / "wrong")
    uri = f"sqlite:///{out / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment(experiment_id=mlflow.create_experiment("rollout", (out / "artifacts").as_uri()))
    versions = {}
    for label, folder in (("champion", champion), ("wrong", wrong), ("good", good)):
        with mlflow.start_run():
            versions[label] = log_student(folder, "fleet").rsplit("/", 1)[1]
    promote("fleet", versions["champion"], "champion")
    promote("fleet", versions["champion"], "challenger")

    local_ray(PORT)
    students = {"main": "models:/fleet@champion", "challenger": "models:/fleet@challenger",
                "trec": "smollm2-trec-dl", "rankvicuna": "smollm2-dl19-rankvicuna"}
    many = AppArgs(students=students, default_student="main", tracking_uri=uri, alias_poll_s=1.0, threads=1,
                   max_models_per_replica=3,
                   rollout={"canary": {"model": "challenger", "share": 0.1, "step_share": 0.2, "max_share": 0.5},
                            "guards": {"min_requests": args.min_requests, "max_error_rate": 0.01, "max_p99_ratio": 2.0,
                                       "p99_slack_ms": 20, "min_agreement": 0.3},
                            "interval_s": 2.0, "report_s": 0.5, "log_path": str(out / "rollout.jsonl")})
    two = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}}  # logical CPUs: every app fits Ray's 4
    serve.run(students_app(many, students_options=two), name="many", route_prefix="/many")
    one = RerankDeployment.options(name="One", ray_actor_options={"num_cpus": 1})
    serve.run(one.bind(AppArgs(model=str(champion), threads=1).model_dump()), name="one", route_prefix="/one")
    ready(f"{ROOT}/many")
    ready(f"{ROOT}/one")
    session = requests.Session()
    payloads = bodies(max(args.requests, 100))
    lines = [f"Embedded champion `{champion}`; synthetic requests of 20 documents; loopback; 2 cores; "
             f"Students on 2 replicas (1 thread each), at most 3 students a replica; one run."]

    # 1. every student answers its own `model`; cold loads
    real = real_body(Path(args.data)) or payloads[0]
    answered, cold = {}, {}
    for name in students:
        body = real if name in ("trec", "rankvicuna") else payloads[0]
        t0 = time.perf_counter()
        r = session.post(f"{ROOT}/many/v1/rerank", json={**body, "model": name}, timeout=600)
        first = time.perf_counter() - t0
        r.raise_for_status()
        t0 = time.perf_counter()
        session.post(f"{ROOT}/many/v1/rerank", json={**body, "model": name}, timeout=600).raise_for_status()
        warm = time.perf_counter() - t0
        answered[name] = r.json()["meta"]["model_version"]
        cold[name] = (first, warm)
    handle = serve.get_deployment_handle("Students", "many")
    loads = {}
    for held in (handle.held.remote().result() for _ in range(16)):
        for x in held["loads"]:
            loads.setdefault(x["model"], x["seconds"])
    lines += ["", f"students behind one endpoint: {len(answered)}", "",
              "| model | answered by (meta.model_version) | load on a replica, s | first request, s | next request, s |",
              "| --- | --- | ---: | ---: | ---: |"]
    for name, version in answered.items():
        load = loads.get(version) or loads.get(students[name])
        lines.append(f"| {name} | `{version}` | {load if load is not None else 'n/a'} | {cold[name][0]:.2f} | "
                     f"{cold[name][1]:.3f} |")

    # 2. routing cost: one-student app vs the many-student app's default, same champion, interleaved
    post_all(f"{ROOT}/one/v1/rerank", payloads[:10])
    one_ms, many_ms = [], []
    for body in payloads[: args.requests]:
        one_ms += post_all(f"{ROOT}/one/v1/rerank", [body], session=session)
        many_ms += post_all(f"{ROOT}/many/v1/rerank", [body], session=session)
    routing = float(np.median(many_ms) - np.median(one_ms))
    lines += ["", f"routing cost per request (many-student p50 - one-student p50, same champion, {args.requests} "
              f"interleaved sequential requests each): {routing:.2f} ms "
              f"(one-student p50 {np.median(one_ms):.2f} ms, many-student p50 {np.median(many_ms):.2f} ms; "
              f"p99 {np.percentile(one_ms, 99):.1f} vs {np.percentile(many_ms, 99):.1f} ms)"]
    serve.delete("one")

    # 3. the shadow's cost on the primary: the same app with every request shadowed vs none, ABAB
    shadow_args = AppArgs(students={"main": str(champion), "candidate": str(good)}, threads=1,
                          rollout={"shadow": {"model": "candidate", "share": 1.0, "queue": 64},
                                   "guards": {"min_requests": 10**9}, "interval_s": 5, "report_s": 0.5})
    plain_args = AppArgs(students={"main": str(champion), "candidate": str(good)}, threads=1)
    apps = {"plain": plain_args, "shadowed": shadow_args}  # both deployed, then measured in turn: ABAB
    for label, app_args in apps.items():
        serve.run(students_app(app_args, students_options={"ray_actor_options": {"num_cpus": 0.5}}), name=label,
                  route_prefix=f"/{label}")
        ready(f"{ROOT}/{label}")
        post_all(f"{ROOT}/{label}/v1/rerank", payloads[:10])
    def rollout_status() -> dict:
        r = session.get(f"{ROOT}/shadowed/v1/rollout", timeout=30)
        if r.status_code != 200:
            print(f"GET /shadowed/v1/rollout: {r.status_code} {r.text[:200]!r}; again")
            return {"state": None}
        return r.json()

    deadline = time.time() + 300
    while (rollout_status()["state"] or {}).get("phase") != "shadow":  # the candidate warmed, the shadow on
        if time.time() > deadline:
            raise TimeoutError("the shadow did not start within 300 s")
        time.sleep(0.5)
    phases = {"shadowed": [], "plain": []}
    for _ in range(2):
        for label in ("plain", "shadowed"):
            phases[label] += post_all(f"{ROOT}/{label}/v1/rerank", payloads[: args.requests // 2], session=session)
    status = rollout_status()
    for label in apps:
        serve.delete(label)
    p50 = {k: float(np.median(v)) for k, v in phases.items()}
    p99 = {k: float(np.percentile(v, 99)) for k, v in phases.items()}
    lines += ["", f"shadow overhead on the primary, p50: {p50['shadowed'] - p50['plain']:.2f} ms "
              f"(shadowed {p50['shadowed']:.2f} ms vs none {p50['plain']:.2f} ms; {len(phases['plain'])} requests each, "
              "two phases each, ABAB)",
              f"shadow overhead on the primary, p99: {p99['shadowed'] - p99['plain']:.2f} ms "
              f"(shadowed {p99['shadowed']:.1f} ms vs none {p99['plain']:.1f} ms); shadow pairs dropped: "
              f"{status.get('dropped_here', 0)}"]

    # 4. the rollout drill under closed-loop load
    def move(version):
        promote("fleet", version, "challenger")
        return f"models:/fleet/{version}"

    result = rollout_under_load(f"{ROOT}/many", payloads, [("wrong", versions["wrong"]), ("good", versions["good"])],
                                move, clients=3, timeout_s=600)
    summary = result.summary()
    rows = [json.loads(line) for line in (out / "rollout.jsonl").read_text().splitlines()]
    lines += ["", f"failed requests across canary, rollback and promotion: {result.failed} of {result.requests}",
              f"champion after the drill: `{pin('models:/fleet@champion')}` (the good candidate was version "
              f"{versions['good']})", "",
              f"Closed loop, 3 clients; p50 {summary['p50_ms']:.1f} ms, p99 {summary['p99_ms']:.1f} ms over the drill.",
              "", "| candidate | decision | reason | seconds from the alias move |", "| --- | --- | --- | ---: |"]
    lines += [f"| {o['label']} | {o['action']} | {o['reason']} | {o['seconds']} |" for o in result.outcomes]
    lines += ["", "requests per model (meta.model_version) during the drill:", "",
              "| model | requests |", "| --- | ---: |"]
    lines += [f"| `{k}` | {v} |" for k, v in sorted(result.by_version.items())]
    lines += ["", "requests per arm (meta.rollout_arm): " + ", ".join(f"{k} {v}" for k, v in sorted(result.by_arm.items())),
              "", "Every decision (the rollout log, as `hllm rollout status` prints it):", "", "```"]
    from hllm.serving.rollout import Decision, status_table

    lines += [status_table([Decision(**r) for r in rows]), "```"]
    write_report("rollout", "Many students behind one endpoint, and a rollout under load", "\n".join(lines))


if __name__ == "__main__":
    main()
