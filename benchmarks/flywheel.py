"""The flywheel under a drift you can watch, on the embedded default: one cycle, measured end to end.

    python benchmarks/flywheel.py [--job runs/default] [--out runs/flywheel] [--requests 1500] [--steps 150]

The drift: the first stage is replaced (a new retriever that merges shards, a catalogue relaunch):
the candidates now arrive in an order that says nothing about relevance, over products the
student never saw. Both lose (BM25's order carried information), but the AR teacher, which reads
every candidate's text before it writes, loses less than the served student, distilled on
BM25-ordered slates, which leaned on that order. The script serves the job's student as
`models:/hllm-student@champion` (2 replicas, traffic log on), sends the shifted traffic, runs one
refresh cycle (`pipelines/refresh.py`: Ray Data, the teacher, Ray Train + DeepSpeed, the gate),
then measures on the held-out shifted traffic with the true labels (teacher, champion, challenger,
the new first stage), the original test split, the traffic log's cost per request, and the swap of
the running deployment under load. Writes `reports/flywheel.md` and `reports/flywheel.png`.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hllm.job.refresh import Cycle

PORT = 8133
TITLE = "The data flywheel: shifted traffic, one cycle, the swap"


def shifted_traffic(n: int, seed: int):
    """New queries over a relaunched catalogue (another generator seed, the same vocabulary), their
    candidates in an order that carries no relevance (shuffled: the new first stage)."""
    from hllm.data.synthetic import SyntheticConfig, generate
    from hllm.records import RerankRequest

    splits, _ = generate(SyntheticConfig(seed=seed, train_slates=n, val_slates=1, test_slates=1))
    rng, out = random.Random(seed), []
    for s in splits["train"]:
        idx = list(range(len(s.candidates)))
        rng.shuffle(idx)
        out.append(RerankRequest(s.query, [s.candidates[i] for i in idx], [s.grades[i] for i in idx]))
    return out


def true_label_figures(record: Cycle, truth: dict) -> dict[str, float]:
    """nDCG@10 with the generator's labels on the cycle's held-out traffic, for the teacher (its
    rankings in the store), the new first stage, champion and challenger (their orders as the cycle
    ranked them, `record.traffic_orders`), on the same slates; paired differences with 95% CIs."""
    import dataclasses

    import numpy as np
    from scipy import stats

    from hllm.data import store
    from hllm.data.traffic import request_key
    from hllm.eval.evaluation import quality
    from hllm.eval.metrics import ir_metrics_per_query

    items = store.read_rankings(record.rankings["test"])
    slates = [dataclasses.replace(i.slate, grades=truth[request_key(i.slate.query.text, [c.text for c in i.slate.candidates])])
              for i in items]
    orders = record.traffic_orders
    perms = {"first_stage": [orders["first_stage"][s.slate_id] for s in slates],
             "teacher": [i.ranking.permutation for i in items],
             **{who: [orders[who][s.slate_id] for s in slates] for who in ("champion", "challenger")}}
    out = {"slates": len(slates), **{k: quality(slates, p, 1)["nDCG@10"] for k, p in perms.items()}}
    per_query = {k: ir_metrics_per_query(slates, p) for k, p in perms.items()}
    for a, b in (("teacher", "champion"), ("teacher", "challenger"), ("challenger", "champion")):
        diff = np.array([per_query[a][s.slate_id] - per_query[b][s.slate_id] for s in slates])
        out[f"{a}-{b}"] = (float(diff.mean()), float(stats.t.ppf(0.975, len(diff) - 1) * diff.std(ddof=1) / np.sqrt(len(diff))))
    return out


def main() -> None:
    import mlflow
    import ray
    from ray import serve

    from bench import local_ray, post_all, write_report  # benchmarks/ is on sys.path when run as a script
    from hllm.config import load_config
    from hllm.data.traffic import request_key
    from pipelines import refresh
    from pipelines.common import PipelineConfig, mlflow_run, tracking_uri
    from pipelines.registry import log_student, pin, promote
    from serve.app import RerankDeployment
    from serve.common import AppArgs
    from serve.faults import swap_under_load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="runs/default", help="the main job's output_dir (its student and teacher rankings)")
    parser.add_argument("--out", default="runs/flywheel")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=101)
    parser.add_argument("overrides", nargs="*", help="more key=value for the refresh's config")
    args = parser.parse_args()
    job, out = Path(args.job), Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)  # a fresh registry and log each run
    out.mkdir(parents=True)
    shutil.copytree(job / "rankings", out / "rankings")  # the job's teacher rankings: the same key, not redone
    cfg = load_config(PipelineConfig, "configs/default.yaml", [
        f"output_dir={out}", f"refresh.log_path={out / 'traffic'}", f"refresh.steps={args.steps}",
        "refresh.max_slates=2000", "refresh.replay_share=0.5", "refresh.lr=0.0003", *args.overrides])
    mlflow.set_tracking_uri(tracking_uri(cfg))
    with mlflow_run(cfg, "champion"):
        log_student(job / "student", "hllm-student", alias="champion")  # version 1

    local_ray(serve_port=PORT)
    tracking = tracking_uri(cfg)
    logged = AppArgs(model="models:/hllm-student@champion", tracking_uri=tracking, threads=1, alias_poll_s=2.0,
                     traffic_log={"path": str(out / "traffic"), "flush_records": 256, "flush_seconds": 2.0})
    plain = logged.model_copy(update={"traffic_log": None})
    for name, app in (("flywheel", logged), ("nolog", plain)):
        dep = RerankDeployment.options(name=f"Reranker-{name}", num_replicas=2, ray_actor_options={"num_cpus": 0.5})
        serve.run(dep.bind(app.model_dump()), name=name, route_prefix=f"/{name}")
    traffic = shifted_traffic(args.requests, args.seed)
    truth = {request_key(s.query.text, [c.text for c in s.candidates]): s.grades for s in traffic}
    bodies = [{"query": s.query.text, "documents": [c.text for c in s.candidates]} for s in traffic]
    t0 = time.perf_counter()
    with_log, without = [], []
    for k in range(0, len(bodies), 20):  # interleaved in blocks: the same load on both
        with_log += post_all(f"http://127.0.0.1:{PORT}/flywheel/v1/rerank", bodies[k: k + 20])
        without += post_all(f"http://127.0.0.1:{PORT}/nolog/v1/rerank", bodies[k: k + 20])
    serve_s = time.perf_counter() - t0
    serve.delete("nolog")
    time.sleep(3)  # the replicas' time flush

    record = refresh.run(cfg)
    quality_now = true_label_figures(record, truth)

    promote("hllm-student", 1, "champion")  # the alias back, to watch the running deployment follow it under load
    deadline = time.time() + 60
    while time.time() < deadline and post_all_version(PORT, bodies[0]) != "models:/hllm-student/1":
        time.sleep(0.5)
    swap = swap_under_load(f"http://127.0.0.1:{PORT}/flywheel/v1/rerank", bodies[:50],
                           lambda: promote("hllm-student", 2 if record.promoted else 1, "champion"),
                           "models:/hllm-student/2" if record.promoted else "models:/hllm-student/1",
                           clients=2, before_s=5.0, timeout_s=120)
    promote("hllm-student", record.challenger.rsplit("/", 1)[1] if record.promoted else 1, "champion")
    serve.shutdown()
    ray.shutdown()
    text = report(args, record, quality_now, swap.summary(), with_log, without, serve_s, pin_now=pin("models:/hllm-student@champion"))
    write_report("flywheel", TITLE, text)
    plot(quality_now, record, Path("reports/flywheel.png"))


def post_all_version(port: int, body: dict) -> str | None:
    import requests

    r = requests.post(f"http://127.0.0.1:{port}/flywheel/v1/rerank", json=body, timeout=60)
    return r.json()["meta"].get("model_version") if r.status_code == 200 else None


def report(args, record: Cycle, q: dict, swap: dict, with_log: list[float], without: list[float], serve_s: float,
           pin_now: str) -> str:
    f, c, s = record.figures, record.counts, record.seconds
    champ, chall = f["champion"], f["challenger"]
    gap_before, gap_after = q["teacher"] - q["champion"], q["teacher"] - q["challenger"]
    closed = 1 - gap_after / gap_before if gap_before > 0 else float("nan")
    lines = [
        f"gap before: {gap_before:+.4f} (teacher {q['teacher']:.4f} - served student {q['champion']:.4f}, nDCG@10 with the "
        f"true labels on {q['slates']} held-out shifted requests; paired 95% CI ±{q['teacher-champion'][1]:.4f})",
        f"gap after: {gap_after:+.4f} (teacher {q['teacher']:.4f} - {'promoted' if record.promoted else 'refused'} "
        f"challenger {q['challenger']:.4f}, ±{q['teacher-challenger'][1]:.4f}; {100 * closed:.0f}% of the gap closed; "
        f"challenger - champion {q['challenger-champion'][0]:+.4f} ±{q['challenger-champion'][1]:.4f})",
        f"original test change: {chall['original.nDCG@10'] - champ['original.nDCG@10']:+.4f} (challenger "
        f"{chall['original.nDCG@10']:.4f} vs champion {champ['original.nDCG@10']:.4f}, nDCG@10 on the job's 300 test "
        f"slates; tolerance {record.config['tolerance']})",
        f"swap requests: {swap['requests']} sent, {swap['failed']} failed",
    ]
    p50_log, p50_plain = statistics.median(with_log), statistics.median(without)
    return "\n".join([
        "\n".join(lines), "",
        f"Verdict: {record.verdict}. Alias now `models:/hllm-student@champion` -> `{pin_now}`.", "",
        "**The drift.** " + __doc__.split("\n\n")[2].replace("\n", " ").removeprefix("The drift: the").split(" The script")[0].join(["The", ""]),
        "",
        f"**Traffic** ({args.requests} requests, N = 20, seed {args.seed}): sent in {serve_s:.0f} s to 2 replicas with the "
        f"log on; the log held {c['rows']} rows in {c['files']} files ({c['files_skipped']} skipped), "
        f"{c['warned']} warned, {c['other_model']} of another model, {c['malformed']} malformed, {c['duplicates']} "
        f"duplicates; {c['train']} slates to fine-tune on, {c['test']} held out (by a hash of the request).", "",
        "| on the held-out shifted traffic (true labels) | nDCG@10 |", "| --- | ---: |",
        f"| new first stage (the order they arrived in) | {q['first_stage']:.4f} |",
        f"| AR teacher (the embedded teacher, constrained decoding) | {q['teacher']:.4f} |",
        f"| served student before the cycle (champion, v1) | {q['champion']:.4f} |",
        f"| challenger after one cycle ({args.steps} steps from the champion, replay {record.config['replay_share']}) | "
        f"{q['challenger']:.4f} |", "",
        "| side by side (the refresh's own figures) | champion | challenger |", "| --- | ---: | ---: |",
        *[f"| {k} | {champ[k]:.4f} | {chall[k]:.4f} |" for k in ("original.nDCG@10", "original.kendall_tau",
                                                                   "original.top1_agreement", "traffic.kendall_tau",
                                                                   "traffic.top1_agreement", "traffic.nDCG@10_vs_teacher")],
        "", "`original.*`: the job's test split (true labels; agreement with the teacher's rankings); `traffic.*`: the "
        "held-out new traffic against the teacher's rankings (Kendall tau, top-1, nDCG@10 with graded pseudo-labels from "
        "the teacher's ranking, `hllm.job.refresh.pseudo_grades`).", "",
        "**The cycle's wall time on 2 cores** (one run): " + ", ".join(f"{k} {v:.0f} s" for k, v in s.items())
        + f"; {sum(s.values()):.0f} s in all (labelling: the teacher on {c['slates']} slates through the Ray Data actor "
        f"pool; fine-tuning: Ray Train, 2 DeepSpeed ZeRO-2 workers, {args.steps} steps of 16 slates).", "",
        f"**The swap under load** (2 closed-loop clients, 2 replicas polling the alias every 2 s): {swap['requests']} "
        f"requests, {swap['failed']} failed; every replica answered with the new version {swap['swap_s']:.1f} s after the "
        f"alias moved (answers by version: {swap['versions']}); p50 {swap['p50_ms']:.1f} ms, p99 {swap['p99_ms']:.1f} ms, "
        f"p99 during the swap {swap['p99_during_swap_ms']:.1f} ms ({swap['requests_during_swap']} requests)."
        if swap["swap_s"] is not None else f"**The swap under load**: not completed within the drill: {swap}", "",
        f"**The log's cost per request** (the same {len(with_log)} requests, interleaved in blocks of 20, sequential): p50 "
        f"{p50_log:.1f} ms with the traffic log, {p50_plain:.1f} ms without ({p50_log - p50_plain:+.1f} ms): a request "
        "appends to a list; the flush thread cuts, encodes and writes.",
    ])


def plot(q: dict, record: Cycle, path: Path) -> None:
    """Left: the models on the held-out shifted traffic (the new first stage: a dashed line); right:
    the paired differences per query with their 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names, values = ["teacher", "champion\n(before)", "challenger\n(after)"], [q["teacher"], q["champion"], q["challenger"]]
    a.bar(names, values, color=["#444", "#c44", "#4a4"])
    low = min(values) - 0.03
    a.set_ylim(low, min(1.0, max(values) + 0.02))
    a.set_ylabel("nDCG@10 (true labels)")
    a.set_title(f"held-out shifted traffic ({q['slates']} requests; new first stage {q['first_stage']:.3f})", fontsize=9)
    pairs = [("teacher-champion", "teacher - champion\n(gap before)"), ("teacher-challenger", "teacher - challenger\n(gap after)"),
             ("challenger-champion", "challenger - champion")]
    b.bar([label for _, label in pairs], [q[k][0] for k, _ in pairs], yerr=[q[k][1] for k, _ in pairs], capsize=4,
          color=["#c44", "#4a4", "#48c"])
    b.axhline(0, color="black", lw=0.8)
    b.set_title("paired per-query differences, 95% CI (nDCG@10)", fontsize=9)
    b.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
