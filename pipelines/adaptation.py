"""Backbone adaptation on real text (`hllm.recipes.adaptation`), recorded in MLflow: a parent run with the report
and the first stage's and teacher's figures per stage, and a child run per student (its backbone, kind, cut, LoRA
and training settings as params; nDCG@10, tau, change from the first stage and share kept per stage, raw and with the
first-stage guard; seconds a fold and each fold's last loss), so the ablation compares in MLflow's UI.

    hllm adaptation --config configs/adaptation/dl19-multistage.yaml [key=value ...] [tracking.experiment=...]
    hllm adaptation --config ... --report runs/adaptation/report.json   # record a finished run's report

The recipe runs in this process (its prefill states are cached; a stopped run resumes at its finished folds);
MLflow's store defaults to sqlite under the recipe's output_dir.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hllm.config import to_dict
from hllm.recipes.adaptation import AdaptationConfig, StudentSpec, markdown, run
from pipelines.common import RecipeJob, TrackingConfig, log_metrics, mlflow_run, parse_recipe_job

log = logging.getLogger("hllm")
DEFAULT_TRACKING = ["experiment=hllm-adaptation", "registered_model=null"]  # tracking.key=value overrides win


@dataclass
class StudentRun:
    """A child run's params: the student's spec."""

    student: StudentSpec
    output_dir: str
    tracking: TrackingConfig


def _figures(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "per_query"}


def log_report(job: RecipeJob, report: dict[str, Any]) -> str:
    """The parent run and one child per student; -> the parent's run id."""
    import mlflow

    cfg, table = job.recipe, report["table"]
    with mlflow_run(job, "adaptation", **{"hllm.data": Path(cfg.data).name}) as parent:
        mlflow.log_dict(report, "report.json")
        mlflow.log_text(markdown(cfg, report), "report.md")
        log_metrics({"queries": report["queries"], "seconds": report["seconds"]})
        for stage, rows in table.items():
            for name in ("first_stage", "teacher"):
                log_metrics(_figures(rows[name]), prefix=f"{stage}.{name}.")
        parent_id = parent.info.run_id
        for s in cfg.students:
            child = StudentRun(s, cfg.output_dir, dataclasses.replace(job.tracking, run_name=s.name))
            with mlflow_run(child, "adaptation-student", parent_id, **{"ablation.variant": s.name, "ablation.kind": s.kind,
                                                                       "ablation.backbone": s.model.preset}):
                for stage, rows in table.items():
                    for suffix in ("", "+guard"):
                        if s.name + suffix in rows:
                            log_metrics(_figures(rows[s.name + suffix]), prefix=f"{stage}.{'guarded' if suffix else 'raw'}.")
                for f, seconds in enumerate(report["fold_seconds"][s.name]):
                    log_metrics({"fold_seconds": seconds} | {f"last_{k}": v for k, v in report["history"][s.name][f].items()
                                                             if k in ("loss", "elapsed_s")}, step=f)
                for stage, weights in report["guard_weights"][s.name].items():
                    for f, w in enumerate(weights):
                        log_metrics({f"guard_weight.{stage}": min(w, 1e9)}, step=f)
    return parent_id


def main(argv: list[str] | None = None) -> None:
    recipe, tracking, report_path = parse_recipe_job(AdaptationConfig, __doc__, DEFAULT_TRACKING,
                                                     "configs/adaptation/dl19-multistage.yaml", argv)
    job = RecipeJob(recipe, tracking)
    t0 = time.perf_counter()
    if report_path:
        report = json.loads(Path(report_path).read_text())
        if report["config"] != to_dict(recipe):
            raise ValueError(f"{report_path} was made under another config than the one given with these overrides: "
                             "run the recipe, or give the config that made it")
    else:
        log.info("config: %s", json.dumps(to_dict(recipe)))
        report = run(recipe)
        if not report:  # only=cache
            return
    print(markdown(recipe, report))
    parent = log_report(job, report)
    print(f"mlflow parent run {parent} ({len(recipe.students)} students as children); total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
