"""Teacher generation: throughput with 1 and 2 Ray Data actors, validity free vs constrained.

    python benchmarks/teacher_gen.py [--config configs/default.yaml] [key=value ...] [--slates 256]
    python benchmarks/teacher_gen.py --append --slates 16 --no-validity teacher.bootstrap=false \
        teacher.model.preset=smollm2-135m prompt.template=rankgpt prompt.max_doc_tokens=32 data.source=beir \
        data.path=../shared/data/trec-dl19-passage-bm25top100 teacher.generation.batch_size=8 cluster.teacher_batch_slates=8

Reuses the job's teacher (bootstrapped once into `output_dir/teacher`). Prints a table and writes
`reports/teacher_gen.md` (`--append` adds a section for another teacher). Figures, not a timed
test: run it on a quiet machine and read ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import tempfile
from pathlib import Path

from bench import write_report  # benchmarks/ is on sys.path when run as a script
from hllm.config import load_config
from hllm.data.splits import load_splits
from hllm.eval.evaluation import evaluate_teacher
from hllm.model.backbones import resolve_device
from hllm.job.config import add_config_args
from hllm.job.stages import bootstrap_teacher_stage, load_teacher, teacher_rankings_stage
from pipelines import teacher_gen
from pipelines.common import PipelineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slates", type=int, default=256, help="training slates to generate per actor setting")
    parser.add_argument("--append", action="store_true", help="add a section to reports/teacher_gen.md")
    parser.add_argument("--no-validity", action="store_true", help="skip free vs constrained decoding on the test split")
    add_config_args(parser)
    args = parser.parse_intermixed_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(PipelineConfig, args.config, args.overrides)
    splits = load_splits(cfg.data)
    teacher_model = bootstrap_teacher_stage(cfg, splits["train"], splits["val"], resolve_device(cfg.device))
    slates = splits["train"][: args.slates]
    rows = []
    for actors in (1, 2):
        with tempfile.TemporaryDirectory() as out:  # a fresh store: every slate is ranked
            run_cfg = dataclasses.replace(cfg, output_dir=out, cluster=dataclasses.replace(cfg.cluster, teacher_actors=actors))
            stats = teacher_rankings_stage(run_cfg, teacher_model, "bench", slates, teacher_gen.ray_ranker(run_cfg, teacher_model)).stats
        rows.append((actors, stats.slates_per_s, stats.output_tokens_per_s, stats.seconds))
    model = teacher_model.path or teacher_model.preset
    lines = [f"Teacher `{model}`, N = {max(len(s.candidates) for s in slates)}, batches of {cfg.teacher.generation.batch_size} "
             f"slates (left padding, KV cache), {cfg.cluster.teacher_cpus_per_actor} CPU per actor, actor start-up and model "
             "load included.", "", "| actors | slates/s | output tokens/s | seconds |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {a} | {s:.2f} | {t:.0f} | {sec:.1f} |" for a, s, t, sec in rows]
    lines.append(f"\n2 actors / 1 actor: **{rows[1][1] / rows[0][1]:.2f}x** ({len(slates)} slates each)\n")
    if not args.no_validity:
        lines += ["| decoding | validity | nDCG@10 (test) | wrong format | repeated | missing |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for constrained in () if args.no_validity else (False, True):
        gen = dataclasses.replace(cfg.teacher.generation, constrained=constrained, repair=True)
        teacher = load_teacher(teacher_model, dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, generation=gen)),
                               resolve_device(cfg.device))
        report = evaluate_teacher(splits["test"], teacher.rank(splits["test"]), cfg.eval.binary_rel)
        lines.append(f"| {'constrained' if constrained else 'free'} | {report['validity']:.3f} | {report['nDCG@10']:.4f} | "
                     f"{report['parse_wrong_format']:.3f} | {report['parse_repeated']:.3f} | {report['parse_missing']:.3f} |")
    if args.append:
        path = Path("reports/teacher_gen.md")
        path.write_text(path.read_text().rstrip() + f"\n\n## {model}\n\n" + "\n".join(lines) + "\n")
        print("\n".join(lines))
    else:
        write_report("teacher_gen", "Teacher generation", "\n".join(lines))


if __name__ == "__main__":
    main()
