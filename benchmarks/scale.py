"""Scale: the data stage on an MS MARCO-shaped collection on disk at 10^3 .. 10^5 queries, then teacher
generation and one distillation epoch per slate at 10^3 and 10^4 (embedded teacher and student).

    python benchmarks/scale.py                               # all of it -> reports/scale.md + .png
    python benchmarks/scale.py --sizes 1000 10000 --teacher-sizes 1000 --no-distill --work /tmp/hllm-scale

Each size writes a BEIR collection under `--work` (queries with a top-100 run, passages of real length
— ~350 characters —, one to three graded judgments a query, a corpus of 20 passages per query), then
runs `pipelines/data.py` on it in a fresh driver process (a local Ray of `--cpus`) and records the
stage's wall time and slates/s, the driver's peak RSS (its own `ru_maxrss`), and the object store's
peak (the most of `/dev/shm` in use while it ran, sampled every 0.2 s: Ray's plasma store lives
there). Figures from one run; a noisy machine moves them, so read the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import write_report  # noqa: E402

WORDS = ("the of and to in is for that on with as by at from it an be this are or was which can have more not use "
         "water body cell heat energy system blood cost price city state year time number people form type food "
         "average temperature definition causes symptoms treatment process population history county college").split()


def write_collection(root: Path, queries: int, seed: int = 0, run_depth: int = 100, docs_per_query: int = 20) -> None:
    rng = random.Random(seed)
    n_docs = queries * docs_per_query
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    (root / "runs").mkdir(exist_ok=True)
    with open(root / "corpus.jsonl", "w") as fh:
        for d in range(n_docs):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(45, 75)))  # ~350 characters
            fh.write(json.dumps({"_id": str(d), "title": "", "text": text}) + "\n")
    with open(root / "queries.jsonl", "w") as qf, open(root / "runs" / "bm25_top100.tsv", "w") as rf, \
            open(root / "qrels" / "test.tsv", "w") as jf:
        rf.write("query-id\tcorpus-id\trank\tscore\n")
        jf.write("query-id\tcorpus-id\tscore\n")
        for q in range(queries):
            qf.write(json.dumps({"_id": f"q{q}", "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))}) + "\n")
            hits = rng.sample(range(n_docs), run_depth)
            rf.writelines(f"q{q}\t{d}\t{k + 1}\t{30.0 - k * 0.2:.2f}\n" for k, d in enumerate(hits))
            for d in rng.sample(hits[:30], rng.randint(1, 3)):
                jf.write(f"q{q}\t{d}\t{rng.choice((1, 2, 3))}\n")


def shm_used() -> int:
    return shutil.disk_usage("/dev/shm").used


def measure(root: Path, out: Path, cpus: int) -> dict:
    base, peak, done = shm_used(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], shm_used() - base)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "pipelines" / "data.py"), f"output_dir={out}", "data.source=beir",
                    f"data.path={root}", "data.top_n=20", f"cluster.local_cpus={cpus}"],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    (stage,) = (out / "slates").glob("*/stage.json")
    stats = json.loads(stage.read_text())["stats"]
    return {**stats, "process_s": round(wall, 1), "object_store_peak_mb": round(peak[0] / 2**20, 1)}


def embedded_job(n: int, out: Path, cpus: int) -> list[str]:
    """The embedded default's job with `n` train slates (drawn as one parallel shard per 1,000)."""
    return [f"output_dir={out}", f"data.synthetic.train_slates={n}", "data.synthetic.val_slates=50",
            "data.synthetic.test_slates=50", f"data.synthetic.shards={max(1, n // 1000)}", f"cluster.local_cpus={cpus}"]


def measure_teacher(n: int, out: Path, cpus: int) -> dict:
    """The data stage, then teacher generation streamed from its shards (the shipped embedded teacher,
    2 actors), in a fresh driver; -> the train split's generation stats."""
    subprocess.run([sys.executable, str(ROOT / "pipelines" / "teacher_gen.py"), *embedded_job(n, out, cpus)],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    (stage,) = (out / "rankings").glob("train-*/stage.json")
    return json.loads(stage.read_text())


def measure_distill(n: int, out: Path, cpus: int, batch: int = 16, workers: int = 2) -> dict:
    """One epoch of distillation on those `n` rankings (`pipelines/train_student.py`: Ray Train + DeepSpeed,
    `workers` workers of `batch` slates a step each, a checkpoint every 50 steps, the rankings streamed
    from the store as at scale: `distill.materialize_mb=0`), in a fresh driver;
    -> the fit's seconds, ms a slate, the rank-0 worker's peak RSS, how the rankings reached the workers."""
    steps = -(-n // (batch * workers))
    done = subprocess.run([sys.executable, str(ROOT / "pipelines" / "distill.py"), *embedded_job(n, out, cpus),
                           f"student.train.steps={steps}", f"student.train.batch_size={batch}",
                           f"cluster.train_workers={workers}", "distill.materialize_mb=0"], cwd=ROOT, check=True, capture_output=True, text=True)
    stage = json.loads((out / "student" / "stage.json").read_text())
    streamed = "streamed every epoch" in done.stdout + done.stderr
    return {"steps": stage["steps"], "seconds": stage["seconds"],
            "ms_per_slate": 1000 * stage["seconds"] / (steps * batch * workers), "worker_peak_mb": stage["worker_peak_mb"],
            "rankings": "streamed" if streamed else "materialised"}


def ratio_lines(rows: list[dict], teacher: list[dict]) -> list[str]:
    """The largest size over the smallest, for each figure with a target."""
    out = []
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        out += [f"- driver peak RSS {b['size']:,} / {a['size']:,}: {b['driver_peak_mb'] / a['driver_peak_mb']:.2f} (<= 1.25)",
                f"- data slates/s {b['size']:,} / {a['size']:,}: {b['slates_per_s'] / a['slates_per_s']:.2f} (>= 0.8)"]
    if len(teacher) > 1:
        a, b = teacher[0], teacher[-1]
        out.append(f"- teacher slates/s {b['size']:,} / {a['size']:,}: {b['slates_per_s'] / a['slates_per_s']:.2f} (>= 0.9)")
        if a["distill"] and b["distill"]:
            out.append(f"- distill ms a slate {b['size']:,} / {a['size']:,}: "
                       f"{b['distill']['ms_per_slate'] / a['distill']['ms_per_slate']:.2f} (flat is the goal)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--work", default="/tmp/hllm-scale", help="where the collections and outputs go (deleted after)")
    parser.add_argument("--cpus", type=int, default=4, help="logical CPUs of the local Ray")
    parser.add_argument("--teacher-sizes", type=int, nargs="*", default=[1000, 10000],
                        help="train slates for the teacher-generation lines (embedded teacher and data)")
    parser.add_argument("--no-distill", dest="distill", action="store_false",
                        help="skip the one-epoch distillation after each teacher size")
    args = parser.parse_args()
    teacher = []
    for n in args.teacher_sizes:
        out = Path(args.work) / f"teacher-{n}"
        shutil.rmtree(out, ignore_errors=True)
        t = measure_teacher(n, out, args.cpus)
        d = measure_distill(n, out, args.cpus) if args.distill else None
        teacher.append({"size": n, **{k: t[k] for k in ("slates", "seconds", "slates_per_s", "output_tokens_per_s",
                                                           "worker_peak_mb")}, "distill": d})
        print(json.dumps(teacher[-1]), flush=True)
        shutil.rmtree(out)
    rows = []
    for n in args.sizes:
        root, out = Path(args.work) / f"beir-{n}", Path(args.work) / f"out-{n}"
        shutil.rmtree(root, ignore_errors=True), shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        write_collection(root, n)
        written = time.perf_counter() - t0
        size_mb = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 2**20
        r = measure(root, out, args.cpus)
        rows.append({**r, "size": n, "collection_mb": round(size_mb, 1), "write_s": round(written, 1)})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(root), shutil.rmtree(out)
    table = ["| slates | collection on disk | data stage | slates/s | driver peak RSS | object store peak | run rows read |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    table += [f"| {r['size']:,} | {r['collection_mb']:,.0f} MB | {r['seconds']:.1f} s | {r['slates_per_s']:,.1f} | "
              f"{r['driver_peak_mb']:,.0f} MB | {r['object_store_peak_mb']:,.0f} MB | {r['rows_read']['run']:,} |" for r in rows]
    lines = [f"`python benchmarks/scale.py --sizes {' '.join(map(str, args.sizes))} --teacher-sizes "
             f"{' '.join(map(str, args.teacher_sizes))}{'' if args.distill else ' --no-distill'}` on this machine, a local "
             f"Ray of {args.cpus} logical CPUs; N = 20 of each query's top 100; every figure from this one run.", "", *table, ""]
    lines += [f"driver peak MB at 1e{len(str(r['size'])) - 1}: {r['driver_peak_mb']}" for r in rows]
    lines += [f"data slates/s at 1e{len(str(r['size'])) - 1}: {r['slates_per_s']}" for r in rows]
    if teacher:
        lines += ["", "Teacher generation streamed from the slate shards (the embedded teacher, 2 actors, the embedded "
                  "default's data drawn as 1 shard per 1,000 train slates; the train split's stage, actor start-up "
                  "included):", "", "| train slates | seconds | slates/s | output tokens/s | teacher worker peak RSS |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {t['size']:,} | {t['seconds']:.1f} | {t['slates_per_s']:.1f} | {t['output_tokens_per_s']:,.0f} | "
                  f"{t['worker_peak_mb']:,.0f} MB |" for t in teacher]
        lines += [""] + [f"teacher slates/s at 1e{len(str(t['size'])) - 1}: {t['slates_per_s']:.1f}" for t in teacher]
        distilled = [t for t in teacher if t["distill"]]
        if distilled:
            lines += ["", "One epoch of distillation on those rankings (`pipelines/train_student.py`: Ray Train + DeepSpeed ZeRO-2, "
                      "2 CPU workers of 16 slates a step, a checkpoint every 50 steps; the fit's own seconds):", "",
                      "| train slates | steps | seconds | ms a slate | rank-0 worker peak RSS | train rankings |",
                      "| ---: | ---: | ---: | ---: | ---: | --- |"]
            lines += [f"| {t['size']:,} | {t['distill']['steps']} | {t['distill']['seconds']:.1f} | "
                      f"{t['distill']['ms_per_slate']:.1f} | {t['distill']['worker_peak_mb']:,.0f} MB | "
                      f"{t['distill']['rankings']} |" for t in distilled]
            lines += [""] + [f"distill ms per slate at 1e{len(str(t['size'])) - 1}: {t['distill']['ms_per_slate']:.1f}"
                             for t in distilled]
    lines += ["", "Ratios of this run (the issue's targets in brackets):"] + ratio_lines(rows, teacher)
    write_report("scale", "Scale: data stage, teacher generation, distillation", "\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        xs = [r["size"] for r in rows]
        a.plot(xs, [r["slates_per_s"] for r in rows], "o-"), a.set_xscale("log"), a.set_title("data stage, slates/s")
        b.plot(xs, [r["driver_peak_mb"] for r in rows], "o-", label="driver peak RSS")
        b.plot(xs, [r["object_store_peak_mb"] for r in rows], "s--", label="object store peak")
        b.set_xscale("log"), b.set_title("MB"), b.legend()
        for ax in (a, b):
            ax.set_xlabel("slates")
        fig.tight_layout()
        fig.savefig(ROOT / "reports" / "scale.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
