"""Evaluation of rankers side by side: quality, agreement to the teacher, validity, latency.

Latency is measured in one run, on the same requests, batch size 1, interleaved (request i is
timed for every method before request i+1), so machine noise hits all methods alike:
- `ar_teacher`: prompt -> greedy generation with the KV cache -> parse;
- `bare_prefill`: the backbone's decoder stack over the same prompt, nothing else;
- `single_pass`: prefill + head + decoder (Hungarian by default) -> permutation;
- `tokenize`: building the prompt tensors (shared by all three, reported apart).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from hllm.eval.metrics import (agreement_values, input_order_values, ir_measure_names, ir_metrics, ir_metrics_by_query,
                               ir_metrics_per_query, validity_rate)
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
    batch_slates: int = 32  # test slates per evaluation batch (in this process, or a task of the Ray pipeline's actor pool)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.decoders + [self.main_decoder]) - set(DECODERS))
        if unknown:
            raise ValueError(f"eval.decoders: unknown {unknown}; known: {sorted(DECODERS)}")
        if self.batch_slates < 1:
            raise ValueError(f"eval.batch_slates must be >= 1, got {self.batch_slates}")
        if self.main_decoder not in self.decoders:
            raise ValueError(f"eval.main_decoder {self.main_decoder!r} must be one of eval.decoders {self.decoders}")


def quality(requests: Sequence[RerankRequest], perms: Sequence[Sequence[int]], rel: int) -> dict[str, float]:
    """Canonical IR metrics (`hllm.eval.metrics.ir_measure_names`) of permutations of the slates."""
    return ir_metrics(requests, perms, ir_measure_names(rel))


def first_stage_order(requests: Sequence[RerankRequest]) -> list[list[int]]:
    return [list(range(len(r.candidates))) for r in requests]


# ---- partial sums: any batching, any order of batches, the same figures to the last bit -----------
class Means:
    """name -> the exact sum (a `Fraction`: a float's exact value) and count of per-slate values, so
    batches merged in any grouping or order give the same mean bit for bit: a test split evaluated in
    batches on an actor pool equals the same split evaluated in one process. A NaN value makes its
    mean NaN (as `np.mean` would)."""

    def __init__(self) -> None:
        self.sums: dict[str, list] = {}  # name -> [sum, count, NaNs]

    def add(self, name: str, values: Iterable[float]) -> "Means":
        s = self.sums.setdefault(name, [Fraction(0), 0, 0])
        for v in values:
            v = float(v)
            if math.isnan(v):
                s[2] += 1
            else:
                s[0] += Fraction(v)
                s[1] += 1
        return self

    def merge(self, other: "Means") -> "Means":
        for name, (total, count, nans) in other.sums.items():
            s = self.sums.setdefault(name, [Fraction(0), 0, 0])
            s[0], s[1], s[2] = s[0] + total, s[1] + count, s[2] + nans
        return self

    def mean(self, name: str) -> float:
        total, count, nans = self.sums.get(name, (Fraction(0), 0, 0))
        return float("nan") if nans or not count else float(total / count)

    def count(self, name: str) -> int:
        return self.sums.get(name, (0, 0, 0))[1]


def add_quality(means: Means, prefix: str, requests: Sequence[RerankRequest], perms: Sequence[Sequence[int]], rel: int) -> None:
    """Adds each judged query's canonical IR metrics under `prefix` + name (`quality` is their mean)."""
    for name, by_qid in ir_metrics_by_query(requests, perms, ir_measure_names(rel)).items():
        means.add(prefix + name, by_qid.values())


def quality_of(means: Means, prefix: str, rel: int) -> dict[str, float]:
    return {name: means.mean(prefix + name) for name in ir_measure_names(rel)}


@dataclass
class TeacherSums:
    """Partial sums of a teacher's rankings of test slates; `report()` is `evaluate_teacher`'s dict."""

    rel: int
    means: Means = field(default_factory=Means)
    counts: ParseCounts = field(default_factory=ParseCounts)
    unparsed: int = 0

    def add(self, requests: Sequence[RerankRequest], rankings: Sequence[TeacherRanking]) -> "TeacherSums":
        for r in rankings:
            self.counts.add(r.counts)
        perms = [r.permutation if r.permutation is not None else list(range(len(q.candidates)))
                 for q, r in zip(requests, rankings)]  # unparseable answers score with the input order
        add_quality(self.means, "", requests, perms, self.rel)
        self.unparsed += sum(r.permutation is None for r in rankings)
        same, taus = input_order_values([r.permutation for r in rankings])
        self.means.add("same_as_input", same).add("tau_to_input", taus)
        return self

    def merge(self, other: "TeacherSums") -> "TeacherSums":
        self.means.merge(other.means)
        self.counts.add(other.counts)
        self.unparsed += other.unparsed
        return self

    def report(self) -> dict:
        return {**quality_of(self.means, "", self.rel), "validity": self.counts.validity,
                **{f"parse_{k}": v for k, v in self.counts.rates().items()},
                "unparsed_scored_as_input_order": self.unparsed,
                "same_as_input": self.means.mean("same_as_input"), "tau_to_input": self.means.mean("tau_to_input")}


def evaluate_teacher(requests: Sequence[RerankRequest], rankings: Sequence[TeacherRanking], rel: int) -> dict:
    """Quality over every slate: unparseable answers score with the input order (counted apart)."""
    return TeacherSums(rel).add(requests, rankings).report()


@dataclass
class StudentEval:
    """Every decoder on the same score matrices of the test slates."""

    decoders: dict[str, dict[str, float]]  # decoder -> canonical IR metrics, agreement, validity, timings
    matrix: dict[str, float]  # properties of the matrices themselves (rank-1 energy)
    per_query: dict[str, list[float]]  # decoder -> nDCG@10 per slate, in slate-id order (paired comparisons)


@dataclass
class StudentSums:
    """Partial sums of the decoder report over batches of score matrices; `report()` -> `StudentEval`.
    Besides the sums it keeps one float per slate (nDCG@10 per decoder, rank-1 energy): the paired
    comparisons and the energy's 10th percentile need them."""

    cfg: EvalConfig
    means: Means = field(default_factory=Means)  # "decoder/metric" -> per-slate values
    decode_s: dict[str, float] = field(default_factory=dict)  # decoder -> seconds over every matrix
    per_query: dict[str, dict[str, float]] = field(default_factory=dict)  # decoder -> slate id -> nDCG@10
    energy: list[float] = field(default_factory=list)  # rank-1 energy per matrix (its 10th percentile)

    def add(self, requests: Sequence[RerankRequest], matrices: Sequence[np.ndarray],
            teacher_perms: Sequence[list[int] | None]) -> "StudentSums":
        perms_by = {}
        for name in self.cfg.decoders:
            t0 = time.perf_counter()
            decoded = [DECODERS[name](m) for m in matrices]
            self.decode_s[name] = self.decode_s.get(name, 0.0) + time.perf_counter() - t0
            perms = perms_by[name] = [d.permutation.tolist() for d in decoded]
            add_quality(self.means, f"{name}/", requests, perms, self.cfg.binary_rel)
            by_qid = ir_metrics_per_query(requests, perms)
            self.per_query.setdefault(name, {}).update({r.slate_id: by_qid.get(r.slate_id, float("nan")) for r in requests})
            taus, top1 = agreement_values(perms, teacher_perms)
            self.means.add(f"{name}/kendall_tau", taus).add(f"{name}/top1_agreement", top1)
            self.means.add(f"{name}/validity", [validity_rate([p], [len(r.candidates)]) for p, r in zip(perms, requests)])
            self.means.add(f"{name}/repaired", [d.repaired for d in decoded])
        main = perms_by[self.cfg.main_decoder]
        for name, perms in perms_by.items():
            self.means.add(f"{name}/same_as_main", [p == q for p, q in zip(perms, main)])
        self.energy += [rank1_energy(m) for m in matrices]
        self.means.add("rank1_energy", self.energy[len(self.energy) - len(matrices):])
        return self

    def merge(self, other: "StudentSums") -> "StudentSums":
        self.means.merge(other.means)
        for name, s in other.decode_s.items():
            self.decode_s[name] = self.decode_s.get(name, 0.0) + s
        for name, by_id in other.per_query.items():
            self.per_query.setdefault(name, {}).update(by_id)
        self.energy += other.energy
        return self

    def report(self) -> StudentEval:
        decoders, matrices = {}, len(self.energy)
        for name in self.cfg.decoders:
            m = lambda metric: self.means.mean(f"{name}/{metric}")  # noqa: E731
            pairs = self.means.count(f"{name}/kendall_tau")
            decoders[name] = {
                **quality_of(self.means, f"{name}/", self.cfg.binary_rel),
                "kendall_tau": m("kendall_tau"), "top1_agreement": m("top1_agreement"), "pairs": pairs,
                "validity": m("validity") if matrices else 0.0, "repaired": m("repaired"),
                "decode_ms": 1000 * self.decode_s.get(name, 0.0) / max(matrices, 1),
                "same_as_main": m("same_as_main"),
            }
        matrix = {"rank1_energy_mean": self.means.mean("rank1_energy"),  # a sorted list: the same whatever the order
                  "rank1_energy_p10": float(np.percentile(sorted(self.energy), 10)) if matrices else float("nan")}
        per_query = {name: [by_id[k] for k in sorted(by_id)] for name, by_id in self.per_query.items()}
        return StudentEval(decoders, matrix, per_query)


def decoder_report(requests: Sequence[RerankRequest], matrices: Sequence[np.ndarray],
                   teacher_perms: Sequence[list[int] | None], cfg: EvalConfig) -> StudentEval:
    """Per decoder: IR metrics, agreement to the teacher (Kendall tau, top-1, over the slates the
    teacher ranked), validity, the share of slates decoded to exactly the main decoder's permutation,
    and the decoder's own time per matrix."""
    return StudentSums(cfg).add(requests, matrices, teacher_perms).report()


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
    """Per-request latency (ms, p50/p95) at batch size 1 for each method (the AR teacher's where `teacher`
    is not None), measured interleaved; the
    single pass also carries `over_prefill` (`paired_ratio` to the bare prefill)."""
    reqs = list(requests[: cfg.latency_requests])
    prompts = {id(r): reranker.encode_slate(r) for r in reqs}
    methods = {"tokenize": reranker.encode_slate, **single_pass_methods(reranker, prompts, cfg.main_decoder)}
    if teacher is not None:  # None: the teacher's rankings came from a file, nothing generates
        methods["ar_teacher"] = lambda req: teacher.rank([req])
    with torch.inference_mode():
        latency = interleaved_latency(methods, reqs, cfg.latency_warmup, samples=True)
    latency["single_pass"]["over_prefill"] = paired_ratio(latency, "single_pass", "bare_prefill")
    for figures in latency.values():
        del figures["samples_ms"]
    return latency
