"""What limits the student distilled from a real teacher (#33): how its held-out quality grows with the
teacher's training queries, and how far the same probe reaches on the very queries it was fitted on.

    python benchmarks/distill_limits.py --config configs/realtext/smollm2-dl19-rankvicuna.yaml   # after `hllm realtext` with it

Reads the recipe's cached states (nothing is computed but fits; a query whose states are missing is
computed first, as the recipe would) and writes reports/distill_limits.md:

- learning curve: on each of the recipe's teacher-folds the fold's training queries are cut to n (a
  random subset, `--draws` of them), the variant chooses its settings by the recipe's CV on that subset
  (`Fitter.fit`), and ranks the fold's test queries once; nDCG@10 is the mean over
  the test queries (every query once) and the draws. n = all is the recipe's own figure.
- in-sample reach: the variant fitted on every query at each (L2, prior scale) of the grid and scored
  on those same queries: the best a linear probe on these states reaches having seen the test queries,
  an upper bound for the held-out figure, beside the teacher's own.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, with or without an install

from hllm.config import load_config  # noqa: E402
from hllm.eval.evaluation import first_stage_order, quality  # noqa: E402
from hllm.model.item_states import POOLINGS  # noqa: E402
from hllm.model.ranker import SinglePassRanker  # noqa: E402
from hllm.recipes.realtext import RealTextConfig  # noqa: E402  (the recipe's config: this reads its caches)
from hllm.train.probes import FOLD_SALT, VariantFitter, load_queries  # noqa: E402
from hllm.train.head_fit import judged_ndcg, query_folds, ridge_utilities, set_utility  # noqa: E402


def learning_curve(fitter: VariantFitter, variant, teacher: str, queries, sizes: list[int], draws: int) -> dict[int | str, list[float]]:
    """{n: per draw the held-out nDCG@10 over every query} for the variant fitted on n training queries a fold."""
    cfg = fitter.cfg
    folds = query_folds(len(queries), [q.slate.slate_id for q in queries], cfg.folds, FOLD_SALT)
    curve: dict[int | str, list[float]] = {}
    for n in [*sizes, "all"]:
        for draw in range(1 if n == "all" else draws):
            rng, held = random.Random(draw), []
            for train_idx, test_idx in folds:
                pick = train_idx if n == "all" else rng.sample(train_idx, min(n, len(train_idx)))
                fitter.fit(variant, teacher, [queries[i] for i in pick])  # its settings by the recipe's CV
                held += [judged_ndcg(fitter.ranker, fitter.judged(variant, [queries[i]]), cfg.rel) for i in test_idx]
            curve.setdefault(n, []).append(float(np.mean(held)))
            print(f"  n={n} draw {draw}: {curve[n][-1]:.4f}", flush=True)
    return curve


def in_sample(fitter: VariantFitter, variant, teacher: str, queries) -> tuple[float, float, float]:
    """The variant fitted on every query, scored on the same queries: (best nDCG@10, its L2, its prior scale)."""
    cfg = fitter.cfg
    items, _ = fitter.views(variant, teacher, queries)
    fitter.new_head(variant)
    best = (-1.0, 0.0, 0.0)
    for lam, (w, b) in zip(cfg.ridge_lambdas, ridge_utilities(items, cfg.ridge_lambdas)):
        for scale in cfg.prior_scales:
            set_utility(fitter.ranker, w, b, scale)
            best = max(best, (judged_ndcg(fitter.ranker, fitter.judged(variant, queries), cfg.rel), lam, scale))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/realtext/smollm2-dl19-rankvicuna.yaml")
    ap.add_argument("--variants", nargs="+", default=["ridge-l16-mean", "judged-ridge-l16-lm"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[8, 16, 24])
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--out", default="reports/distill_limits.md")
    args = ap.parse_args()
    cfg = load_config(RealTextConfig, args.config, [])
    ranker = SinglePassRanker.build(cfg.ranker).eval()
    queries, _ = load_queries(cfg, ranker, cfg.teacher_collection, cfg.teachers)
    fitter = VariantFitter(cfg, ranker, queries[0].states[cfg.layers[0]].shape[1] // len(POOLINGS[cfg.ranker.pooling]))
    teacher = cfg.teachers[0].name
    slates = [q.slate for q in queries]
    first = quality(slates, first_stage_order(slates), cfg.rel)["nDCG@10"]
    taught = quality(slates, [q.perms[teacher] for q in queries], cfg.rel)["nDCG@10"]
    by_name = {v.name: v for v in cfg.variants}
    lines = [f"# What limits the distilled student ({Path(cfg.teacher_collection).name}, {len(queries)} queries, teacher {teacher})", "",
             f"`python benchmarks/distill_limits.py --config {args.config}`; the recipe's states, folds ({cfg.folds}, by query hash) "
             f"and CV ({cfg.cv_folds}-fold; L2 {cfg.ridge_lambdas}, prior scale {cfg.prior_scales}). nDCG@10, means over queries "
             f"(and over {args.draws} random subsets of each fold's training queries where n < all).", "",
             f"First stage {first:.4f}; {teacher} {taught:.4f}; half of the teacher's gain: {(first + taught) / 2:.4f}.", ""]
    for name in args.variants:
        v = by_name[name]
        if v.fit != "ridge":
            raise SystemExit(f"{name}: the in-sample reach is the closed-form probe's; pass ridge variants")
        target = None if v.target == "judgments" else teacher
        print(f"{name}: learning curve", flush=True)
        curve = learning_curve(fitter, v, target, queries, args.sizes, args.draws)
        reach = in_sample(fitter, v, target, queries)
        per_fold = len(queries) * (cfg.folds - 1) // cfg.folds
        lines += [f"## {name} (target: {v.target})", "", "| training queries a fold | held-out nDCG@10 | draws |", "| ---: | ---: | --- |"]
        lines += [f"| {n if n != 'all' else f'all (~{per_fold})'} | {statistics.mean(vals):.4f} | {', '.join(f'{x:.4f}' for x in vals)} |"
                  for n, vals in curve.items()]
        lines += ["", f"In-sample reach (fitted and scored on all {len(queries)} queries): {reach[0]:.4f} "
                      f"(L2 {reach[1]:g}, prior scale {reach[2]:g}).", ""]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
