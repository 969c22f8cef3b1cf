"""TREC run files: written in query shards that a re-run resumes, evaluated with trec_eval's code.

A run is six columns, `qid Q0 docid rank score tag`, scores strictly decreasing along each query's
ranking (N - rank + 1: rank-derived, so trec_eval's tie-break by document id never reorders it).
`ShardedRun` plans query shards; each finished shard is a file named by a hash of its query ids,
written atomically (temp file + rename), so shards can be ranked anywhere (a process, a Ray actor)
and a re-run skips the ones on disk. `finish` joins them into the run file atomically; nothing is
half-written at any moment, and a shard folder started with other settings is refused, not mixed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import ir_measures

from hllm.data.readers import DataFormatError, read_qrels, read_run
from hllm.data.store import merge, shard_name
from hllm.eval.metrics import ir_measure_names
from hllm.records import RerankRequest


def atomic_write(path: str | Path, text: str) -> None:
    """`text` appears at `path` whole or not at all (temp file in the same folder + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def run_lines(slates: Sequence[RerankRequest], orders: Sequence[Sequence[int]], tag: str) -> list[str]:
    """Each slate's order (0-based candidate indices, best first) -> TREC run lines."""
    if len(slates) != len(orders):
        raise ValueError(f"{len(slates)} slates but {len(orders)} orders")
    lines = []
    for slate, order in zip(slates, orders):
        if sorted(order) != list(range(len(slate.candidates))):
            raise ValueError(f"query {slate.slate_id!r}: the order is not a permutation of its "
                             f"{len(slate.candidates)} candidates")
        n = len(order)
        lines += [f"{slate.slate_id} Q0 {slate.candidates[i].docid} {r + 1} {n - r} {tag}" for r, i in enumerate(order)]
    return lines


class ShardWriter:
    """Writes finished shards into a run's shard folder; small, so it travels to Ray actors."""

    def __init__(self, directory: Path, settings: dict[str, Any]):
        self.directory, self.settings = directory, settings
        self.manifest = directory / "manifest.json"

    def path(self, shard: Sequence[RerankRequest]) -> Path:
        return self.directory / shard_name([s.slate_id for s in shard], ".trec")

    def write(self, shard: Sequence[RerankRequest], orders: Sequence[Sequence[int]], tag: str,
              stats: dict[str, Any] | None = None, notes: Sequence[dict[str, Any]] | None = None) -> None:
        """One shard's run lines, its counts and its per-query notes (confidence, trust, ...) beside them (the
        lines land last: they mark it done)."""
        path = self.path(shard)
        if not self.manifest.exists():  # written with the first shard: a run that fails to start leaves nothing
            atomic_write(self.manifest, json.dumps(self.settings, indent=2, sort_keys=True))
        atomic_write(path.with_suffix(".json"), json.dumps(stats or {}))
        if notes is not None:
            atomic_write(path.with_suffix(".queries.jsonl"), "".join(json.dumps(n) + "\n" for n in notes))
        atomic_write(path, "\n".join(run_lines(shard, orders, tag)) + "\n")


class ShardedRun:
    """The run file `out`, built from query shards under `out.shards/` (see the module docstring).

    `settings` (model, data, windows, ...) are recorded with the shards: a re-run with other
    settings is an error rather than a run that mixes two rankers."""

    def __init__(self, out: str | Path, slates: Sequence[RerankRequest], shard_size: int, settings: dict[str, Any]):
        if shard_size < 1:
            raise ValueError(f"shard size must be >= 1, got {shard_size}")
        ids = [s.slate_id for s in slates]
        if len(set(ids)) != len(ids):
            dup = sorted({q for q in ids if ids.count(q) > 1})[:5]
            raise DataFormatError(f"query ids repeat in the input: {dup}")
        self.out = Path(out)
        self.shards = [list(slates[i: i + shard_size]) for i in range(0, len(slates), shard_size)]
        self.writer = ShardWriter(self.out.with_name(self.out.name + ".shards"),
                                  {**settings, "queries": len(slates), "shard_size": shard_size})
        if self.writer.manifest.exists():
            before, now = json.loads(self.writer.manifest.read_text()), self.writer.settings
            if before != now:
                changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
                raise ValueError(f"{self.directory} holds shards of a run with other settings ({', '.join(changed)}); "
                                 f"re-run with the same settings to resume, or delete the folder to start over")

    @property
    def directory(self) -> Path:
        return self.writer.directory

    def todo(self) -> list[list[RerankRequest]]:
        """The shards not on disk yet, in plan order."""
        return [s for s in self.shards if not self.writer.path(s).exists()]

    def stats(self) -> dict[str, Any]:
        """Counts summed over the shards on disk (nested counts key by key)."""
        totals: dict[str, Any] = {}
        for shard in self.shards:
            path = self.writer.path(shard)
            if path.exists() and path.with_suffix(".json").exists():
                totals = merge(totals, json.loads(path.with_suffix(".json").read_text()))
        return totals

    @property
    def notes_path(self) -> Path:
        """The per-query sidecar (`OUT.queries.jsonl`): one JSON object a query, where the ranker wrote notes."""
        return self.out.with_name(self.out.name + ".queries.jsonl")

    def finish(self) -> Path:
        """All shards -> the run file (atomically), their notes -> `notes_path`; the shard folder is removed."""
        missing = self.todo()
        if missing:
            raise RuntimeError(f"{len(missing)} of {len(self.shards)} shards are not written yet")
        notes = [self.writer.path(s).with_suffix(".queries.jsonl") for s in self.shards]
        if all(n.exists() for n in notes):
            atomic_write(self.notes_path, "".join(n.read_text(encoding="utf-8") for n in notes))
        atomic_write(self.out, "".join(self.writer.path(s).read_text(encoding="utf-8") for s in self.shards))
        shutil.rmtree(self.directory, ignore_errors=True)
        return self.out


def relevance_threshold(qrels: dict[str, dict[str, int]]) -> tuple[int, str]:
    """The grade from which MRR and recall count a judged document as relevant, read off the qrels' scale
    -> (threshold, why). A scale with a non-relevant grade 0 and grades of 2 or more (TREC DL's 0-3) ->
    2, TREC DL's convention (1 is "related"); binary qrels, or a scale without a 0 (Cranfield's 1-4: every
    judgment marks some relevance) -> 1."""
    grades = sorted({int(g) for judged in qrels.values() for g in judged.values()})
    if grades and min(grades) <= 0 and max(grades) >= 2:
        return 2, f"graded qrels (grades {grades}): grade >= 2, as TREC DL counts relevance"
    return 1, f"qrels graded {grades}: every positive grade counts"


def run_measures(rel: int) -> dict[str, str]:
    """The job's canonical nDCG@10 / MRR@10 (`hllm.eval.metrics.ir_measure_names`) plus R@100."""
    names = ir_measure_names(rel, depths=(10,))
    return {"nDCG@10": names["nDCG@10"], "MRR@10": names["MRR@10"], "R@100": f"R(rel={rel})@100"}


def evaluate_run(run_path: str | Path, qrels_path: str | Path, rel: int = 2,
                 measures: dict[str, str] | None = None) -> dict[str, Any]:
    """A TREC run file + qrels file -> {"queries": judged queries evaluated, "unjudged": run queries
    without qrels, metric: mean}. Means over the run's judged queries, like trec_eval without -c; a
    run that shares no query with the qrels is an error (the ids do not match)."""
    return evaluate(read_run(run_path), read_qrels(qrels_path), rel, measures, str(run_path), str(qrels_path))


def evaluate(run: dict[str, list[tuple[str, float]]], qrels: dict[str, dict[str, int]], rel: int = 2,
             measures: dict[str, str] | None = None, run_name: str = "the run", qrels_name: str = "the qrels"
             ) -> dict[str, Any]:
    """`evaluate_run` on a run already read ({qid: [(docid, score), ...]} in rank order)."""
    judged = sorted(q for q in run if q in qrels)
    if not judged:
        raise DataFormatError(f"no query of {run_name} ({len(run)} queries, e.g. {sorted(run)[:3]}) is in "
                              f"{qrels_name} ({len(qrels)} queries, e.g. {sorted(qrels)[:3]}): the ids do not match")
    parsed = {name: ir_measures.parse_measure(m) for name, m in (measures or run_measures(rel)).items()}
    # scores from the rank order (N - rank): the run's own order, whatever its scores say
    scored = [ir_measures.ScoredDoc(q, d, float(len(run[q]) - r)) for q in judged for r, (d, _) in enumerate(run[q])]
    agg = ir_measures.calc_aggregate(list(parsed.values()), _qrels(qrels, judged), scored)
    return {"queries": len(judged), "unjudged": len(run) - len(judged), "rel": rel,
            **{name: float(agg[p]) for name, p in parsed.items()}}


def _qrels(qrels: dict[str, dict[str, int]], qids: Iterable[str]) -> list[ir_measures.Qrel]:
    return [ir_measures.Qrel(q, d, g) for q in qids for d, g in qrels[q].items()]
