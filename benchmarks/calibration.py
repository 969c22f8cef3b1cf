"""How well `relevance_score` is calibrated: ECE and a reliability diagram on jobs' test splits.

    python benchmarks/calibration.py runs/default [runs/dl19-smollm2 ...]

For each finished job folder: its student's calibration (fitted by the job on the val split; fitted
here the same way, and said, for a student saved before calibration existed), evaluated on the job's
test split (`hllm.model.calibration.calibration_report`). Writes `reports/calibration.md` (ECE, items,
queries, base rate per job, and the bins) and `reports/calibration.png` (the reliability diagram).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hllm.config import from_dict
from hllm.data.splits import load_splits
from hllm.model.calibration import Calibrator
from hllm.job.stages import calibrate_student, calibration_on
from hllm.reranker import Reranker
from pipelines.common import PipelineConfig
from pipelines.reports import plot_reliability


def job_report(job: Path) -> tuple[dict, str]:
    cfg = from_dict(PipelineConfig, {**json.loads((job / "config.json").read_text()), "output_dir": str(job)})
    splits = load_splits(cfg.data)
    student = job / "student"
    note = "fitted by the job"
    if Calibrator.load(student) is None:
        calibrate_student(student, splits["val"], cfg.eval.binary_rel)
        note = "fitted here on the job's val split (the student predates calibration)"
    report = calibration_on(Reranker.load(student, merge_lora=True), splits["test"])
    return report, note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jobs", nargs="+", type=Path)
    parser.add_argument("--out", default="reports/calibration.md")
    args = parser.parse_args()
    reports, lines = {}, ["# relevance_score calibration (test splits)", "",
                          "| job | test queries | items | relevant (base rate) | mean predicted | ECE | calibration |",
                          "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for job in args.jobs:
        rep, note = job_report(job)
        reports[job.name] = rep
        lines.append(f"| {job.name} | {rep['slates']} | {rep['items']} | {rep['positives']} ({rep['fraction_relevant']:.3f}) "
                     f"| {rep['mean_predicted']:.3f} | **{rep['ece']:.4f}** | {note} |")
        print(lines[-1], flush=True)
    for name, rep in reports.items():
        lines += ["", f"Reliability bins, {name} (grade >= {rep['rel']} is relevant):", "",
                  "| predicted | items | mean predicted | fraction relevant |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {b['lo']:.1f}–{b['hi']:.1f} | {b['count']} | {b['mean_predicted']:.3f} | {b['fraction_relevant']:.3f} |"
                  for b in rep["bins"] if b["count"]]
    out = Path(args.out)
    png = plot_reliability(reports, out.with_suffix(".png"))
    lines += ["", f"![reliability diagram]({png.name})", "",
              "ECE: count-weighted mean |fraction relevant − mean predicted| over 10 equal-width bins of the predicted "
              "P(relevant). One run; the calibration is a logistic model over 8 features of the score matrix, fitted "
              "on the val split, projected onto the returned order (non-increasing)."]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
