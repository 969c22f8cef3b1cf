"""The real-text recipes recorded in MLflow: a parent run with the recipe's report and headline figures, a child run per
variant or student with its settings as params, so the ablation compares in MLflow's UI like the embedded grid's cells.

    hllm realtext --config configs/realtext/smollm2-dl19-rankvicuna.yaml [key=value ...] [tracking.experiment=...]
    hllm realtext --config configs/realtext/smollm2-dl19-multistage.yaml [key=value ...]
    hllm realtext --config ... --report runs/realtext/report.json   # record a finished run's report

realtext (`hllm.recipes.realtext`; `hllm distilltext` and `hllm adaptation` are its old names): the parent holds the
methods' teacher-folds and cross-year figures (per first stage, the first stage's and teacher's), the transfer checks and
the calibration; a child per trial (a variant fitted on one teacher, or on the judgments: its settings as params; its
teacher-folds figures, per first stage raw and blended with the first stage; seconds a fold and each fold's last loss).

The recipe runs in this process (its states are cached; a stopped run resumes); MLflow's store defaults to sqlite
under the recipe's output_dir.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hllm.config import to_dict
from hllm.data.cache import fingerprint
from hllm.eval.blend import BLENDED
from hllm.recipes import realtext
from hllm.recipes.realtext import trial_name, trials
from hllm.train.probes import Variant
from pipelines.common import RecipeJob, TrackingConfig, log_metrics, mlflow_run, parse_recipe_job

log = logging.getLogger("hllm")


@dataclass
class TrialRun:
    """A child run's params: the variant and the teacher it learned from."""

    variant: Variant
    teacher: str  # "judgments" for a judgments-only variant
    output_dir: str
    tracking: TrackingConfig


def _figures(row: dict[str, Any]) -> dict[str, Any]:
    """A report row's figures as metrics (log_metrics flattens the nested share kept), its per-query values left out."""
    return {k: v for k, v in row.items() if k != "per_query_nDCG@10"}


def log_realtext(job: RecipeJob, report: dict[str, Any]) -> str:
    """The parent run and one child per trial; -> the parent's run id."""
    import mlflow

    cfg, folds = job.recipe, report["teacher_folds"]
    with mlflow_run(job, "realtext", **({"hllm.collection": report["collection"]} if report["collection"] else {})) as parent:
        mlflow.log_dict(report, "report.json")
        if folds:
            log_metrics({"queries": folds["queries"]})
            for name, row in folds["table"].items():
                if not name.startswith("trial:"):
                    log_metrics(_figures(row), prefix=f"folds.{name}.")
            for name, share in folds["share_kept"].items():
                log_metrics(share, prefix=f"folds.{name}.share_kept.")
        for fit in report["cross_year"]:
            for collection, test in fit["tests"].items():
                for name, m in test["methods"].items():
                    log_metrics(m, prefix=f"cross.{'_and_'.join(fit['trained_on'])}.{collection}.{name}.")
        for t in report["transfer"]:
            log_metrics({"first_stage": t["first_stage"]["nDCG@10"], "student": t["student"]["nDCG@10"]},
                        prefix=f"transfer.{t['collection']}.nDCG_at_10.")
        cal = report["calibration"]
        if cal:
            log_metrics({"ece_held_out_queries": cal["oof"]["ece"]} | {f"ece.{c}": r["ece"] for c, r in cal["cross_year"].items()},
                        prefix="calibration.")
        for stage, got in report.get("by_stage", {}).items():
            for name in ("first_stage", *(realtext.method_key("teacher", t.name) for t in cfg.teachers)):
                log_metrics(_figures(got["table"][name]), prefix=f"stage.{stage}.{name}.")
        parent_id = parent.info.run_id
        for v, teacher in trials(cfg):
            name = trial_name(v, teacher)
            child = TrialRun(v, teacher or "judgments", cfg.output_dir, dataclasses.replace(job.tracking, run_name=name))
            with mlflow_run(child, "realtext-trial", parent_id, **{"ablation.variant": name, "ablation.kind": "trial",
                                                                   "ablation.target": v.target}):
                if folds:
                    row = folds["table"][f"trial:{name}"]
                    log_metrics(_figures(row), prefix="folds.")
                    log_metrics({"folds_chosen": sum(name in c.values() for c in folds["chosen"])})
                    for f, cv in enumerate(folds["cv"]):
                        log_metrics(cv[name], step=f, prefix="fold_cv.")
                for stage, got in report.get("by_stage", {}).items():
                    for suffix in ("", BLENDED):
                        if f"trial:{name}{suffix}" in got["table"]:
                            log_metrics(_figures(got["table"][f"trial:{name}{suffix}"]), prefix=f"stage.{stage}.{'blended' if suffix else 'raw'}.")
                for f, fold in enumerate(report.get("fits", {}).get(name, [])):
                    log_metrics({"fold_seconds": fold["seconds"]} | {f"last_{k}": x for k, x in fold["last"].items() if k in ("loss", "elapsed_s")}, step=f)
                for stage, weights in report.get("first_stage_weights", {}).get(name, {}).items():
                    for f, w in enumerate(weights):
                        log_metrics({f"first_stage_weight.{stage}": min(w, 1e9)}, step=f)
                for fit in report["cross_year"]:
                    if name in fit["cv"]:
                        trained = "_and_".join(fit["trained_on"])
                        log_metrics({k: x for k, x in fit["cv"][name].items() if k != "guard"}, prefix=f"cross.{trained}.")
                        for collection, test in fit["tests"].items():
                            log_metrics(test["trials"][name], prefix=f"cross.{trained}.{collection}.")
    return parent_id


@dataclass(frozen=True)
class RecordedRecipe:
    """How one recipe is run and recorded."""

    config: type
    example: str  # its shipped config
    tracking: list[str]  # tracking.key=value defaults (the command line's win)
    run: Callable[[Any], dict[str, Any]]  # -> the report ({} when there is nothing to record, e.g. only=cache)
    made_by: Callable[[Any], Any]  # the config as the report names it (report["config"])
    headline: Callable[[Any, dict[str, Any]], str]
    log_report: Callable[[RecipeJob, dict[str, Any]], str]  # -> the parent run's id
    children: Callable[[Any, dict[str, Any]], str]  # what the child runs are, for the last line


RECIPES = {
    "realtext": RecordedRecipe(realtext.RealTextConfig, "configs/realtext/smollm2-trec-dl.yaml",
                               ["experiment=hllm-realtext", "registered_model=null"], realtext.run, fingerprint,
                               lambda cfg, r: "\n".join(realtext.summary_lines(cfg, r)), log_realtext,
                               lambda cfg, r: f"{len(realtext.trials(cfg))} trial(s) as children"),
}


def main(name: str, argv: list[str] | None = None) -> None:
    """Runs the recipe `name` (or reads its finished report with `--report`), prints its headline, records it."""
    spec = RECIPES[name]
    recipe, tracking, report_path = parse_recipe_job(spec.config, __doc__, spec.tracking, spec.example, argv)
    job = RecipeJob(recipe, tracking)
    t0 = time.perf_counter()
    if report_path:
        report = json.loads(Path(report_path).read_text())
        if report["config"] != spec.made_by(recipe):
            raise ValueError(f"{report_path} was made under another config than the one given with these overrides: "
                             "run the recipe, or give the config that made it")
    else:
        log.info("config: %s", json.dumps(to_dict(recipe)))
        report = spec.run(recipe)
        if not report:  # only=cache: nothing to record
            return
    print(spec.headline(recipe, report))
    parent = spec.log_report(job, report)
    print(f"mlflow parent run {parent} ({spec.children(recipe, report)}); total {time.perf_counter() - t0:.0f}s")
