"""The single-process job: data -> teacher bootstrap -> teacher rankings -> student -> evaluation.

    python -m hllm.recipes.local_job [--config configs/default.yaml] [key=value ...]

A recipe: it only calls the stages (`hllm.job.stages`) in order, in this process; nothing imports it.
The Ray pipeline (`pipelines/full.py`) calls the same stages with Ray Data generation and Ray
Train + DeepSpeed fitting passed in. Each stage reuses its output when its inputs are unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from hllm.config import load_config, to_dict
from hllm.data.splits import SPLITS, load_splits
from hllm.model.backbones import resolve_device
from hllm.job.config import JobConfig, add_config_args, console_logging
from hllm.job.stages import (EvalReport, bootstrap_teacher_stage, evaluate_stage, fit_in_process, load_teacher, rank_in_process,
                                 summary_lines, teacher_rankings_stage, train_student_stage)

log = logging.getLogger("hllm")


def run(cfg: JobConfig) -> EvalReport:
    """The whole job; -> the evaluation report (also written to output_dir/report.json)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    splits = load_splits(cfg.data)
    teacher_model = bootstrap_teacher_stage(cfg, splits["train"], splits["val"], device)
    teacher = load_teacher(teacher_model, cfg, device)
    rank = rank_in_process(teacher, max_failed_share=cfg.teacher.max_failed_share)
    rankings = {name: teacher_rankings_stage(cfg, teacher_model, name, splits[name], rank) for name in SPLITS}
    student_dir = train_student_stage(cfg, teacher_model, rankings["train"], rankings["val"], fit_in_process(cfg, device))
    report = evaluate_stage(cfg, teacher, student_dir, rankings["test"], device)
    (out / "report.json").write_text(json.dumps(dataclasses.asdict(report), indent=2))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser)
    args = parser.parse_args(argv)
    console_logging()
    cfg = load_config(JobConfig, args.config, args.overrides)
    log.info("config: %s", json.dumps(to_dict(cfg)))
    t0 = time.perf_counter()
    report = run(cfg)
    for line in summary_lines(report, cfg.eval.main_decoder):
        print(line)
    print(f"total {time.perf_counter() - t0:.0f}s; report: {Path(cfg.output_dir) / 'report.json'}")


if __name__ == "__main__":
    main()
