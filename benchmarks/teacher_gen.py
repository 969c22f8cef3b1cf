"""Teacher generation: throughput with 1 and 2 Ray Data actors, validity free vs constrained.

    python benchmarks/teacher_gen.py [--config configs/default.yaml] [key=value ...] [--slates 256]

Reuses the job's teacher (bootstrapped once into `output_dir/teacher`). Prints a table and writes
`reports/teacher_gen.md`. Figures, not a timed test: run it on a quiet machine and read ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile

from bench import write_report  # benchmarks/ is on sys.path when run as a script
from hllm.config import load_config
from hllm.evaluation import evaluate_teacher
from hllm.job import add_config_args
from hllm.models import resolve_device
from hllm.splits import load_splits
from hllm.stages import bootstrap_teacher_stage, load_teacher, teacher_rankings_stage
from pipelines import teacher_gen
from pipelines.common import PipelineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slates", type=int, default=256, help="training slates to generate per actor setting")
    add_config_args(parser)
    args = parser.parse_intermixed_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(PipelineConfig, args.config, args.overrides)
    splits = load_splits(cfg.data)
    teacher_model = bootstrap_teacher_stage(cfg, splits["train"], resolve_device(cfg.device))
    slates = splits["train"][: args.slates]
    rows = []
    for actors in (1, 2):
        with tempfile.TemporaryDirectory() as out:  # a fresh store: every slate is ranked
            run_cfg = dataclasses.replace(cfg, output_dir=out, cluster=dataclasses.replace(cfg.cluster, teacher_actors=actors))
            stats = teacher_rankings_stage(run_cfg, teacher_model, "bench", slates, teacher_gen.ray_ranker(run_cfg, teacher_model)).stats
        rows.append((actors, stats["slates_per_s"], stats["output_tokens_per_s"], stats["seconds"]))
    lines = ["| actors | slates/s | output tokens/s | seconds |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {a} | {s:.2f} | {t:.0f} | {sec:.1f} |" for a, s, t, sec in rows]
    lines.append(f"\n2 actors / 1 actor: **{rows[1][1] / rows[0][1]:.2f}x** ({len(slates)} slates each)\n")
    lines += ["| decoding | validity | nDCG@10 (test) | wrong format | repeated | missing |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for constrained in (False, True):
        gen = dataclasses.replace(cfg.teacher.generation, constrained=constrained, repair=True)
        teacher = load_teacher(teacher_model, dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, generation=gen)),
                               resolve_device(cfg.device))
        report = evaluate_teacher(splits["test"], teacher.rank(splits["test"]), cfg.eval.binary_rel)
        lines.append(f"| {'constrained' if constrained else 'free'} | {report['validity']:.3f} | {report['nDCG@10']:.4f} | "
                     f"{report['parse_wrong_format']:.3f} | {report['parse_repeated']:.3f} | {report['parse_missing']:.3f} |")
    write_report("teacher_gen", "Teacher generation", "\n".join(lines))


if __name__ == "__main__":
    main()
