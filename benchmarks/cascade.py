"""The cascade on real text: the single pass answers every query, the AR teacher only the least confident ones.

    python benchmarks/cascade.py [--states runs/cascade/states]

DL19's 43 queries, BM25 top 100, the same 5 teacher-folds by query hash as `hllm realtext`'s teacher-folds (`FOLD_SALT`). The
students are the shipped `smollm2-dl19-rankvicuna` refitted per fold on its training queries, its settings read from
its folder (`ShippedProbe`), not chosen here: SmolLM2-135M frozen, cut after layer 16, mean-pooled states, a ridge probe
(L2 1e3) under the first-stage prior (scale 1/32) — `distilled` on the teacher's whole order (RankVicuna-7B's, or gpt-3.5's run 1),
`judged` on the qrels. Each query is tested once, out of fold. Its confidence signals (`hllm.model.confidence`) are
read off the same matrix; the teacher is the teacher's own run on the same candidates (files: nothing generates).

For each signal — and a predictor of the teacher's gain fitted per fold on its training queries alone
(`predicted_gains`) — escalating the least confident share s of the 43 out-of-fold queries (0, 10, 25, 50, 100%; ranked by
the signal alone, no label read — what `hllm rerank --cascade s%` does to a batch) against random escalation (mean
over 2,000 draws) and the oracle (escalate where the teacher gains most): nDCG@10 with a 95% bootstrap interval over
queries, the share of the student -> teacher gap recovered, each signal's Spearman correlation with the per-query
gap and its AUC for "the teacher gains >= 0.05", and the cost per query. The states are computed once (~10 min on 2
cores) into `--states`. Writes reports/cascade.md, reports/cascade.png and the `cascade` rows of reports/real_data.csv.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hllm.data.readers import read_slates  # noqa: E402
from hllm.eval.evaluation import first_stage_order  # noqa: E402
from hllm.model.confidence import THRESHOLDS_FILE, confidence  # noqa: E402
from hllm.model.ranker import SinglePassRanker  # noqa: E402
from hllm.model.card import record_in_provenance  # noqa: E402
from hllm.eval.metrics import top10_by_query  # noqa: E402
from hllm.train.probes import FOLD_SALT, ShippedProbe, oof_thresholds, teacher_grades  # noqa: E402
from hllm.teacher.external import external_rankings  # noqa: E402
from hllm.train.head_fit import StateSlate, decode_orders, query_folds, score_state_slates  # noqa: E402
from hllm.train.state_cache import cached_states  # noqa: E402

DL19 = ROOT.parent / "shared" / "data" / "trec-dl19-passage-bm25top100"
TEACHERS = {"rankvicuna-7b": "teacher-runs/rankvicuna-7b_top100.tsv", "gpt-3.5-turbo": "teacher-runs/gpt-3.5-turbo_top100_run1.tsv"}
SHARES = (0.0, 0.1, 0.25, 0.5, 1.0)
SIGNALS_USED = ("margin", "sharpness", "agreement")  # trust: this student has no guard (1 everywhere)
SINGLE_PASS_S = 0.024  # a 100-passage single pass on one H200 (reports/gpu_latency.md's shape)
TEACHER_S = 13.0  # a 7B AR teacher's top 100 in 9 sequential windows on one H100, estimated (reports/teacher_service.md)


SHIPPED = ShippedProbe.load()  # the shipped student's config, ridge weight and prior scale, read from its folder


def out_of_fold(model, slates, states, targets, folds) -> tuple[list[np.ndarray], list[list[int]]]:
    """Per query its (N, K) matrix and order from the probe fitted on the other folds' queries."""
    matrices: list[np.ndarray | None] = [None] * len(slates)
    for train, test in folds:
        SHIPPED.fit(model, [StateSlate(slates[i], states[i], None, targets[i]) for i in train])
        for i, m in zip(test, score_state_slates(model, [StateSlate(slates[i], states[i]) for i in test])):
            matrices[i] = m
    return matrices, decode_orders(matrices)


def features(slate, matrix: np.ndarray, order: list[int]) -> np.ndarray:
    """What the predictor reads of one query, all known before any teacher is asked: the signals, the first stage's
    score drop from its 1st to its 10th candidate, the query's length in words."""
    c = confidence(matrix, np.array(order), None, 10)
    bm25 = [cand.score or 0.0 for cand in slate.candidates]
    return np.array([c.margin, c.sharpness, c.agreement, bm25[0] - bm25[min(9, len(bm25) - 1)], len(slate.query.text.split())])


def predicted_gains(model, slates, states, targets, teacher: np.ndarray, ndcg_of, folds, lam: float = 1.0) -> np.ndarray:
    """Per query, out of fold: the teacher's gain over the student as a ridge regression on `features` predicts it,
    fitted on the fold's training queries alone — their own out-of-fold students (an inner 5-fold CV by another
    hash) against the teacher on their qrels. The test queries' qrels are never read."""
    return predicted(model, slates, states, targets, folds, lambda train, sub, orders: teacher[train] - ndcg_of(sub, orders), lam)


def top10_change(a: list[int], b: list[int]) -> float:
    """The share of `a`'s top 10 that `b` does not have in its top 10."""
    return 1 - len(set(a[:10]) & set(b[:10])) / min(10, len(a))


def predicted_change(model, slates, states, targets, perms, folds) -> np.ndarray:
    """Ablation: the same predictor fitted to how much the teacher would change the student's top 10 on each training
    query (no qrels needed: every teacher-labelled query is a label)."""
    return predicted(model, slates, states, targets, folds,
                     lambda train, sub, orders: np.array([top10_change(o, perms[i]) for o, i in zip(orders, train)]))


def committee(model, slates, states, targets, orders, folds, bags: int = 12, seed: int = 0) -> np.ndarray:
    """Ablation: per query, out of fold, the mean share of its top 10 that probes fitted on `bags` bootstrap resamples of
    the fold's training queries also put in their top 10 (query-by-committee; higher = surer)."""
    rng = np.random.default_rng(seed)
    out = np.zeros(len(slates))
    for train, test in folds:
        bagged = []
        for _ in range(bags):
            pick = rng.choice(train, len(train), replace=True)
            SHIPPED.fit(model, [StateSlate(slates[i], states[i], None, targets[i]) for i in pick])
            bagged.append(decode_orders(score_state_slates(model, [StateSlate(slates[i], states[i]) for i in test])))
        for j, i in enumerate(test):
            out[i] = 1 - np.mean([top10_change(orders[i], b[j]) for b in bagged])
    return out


def predicted(model, slates, states, targets, folds, target, lam: float = 1.0) -> np.ndarray:
    """Per query, out of fold: `target(train indices, their slates, their inner out-of-fold orders)` as a ridge
    regression on `features` predicts it, fitted on the fold's training queries alone."""
    out = np.zeros(len(slates))
    outer, _ = out_of_fold(model, slates, states, targets, folds)  # the test queries' matrices, as the cascade ranks them
    for train, test in folds:
        sub = [slates[i] for i in train]
        inner = query_folds(len(sub), [s.slate_id for s in sub], 5, "cascade-inner/")
        mats, orders = out_of_fold(model, sub, [states[i] for i in train], [targets[i] for i in train], inner)
        x = np.stack([features(sl, m, o) for sl, m, o in zip(sub, mats, orders)])  # (Q, F)
        y = target(train, sub, orders)  # (Q,) e.g. the teacher's gain on each training query
        mu, sd = x.mean(0), x.std(0) + 1e-9
        xn = (x - mu) / sd
        w = np.linalg.solve(xn.T @ xn + lam * np.eye(xn.shape[1]), xn.T @ (y - y.mean()))
        xt = np.stack([features(slates[i], outer[i], decode_orders([outer[i]])[0]) for i in test])
        out[test] = ((xt - mu) / sd) @ w + y.mean()
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def auc(score: np.ndarray, positive: np.ndarray) -> float:
    """P(a positive's score > a negative's), ties half: the AUC of `score` for `positive`."""
    pos, neg = score[positive], score[~positive]
    if not len(pos) or not len(neg):
        return float("nan")
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (len(pos) * len(neg)))


def cascade_mean(student: np.ndarray, teacher: np.ndarray, escalate: np.ndarray) -> np.ndarray:
    return np.where(escalate, teacher, student)


def bootstrap_ci(values: np.ndarray, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def curves(student: np.ndarray, teacher: np.ndarray, conf: dict[str, np.ndarray], draws: int = 2000, seed: int = 0) -> dict:
    """Per policy (each signal, random, oracle) and share: nDCG@10 mean and CI, gap recovered."""
    n, gap = len(student), teacher.mean() - student.mean()
    rng = np.random.default_rng(seed)
    out: dict[str, dict[float, dict]] = {}
    gains = teacher - student
    for policy in (*conf, "random", "oracle"):
        out[policy] = {}
        for share in SHARES:
            m = math.ceil(share * n)
            if policy == "random":
                vals = np.array([cascade_mean(student, teacher, np.isin(np.arange(n), rng.choice(n, m, replace=False))).mean()
                                 for _ in range(draws)])
                mean, lo, hi = float(vals.mean()), float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))
            else:
                key = -gains if policy == "oracle" else conf[policy]
                chosen = np.zeros(n, bool)
                chosen[np.argsort(key, kind="stable")[:m]] = True
                per = cascade_mean(student, teacher, chosen)
                mean, (lo, hi) = float(per.mean()), bootstrap_ci(per)
            out[policy][share] = {"nDCG@10": mean, "ci": (lo, hi), "recovered": (mean - student.mean()) / gap if gap else float("nan")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DL19))
    parser.add_argument("--states", default="runs/cascade/states")
    parser.add_argument("--reports", default=str(ROOT / "reports"))
    parser.add_argument("--ship-thresholds", metavar="DIR", help="write the distilled -> RankVicuna student's out-of-fold "
                        "confidence quantiles there as its cascade.json (the shipped smollm2-dl19-rankvicuna's, as "
                        "`hllm realtext` writes them when it ships)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    data = Path(args.data)
    slates = read_slates("beir", data, top_n=100)
    model = SinglePassRanker.build(SHIPPED.ranker).eval()
    states = cached_states(model, slates, args.states, shard_slates=4, progress=lambda d, t, s: print(
        f"states: {d}/{t} shards ({s:.0f}s)", flush=True))
    folds = query_folds(len(slates), [s.slate_id for s in slates], 5, FOLD_SALT)
    def ndcg_of(some, orders) -> np.ndarray:  # per query of `some`, in their order
        got = top10_by_query(some, orders, 2)["nDCG@10"]
        return np.array([got[s.slate_id] for s in some])

    def ndcg(orders) -> np.ndarray:
        return ndcg_of(slates, orders)

    first = ndcg(first_stage_order(slates))
    results, lines, rows = {}, [], []
    for tname, run in TEACHERS.items():
        rankings, _ = external_rankings("run", data / run, slates)
        perms = [r.permutation for r in rankings]
        teacher = ndcg(perms)
        for student_name, targets in (("distilled", [teacher_grades(p, len(p)) for p in perms]),
                                      ("judged", [[float(0 if g is None else g) for g in s.grades] for s in slates])):
            if student_name == "judged" and tname != "rankvicuna-7b":
                continue
            matrices, orders = out_of_fold(model, slates, states, targets, folds)
            student = ndcg(orders)
            if args.ship_thresholds and student_name == "distilled" and tname == "rankvicuna-7b":
                table = oof_thresholds(matrices, orders, data.name)  # as `hllm realtext` ships them
                print(f"wrote {table.save(args.ship_thresholds)}", flush=True)
                record_in_provenance(args.ship_thresholds, THRESHOLDS_FILE, "python benchmarks/cascade.py --ship-thresholds")
            conf = {sig: np.array([confidence(m, np.array(o), None, 10).value(sig) for m, o in zip(matrices, orders)])
                    for sig in SIGNALS_USED}
            # the predictor: escalate where the predicted gain is largest (as a "confidence", its negative)
            conf["predictor"] = -predicted_gains(model, slates, states, targets, teacher, ndcg_of, folds)
            if student_name == "distilled":  # ablations, tried after the first results were seen: reported, not chosen
                conf["committee*"] = committee(model, slates, states, targets, orders, folds)
                conf["predicted change*"] = -predicted_change(model, slates, states, targets, perms, folds)
                conf["teacher's change (bound)*"] = -np.array([top10_change(o, p) for o, p in zip(orders, perms)])
            gap = teacher - student
            table = curves(student, teacher, conf)
            key = f"{student_name} / {tname}"
            results[key] = {"first": float(first.mean()), "student": float(student.mean()), "teacher": float(teacher.mean()),
                            "curves": table, "signals": {s: {"spearman_vs_gap": spearman(conf[s], gap),
                                                              "auc_teacher_gains": auc(-conf[s], gap >= 0.05)} for s in conf}}
            best = max((s for s in conf if not s.endswith("*")), key=lambda s: table[s][0.25]["nDCG@10"])  # no ablation
            if student_name == "distilled" and tname == "rankvicuna-7b":
                lines.append(f"gap recovered at 25%: {table['margin'][0.25]['recovered']:.2f} (random "
                             f"{table['random'][0.25]['recovered']:.2f}, oracle {table['oracle'][0.25]['recovered']:.2f})")
                lines.append(f"gap recovered at 25% by the out-of-fold predictor: {table['predictor'][0.25]['recovered']:.2f}")
                lines.append(f"(by the best signal at 25%, {best}: {table[best][0.25]['recovered']:.2f} — chosen on these "
                             "same queries, so read it as an upper bound)")
            for share in SHARES:
                for policy in ("margin", "predictor", "random", "oracle"):
                    rows.append([data.name, len(slates), "cascade", f"{student_name}+{policy}@{int(share * 100)}%",
                                 f"{table[policy][share]['nDCG@10']:.4f}", "", tname, "", "", ""])
            print(key, {s: round(table[s][0.25]["nDCG@10"], 4) for s in table}, flush=True)
    write(Path(args.reports), results, lines, rows)


def write(reports: Path, results: dict, lines: list[str], rows: list[list]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "distilled / rankvicuna-7b"
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, table in results[key]["curves"].items():
        ax.plot([100 * s for s in SHARES], [table[s]["nDCG@10"] for s in SHARES], marker="o", label=policy)
    ax.axhline(results[key]["first"], color="grey", linestyle=":", label="BM25")
    ax.set_xlabel("queries escalated to the teacher (%)")
    ax.set_ylabel("nDCG@10 (DL19, 43 queries)")
    ax.set_title("cascade: distilled student -> RankVicuna-7B")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(reports / "cascade.png", dpi=120)
    md = ["`python benchmarks/cascade.py`, one run (closed-form fits: no seeds). DL19, 43 queries, each tested once out "
          "of fold (5 teacher-folds by query hash); BM25 top 100; nDCG@10 means over the 43 queries, 95% bootstrap "
          "intervals over queries; escalation ranks the 43 out-of-fold queries by the signal alone.", "", *lines, "",
          "![cascade curves](cascade.png)", "", "\\* ablations, tried after the first results were seen (reported, not "
          "chosen): `committee*`, the agreement of 12 probes fitted on bootstrap resamples of each fold's training queries "
          "(query-by-committee); `predicted change*`, the predictor fitted to how much the teacher changes the student's "
          "top 10 on training queries (no qrels needed); `teacher's change (bound)*`, that change itself — it needs the "
          "teacher's answer, so no cascade can have it: it bounds what *any* predictor of \"the teacher would change this "
          "ranking\" can recover.", "", "What the figures say and what limits them: docs/real-text.md, \"The cascade on "
          "real text\".", ""]
    for k, r in results.items():
        md += [f"### {k}", "", f"BM25 {r['first']:.4f}, student {r['student']:.4f}, teacher {r['teacher']:.4f}.", "",
               "| escalation | " + " | ".join(f"{int(100 * s)}%" for s in SHARES) + " |",
               "| --- | " + " | ".join("---:" for _ in SHARES) + " |"]
        for policy, table in r["curves"].items():
            md.append(f"| {policy} | " + " | ".join(
                f"{table[s]['nDCG@10']:.4f} [{table[s]['ci'][0]:.3f}, {table[s]['ci'][1]:.3f}] ({table[s]['recovered']:.2f})"
                for s in SHARES) + " |")
        md += ["", "(nDCG@10 [95% CI] (gap recovered); the random row's interval is the spread over its draws)", "", "| signal | Spearman with the teacher - student gap | AUC for teacher gains >= 0.05 |",
               "| --- | ---: | ---: |"]
        md += [f"| {s} | {v['spearman_vs_gap']:.3f} | {v['auc_teacher_gains']:.3f} |" for s, v in r["signals"].items()]
        md.append("")
    cost = ["Cost per query (estimates, labelled): single pass ~24 ms (a 100-passage prompt on one H200, measured in "
            "reports/gpu_latency.md's shape), RankVicuna-7B's top 100 in 9 sequential windows ~13 s on one H100 "
            "(reports/teacher_service.md's token counts at published vLLM rates). A cascade costs single + share x teacher:",
            "", "| share | seconds a query | x the single pass |", "| ---: | ---: | ---: |"]
    cost += [f"| {int(100 * s)}% | {SINGLE_PASS_S + s * TEACHER_S:.2f} | {(SINGLE_PASS_S + s * TEACHER_S) / SINGLE_PASS_S:.0f} |"
             for s in SHARES]
    (reports / "cascade.md").write_text("# The cascade on real text\n\n" + "\n".join(md + cost) + "\n")
    path = reports / "real_data.csv"
    kept = [r for r in csv.reader(path.open()) if r and r[2] != "cascade"] if path.exists() else \
        [["collection", "queries", "split", "method", "nDCG@10", "MRR@10", "teacher", "tau_to_teacher", "share_kept", "share_kept_ci95"]]
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows(kept + rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
