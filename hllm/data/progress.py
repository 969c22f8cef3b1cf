"""Progress of a long stage: rows done, rows/s and the ETA, logged at most every `every_s` seconds."""

from __future__ import annotations

import logging
import time


class Progress:
    """`update(n)` after each batch; logs "<what>: done/total rows, R rows/s, ETA" now and then and at the end."""

    def __init__(self, what: str, total: int, log: logging.Logger, every_s: float = 15.0, unit: str = "slates"):
        self.what, self.total, self.log, self.every_s, self.unit = what, max(total, 0), log, every_s, unit
        self.done, self.t0 = 0, time.perf_counter()
        self.last = self.t0

    @property
    def rate(self) -> float:
        return self.done / max(time.perf_counter() - self.t0, 1e-9)

    def eta_s(self) -> float:
        return (self.total - self.done) / self.rate if self.done else float("inf")

    def line(self) -> str:
        eta = self.eta_s()
        left = "done" if self.done >= self.total else "ETA ?" if eta == float("inf") else f"ETA {eta:.0f}s"
        return f"{self.what}: {self.done}/{self.total} {self.unit}, {self.rate:.1f} {self.unit}/s, {left}"

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            self.log.info("%s", self.line())
