"""The paper's core ablation on real text, in one command: a frozen probe against LoRA, distilled from RankVicuna-7B.

    python benchmarks/gpu/backbone_adaptation.py --pack gpu_pack --out $OUT     # on the GPU (scripts/gpu_pack.sh prints it)
    python benchmarks/gpu/backbone_adaptation.py --tiny --out /tmp/adapt         # the CPU dry run CI keeps alive

DL19's 43 queries, BM25 top 100, RankVicuna-7B's rankings (`teacher-runs/`); the same 5 teacher-folds by query hash
as `hllm distilltext` (`hllm.recipes.distilltext.FOLD_SALT`), its prompt (`rankgpt-query`, passages cut to 48 tokens)
and cut (SmolLM2-135M-Instruct after decoder layer 16). On each fold's training queries, tested once on its test queries:

- `probe`: the shipped `smollm2-dl19-rankvicuna` refitted per fold — frozen, its mean-pooled states' ridge probe on the
  teacher's whole order (L2 1e3) under the first-stage prior (scale 1/32): the settings its recipe chose, read from its
  folder (`hllm.recipes.distilltext.ShippedProbe`);
- `head`: frozen backbone + the paper's 2-layer attention head (K = 20, rank prior), Sinkhorn CE on the teacher's order;
- `lora`: LoRA r = 64 on every attention and MLP projection + the same head, the same loss;
- `lora+qrels`: `lora` plus graded CE on the judged passages;
- `lora-whole`: `lora` trained on whole 100-passage lists instead of sub-slates (the training-data ablation).

The trained students see sub-slates of 20 passages sampled from a training query's top 100, in first-stage order, with
the teacher's relative order as the target (`lora-whole`: the whole list). The rule, fixed before any test fold was
read: `--steps` steps (default 150) of `--batch` slates, lr 2e-4 for LoRA and 1e-3 for the head (the embedded
default's head lr), cosine after 10 warm-up steps, bf16 autocast on CUDA — the project's loop
(`hllm.train.loop.train_student`), no second loop. Test lists are ranked whole (N = 100, K = 20: rectangular Hungarian).
Cross-year: each student trained on all of DL19, tested on DL21. A time budget (`--budget-s`) drops folds rather than
overrun: the report says how many ran. Writes `$OUT/backbone_adaptation.md` and `.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hllm.data.readers import read_slates  # noqa: E402
from hllm.eval.evaluation import first_stage_order  # noqa: E402
from hllm.eval.metrics import kendall_tau  # noqa: E402
from hllm.model.backbones import ModelConfig  # noqa: E402
from hllm.model.heads import HeadConfig  # noqa: E402
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker  # noqa: E402
from hllm.records import RerankRequest  # noqa: E402
from hllm.recipes.distilltext import FOLD_SALT, ShippedProbe, per_query, share_kept, teacher_grades  # noqa: E402
from hllm.reranker import Reranker  # noqa: E402
from hllm.teacher.external import external_rankings  # noqa: E402
from hllm.train.head_fit import StateSlate, decode_orders, query_folds, score_state_slates  # noqa: E402
from hllm.train.loop import LossConfig, StudentExample, TrainConfig, train_student  # noqa: E402
from hllm.train.state_cache import compute_states  # noqa: E402

TEACHER_RUN = "teacher-runs/rankvicuna-7b_top100.tsv"
STUDENTS = ("probe", "head", "lora", "lora+qrels", "lora-whole")
SHIPPED = ShippedProbe.load()  # the shipped student's prompt, head, ridge weight and prior scale, read from its folder


@dataclasses.dataclass
class Setup:
    model: ModelConfig
    data: Path  # DL19 (BEIR folder with teacher-runs/)
    cross_year: Path | None  # DL21
    top_n: int = 100
    folds: int = 5
    layer: int = 16
    steps: int = 150
    batch: int = 8
    sub: int = 20
    positions: int = 20  # the head's K (at most `sub`: a sub-slate fills every position)
    lora_r: int = 64
    head_width: int = 128
    budget_s: float = 540.0
    rel: int = 2


def ranker_config(s: Setup, student: str) -> RankerConfig:
    """The shipped student's config (its prompt, frozen utility head; `ShippedProbe`) on this run's backbone and cut;
    the trained students swap in the paper's attention head (and LoRA)."""
    shipped = dataclasses.replace(SHIPPED.ranker, model=s.model, state_layer=s.layer,
                                  head=dataclasses.replace(SHIPPED.ranker.head, positions=s.positions))
    if student == "probe":
        return shipped
    adapt = AdaptConfig(mode="lora", lora_r=s.lora_r, lora_alpha=2 * s.lora_r) if student.startswith("lora") else \
        AdaptConfig(mode="frozen")
    return dataclasses.replace(shipped, adapt=adapt, pooling="last+mean", head=HeadConfig(
        kind="attention", positions=s.positions, layers=2, width=s.head_width, num_heads=4, prior="rank"))


def sub_slates(slate: RerankRequest, perm: list[int], m: int, rng: random.Random) -> list[tuple[RerankRequest, list[int]]]:
    """`len // m` random sub-slates of `m` candidates, in first-stage order, each with the teacher's relative order."""
    n, out = len(slate.candidates), []
    for _ in range(max(1, n // m)):
        keep = sorted(rng.sample(range(n), min(m, n)))
        where = {c: i for i, c in enumerate(keep)}
        sub = dataclasses.replace(slate, candidates=[slate.candidates[c] for c in keep],
                                  grades=[slate.grades[c] for c in keep] if slate.grades else None)
        out.append((sub, [where[c] for c in perm if c in where]))
    return out


def train_ranker(s: Setup, student: str, slates: list[RerankRequest], perms: list[list[int]], device: str, seed: int):
    """A trained student of kind `student` on these queries -> (ranker, seconds per step)."""
    torch.manual_seed(seed)
    cfg = ranker_config(s, student)
    ranker = SinglePassRanker.build(cfg).to(device)
    if student == "probe":  # closed form on the frozen states: the teacher's whole order as grades
        states = compute_states(ranker, slates)
        items = [StateSlate(sl, st, p, [float(g) for g in teacher_grades(p, len(p))]) for sl, st, p in zip(slates, states, perms)]
        t0 = time.perf_counter()
        SHIPPED.fit(ranker, items)
        return ranker, time.perf_counter() - t0
    rng = random.Random(seed)
    pairs = [(sl, p) for sl, p in zip(slates, perms)] if student == "lora-whole" else \
        [pair for sl, p in zip(slates, perms) for pair in sub_slates(sl, p, s.sub, rng)]
    examples = [StudentExample(ranker.prompts.encode(sl, with_answer=False), p, sl.grades) for sl, p in pairs]
    loss = LossConfig({"sinkhorn_ce": 1.0, "graded_ce": 1.0} if student == "lora+qrels" else {"sinkhorn_ce": 1.0})
    batch = max(1, s.batch // 4) if student == "lora-whole" else s.batch  # whole lists: 5x the tokens a slate
    train = TrainConfig(steps=s.steps, batch_size=batch, lr=2e-4 if student.startswith("lora") else 1e-3, head_lr=1e-3,
                        warmup_steps=10, log_every=s.steps, seed=seed)
    history = train_student(ranker, examples, train, loss)
    return ranker, history[-1]["elapsed_s"] / len(history)


@torch.no_grad()
def rank(ranker: SinglePassRanker, student: str, slates: list[RerankRequest]) -> list[list[int]]:
    """Whole lists (N = 100) in one pass each: the (N, K) matrices decoded by the rectangular Hungarian."""
    if student == "probe":
        return decode_orders(score_state_slates(ranker, [StateSlate(sl, st) for sl, st in zip(slates, compute_states(ranker, slates))]))
    reranker = Reranker(ranker, batch_size=1, max_batch_tokens=None)
    return [reranker.decode(m).permutation.tolist() for m in reranker.score_slates(slates, batch_size=1)]


def figures(slates, orders, perms, first, teacher, rel, resamples=2000) -> dict:
    ndcg = np.array([per_query(slates, orders, rel)["nDCG@10"][s.slate_id] for s in slates])
    taus = [kendall_tau(o, p) for o, p in zip(orders, perms)]
    return {"nDCG@10": float(ndcg.mean()), "tau_to_teacher": float(np.mean(taus)),
            **share_kept(ndcg, first, teacher, resamples, seed=0), "per_query": ndcg.tolist()}


def load(path: Path, top_n: int) -> tuple[list[RerankRequest], list[list[int]]]:
    slates = read_slates("beir", path, top_n=top_n)
    rankings, cov = external_rankings("run", path / TEACHER_RUN, slates)
    if cov.uncovered or cov.missing_ids:
        raise ValueError(f"{path / TEACHER_RUN}: {cov.uncovered} queries unranked, {cov.missing_ids} candidates left out")
    return slates, [r.permutation for r in rankings]


def run(s: Setup, out: Path, device: str) -> dict:
    t_start = time.perf_counter()
    slates, perms = load(s.data, s.top_n)
    rel = s.rel
    ids = [sl.slate_id for sl in slates]
    folds = query_folds(len(slates), ids, s.folds, FOLD_SALT)
    first = per_query(slates, first_stage_order(slates), rel)["nDCG@10"]
    teach = per_query(slates, perms, rel)["nDCG@10"]
    orders: dict[str, dict[str, list[int]]] = {k: {} for k in STUDENTS}
    timing: dict[str, list[float]] = {k: [] for k in STUDENTS}
    done_folds = 0
    for f, (train_idx, test_idx) in enumerate(folds):
        elapsed = time.perf_counter() - t_start
        if done_folds and elapsed / done_folds * (done_folds + 1) > s.budget_s:  # the next fold would overrun
            print(f"budget: {elapsed:.0f}s after {done_folds} folds, stopping before fold {f + 1} of {len(folds)}", flush=True)
            break
        for student in STUDENTS:
            t0 = time.perf_counter()
            ranker, per_step = train_ranker(s, student, [slates[i] for i in train_idx], [perms[i] for i in train_idx], device, f)
            test = [slates[i] for i in test_idx]
            for sl, o in zip(test, rank(ranker, student, test)):
                orders[student][sl.slate_id] = o
            timing[student].append(time.perf_counter() - t0)
            print(f"fold {f + 1}/{len(folds)} {student}: {per_step * 1000:.0f} ms a step, fold {timing[student][-1]:.1f}s",
                  flush=True)
            del ranker
        done_folds += 1
    tested = [sl for sl in slates if sl.slate_id in orders["probe"]]
    report = {"folds_run": done_folds, "folds": len(folds), "queries": len(tested), "device": device_name(device),
              "first_stage": float(np.mean([first[sl.slate_id] for sl in tested])),
              "teacher": float(np.mean([teach[sl.slate_id] for sl in tested])), "students": {}, "seconds_per_fold": {}}
    f_arr = np.array([first[sl.slate_id] for sl in tested])
    t_arr = np.array([teach[sl.slate_id] for sl in tested])
    tperm = {sl.slate_id: p for sl, p in zip(slates, perms)}
    for student in STUDENTS:
        o = [orders[student][sl.slate_id] for sl in tested]
        report["students"][student] = figures(tested, o, [tperm[sl.slate_id] for sl in tested], f_arr, t_arr, rel)
        report["seconds_per_fold"][student] = float(np.mean(timing[student])) if timing[student] else None
    if s.cross_year is not None and time.perf_counter() - t_start < s.budget_s:
        other = read_slates("beir", s.cross_year, top_n=s.top_n)
        of = per_query(other, first_stage_order(other), rel)["nDCG@10"]
        report["cross_year"] = {"queries": len(other), "first_stage": float(np.mean(list(of.values())))}
        for student in ("probe", "lora"):
            ranker, _ = train_ranker(s, student, slates, perms, device, 0)
            got = per_query(other, rank(ranker, student, other), rel)["nDCG@10"]
            report["cross_year"][student] = float(np.mean([got[sl.slate_id] for sl in other]))
    report["seconds"] = time.perf_counter() - t_start
    out.mkdir(parents=True, exist_ok=True)
    (out / "backbone_adaptation.json").write_text(json.dumps(report, indent=2))
    (out / "backbone_adaptation.md").write_text(markdown(report, s))
    print(markdown(report, s))
    return report


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def markdown(r: dict, s: Setup) -> str:
    rows = ["| student | nDCG@10 | tau to RankVicuna | share of its gain kept [95% CI] | s a fold |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| BM25 (first stage) | {r['first_stage']:.4f} | | | |", f"| RankVicuna-7B | {r['teacher']:.4f} | 1 | | |"]
    for k, v in r["students"].items():
        sec = r["seconds_per_fold"][k]
        rows.append(f"| {k} | {v['nDCG@10']:.4f} | {v['tau_to_teacher']:.3f} | {v['share']:.2f} [{v['ci_low']:.2f}, "
                    f"{v['ci_high']:.2f}] | {sec:.1f} |" if sec is not None else f"| {k} | — | | | |")
    lines = [f"Device: {r['device']}; {r['folds_run']} of {r['folds']} teacher-folds run ({r['queries']} test queries, "
             f"means over them); {s.steps} steps a student, {r['seconds']:.0f} s in all.", "", *rows, "",
             f"share kept, lora: {r['students']['lora']['share']:.2f}",
             f"share kept, frozen probe: {r['students']['probe']['share']:.2f}"]
    if "cross_year" in r:
        c = r["cross_year"]
        lines += ["", f"Cross-year (trained on all of DL19, tested on DL21's {c['queries']} queries): BM25 {c['first_stage']:.4f}, "
                  f"probe {c['probe']:.4f}, lora {c['lora']:.4f}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", help="what scripts/gpu_pack.sh prepared: the backbone and the data")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "trec-dl19-passage-bm25top100"))
    parser.add_argument("--cross-year", default=str(ROOT.parent / "shared" / "data" / "trec-dl21-passage-bm25top100"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny backbone from config, 2 folds, 3 steps, top 8")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--budget-s", type=float, default=540.0, help="drop the folds that would end past this")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        s = Setup(ModelConfig(hidden_size=32, layers=2, heads=2, intermediate_size=64, context_length=4096),
                  Path(args.data), None, top_n=8, folds=2, layer=1, steps=3, batch=2, sub=4, positions=4, lora_r=4,
                  head_width=32)
    else:
        pack = Path(args.pack) if args.pack else None
        # fp32 weights, bf16 autocast on CUDA (the loop's rule): LoRA's adapters train in fp32
        model = ModelConfig(preset="hf", path=str(pack / "backbone"), context_length=8192) if pack else \
            ModelConfig(preset="smollm2-135m", context_length=8192)
        data = pack / "data" / "dl19" if pack else Path(args.data)
        cross = pack / "data" / "dl21" if pack else Path(args.cross_year)
        s = Setup(model, data, cross if cross.exists() else None, steps=args.steps, budget_s=args.budget_s)
    run(s, Path(args.out), device)


if __name__ == "__main__":
    main()
