"""Ranking metrics. IR metrics go through `ir_measures` (pytrec_eval, i.e. trec_eval's own code):

- nDCG@k exactly as trec_eval's `ndcg_cut`: gain = grade, log2 discount, and judged documents
  outside the slate count in the ideal DCG (they are in the qrels, not in the run);
- MRR and Recall@k with a binary relevance threshold (TREC DL uses grade >= 2).
Runs are written with strictly decreasing scores (N - rank), so trec_eval's tie-breaking by
document id never reorders them.

Agreement to the teacher (Kendall tau over item positions, top-1 agreement) and validity are
computed here; Kendall tau comes from scipy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import ir_measures
import numpy as np
from scipy.stats import kendalltau

from hllm.records import RerankRequest


def ir_measure_names(rel: int = 1, depths: Sequence[int] = (1, 5, 10)) -> dict[str, str]:
    """Canonical metric names (the keys every report carries) -> ir_measures measure strings;
    MRR and Recall count grade >= `rel` as relevant."""
    return {**{f"nDCG@{k}": f"nDCG@{k}" for k in depths}, "MRR@10": f"RR(rel={rel})@10", "R@10": f"R(rel={rel})@10"}


def _qrels_and_run(requests: Sequence[RerankRequest], permutations: Sequence[Sequence[int]], ids: Sequence[str]):
    """trec_eval's qrels and run, list k under the query id `ids[k]` (trec_eval keys by query id)."""
    if len(requests) != len(permutations):
        raise ValueError(f"{len(requests)} requests but {len(permutations)} permutations")
    qrels, run = [], []
    for req, perm, qid in zip(requests, permutations, ids):
        for docid, grade in req.qrels().items():
            qrels.append(ir_measures.Qrel(qid, docid, int(grade)))
        n = len(perm)
        for rank, idx in enumerate(perm):
            run.append(ir_measures.ScoredDoc(qid, req.candidates[int(idx)].docid, float(n - rank)))
    return qrels, run


def _list_ids(requests: Sequence[RerankRequest]) -> list[str]:
    """An id per list for one evaluation: the query id, or, where some query has several lists (first stages,
    collections), the list's position too, so that each list is scored apart with its own judgments."""
    ids = [r.slate_id for r in requests]
    return ids if len(set(ids)) == len(ids) else [f"{k}:{q}" for k, q in enumerate(ids)]


def _parsed(measures: Mapping[str, str] | Sequence[str]) -> dict[str, Any]:
    named = dict(measures) if isinstance(measures, Mapping) else {m: m for m in measures}
    return {name: ir_measures.parse_measure(m) for name, m in named.items()}


def ir_metrics(requests: Sequence[RerankRequest], permutations: Sequence[Sequence[int]],
               measures: Mapping[str, str] | Sequence[str] | None = None) -> dict[str, float]:
    """Mean over judged lists (queries, when each has one list), like trec_eval without -c. `measures` maps the names
    to report to measure strings (default `ir_measure_names()`); a plain list reports under the strings."""
    parsed = _parsed(measures or ir_measure_names())
    agg = ir_measures.calc_aggregate(list(parsed.values()), *_qrels_and_run(requests, permutations, _list_ids(requests)))
    return {name: float(agg[p]) for name, p in parsed.items()}


def ir_metrics_per_query(requests: Sequence[RerankRequest], permutations: Sequence[Sequence[int]],
                         measure: str = "nDCG@10") -> dict[str, float]:
    return ir_metrics_by_query(requests, permutations, [measure])[measure]


def _by_id(requests: Sequence[RerankRequest], permutations: Sequence[Sequence[int]], ids: Sequence[str],
           measures: Mapping[str, str] | Sequence[str]) -> dict[str, dict[str, float]]:
    parsed = _parsed(measures)
    names = {p: name for name, p in parsed.items()}
    out: dict[str, dict[str, float]] = {name: {} for name in parsed}
    for m in ir_measures.iter_calc(list(parsed.values()), *_qrels_and_run(requests, permutations, ids)):
        out[names[m.measure]][m.query_id] = float(m.value)
    return out


def ir_metrics_by_query(requests: Sequence[RerankRequest], permutations: Sequence[Sequence[int]],
                        measures: Mapping[str, str] | Sequence[str]) -> dict[str, dict[str, float]]:
    """-> {name: {query id: value}} over the judged queries (those `ir_metrics` averages), one
    trec_eval pass for every measure; the per-batch partial sums of a streamed evaluation add these.
    Keyed by query id, so a query may have one list here (`ndcg10_per_list` takes several)."""
    ids = [r.slate_id for r in requests]
    if twice := sorted(q for q, n in Counter(ids).items() if n > 1):
        raise ValueError(f"{len(twice)} query ids ranked more than once in one evaluation by query (e.g. {twice[:3]}): "
                         "a query's lists of two first stages or collections would be merged into one run")
    return _by_id(requests, permutations, ids, measures)


def ndcg10_per_list(requests: Sequence[RerankRequest], permutations: Sequence[Sequence[int]]) -> np.ndarray:
    """(lists,) nDCG@10 of each ranked list, in the lists' order; NaN where its query has no judgments. Lists that share
    a query id (one query over several first stages or collections) are scored apart, each with its own judgments."""
    ids = [str(k) for k in range(len(requests))]
    got = _by_id(requests, permutations, ids, ["nDCG@10"])["nDCG@10"]
    return np.array([got.get(k, np.nan) for k in ids], dtype=float)


def kendall_tau(perm: Sequence[int], reference: Sequence[int]) -> float:
    """Kendall tau-b between two rankings of the same items (1.0 = identical order)."""
    n = len(reference)
    pos_a, pos_b = np.empty(n), np.empty(n)
    pos_a[np.asarray(perm, dtype=int)] = np.arange(n)
    pos_b[np.asarray(reference, dtype=int)] = np.arange(n)
    return float(kendalltau(pos_a, pos_b).statistic)


def agreement_values(perms: Sequence[Sequence[int] | None], references: Sequence[Sequence[int] | None]
                     ) -> tuple[list[float], list[bool]]:
    """Per pair where both rankings exist: Kendall tau, and whether the top-1 agrees."""
    pairs = [(p, r) for p, r in zip(perms, references) if p is not None and r is not None]
    return [kendall_tau(p, r) for p, r in pairs], [int(p[0]) == int(r[0]) for p, r in pairs]


def agreement(perms: Sequence[Sequence[int] | None], references: Sequence[Sequence[int] | None]) -> dict[str, float]:
    """Mean Kendall tau and top-1 agreement over the pairs where both rankings exist."""
    taus, top1 = agreement_values(perms, references)
    if not taus:
        return {"kendall_tau": float("nan"), "top1_agreement": float("nan"), "pairs": 0}
    return {"kendall_tau": float(np.mean(taus)), "top1_agreement": float(np.mean(top1)), "pairs": len(taus)}


def input_order_values(perms: Sequence[Sequence[int] | None]) -> tuple[list[bool], list[float]]:
    """Per ranking that exists: whether it is the input (first-stage) order, and its Kendall tau to it."""
    given = [list(map(int, p)) for p in perms if p is not None]
    return [p == list(range(len(p))) for p in given], [kendall_tau(p, range(len(p))) for p in given]


def input_order_agreement(perms: Sequence[Sequence[int] | None]) -> dict[str, float]:
    """How much rankings merely repeat the order they were given (the first stage's): the share
    identical to it and the mean Kendall tau to it, over the rankings that exist. A teacher that
    copies its input teaches the student nothing the first stage did not know."""
    same, taus = input_order_values(perms)
    if not same:
        return {"same_as_input": float("nan"), "tau_to_input": float("nan"), "rankings": 0}
    return {"same_as_input": float(np.mean(same)), "tau_to_input": float(np.mean(taus)), "rankings": len(same)}


def validity_rate(perms: Sequence[Sequence[int] | None], sizes: Sequence[int]) -> float:
    ok = sum(p is not None and sorted(int(i) for i in p) == list(range(n)) for p, n in zip(perms, sizes))
    return ok / max(len(sizes), 1)


def top10_by_query(requests: Sequence[RerankRequest], permutations: Sequence[Sequence[int]], rel: int) -> dict[str, dict[str, float]]:
    """{"nDCG@10" | "MRR@10": {query id: value}} over the judged queries (MRR counts grade >= `rel`)."""
    names = {k: v for k, v in ir_measure_names(rel).items() if k in ("nDCG@10", "MRR@10")}
    return ir_metrics_by_query(requests, permutations, names)


def mean_ci(values: np.ndarray, resamples: int, seed: int) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean over queries (scipy.stats.bootstrap)."""
    from scipy.stats import bootstrap

    out = bootstrap((values,), np.mean, n_resamples=resamples, method="percentile", random_state=seed)
    return float(out.confidence_interval.low), float(out.confidence_interval.high)


def share_kept(student: np.ndarray, first: np.ndarray, teacher: np.ndarray, resamples: int, seed: int) -> dict[str, float]:
    """(student - first) / (teacher - first) on the means over queries, with a 95% percentile
    bootstrap interval over queries (scipy.stats.bootstrap, the queries resampled in pairs)."""
    from scipy.stats import bootstrap

    def ratio(s, b, t, axis=-1):
        return (s.mean(axis) - b.mean(axis)) / (t.mean(axis) - b.mean(axis))

    ci = bootstrap((student, first, teacher), ratio, paired=True, n_resamples=resamples, method="percentile",
                   random_state=np.random.default_rng(seed), vectorized=True).confidence_interval
    return {"share": float(ratio(student, first, teacher)), "ci_low": float(ci.low), "ci_high": float(ci.high)}
