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

from hllm.eval.metrics import agreement, input_order_agreement, ir_measure_names, ir_metrics, ir_metrics_per_query, validity_rate
from hllm.model.decoding import DECODERS, is_permutation, rank1_energy
from hllm.model.prompts import EncodedPrompt
from hllm.records import ParseCounts, RerankRequest, TeacherRanking
from hllm.reranker import Reranker


@dataclass
class EvalConfig:
    """Held-out evaluation."""

    decoders: list[str] = field(default_factory=lambda: list(DECODERS))  # decoders evaluated side by side
    main_decoder: str = "hungarian"  # the one the summary and Serve use
    binary_rel: int = 2  # MRR@10 / R@10 count grade >= this as relevant
    latency_requests: int = 20  # timed requests per method in the latency profile
    latency_warmup: int = 3  # untimed requests first

    def __post_init__(self) -> None:
        unknown = sorted(set(self.decoders + [self.main_decoder]) - set(DECODERS))
        if unknown:
            raise ValueError(f"eval.decoders: unknown {unknown}; known: {sorted(DECODERS)}")
        if self.main_decoder not in self.decoders:
            raise ValueError(f"eval.main_decoder {self.main_decoder!r} must be one of eval.decoders {self.decoders}")


def quality(requests: Sequence[RerankRequest], perms: Sequence[Sequence[int]], rel: int) -> dict[str, float]:
    """Canonical IR metrics (`hllm.eval.metrics.ir_measure_names`) of permutations of the slates."""
    return ir_metrics(requests, perms, ir_measure_names(rel))


def first_stage_order(requests: Sequence[RerankRequest]) -> list[list[int]]:
    return [list(range(len(r.candidates))) for r in requests]


def evaluate_teacher(requests: Sequence[RerankRequest], rankings: Sequence[TeacherRanking], rel: int) -> dict:
    """Quality over every slate: unparseable answers score with the input order (counted apart)."""
    counts = ParseCounts()
    for r in rankings:
        counts.add(r.counts)
    perms = [r.permutation if r.permutation is not None else list(range(len(q.candidates)))
             for q, r in zip(requests, rankings)]
    return {**quality(requests, perms, rel), "validity": counts.validity, **{f"parse_{k}": v for k, v in counts.rates().items()},
            "unparsed_scored_as_input_order": sum(r.permutation is None for r in rankings),
            **{k: v for k, v in input_order_agreement([r.permutation for r in rankings]).items() if k != "rankings"}}


@dataclass
class StudentEval:
    """Every decoder on the same score matrices of the test slates."""

    decoders: dict[str, dict[str, float]]  # decoder -> canonical IR metrics, agreement, validity, timings
    matrix: dict[str, float]  # properties of the matrices themselves (rank-1 energy)
    per_query: dict[str, list[float]]  # decoder -> nDCG@10 per slate, in slate order (paired comparisons)


def decoder_report(requests: Sequence[RerankRequest], matrices: Sequence[np.ndarray],
                   teacher_perms: Sequence[list[int] | None], cfg: EvalConfig) -> StudentEval:
    """Per decoder: IR metrics, agreement to the teacher, validity, the share of slates decoded to
    exactly the main decoder's permutation, and the decoder's own time per matrix."""
    decoders, per_query, perms_by = {}, {}, {}
    for name in cfg.decoders:
        t0 = time.perf_counter()
        decoded = [DECODERS[name](m) for m in matrices]
        decode_ms = 1000 * (time.perf_counter() - t0) / max(len(matrices), 1)
        perms = perms_by[name] = [d.permutation.tolist() for d in decoded]
        by_qid = ir_metrics_per_query(requests, perms)
        per_query[name] = [by_qid.get(r.slate_id, float("nan")) for r in requests]
        decoders[name] = {
            **quality(requests, perms, cfg.binary_rel),
            **agreement(perms, teacher_perms),
            "validity": validity_rate(perms, [len(r.candidates) for r in requests]),
            "repaired": float(np.mean([d.repaired for d in decoded])),
            "decode_ms": decode_ms,
        }
    main = perms_by[cfg.main_decoder]
    for name, perms in perms_by.items():
        decoders[name]["same_as_main"] = float(np.mean([p == q for p, q in zip(perms, main)]))
    energy = [rank1_energy(m) for m in matrices]
    matrix = {"rank1_energy_mean": float(np.mean(energy)), "rank1_energy_p10": float(np.percentile(energy, 10))}
    return StudentEval(decoders, matrix, per_query)


def evaluate_student(reranker: Reranker, requests: Sequence[RerankRequest], teacher_perms: Sequence[list[int] | None],
                     cfg: EvalConfig) -> StudentEval:
    """Scores once, then compares every decoder on the same matrices."""
    return decoder_report(requests, reranker.score_slates(requests), teacher_perms, cfg)


def interleaved_latency(methods: dict[str, Callable[[RerankRequest], object]], requests: Sequence[RerankRequest],
                        warmup: int = 3, samples: bool = False) -> dict[str, dict]:
    """-> {method: {p50_ms, p95_ms}} (and `samples_ms`, each request's time in request order, when
    `samples`) at batch size 1; request i is timed for every method before
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
    return {k: {"p50_ms": float(np.median(v)), "p95_ms": float(np.percentile(v, 95)), **({"samples_ms": v} if samples else {})}
            for k, v in times.items()}


def paired_ratio(latency: dict[str, dict], num: str, den: str) -> float:
    """Median over requests of each request's `num` time / its `den` time (from `interleaved_latency(...,
    samples=True)`): the two are timed moments apart, so the machine's drift cancels."""
    return float(np.median(np.array(latency[num]["samples_ms"]) / np.array(latency[den]["samples_ms"])))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def single_pass_methods(reranker: Reranker, prompts: dict[int, EncodedPrompt], decoder: str | None = None
                        ) -> dict[str, Callable[[RerankRequest], object]]:
    """The bare prefill and the single pass (prefill + head + decoder) of already-encoded requests
    (keyed by `id(request)`), both through the `Reranker` path that Serve runs."""
    def single_pass(req: RerankRequest) -> None:
        decoded = reranker.decode(reranker.score_encoded([prompts[id(req)]])[0], decoder)
        assert is_permutation(decoded.permutation, len(req.candidates))

    return {"bare_prefill": lambda req: reranker.prefill([prompts[id(req)]]), "single_pass": single_pass}


def latency_profile(reranker: Reranker, teacher, requests: Sequence[RerankRequest], cfg: EvalConfig) -> dict[str, dict[str, float]]:
    """Per-request latency (ms, p50/p95) at batch size 1 for each method, measured interleaved; the
    single pass also carries `over_prefill` (`paired_ratio` to the bare prefill)."""
    reqs = list(requests[: cfg.latency_requests])
    prompts = {id(r): reranker.encode_slate(r) for r in reqs}
    methods = {"tokenize": reranker.encode_slate, **single_pass_methods(reranker, prompts, cfg.main_decoder),
               "ar_teacher": lambda req: teacher.rank([req])}
    with torch.inference_mode():
        latency = interleaved_latency(methods, reqs, cfg.latency_warmup, samples=True)
    latency["single_pass"]["over_prefill"] = paired_ratio(latency, "single_pass", "bare_prefill")
    for figures in latency.values():
        del figures["samples_ms"]
    return latency
