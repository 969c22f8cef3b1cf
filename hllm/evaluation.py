"""Evaluation of rankers side by side: quality, agreement to the teacher, validity, latency.

Latency is measured in one run, on the same requests, batch size 1, interleaved (request i is
timed for every method before request i+1), so machine noise hits all methods alike:
- `ar_teacher`: prompt -> greedy generation with the KV cache -> parse;
- `bare_prefill`: the backbone's decoder stack over the same prompt, nothing else;
- `single_pass`: prefill + head + decoder (Hungarian by default) -> permutation;
- `tokenize`: building the prompt tensors (shared by all three, reported apart).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hllm.decoding import DECODERS, is_permutation, rank1_energy
from hllm.metrics import agreement, ir_measure_names, ir_metrics, ir_metrics_per_query, validity_rate
from hllm.prompts import collate
from hllm.records import ParseCounts, RerankRequest, TeacherRanking


@dataclass
class EvalConfig:
    """Held-out evaluation."""

    decoders: list[str] = field(default_factory=lambda: list(DECODERS))
    main_decoder: str = "hungarian"
    binary_rel: int = 2  # MRR / Recall count grade >= this as relevant
    latency_requests: int = 20
    latency_warmup: int = 3

    def __post_init__(self) -> None:
        unknown = sorted(set(self.decoders + [self.main_decoder]) - set(DECODERS))
        if unknown:
            raise ValueError(f"eval.decoders: unknown {unknown}; known: {sorted(DECODERS)}")


def quality(requests: Sequence[RerankRequest], perms: Sequence[Sequence[int]], rel: int) -> dict[str, float]:
    return ir_metrics(requests, perms, ir_measure_names(rel))


def evaluate_teacher(requests: Sequence[RerankRequest], rankings: Sequence[TeacherRanking], rel: int) -> dict:
    """Quality over every slate: unparseable answers score with the input order (counted apart)."""
    counts = ParseCounts()
    for r in rankings:
        counts.add(r.counts)
    perms = [r.permutation if r.permutation is not None else list(range(len(q.candidates)))
             for q, r in zip(requests, rankings)]
    return {**quality(requests, perms, rel), "validity": counts.validity, **{f"parse_{k}": v for k, v in counts.rates().items()},
            "unparsed_scored_as_input_order": sum(r.permutation is None for r in rankings)}


def score_matrices(ranker, requests: Sequence[RerankRequest], batch_size: int = 32) -> list[np.ndarray]:
    """-> per request the (n, min(K, n)) score matrix, scored in batches."""
    matrices: list[np.ndarray] = []
    for start in range(0, len(requests), batch_size):
        matrices += ranker.score(list(requests[start: start + batch_size]))
    return matrices


def decoder_report(requests: Sequence[RerankRequest], matrices: Sequence[np.ndarray],
                   teacher_perms: Sequence[list[int] | None], cfg: EvalConfig) -> tuple[dict[str, dict], dict[str, list]]:
    """Every decoder on the same matrices -> ({decoder: metrics, "matrix": ...}, {decoder: per-query nDCG@10}).

    Per decoder: IR metrics, agreement to the teacher, validity, the share of slates decoded to
    exactly the main decoder's permutation, and the decoder's own time per matrix.
    """
    out, per_query, perms_by = {}, {}, {}
    for name in cfg.decoders:
        t0 = time.perf_counter()
        decoded = [DECODERS[name](m) for m in matrices]
        decode_ms = 1000 * (time.perf_counter() - t0) / max(len(matrices), 1)
        perms = perms_by[name] = [d.permutation.tolist() for d in decoded]
        by_qid = ir_metrics_per_query(requests, perms)
        per_query[name] = [by_qid.get(r.slate_id, float("nan")) for r in requests]
        out[name] = {
            **quality(requests, perms, cfg.binary_rel),
            **agreement(perms, teacher_perms),
            "validity": validity_rate(perms, [len(r.candidates) for r in requests]),
            "repaired": float(np.mean([d.repaired for d in decoded])),
            "decode_ms": decode_ms,
        }
    main = perms_by.get(cfg.main_decoder)
    for name, perms in perms_by.items():
        if main is not None:
            out[name]["same_as_main"] = float(np.mean([p == q for p, q in zip(perms, main)]))
    energy = [rank1_energy(m) for m in matrices]
    out["matrix"] = {"rank1_energy_mean": float(np.mean(energy)), "rank1_energy_p10": float(np.percentile(energy, 10))}
    return out, per_query


def evaluate_student(ranker, requests: Sequence[RerankRequest], teacher_perms: Sequence[list[int] | None],
                     cfg: EvalConfig, batch_size: int = 32) -> dict[str, dict]:
    """Scores once, then compares every decoder on the same matrices."""
    return decoder_report(requests, score_matrices(ranker, requests, batch_size), teacher_perms, cfg)[0]


def interleaved_latency(methods: dict[str, Callable[[RerankRequest], object]], requests: Sequence[RerankRequest],
                        warmup: int = 3) -> dict[str, dict[str, float]]:
    """-> {method: {p50_ms, p95_ms}} at batch size 1; request i is timed for every method before
    request i + 1, so machine noise hits all methods alike. Each timed call comes right after an
    untimed call of the same method on the same request: whichever method follows the AR teacher's
    long generation otherwise pays ~2 ms of cold caches (a replica serving one method does not), and
    the order is shuffled per request (seeded). The first `warmup` requests are run but not counted."""
    reqs = list(requests)
    times: dict[str, list[float]] = {name: [] for name in methods}
    order, rng = list(methods), random.Random(0)
    for i, req in enumerate(reqs[:warmup] + reqs):
        rng.shuffle(order)
        for name in order:
            methods[name](req)  # warm: caches and allocator back in this method's state
            t = _timed(lambda: methods[name](req))
            if i >= warmup:
                times[name].append(1000 * t)
    return {k: {"p50_ms": float(np.median(v)), "p95_ms": float(np.percentile(v, 95))} for k, v in times.items()}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.no_grad()
def latency_profile(ranker, teacher, requests: Sequence[RerankRequest], cfg: EvalConfig) -> dict[str, dict[str, float]]:
    """Per-request latency (ms, p50/p95) at batch size 1 for each method, measured interleaved."""
    reqs = list(requests[: cfg.latency_requests])
    batches = {id(r): {k: v.to(ranker.device) for k, v in
                       collate([ranker.prompts.encode(r, with_answer=False)], ranker.tokenizer.pad_token_id).items()}
               for r in reqs}

    def single_pass(req: RerankRequest) -> None:
        logits = ranker(**batches[id(req)])[0].float().cpu().numpy()  # (N, K)
        n = len(req.candidates)
        assert is_permutation(DECODERS[cfg.main_decoder](logits[:n, :min(n, logits.shape[1])]).permutation, n)

    methods = {
        "tokenize": lambda req: collate([ranker.prompts.encode(req, with_answer=False)], ranker.tokenizer.pad_token_id),
        "bare_prefill": lambda req: ranker.hidden_states(batches[id(req)]["input_ids"], batches[id(req)]["attention_mask"]),
        "single_pass": single_pass,
        "ar_teacher": lambda req: teacher.rank([req]),
    }
    return interleaved_latency(methods, reqs, cfg.latency_warmup)
