"""reports/real_data.csv, the one table of real-text figures: its columns, and how a run's rows replace an earlier run's.
Written by the real-text recipe (its per-first-stage rows) and by `benchmarks/real_data.py` (the job, cross-year,
teacher-folds and input-order rows)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

FIELDS = ["collection", "queries", "split", "method", "nDCG@10", "MRR@10", "teacher", "tau_to_teacher", "share_kept",
          "share_kept_ci95",  # these four: teacher-folds, per-stage and distilled cross-year rows only
          "input_order", "order_declared", "nDCG@10_ci95"]  # the order the candidates came in (hllm.data.order), declared to the prior or not


def input_order_of(row: dict[str, Any]) -> str:
    """A row's input order: rows from before the column (and the recipes' rows) were measured in the first stage's order."""
    return row.get("input_order") or "first-stage"


def merge_rows(rows: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    """`out`'s rows with `rows` merged in: a row of the same (collection, split, method, teacher, input order, declared)
    is replaced where it stood, the others added at the end. A row from before the input-order column was measured in
    the first stage's order."""
    def key(x: dict[str, Any]) -> tuple:
        return (x["collection"], x["split"], x["method"], x.get("teacher") or "", input_order_of(x),
                x.get("order_declared") or "")

    new = {key(x): x for x in rows}
    merged = []
    if out.is_file():
        with out.open() as f:
            merged = [new.get(key(x), {**x, "input_order": input_order_of(x)}) for x in csv.DictReader(f)]
    return merged + [x for x in rows if x not in merged]


def write_rows(rows: list[dict[str, Any]], out: Path) -> None:
    """The table `out` (CSV, FIELDS' columns) holding `rows` alone."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, restval="")
        writer.writeheader()
        writer.writerows({**r, "input_order": input_order_of(r)} for r in rows)
