"""Real text, across years: a single-pass head over a frozen LM, fitted on one TREC year's judged
queries and tested on another's, then (optionally) fitted on all of them and shipped.

    python -m hllm.recipes.realtext --config configs/realtext/smollm2-trec-dl.yaml [key=value ...]
    hllm realtext --config configs/realtext/smollm2-trec-dl.yaml

A recipe over the library's stages: every collection's top-`top_n` list is encoded as one prompt
(`ranker.prompt`, passages cut to `prompt.max_doc_tokens`) and its item states are computed once
by the frozen backbone, cut at `ranker.state_layer` and read as `ranker.pooling` (`hllm.train.state_cache`,
`hllm.model.item_states.POOLINGS`). The head, under a first-stage prior (`head.prior`), is fitted on them
by SGD (`fit: sgd`, its step count chosen by k-fold cross-validation over the training year's
queries, `hllm.train.head_fit`) or in closed form (`fit: ridge`, a utility probe whose L2 weight and
prior scale the same cross-validation chooses); never on the test year. Each fold reports, on every
query of its test collection, the first stage and the student on the same candidates — the whole
top `top_n` reranked in one pass, as `hllm rerank` does with this model (its `window` is `top_n`).
Means over queries, and over `seeds`.

`ship_to` fits the head once more on every judged query of `ship_on` and saves it as a student
folder (`Reranker.load`) with a model card and `provenance.json`, checked on the `transfer`
collections (never trained on: their hashed test split). Writes `report.json`.

With `ranker.head.guard: distance` every fitted head also fits its domain guard on the same training
queries (`hllm.train.head_fit.fit_guard`), and every test set reports the same head without the guard
(`student_unguarded`) and how far the guard trusted its queries (`trust`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from hllm.config import to_dict
from hllm.data.cache import fingerprint
from hllm.data.readers import collection_name, read_slates
from hllm.data.splits import split_by_hash
from hllm.eval.evaluation import first_stage_order, quality
from hllm.eval.runfile import relevance_threshold
from hllm.model.backbones import ModelConfig
from hllm.model.heads import HeadConfig
from hllm.model.prompts import PromptConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.model.card import ModelCard, PromptCard, ship_student
from hllm.job.config import recipe_config, start_recipe
from hllm.train.head_fit import StateSlate, cv_ridge, cv_sgd, fit_guard, fit_head, guard_trust, guarded_orders
from hllm.train.loop import LossConfig, TrainConfig
from hllm.train.probes import in_sample_thresholds
from hllm.train.state_cache import cached_states, states_key

log = logging.getLogger("hllm")


@dataclass
class Fold:
    """Train on these collections' judged queries, test on every judged query of those."""

    train_on: list[str]  # BEIR folders (names in the report: the folder name)
    test_on: list[str]


@dataclass
class RealTextConfig:
    output_dir: str = "runs/realtext"  # cached states, report.json
    device: str = "auto"
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    ranker: RankerConfig = field(default_factory=lambda: RankerConfig(
        model=ModelConfig(preset="smollm2-135m", context_length=8192), adapt=AdaptConfig(mode="frozen"),
        head=HeadConfig(positions=20, width=128, num_heads=4, prior="rank"),
        prompt=PromptConfig(template="rankgpt", max_doc_tokens=48), state_layer=20))
    top_n: int = 100  # first-stage candidates per query, ranked in one pass
    folds: list[Fold] = field(default_factory=list)
    # the number of steps is chosen on the training collection's own queries: k-fold cross-validation
    # (cv_folds >= 2; then one head on all of them), or one validation split of val_fraction (by a hash)
    cv_folds: int = 5
    val_fraction: float = 0.2
    # how the head is fitted: sgd (train_loop on the loss; the step chosen as above) or ridge (a `utility`
    # head under the `logrank` prior set in closed form: ridge regression of the grade on the state, its
    # L2 weight and the prior's scale chosen by cross-validation over the grids below)
    fit: Literal["sgd", "ridge"] = "sgd"
    ridge_lambdas: list[float] = field(default_factory=lambda: [100.0, 1000.0, 10000.0])
    prior_scales: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0, 3.0])
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=600, batch_size=8, lr=1e-3, warmup_steps=20,
                                                                   log_every=20, weight_decay=0.01))
    loss: LossConfig = field(default_factory=lambda: LossConfig({"graded_ce": 1.0}))
    sample_items: int | None = None  # train on sub-slates of this many candidates (None: whole lists)
    unjudged_grade: int = 0  # unjudged candidates train as this grade (trec_eval scores them as 0)
    rel: int = 2  # MRR@10's relevance threshold (TREC DL: 2)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # head initialisation and data order
    ship_on: list[str] = field(default_factory=list)  # train the shipped head on these collections' queries
    ship_to: str | None = None  # ... and save it here (a student folder)
    transfer: list[str] = field(default_factory=list)  # never trained on: checked with the shipped head
    transfer_fraction: float = 0.2  # a transfer collection's hashed test split ...
    transfer_queries: int = 40  # ... capped at this many queries
    # which side of that split: `test`, or `rest` (the other queries: a second, independent sample, e.g. to confirm
    # on queries never looked at what was built while looking at the test split's)
    transfer_split: Literal["test", "rest"] = "test"
    shard_slates: int = 4  # slates per state shard (a crash loses at most one shard)

    def __post_init__(self) -> None:
        if self.ranker.adapt.mode != "frozen":
            raise ValueError("ranker.adapt.mode must be frozen: the item states are computed once and cached")
        if bool(self.ship_on) != bool(self.ship_to):
            raise ValueError("ship_on and ship_to go together (the collections to train the shipped head on, and where)")
        if self.transfer and not self.ship_to:
            raise ValueError("transfer collections are checked with the shipped head: set ship_on and ship_to")
        if not (self.folds or self.ship_on):
            raise ValueError("nothing to do: give folds (cross-year tests) or ship_on + ship_to")
        if not self.seeds:
            raise ValueError("seeds: at least one")
        if self.fit == "ridge":
            head = self.ranker.head
            if head.kind != "utility" or head.prior != "logrank":
                raise ValueError(f"fit=ridge sets a utility head under the logrank prior in closed form; "
                                 f"got ranker.head.kind={head.kind!r}, ranker.head.prior={head.prior!r}")
            if self.cv_folds < 2:
                raise ValueError("fit=ridge chooses its L2 weight and prior scale by cross-validation: cv_folds >= 2")


class Collections:
    """Each collection's slates and cached item states, read and computed once per run."""

    def __init__(self, cfg: RealTextConfig, ranker: SinglePassRanker):
        self.cfg, self.ranker = cfg, ranker
        self._items: dict[tuple[str, bool], list[StateSlate]] = {}

    def items(self, path: str, transfer: bool = False) -> list[StateSlate]:
        """All its queries, or (`transfer`) its hashed test split, capped."""
        if (path, transfer) not in self._items:
            slates = read_slates("beir", path, top_n=self.cfg.top_n)
            if transfer:
                rest, test = split_by_hash(slates, self.cfg.transfer_fraction)
                slates = (test if self.cfg.transfer_split == "test" else rest)[: self.cfg.transfer_queries]
            directory = Path(self.cfg.output_dir) / "states" / f"{collection_name(path)}-{states_key(self.ranker.cfg, slates)}"
            t0 = time.perf_counter()
            states = cached_states(self.ranker, slates, directory, self.cfg.shard_slates, progress=lambda done, total, s: log.info(
                "  %s: %d/%d state shards (%.0fs)", collection_name(path), done, total, s))
            log.info("%s%s: %d queries, states ready in %.0fs", collection_name(path), " (transfer split)" if transfer else "",
                     len(slates), time.perf_counter() - t0)
            self._items[path, transfer] = [StateSlate(s, x) for s, x in zip(slates, states)]
        return self._items[path, transfer]


def fresh_head(ranker: SinglePassRanker, seed: int) -> None:
    torch.manual_seed(seed)
    ranker.head = ranker.new_head().to(ranker.device)


def train_head(ranker: SinglePassRanker, items: list[StateSlate], cfg: RealTextConfig, seed: int) -> dict[str, Any]:
    """A new head trained on `items`, its number of steps chosen on their own queries: by
    `cv_folds`-fold cross-validation (the step with the best mean held-out nDCG@10 over the folds,
    then one head trained on all of them up to that step of the same schedule), or by one hashed
    validation split (`cv_folds` < 2). A head with a domain guard then fits it on the same slates
    (`hllm.train.head_fit.fit_guard`: its thresholds from their own held-out distances)."""
    record = _train_head(ranker, items, cfg, seed)
    if cfg.ranker.head.guard != "none":
        record["guard"] = fit_guard(ranker, items, max(cfg.cv_folds, 2))
        log.info("    domain guard: trust 1 up to distance %.3f, 0 from %.3f (held-out training slates: median %.3f); "
                 "support: prompts that show each passage >= %d tokens", record["guard"]["guard_low"], record["guard"]["guard_high"],
                 record["guard"]["guard_heldout_median"], record["guard"]["guard_min_doc_budget"])
    return record


def _train_head(ranker: SinglePassRanker, items: list[StateSlate], cfg: RealTextConfig, seed: int) -> dict[str, Any]:
    if cfg.fit == "ridge":
        return _ridge(ranker, items, cfg)
    if cfg.cv_folds >= 2:
        return _cross_validated(ranker, items, cfg, seed)
    ids = {s.slate_id for s in split_by_hash([i.slate for i in items], cfg.val_fraction)[1]}
    fresh_head(ranker, seed)

    def progress(step: int, row: dict) -> None:
        if step % (cfg.train.log_every * 5) == 0 or step == cfg.train.steps:
            log.info("    step %d loss %.4f val nDCG@10 %.4f (%.0fs)", step, row["loss"], row.get("val_nDCG@10", float("nan")), row["elapsed_s"])

    out = fit_head(ranker, [i for i in items if i.slate.slate_id not in ids], [i for i in items if i.slate.slate_id in ids],
                   dataclasses.replace(cfg.train, seed=seed), cfg.loss, cfg.rel, unjudged=cfg.unjudged_grade,
                   sample_items=cfg.sample_items, log=progress)
    return {"train_queries": len(items) - len(ids), "val_queries": len(ids), "best_step": out["best_step"],
            "val_nDCG@10": out["best_val"], "val_nDCG@10_at_start": out["val_at_start"],
            "seconds": out["history"][-1]["elapsed_s"]}


def _cross_validated(ranker: SinglePassRanker, items: list[StateSlate], cfg: RealTextConfig, seed: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = cv_sgd(ranker, items, items, cfg.cv_folds, dataclasses.replace(cfg.train, seed=seed), cfg.loss, cfg.rel,
                 lambda: fresh_head(ranker, seed), cfg.unjudged_grade, cfg.sample_items)
    log.info("    %d-fold CV over %d queries: step %d kept (held-out nDCG@10 %.4f, %.4f untrained) in %.0fs",
             cfg.cv_folds, len(items), out["best_step"], out["cv_score"], out["cv_first_stage"], time.perf_counter() - t0)
    return {"train_queries": len(items), "val_queries": 0, "cv_folds": cfg.cv_folds, "best_step": out["best_step"],
            "val_nDCG@10": out["cv_score"], "val_nDCG@10_at_start": out["cv_first_stage"], "cv_curve": out["cv_curve"],
            "seconds": time.perf_counter() - t0}


def _ridge(ranker: SinglePassRanker, items: list[StateSlate], cfg: RealTextConfig) -> dict[str, Any]:
    """The closed-form probe: (L2 weight, prior scale) by k-fold CV, then fitted on every query."""
    t0 = time.perf_counter()
    fresh_head(ranker, 0)
    out = cv_ridge(ranker, items, items, cfg.cv_folds, cfg.ridge_lambdas, cfg.prior_scales, cfg.rel, cfg.unjudged_grade)
    log.info("    ridge probe: L2 %g, prior scale %g kept by %d-fold CV over %d queries (held-out nDCG@10 %.4f, first stage %.4f)",
             out["ridge_lambda"], out["prior_scale"], cfg.cv_folds, len(items), out["cv_score"], out["cv_first_stage"])
    return {"train_queries": len(items), "val_queries": 0, "cv_folds": cfg.cv_folds, "best_step": 0,
            "ridge_lambda": out["ridge_lambda"], "prior_scale": out["prior_scale"], "val_nDCG@10": out["cv_score"],
            "val_nDCG@10_at_start": out["cv_first_stage"], "cv_grid": out["cv_grid"], "seconds": time.perf_counter() - t0}


def measure(ranker: SinglePassRanker, items: list[StateSlate], rel: int) -> dict[str, float]:
    slates = [i.slate for i in items]
    return quality(slates, guarded_orders(ranker, items), rel)


def guarded(ranker: SinglePassRanker, items: list[StateSlate], rel: int) -> dict[str, Any]:
    """With a domain guard: the same head without it (the ablation) and how far the guard trusted the
    slates (mean trust; shares of slates fully and partly fallen back to the first stage). {} without."""
    guard = getattr(ranker.head, "guard", None)
    if guard is None:
        return {}
    trust = guard_trust(ranker, items)
    with guard.suspended():
        unguarded = measure(ranker, items, rel)
    return {"student_unguarded": unguarded, "trust": {"mean": float(trust.mean()), "fallback_share": float((trust == 0).mean()),
                                                       "partial_share": float(((trust > 0) & (trust < 1)).mean())}}


def _guard_note(row: dict[str, Any]) -> str:
    if "trust" not in row:
        return ""
    return (f" (unguarded {row['student_unguarded']['nDCG@10']:.4f}; guard: mean trust {row['trust']['mean']:.2f}, "
            f"{row['trust']['fallback_share']:.0%} of queries fell back to the first stage, {row['trust']['partial_share']:.0%} partly)")


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def _spread(rows: list[dict[str, float]], key: str) -> float:
    return statistics.stdev(r[key] for r in rows) if len(rows) > 1 else 0.0


def run(cfg: RealTextConfig) -> dict[str, Any]:
    """Every fold, then the shipped head and its transfer checks. -> the report (also report.json)."""
    out = Path(cfg.output_dir)
    ranker = start_recipe(cfg)
    data = Collections(cfg, ranker)
    report: dict[str, Any] = {"config": fingerprint(cfg), "folds": [], "shipped": None, "transfer": []}
    for fold in cfg.folds:
        train = [i for path in fold.train_on for i in data.items(path)]
        runs = []
        for seed in cfg.seeds:
            log.info("fold %s -> %s, seed %d", [collection_name(p) for p in fold.train_on],
                     [collection_name(p) for p in fold.test_on], seed)
            record = train_head(ranker, train, cfg, seed)
            record["test"] = {collection_name(p): measure(ranker, data.items(p), cfg.rel) for p in fold.test_on}
            record["guarded"] = {collection_name(p): guarded(ranker, data.items(p), cfg.rel) for p in fold.test_on}
            runs.append(record)
        for path in fold.test_on:
            name, items = collection_name(path), data.items(path)
            per_seed = [r["test"][name] for r in runs]
            row = {"collection": name, "queries": len(items), "trained_on": [collection_name(p) for p in fold.train_on],
                   "first_stage": quality([i.slate for i in items], first_stage_order([i.slate for i in items]), cfg.rel),
                   "student": _mean(per_seed), "student_nDCG@10_sd": _spread(per_seed, "nDCG@10"),
                   "student_per_seed": per_seed, "seeds": cfg.seeds, "training": runs, **runs[0]["guarded"][name]}
            log.info("fold -> %s (%d queries): first stage %.4f, student %.4f +- %.4f over %d seeds%s", name, len(items),
                     row["first_stage"]["nDCG@10"], row["student"]["nDCG@10"], row["student_nDCG@10_sd"], len(cfg.seeds),
                     _guard_note(row))
            report["folds"].append(row)
    if cfg.ship_to:
        report["shipped"], report["transfer"] = ship(cfg, ranker, data)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def ship(cfg: RealTextConfig, ranker: SinglePassRanker, data: Collections) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The head trained on every `ship_on` query (seed: the first), saved to `ship_to`, checked on `transfer`."""
    items = [i for path in cfg.ship_on for i in data.items(path)]
    record = train_head(ranker, items, cfg, cfg.seeds[0])
    ranker.cfg = dataclasses.replace(ranker.cfg, window=cfg.top_n)
    thresholds = in_sample_thresholds(ranker, items, [collection_name(p) for p in cfg.ship_on])
    transfer = []
    for path in cfg.transfer:
        t_items = data.items(path, transfer=True)
        slates = [i.slate for i in t_items]
        rel, _ = relevance_threshold({s.slate_id: s.qrels() for s in slates})  # MRR's threshold from its grade scale
        transfer.append({"collection": collection_name(path), "queries": len(t_items), "rel": rel,
                         "first_stage": quality(slates, first_stage_order(slates), rel),
                         "student": measure(ranker, t_items, rel), **guarded(ranker, t_items, rel)})
        log.info("shipped -> %s (%d queries): first stage %.4f, student %.4f%s", transfer[-1]["collection"], len(t_items),
                 transfer[-1]["first_stage"]["nDCG@10"], transfer[-1]["student"]["nDCG@10"], _guard_note(transfer[-1]))
    card = ModelCard(
        base_model=f"{cfg.ranker.model.preset} (frozen, cut after decoder layer {cfg.ranker.state_layer})",
        pooling=cfg.ranker.pooling,
        teacher="none: trained on graded relevance labels (TREC qrels), not distilled",
        training_data={"collections": [collection_name(p) for p in cfg.ship_on], "top_n": cfg.top_n,
                       "train_queries": record["train_queries"], "val_queries": record["val_queries"]},
        vocabulary="the base model's", positions=cfg.ranker.head.positions, window=cfg.top_n,
        prompt=PromptCard(cfg.ranker.prompt.template, cfg.ranker.prompt.max_doc_tokens, cfg.ranker.model.context_length),
        adapt="frozen", head=f"{cfg.ranker.head.kind} with the first-stage prior ({cfg.ranker.head.prior})",
        input="candidates in first-stage order, best first: the prior reads their ranks",
        figures={
            "fit": ({"method": "ridge probe (closed form)", "l2": record["ridge_lambda"], "prior_scale": record["prior_scale"]}
                    if cfg.fit == "ridge" else {"method": "sgd", "loss": cfg.loss.terms, "steps": record["best_step"]}),
            "cv_nDCG@10": record["val_nDCG@10"], "cv_first_stage_nDCG@10": record["val_nDCG@10_at_start"],
            "transfer": {t["collection"]: transfer_figures(t) for t in transfer},
            **({"guard": {"what": "the head's residual scaled by a per-query trust from the distance of its passages' states "
                                  "to the training passages' (hllm.model.heads.DomainGuard): 0 keeps the first-stage order, as "
                                  "does a prompt that shows each passage fewer tokens than guard_min_doc_budget (a long query)",
                          **record["guard"],
                          "transfer_fallback_share": {t["collection"]: t["trust"]["fallback_share"] for t in transfer}}}
               if "guard" in record else {})})
    ship_student(cfg.ship_to, ranker, card, thresholds, "python -m hllm.recipes.realtext --config <the recipe below>", to_dict(cfg),
                 fit={k: v for k, v in record.items() if k != "cv_grid"},
                 transfer=[{"collection": t["collection"], **transfer_figures(t)} for t in transfer])
    return record, transfer


def transfer_figures(t: dict[str, Any]) -> dict[str, Any]:
    """A transfer check as the model card and provenance keep it."""
    return {"queries": t["queries"], "first_stage_nDCG@10": t["first_stage"]["nDCG@10"], "student_nDCG@10": t["student"]["nDCG@10"],
            **({"student_unguarded_nDCG@10": t["student_unguarded"]["nDCG@10"], "guard_mean_trust": t["trust"]["mean"]}
               if "trust" in t else {})}


def main(argv: list[str] | None = None) -> None:
    cfg = recipe_config(RealTextConfig, __doc__, argv, "configs/realtext/smollm2-trec-dl.yaml")
    t0 = time.perf_counter()
    report = run(cfg)
    for row in report["folds"]:
        print(f"{' + '.join(row['trained_on'])} -> {row['collection']} ({row['queries']} queries): first stage "
              f"{row['first_stage']['nDCG@10']:.4f}, student {row['student']['nDCG@10']:.4f} +- {row['student_nDCG@10_sd']:.4f} "
              f"({len(row['seeds'])} seeds){_guard_note(row)}")
    for row in report["transfer"]:
        print(f"shipped -> {row['collection']} ({row['queries']} queries, never trained on): first stage "
              f"{row['first_stage']['nDCG@10']:.4f}, student {row['student']['nDCG@10']:.4f}{_guard_note(row)}")
    print(f"total {time.perf_counter() - t0:.0f}s; report: {Path(cfg.output_dir) / 'report.json'}")


if __name__ == "__main__":
    main()
