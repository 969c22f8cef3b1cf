"""RankGPT-style sliding windows for slates longer than the teacher's window.

Back to front: rank candidates [N-w, N), move the window up by `stride`, rank again, until the
window reaches the top; the best candidates bubble up. All slates advance one window per step,
so each step is one batched generation. A slate's parse counts are the OR of its windows' flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from hllm.records import ParseCounts, RerankRequest, TeacherRanking


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


def _merge(counts: list[ParseCounts]) -> ParseCounts:
    merged = ParseCounts(total=1)
    for f in ("wrong_format", "repeated", "missing", "out_of_range"):
        setattr(merged, f, int(any(getattr(c, f) for c in counts)))
    merged.ok = int(all(c.ok for c in counts))
    return merged


def rank_with_windows(rank: Callable[[list[RerankRequest]], list[TeacherRanking]], requests: list[RerankRequest],
                      window: int, stride: int) -> list[TeacherRanking]:
    """`rank` is the teacher's batch call; windows whose answer has no permutation (not repaired)
    leave that window's order unchanged and the slate's permutation None."""
    orders = [list(range(len(r.candidates))) for r in requests]
    plans = [window_plan(len(r.candidates), window, stride) for r in requests]
    parts: list[list[TeacherRanking]] = [[] for _ in requests]
    for step in range(max(len(p) for p in plans)):
        active = [i for i, p in enumerate(plans) if step < len(p)]
        subs = []
        for i in active:
            start, end = plans[i][step]
            idx = orders[i][start:end]
            req = requests[i]
            subs.append(dataclasses.replace(
                req, candidates=[req.candidates[j] for j in idx],
                grades=[req.grades[j] for j in idx] if req.grades else None))
        for i, result in zip(active, rank(subs)):
            start, end = plans[i][step]
            if result.permutation is not None:
                window_ids = orders[i][start:end]
                orders[i][start:end] = [window_ids[p] for p in result.permutation]
            parts[i].append(result)
    out = []
    for req, order, plan, results in zip(requests, orders, plans, parts):
        failed = any(r.permutation is None for r in results)
        out.append(TeacherRanking(
            slate_id=req.slate_id, permutation=None if failed else order,
            raw_text=" || ".join(r.raw_text for r in results), counts=_merge([r.counts for r in results]),
            prompt_tokens=sum(r.prompt_tokens for r in results), output_tokens=sum(r.output_tokens for r in results),
            latency_s=sum(r.latency_s for r in results), windows=[list(w) for w in plan]))
    return out
