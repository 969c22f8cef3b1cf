"""Distillation from a real teacher's rankings (`hllm.recipes.distilltext`), recorded in MLflow: a
parent run with the methods' figures and the report, and a child run per trial (a variant fitted on
one teacher, or on the judgments) with its settings and its figures, so the ablation compares in
MLflow's UI like the embedded grid's cells.

    hllm distilltext --config configs/distilltext/smollm2-dl19-rankvicuna.yaml [key=value ...] [tracking.experiment=...]
    hllm distilltext --config ... --report runs/distilltext/report.json   # record a finished run's report

The recipe runs in this process (its states are cached per query; each fit is seconds to minutes on
a CPU); MLflow's store defaults to sqlite under the recipe's output_dir.
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
from hllm.data.cache import fingerprint
from hllm.recipes.distilltext import DistillTextConfig, Variant, run, summary_lines, trial_name, trials
from pipelines.common import RecipeJob, TrackingConfig, log_metrics, mlflow_run, parse_recipe_job

log = logging.getLogger("hllm")
DEFAULT_TRACKING = ["experiment=hllm-distilltext", "registered_model=null"]  # tracking.key=value overrides win


@dataclass
class TrialRun:
    """A child run's params: the variant and the teacher it learned from."""

    variant: Variant
    teacher: str  # "judgments" for a judgments-only variant
    output_dir: str
    tracking: TrackingConfig


def log_report(job: RecipeJob, report: dict[str, Any]) -> str:
    """The parent run and one child per trial; -> the parent's run id."""
    import mlflow

    cfg, folds, cross = job.recipe, report["teacher_folds"], report["cross_year"]
    table = folds["table"]
    with mlflow_run(job, "distilltext", **{"hllm.collection": report["collection"]}) as parent:
        mlflow.log_dict(report, "report.json")
        log_metrics({"queries": folds["queries"]})
        for name, row in table.items():
            if not name.startswith("trial:"):
                log_metrics({k: x for k, x in row.items() if k != "per_query_nDCG@10"}, prefix=f"folds.{name}.")
        for name, share in folds["share_kept"].items():
            log_metrics(share, prefix=f"folds.{name}.share_kept.")
        for collection, test in cross["tests"].items():
            for name, m in test["methods"].items():
                log_metrics(m, prefix=f"cross.{collection}.{name}.")
        cal = report["calibration"]
        log_metrics({"ece_held_out_queries": cal["oof"]["ece"]} | {f"ece.{c}": r["ece"] for c, r in cal["cross_year"].items()},
                    prefix="calibration.")
        parent_id = parent.info.run_id
        for v, teacher in trials(cfg):
            name = trial_name(v, teacher)
            child = TrialRun(v, teacher or "judgments", cfg.output_dir, dataclasses.replace(job.tracking, run_name=name))
            chosen = sum(name in c.values() for c in folds["chosen"])
            with mlflow_run(child, "distilltext-trial", parent_id, **{"ablation.variant": name, "ablation.kind": "trial",
                                                                      "ablation.target": v.target}):
                row = table[f"trial:{name}"]
                log_metrics({k: x for k, x in row.items() if k != "per_query_nDCG@10"}, prefix="folds.")
                log_metrics({"folds_chosen": chosen, **cross["cv"][name]})
                for f, cv in enumerate(folds["cv"]):
                    log_metrics(cv[name], step=f, prefix="fold_cv.")
                for collection, test in cross["tests"].items():
                    log_metrics(test["trials"][name], prefix=f"cross.{collection}.")
    return parent_id


def main(argv: list[str] | None = None) -> None:
    recipe, tracking, report_path = parse_recipe_job(DistillTextConfig, __doc__, DEFAULT_TRACKING,
                                                     "configs/distilltext/smollm2-dl19-rankvicuna.yaml", argv)
    job = RecipeJob(recipe, tracking)
    t0 = time.perf_counter()
    if report_path:
        report = json.loads(Path(report_path).read_text())
        if report["config"] != fingerprint(recipe):
            raise ValueError(f"{report_path} was made under another config than the one given with these overrides "
                             "(its fingerprint differs): run the recipe, or give the config that made it")
    else:
        log.info("config: %s", json.dumps(to_dict(recipe)))
        report = run(recipe)
    print("\n".join(summary_lines(recipe, report)))
    parent = log_report(job, report)
    print(f"mlflow parent run {parent} ({len(report['cross_year']['cv'])} trials as children); total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
