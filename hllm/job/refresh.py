"""The data flywheel, as library steps: served traffic -> slates to label -> a fine-tuning set with
replay -> champion and challenger side by side -> the promotion gate.

`pipelines/refresh.py` runs them as one Ray job (Ray Data reads the log and labels with the
teacher, Ray Train + DeepSpeed fine-tunes, MLflow records and moves the alias); everything here is
plain Python on records and matrices, tested without Ray.

Pseudo-labels: on new traffic there are no qrels, so the teacher's ranking is the reference. The
agreement figures are Kendall tau and top-1 to it, and nDCG@10 against graded pseudo-labels taken
from it (`pseudo_grades`: 3 for the teacher's first, 2 for its 2nd-3rd, 1 for 4th-7th, else 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from hllm.data.splits import unit_hash
from hllm.data.traffic import dedupe, teacher_label, to_slate
from hllm.eval.metrics import agreement, ir_metrics
from hllm.records import ParseCounts, RankedSlate, RerankRequest, TeacherRanking
from hllm.uris import registry_alias


class NothingToRefresh(ValueError):
    """The log holds nothing this champion can learn from: no new version is made."""


@dataclass
class RefreshConfig:
    """One flywheel cycle (`pipelines/refresh.py`, `hllm refresh`)."""

    log_path: str = "runs/traffic"  # the Serve traffic log (`serve.common.AppArgs.traffic_log.path`)
    # the serving model, a registry alias: fine-tuned from, compared against, and the alias the gate moves
    champion: str = "models:/hllm-student@champion"
    sample_share: float = 1.0  # requests kept, by a hash of the request, before deduplication (lower it at scale)
    max_slates: int = 2000  # new slates labelled per cycle, at most
    min_slates: int = 20  # fewer usable requests than this: no cycle (and no new version)
    traffic_test_fraction: float = 0.2  # new traffic held out for the gate, by a hash of the request
    replay_share: float = 0.5  # share of the fine-tuning set drawn from the original training rankings
    steps: int = 100  # fine-tuning steps from the champion's weights
    lr: float = 3e-4  # peak learning rate of the fine-tuning (the schedule: student.train's)
    tolerance: float = 0.005  # the challenger may lose at most this nDCG@10 on the original test split ...
    min_gain: float = 0.0  # ... and must beat the champion on held-out new traffic by more than this
    # what "better on held-out new traffic" measures, against the teacher's rankings (see the module docstring)
    gate_metric: Literal["nDCG@10_vs_teacher", "kendall_tau", "top1_agreement"] = "nDCG@10_vs_teacher"
    seed: int = 0  # the replay sample
    # None: the gate moves the champion alias itself. An alias (e.g. "challenger"): the gate moves models:/NAME@<it>
    # instead, and a serving app whose args.rollout rolls that alias out takes it on from there — shadow, canary,
    # then promotion to the champion alias or a rollback, on live traffic (serve/students.py, docs/rollout.md)
    rollout_alias: str | None = None
    # requests the online cascade escalated carry the served teacher's ranking in the log (`teacher_order`): used as
    # their labels instead of asking the job's teacher again (false: every slate labelled by the job's teacher, e.g.
    # when the served teacher is another model than the job's and one teacher's labels are wanted)
    reuse_teacher_orders: bool = True

    def __post_init__(self) -> None:
        if registry_alias(self.champion) is None:
            raise ValueError(f"refresh.champion must be a registry alias, models:/NAME@ALIAS (the gate moves it), "
                             f"not {self.champion!r}")
        if not (0 < self.sample_share <= 1 and 0 < self.traffic_test_fraction < 1 and 0 <= self.replay_share < 1):
            raise ValueError("refresh: need 0 < sample_share <= 1, 0 < traffic_test_fraction < 1, 0 <= replay_share < 1")
        if self.min_slates < 2 or self.max_slates < self.min_slates:
            raise ValueError("refresh: need 2 <= min_slates <= max_slates")
        if self.rollout_alias is not None and self.rollout_alias == registry_alias(self.champion)[1]:
            raise ValueError(f"refresh.rollout_alias {self.rollout_alias!r} is the champion's own alias: name the alias "
                             "the serving app rolls out (e.g. challenger), or leave it unset to move the champion directly")


@dataclass
class Selection:
    """The cycle's new slates, split by a hash of the request, and what the log held besides."""

    train: list[RerankRequest]
    test: list[RerankRequest]
    counts: dict[str, int]  # rows read, dropped by cause, duplicates, sampled out, files skipped
    teacher_orders: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # slate id -> the served teacher's

    @property
    def cycle(self) -> str:
        """The cycle's name: a hash of its slates (the same log, the same cycle: a re-run resumes)."""
        ids = sorted(s.slate_id for s in self.train + self.test)
        return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:12]


def select_slates(rows: list[dict[str, Any]], counts: dict[str, int], cfg: RefreshConfig) -> Selection:
    """Clean rows (`hllm.data.traffic.clean_rows`, each with its `key`) -> one slate per distinct request,
    at most `max_slates` (a hash of the request decides which: no order effects), split into
    fine-tuning and held-out traffic by another hash of the request."""
    unique, duplicates = dedupe(rows)
    unique.sort(key=lambda r: (unit_hash(f"pick:{r['key']}"), r["key"]))
    chosen = unique[: cfg.max_slates]
    counts = {**counts, "duplicates": duplicates, "over_max_slates": len(unique) - len(chosen), "slates": len(chosen)}
    if len(chosen) < cfg.min_slates:
        raise NothingToRefresh(f"the traffic log holds {len(chosen)} usable distinct requests (< refresh.min_slates "
                               f"{cfg.min_slates}); counts: {counts}. No new version")
    test = [r for r in chosen if unit_hash(f"split:{r['key']}") < cfg.traffic_test_fraction]
    held = {r["key"] for r in test}
    train = [r for r in chosen if r["key"] not in held]
    if not train or not test:
        raise NothingToRefresh(f"{len(chosen)} requests split into {len(train)} to learn from and {len(test)} to test "
                               "on: both are needed. No new version")
    orders = {to_slate(r).slate_id: order for r in chosen if (order := teacher_label(r)) is not None} \
        if cfg.reuse_teacher_orders else {}
    return Selection([to_slate(r) for r in train], [to_slate(r) for r in test],
                     {**counts, "train": len(train), "test": len(test), "teacher_labelled": len(orders)}, orders)


def reused_rankings(slates: Sequence[RerankRequest], orders: dict[str, list[int]]) -> list[RankedSlate]:
    """The slates whose served teacher's ranking the log holds, as rankings-store rows (no teacher asked)."""
    return [RankedSlate(s, TeacherRanking(s.slate_id, orders[s.slate_id], "(the served teacher's ranking, from the "
                                          "traffic log)", ParseCounts(total=1, ok=1))) for s in slates if s.slate_id in orders]


def refuse_foreign(counts: dict[str, int], keys: set[str], champion_key: str, log_path: str) -> None:
    """A log none of whose rows the champion's prompt and vocabulary wrote is another model's: refused."""
    if counts["rows"] == 0:
        raise NothingToRefresh(f"the traffic log at {log_path} has no records{_skipped(counts)}. No new version")
    if counts["other_model"] == counts["rows"]:
        raise NothingToRefresh(
            f"every record in {log_path} was answered by a model of another prompt or vocabulary (model_key "
            f"{sorted(keys)}, the champion's is {champion_key!r}): its documents were cut and its requests read "
            "for another model; refusing to train the champion on it. No new version")


def _skipped(counts: dict[str, int]) -> str:
    return f" ({counts['files_skipped']} unreadable file(s) skipped)" if counts.get("files_skipped") else ""


def replay_mix(new: Sequence[RankedSlate], original: Sequence[RankedSlate], share: float, seed: int) -> list[RankedSlate]:
    """The fine-tuning set: every new labelled slate plus original training rankings, drawn so that
    they are `share` of the whole (capped by what there is): the champion keeps what it knew."""
    want = round(len(new) * share / (1 - share)) if share else 0
    replay = random.Random(seed).sample(list(original), min(want, len(original)))
    return list(new) + replay


def pseudo_grades(permutation: Sequence[int]) -> list[int]:
    """A teacher's ranking -> graded pseudo-labels in input order: 3 for its first, 2 for its
    2nd-3rd, 1 for its 4th-7th, 0 below (log2 of the rank, so the top is finely graded)."""
    grades = [0] * len(permutation)
    for rank, item in enumerate(permutation, start=1):
        grades[int(item)] = max(0, 3 - int(np.log2(rank)))
    return grades


def with_pseudo_grades(item: RankedSlate) -> RerankRequest:
    return dataclasses.replace(item.slate, grades=pseudo_grades(item.ranking.permutation), extra_qrels={})


def side_by_side(perms: dict[str, list[list[int]]], original: Sequence[RankedSlate], traffic: Sequence[RankedSlate]
                 ) -> dict[str, dict[str, float]]:
    """Each model's rankings of the original test split then the held-out traffic (`perms[name]` =
    original + traffic, in that order) -> its figures: on the original split nDCG@10 with the true
    labels and agreement with the teacher; on the traffic, agreement with the teacher, nDCG@10
    against the teacher's pseudo-labels, and nDCG@10 with true labels where slates have them."""
    n, ndcg = len(original), {"nDCG@10": "nDCG@10"}
    labelled = [k for k, i in enumerate(traffic) if i.ranking.permutation is not None]
    judged = [k for k in labelled if traffic[k].slate.grades]
    out = {}
    for name, p in perms.items():
        orig, new = p[:n], p[n:]
        row = {"original.nDCG@10": ir_metrics([i.slate for i in original], orig, ndcg)["nDCG@10"],
               **{f"original.{k}": v for k, v in agreement(orig, [i.ranking.permutation for i in original]).items()
                  if k != "pairs"},
               **{f"traffic.{k}": v for k, v in agreement([new[k] for k in labelled],
                                                          [traffic[k].ranking.permutation for k in labelled]).items()},
               "traffic.nDCG@10_vs_teacher": ir_metrics([with_pseudo_grades(traffic[k]) for k in labelled],
                                                        [new[k] for k in labelled], ndcg)["nDCG@10"]}
        if judged:
            row["traffic.nDCG@10"] = ir_metrics([traffic[k].slate for k in judged], [new[k] for k in judged], ndcg)["nDCG@10"]
        out[name] = row
    return out


@dataclass
class Verdict:
    promote: bool
    reasons: list[str]  # why, figure by figure

    def text(self) -> str:
        return ("PROMOTE: " if self.promote else "KEEP the champion: ") + "; ".join(self.reasons)


def gate(champion: dict[str, float], challenger: dict[str, float], cfg: RefreshConfig) -> Verdict:
    """The challenger replaces the champion only if it is no worse on the original test split than
    `tolerance` allows and better on the held-out new traffic by more than `min_gain`."""
    orig_c, orig_n = champion["original.nDCG@10"], challenger["original.nDCG@10"]
    key = f"traffic.{cfg.gate_metric}"
    new_c, new_n = champion[key], challenger[key]
    keeps = orig_n >= orig_c - cfg.tolerance
    gains = new_n > new_c + cfg.min_gain
    reasons = [f"original test nDCG@10 {orig_n:.4f} vs {orig_c:.4f} ({orig_n - orig_c:+.4f}; allowed -{cfg.tolerance})"
               + ("" if keeps else ": worse than the tolerance"),
               f"new traffic {cfg.gate_metric} {new_n:.4f} vs {new_c:.4f} ({new_n - new_c:+.4f}; needed > +{cfg.min_gain})"
               + ("" if gains else ": no gain")]
    return Verdict(keeps and gains, reasons)


@dataclass
class Cycle:
    """One flywheel cycle, as `pipelines/refresh.py` ran it (also its `cycle.json` and an MLflow artifact)."""

    cycle: str  # the selected slates' hash
    champion: str  # models:/NAME/VERSION the challenger was compared with
    challenger: str  # models:/NAME/VERSION it was registered as
    promoted: bool
    moved: str | None  # the alias the promotion moved (None: kept)
    verdict: str  # Verdict.text(): the gate's figures and why
    counts: dict[str, int]  # the traffic log's: records, duplicates, warned, train / test slates, files skipped...
    figures: dict[str, dict[str, float]]  # champion / challenger / first_stage -> side_by_side's figures
    seconds: dict[str, float]  # by step: read_log, label, fine_tune, evaluate
    mlflow_run_id: str
    cycle_dir: str  # where cycle.json, the replay mix and the challenger live
    rankings: dict[str, str]  # split -> the teacher's rankings of the new traffic (a store folder)
    config: dict[str, Any]  # the RefreshConfig it ran under
    traffic_orders: dict[str, dict[str, list[int]]]  # model -> slate id -> its order of each held-out traffic slate

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
