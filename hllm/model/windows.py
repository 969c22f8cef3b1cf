"""Ranking lists longer than one window: each window is one ranker call (a generation for the
teacher, a prefill for the student); all slates advance one round at a time, so each round is one
batched call whatever the number of slates.

Strategies (`WINDOWINGS`), each a generator over one slate that yields the windows of its next
round (lists of candidate indices) and receives their permutations:

- `sliding` (RankGPT): back to front, rank [N-w, N), move up by `stride`, rank again until the
  window reaches the top; the best candidates bubble up. ceil((N-w)/stride)+1 windows, sequential.
- `blocks` (a tournament): rank N/w disjoint blocks in one round, then rank the top
  max(1, w // blocks) of every block together (recursively while they exceed w); the rest follow
  round-robin by within-block rank. ceil(N/w) + 1 windows for N <= w^2, in 2 rounds.

A window whose ranker returns None (the teacher's unparseable answer, not repaired) keeps its order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence

from hllm.records import ParseCounts, RerankRequest, TeacherRanking

Perm = list[int]
Windowing = Generator[list[list[int]], list["Perm | None"], list[int]]


def window_plan(n: int, window: int, stride: int) -> list[tuple[int, int]]:
    """[(start, end), ...] from the back to the front; one window when n <= window."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window={window}, stride={stride}")
    plan, end = [], n
    while True:
        start = max(0, end - window)
        plan.append((start, end))
        if start == 0:
            return plan
        end -= stride


def _apply(items: list[int], perm: Perm | None) -> list[int]:
    return list(items) if perm is None else [items[p] for p in perm]


def sliding(n: int, window: int, stride: int) -> Windowing:
    order = list(range(n))
    for start, end in window_plan(n, window, stride):
        (perm,) = yield [order[start:end]]
        order[start:end] = _apply(order[start:end], perm)
    return order


def _tournament(items: list[int], window: int) -> Windowing:
    if len(items) <= window:
        (perm,) = yield [items]
        return _apply(items, perm)
    blocks = [items[i: i + window] for i in range(0, len(items), window)]
    ranked = [_apply(b, p) for b, p in zip(blocks, (yield blocks))]
    m = max(1, window // len(blocks))
    # the winners go on in first-stage order: a ranker that reads input position (all do) sees the
    # order it was trained on, not a round-robin of blocks
    winners = sorted(r[j] for j in range(m) for r in ranked if j < len(r))
    top = yield from _tournament(winners, window)
    rest = [r[j] for j in range(m, window) for r in ranked if j < len(r)]
    return top + rest


def blocks(n: int, window: int, stride: int) -> Windowing:  # stride unused: blocks do not overlap
    if window < 2:
        raise ValueError(f"need window >= 2, got {window}")
    return (yield from _tournament(list(range(n)), window))


WINDOWINGS: dict[str, Callable[[int, int, int], Windowing]] = {"sliding": sliding, "blocks": blocks}


def rank_in_windows(sizes: Sequence[int], rank_windows: Callable[[list[tuple[int, list[int]]]], list[Perm | None]],
                    window: int, stride: int, strategy: str = "sliding") -> tuple[list[list[int]], list[int]]:
    """-> (each slate's order of all its candidates, each slate's number of windows ranked).

    `rank_windows([(slate index, candidate indices of one window), ...])` ranks every window of
    one round in one call and returns, per window, a permutation of it (or None)."""
    if strategy not in WINDOWINGS:
        raise ValueError(f"unknown windowing {strategy!r}; known: {sorted(WINDOWINGS)}")
    orders: list[list[int] | None] = [None] * len(sizes)
    calls = [0] * len(sizes)
    gens = {i: WINDOWINGS[strategy](n, window, stride) for i, n in enumerate(sizes)}
    pending = {}
    for i, gen in gens.items():
        pending[i] = next(gen)
    while pending:
        flat = [(i, w) for i, windows in pending.items() for w in windows]
        perms = iter(rank_windows(flat))
        answered = {i: [next(perms) for _ in windows] for i, windows in pending.items()}
        pending = {}
        for i, got in answered.items():
            calls[i] += len(got)
            try:
                pending[i] = gens[i].send(got)
            except StopIteration as done:
                orders[i] = done.value
    return orders, calls  # type: ignore[return-value]


def merge_counts(counts: list[ParseCounts]) -> ParseCounts:
    """A slate's windows' parse flags -> one answer's: a flag raised by any window, ok when all were."""
    merged = ParseCounts(total=1)
    for f in ("wrong_format", "repeated", "missing", "out_of_range"):
        setattr(merged, f, int(any(getattr(c, f) for c in counts)))
    merged.ok = int(all(c.ok for c in counts))
    return merged


def rank_with_windows(rank: Callable[[list[RerankRequest]], list[TeacherRanking]], requests: list[RerankRequest],
                      window: int, stride: int, strategy: str = "sliding") -> list[TeacherRanking]:
    """The teacher over windows: `rank` is its batch call. A window whose answer has no permutation
    (not repaired) keeps its order and leaves the slate's permutation None."""
    parts: list[list[TeacherRanking]] = [[] for _ in requests]
    spans: list[list[list[int]]] = [[] for _ in requests]

    def rank_windows(flat: list[tuple[int, list[int]]]) -> list[Perm | None]:
        subs = []
        for i, idx in flat:
            req = requests[i]
            subs.append(dataclasses.replace(
                req, candidates=[req.candidates[j] for j in idx],
                grades=[req.grades[j] for j in idx] if req.grades else None))
        results = rank(subs)
        for (i, idx), result in zip(flat, results):
            parts[i].append(result)
            spans[i].append(sorted(idx))
        return [r.permutation for r in results]

    orders, _ = rank_in_windows([len(r.candidates) for r in requests], rank_windows, window, stride, strategy)
    out = []
    for req, order, results, windows in zip(requests, orders, parts, spans):
        failed = any(r.permutation is None for r in results)
        out.append(TeacherRanking(
            slate_id=req.slate_id, permutation=None if failed else order,
            raw_text=" || ".join(r.raw_text for r in results), counts=merge_counts([r.counts for r in results]),
            prompt_tokens=sum(r.prompt_tokens for r in results), output_tokens=sum(r.output_tokens for r in results),
            latency_s=sum(r.latency_s for r in results), windows=windows,
            failure=next((r.failure for r in results if r.failure), "")))
    return out
