"""Quality on real text: first stage, AR teacher, single-pass student and the FIRST-style readout of
the teacher, on a finished job's held-out queries and (optionally) on a second collection the
job never saw; and the cross-year protocol of a finished `hllm.recipes.realtext` run.

    python benchmarks/real_data.py --cross-year runs/realtext                 # the report as committed
    python benchmarks/real_data.py --job runs/dl19-smollm2 [--transfer ../shared/data/cranfield] [--transfer-queries 40]

`--cross-year RUN`: RUN's `report.json` (`python -m hllm.recipes.realtext --config configs/realtext/smollm2-trec-dl.yaml`)
gives, per fold, split `cross-year` rows (collection = the test year, trained on the other): the
first stage and the student on every judged query of the test year, the whole BM25 top 100
reranked in one pass, the student's figures the mean over the run's seeds; and split
`transfer-test` rows: the shipped student (trained on both years) on a collection never trained on.

Reads the job's `config.json` and `report.json` (first stage, teacher and student on its test
split, as the job measured them), runs the FIRST-style readout (one prefill of the teacher's
prompt, identifiers ranked by their logits where the answer starts) on the same slates, and for
each `--transfer` collection (BEIR layout with `runs/bm25_top100.tsv`) reranks the queries of its
hashed test split (the same `data.test_fraction` rule, capped at `--transfer-queries`) with all
four. Writes `reports/real_data.csv` (collection, queries, split, method, nDCG@10, MRR@10) and
its Markdown twin (`.md` beside it). Rows say how many queries they average; the first stage is always there.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
from pathlib import Path

from hllm.config import from_dict
from hllm.data.readers import read_slates
from hllm.data.splits import load_splits, query_bucket
from hllm.eval.evaluation import evaluate_student, evaluate_teacher, first_stage_order, quality
from hllm.model.backbones import resolve_device
from hllm.recipes.stages import load_teacher, teacher_model
from hllm.records import RerankRequest
from hllm.reranker import Reranker
from hllm.teacher.baselines import first_style_orders
from pipelines.common import PipelineConfig

FIELDS = ["collection", "queries", "split", "method", "nDCG@10", "MRR@10"]
log = logging.getLogger("hllm")


def rows_for(collection: str, split: str, slates: list[RerankRequest], metrics: dict[str, dict[str, float]]) -> list[dict]:
    return [{"collection": collection, "queries": len(slates), "split": split, "method": method,
             "nDCG@10": round(m["nDCG@10"], 4), "MRR@10": round(m["MRR@10"], 4)} for method, m in metrics.items()]


def cross_year_rows(run: Path) -> tuple[list[dict], list[str]]:
    """Rows and Markdown notes from a finished `hllm.recipes.realtext` run's report.json."""
    report = json.loads((run / "report.json").read_text())
    rows, notes = [], []
    for fold in report["folds"]:
        n, seeds = fold["queries"], len(fold["seeds"])
        rows += [{"collection": fold["collection"], "queries": n, "split": "cross-year", "method": method,
                  "nDCG@10": round(m["nDCG@10"], 4), "MRR@10": round(m["MRR@10"], 4)}
                 for method, m in (("first_stage", fold["first_stage"]), ("student", fold["student"]))]
        notes.append(f"- {fold['collection']} ({n} queries) trained on {' + '.join(fold['trained_on'])}: student "
                     f"nDCG@10 {fold['student']['nDCG@10']:.4f} ± {fold['student_nDCG@10_sd']:.4f} (sd over {seeds} seeds: "
                     + ", ".join(f"{r['nDCG@10']:.4f}" for r in fold["student_per_seed"]) + f"); {chosen(fold['training'][0])}")
    for t in report["transfer"]:
        rows += [{"collection": t["collection"], "queries": t["queries"], "split": "transfer-test", "method": method,
                  "nDCG@10": round(m["nDCG@10"], 4), "MRR@10": round(m["MRR@10"], 4)}
                 for method, m in (("first_stage", t["first_stage"]), ("student", t["student"]))]
    if report["shipped"]:
        notes.append(f"- shipped student, fitted on {report['shipped']['train_queries']} queries of both years: {chosen(report['shipped'])}")
    return rows, notes


def chosen(t: dict) -> str:
    """How a fit's settings were chosen, from its training record."""
    if "ridge_lambda" in t:
        return (f"L2 {t['ridge_lambda']:g} and prior scale {t['prior_scale']:g} chosen by {t['cv_folds']}-fold CV over the "
                f"training queries (held-out nDCG@10 {t['val_nDCG@10']:.4f}, first stage {t['val_nDCG@10_at_start']:.4f})")
    by = f"{t['cv_folds']}-fold CV over the training queries" if t.get("cv_folds") else f"{t['val_queries']} validation queries"
    return (f"step {t['best_step']} kept by {by} (held-out nDCG@10 {t['val_nDCG@10']:.4f}, "
            f"untrained = first stage {t['val_nDCG@10_at_start']:.4f})")


def write(rows: list[dict], out: Path, text: str) -> None:
    out.parent.mkdir(exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(text)
    out.with_suffix(".md").write_text(f"# Real text: first stage, teacher, student\n\n{text}\n")


def table(rows: list[dict]) -> list[str]:
    return ["| " + " | ".join(FIELDS) + " |", "| --- | ---: | --- | --- | ---: | ---: |"] + [
        "| " + " | ".join(f"{r[k]:.4f}" if isinstance(r[k], float) else str(r[k]) for k in FIELDS) + " |" for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", help="a finished job's output_dir (config.json, report.json, teacher/, student/)")
    parser.add_argument("--cross-year", metavar="RUN", help="a finished hllm.recipes.realtext run's output_dir (report.json)")
    parser.add_argument("--transfer", action="append", default=[], help="with --job: another BEIR-style collection to rerank")
    parser.add_argument("--transfer-queries", type=int, default=40, help="at most this many of its test queries")
    parser.add_argument("--out", default="reports/real_data.csv")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not (args.job or args.cross_year):
        parser.error("give --job, --cross-year, or both")
    rows, sections = [], []
    if args.cross_year:
        cross, notes = cross_year_rows(Path(args.cross_year))
        rows += cross
        cfg = json.loads((Path(args.cross_year) / "config.json").read_text())
        r = cfg["ranker"]
        sections += [
            f"Run `{args.cross_year}` (`hllm.recipes.realtext`): {r['model']['preset']} frozen, cut after decoder layer "
            f"{r['state_layer']}, each passage read as `{r.get('pooling', 'last')}` (hllm.model.item_states.POOLINGS); "
            f"prompt `{r['prompt']['template']}`; {r['head']['kind']} head with the first-stage prior "
            f"({r['head']['prior']}), fitted on graded qrels over cached item states "
            + ("in closed form (ridge)" if cfg["fit"] == "ridge" else f"by SGD ({', '.join(cfg['loss']['terms'])})")
            + f". Every query's BM25 top {cfg['top_n']} is reranked in one pass (one prompt, passages cut to "
            f"{r['prompt']['max_doc_tokens']} tokens), as `hllm rerank` does with this model. `cross-year`: every judged "
            f"query of the test year, fitted on the other year (whose own queries choose the settings); the student's "
            f"figures are means over {len(cfg['seeds'])} seed(s). `transfer-test`: the shipped student (both years) on the hashed test split of "
            f"a collection never trained on. MRR@10 counts grade >= {cfg['rel']} as relevant.", "", *notes, ""]
    if not args.job:
        write(rows, Path(args.out), "\n".join(sections + table(rows)))
        return
    job = Path(args.job)
    cfg = from_dict(PipelineConfig, json.loads((job / "config.json").read_text()))  # the config that ran
    report = json.loads((job / "report.json").read_text())
    device = resolve_device(cfg.device)
    rel, main_decoder = cfg.eval.binary_rel, cfg.eval.main_decoder
    splits = load_splits(cfg.data)
    teacher = load_teacher(teacher_model(cfg), cfg, device)  # the job's own teacher, as it ranked
    student = Reranker.load(job / "student", device=str(device), merge_lora=True, decoder=main_decoder)
    test = splits["test"]
    if len(test) != report["test_slates"]:
        raise RuntimeError(f"{job}: report.json has {report['test_slates']} test slates, the config's split {len(test)}")
    name = Path(cfg.data.path).name if cfg.data.path else cfg.data.source
    log.info("%s: FIRST-style readout on %d test queries", name, len(test))
    rows += rows_for(name, "test", test, {
        "first_stage": report["first_stage"], "teacher": report["teacher"],
        "student": report["student"]["decoders"][main_decoder], "first_style": quality(test, first_style_orders(teacher.model, teacher.prompts, test, 4), rel)})
    for path in args.transfer:
        slates = [s for s in read_slates("beir", path, top_n=cfg.data.top_n) if query_bucket(s.slate_id) < cfg.data.test_fraction]
        slates = slates[: args.transfer_queries]
        log.info("%s (never trained on): %d test queries, AR teacher + student + FIRST-style", Path(path).name, len(slates))
        ranked = teacher.rank(slates)
        rows += rows_for(Path(path).name, "transfer-test", slates, {
            "first_stage": quality(slates, first_stage_order(slates), rel),
            "teacher": evaluate_teacher(slates, ranked, rel),
            "student": evaluate_student(student, slates, [r.permutation for r in ranked],
                                        dataclasses.replace(cfg.eval, decoders=[main_decoder])).decoders[main_decoder],
            "first_style": quality(slates, first_style_orders(teacher.model, teacher.prompts, slates, 4), rel)})
    teacher_name = cfg.teacher.model.preset + (" (bootstrapped on the train queries' qrels)" if cfg.teacher.bootstrap else "")
    text = "\n".join([
        f"Job `{job}`: teacher {teacher_name}, prompt `{cfg.prompt.template}`, top {cfg.data.top_n} of the first stage, "
        f"passages cut to {cfg.prompt.max_doc_tokens} tokens. `test`: the job's held-out queries (split by a hash of the "
        f"query id, never trained on); `transfer-test`: the same hash rule on a collection the job never saw. Means over "
        f"the queries counted; MRR@10 counts grade >= {rel} as relevant. first_style: identifiers ranked by the "
        f"teacher's logits where its answer starts (one prefill, no head).", ""])
    write(rows, Path(args.out), "\n".join(sections) + text + "\n" + "\n".join(table(rows)))


if __name__ == "__main__":
    main()
