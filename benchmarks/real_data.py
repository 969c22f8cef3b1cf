"""Quality on real text: first stage, AR teacher, single-pass student and the FIRST-style readout of
the teacher, on a finished job's held-out queries and (optionally) on a second collection the
job never saw; and the cross-year protocol and teacher-folds of finished `hllm realtext` runs.

    python benchmarks/real_data.py --cross-year runs/realtext --confirm runs/realtext-confirm   # the report as committed
    python benchmarks/real_data.py --teacher-folds runs/distilltext           # adds the real teachers' rows to it
    python benchmarks/real_data.py --input-order runs/order                   # and the input-order rows (hllm order)
    python benchmarks/real_data.py --job runs/dl19-smollm2 [--transfer ../shared/data/cranfield] [--transfer-queries 40]

`--cross-year RUN`: RUN's `report.json` (`hllm realtext --config configs/realtext/smollm2-trec-dl.yaml`)
gives, per cross-year fit, split `cross-year` rows (collection = the test year, trained on the other): the
first stage and the student on every judged query of the test year, the whole BM25 top 100
reranked in one pass; and split
`transfer-test` rows: the shipped student (trained on both years) on a collection never trained on.

`--teacher-folds RUN`: RUN's `report.json` (`hllm realtext --config configs/realtext/smollm2-dl19-rankvicuna.yaml`)
gives split `teacher-folds` rows per teacher (first stage, the teacher's own run, and each student
method, every query of the collection tested once, with Kendall tau to that teacher and the share of
its gain over the first stage kept, a 95% bootstrap interval over queries) and split `cross-year`
rows of the students distilled on every query, tested on another year. They replace the rows of
an earlier `--teacher-folds` run in `--out` and keep every other row there.

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
import dataclasses
import json
import logging
from pathlib import Path

from hllm.config import from_dict
from hllm.data.readers import read_slates
from hllm.data.splits import load_splits, unit_hash
from hllm.eval.evaluation import evaluate_student, evaluate_teacher, first_stage_order, quality
from hllm.eval.results_table import FIELDS, merge_rows, write_rows
from hllm.job.stages import load_teacher, teacher_model
from hllm.model.backbones import resolve_device
from hllm.records import RerankRequest
from hllm.recipes.realtext import RealTextConfig, shipped_key
from hllm.reranker import Reranker
from hllm.teacher.baselines import first_style_orders
from pipelines.common import PipelineConfig

TEACHER_FIELDS = FIELDS[:10]
ORDER_FIELDS = ["collection", "queries", "split", "method", "input_order", "order_declared", "nDCG@10", "nDCG@10_ci95"]
DISTILLED = "## Real teachers"  # the Markdown section of the --teacher-folds rows
ORDERED = "## Input order"  # the Markdown section of the --input-order rows
SECTIONS = (DISTILLED, ORDERED)
log = logging.getLogger("hllm")


def rows_for(collection: str, split: str, slates: list[RerankRequest], metrics: dict[str, dict[str, float]]) -> list[dict]:
    return [{"collection": collection, "queries": len(slates), "split": split, "method": method,
             "nDCG@10": round(m["nDCG@10"], 4), "MRR@10": round(m["MRR@10"], 4)} for method, m in metrics.items()]


def cross_year_rows(run: Path, transfer_only: bool = False) -> tuple[list[dict], list[str]]:
    """Rows and Markdown notes from a finished `hllm realtext` run's report.json: per cross-year test the first stage,
    the student (the trial the shipped method's CV chose on that training set) and, with a domain guard, the same head
    without it; the shipped student's transfer checks (`transfer_only`: those alone, split `transfer-confirm`: a second
    run on the other side of the hashed split)."""
    report = json.loads((run / "report.json").read_text())
    cfg = json.loads((run / "config.json").read_text())
    key = shipped_key(from_dict(RealTextConfig, cfg))  # the shipped method's name in the report
    if transfer_only:
        report = {**report, "cross_year": [], "shipped": None}
    split_name = "transfer-confirm" if transfer_only else "transfer-test"
    tested, notes = [], []  # (a row as the transfer checks write it, its split); the notes
    for fit in report["cross_year"]:
        trial = fit["chosen"][key]
        for collection, test in fit["tests"].items():
            tested.append(({"collection": collection, "queries": test["queries"], "first_stage": test["methods"]["first_stage"],
                            "student": test["methods"][key], **test.get("guard", {}).get(trial, {})}, "cross-year"))
            notes.append(f"- {collection} ({test['queries']} queries) trained on {' + '.join(fit['trained_on'])} ({fit['queries']} "
                         f"queries): student `{trial}` nDCG@10 {test['methods'][key]['nDCG@10']:.4f}; "
                         + chosen({**fit["cv"][trial], "cv_folds": cfg["cv_folds"]}))
    tested += [(t, split_name) for t in report["transfer"]]
    rows = [{"collection": row["collection"], "queries": row["queries"], "split": split, "method": method,
             "nDCG@10": round(m["nDCG@10"], 4), "MRR@10": round(m["MRR@10"], 4)}
            for row, split in tested for method, m in _methods(row)]
    for row, split in tested:
        if "trust" in row:
            trust = row["trust"]
            notes.append(f"- domain guard, {row['collection']} ({split}): mean trust {trust['mean']:.2f}; "
                         f"{trust['fallback_share']:.0%} of {row['queries']} queries fell back to the first-stage order, "
                         f"{trust['partial_share']:.0%} partly (student {row['student']['nDCG@10']:.4f}, unguarded "
                         f"{row['student_unguarded']['nDCG@10']:.4f}, first stage {row['first_stage']['nDCG@10']:.4f})")
    if report["shipped"]:
        shipped = report["shipped"]
        notes.append(f"- shipped student `{shipped['trial']}`, fitted on {shipped['queries']} queries of "
                     f"{' + '.join(shipped['trained_on'])}: {chosen({**shipped, 'cv_folds': cfg['cv_folds']})}")
    return rows, notes


def _methods(row: dict) -> list[tuple[str, dict]]:
    """A realtext report row's methods: the first stage, the student and, with a domain guard, the student without it."""
    return [("first_stage", row["first_stage"]), ("student", row["student"]),
            *([("student_unguarded", row["student_unguarded"])] if "student_unguarded" in row else [])]


def teacher_fold_rows(run: Path) -> tuple[list[dict], list[str]]:
    """Rows and Markdown notes from a finished `hllm realtext` run's report.json with teacher-folds."""
    report = json.loads((run / "report.json").read_text())
    cfg = json.loads((run / "config.json").read_text())
    folds, collection = report["teacher_folds"], report["collection"]
    if not folds:
        raise ValueError(f"{run}: this run has no teacher-folds (its config's folds is 0)")
    table, n = folds["table"], folds["queries"]
    rows, notes = [], []

    def row(coll, queries, split, method, m, teacher="", tau=None, share=None):
        return {"collection": coll, "queries": queries, "split": split, "method": method, "nDCG@10": round(m["nDCG@10"], 4),
                "MRR@10": round(m["MRR@10"], 4), "teacher": teacher, "tau_to_teacher": "" if tau is None else f"{tau:.3f}",
                "share_kept": "" if share is None else f"{share['share']:.2f}",
                "share_kept_ci95": "" if share is None else f"[{share['ci_low']:.2f}, {share['ci_high']:.2f}]"}

    for t in cfg["teachers"]:
        name = t["name"]
        for method in ["first_stage", "teacher", "student_distilled", "student_both", "student_judged"]:
            key = method if method == "first_stage" else f"{method}@{name}"
            if key in table:
                rows.append(row(collection, n, "teacher-folds", method, table[key], name, table[key][f"tau_to_{name}"],
                                folds["share_kept"].get(key)))
        picks = [c.get(f"student_distilled@{name}") for c in folds["chosen"]]
        notes.append(f"- {name}: the distilled student's variant per fold (by CV on the fold's training queries): "
                     + ", ".join(p.split("@")[0] for p in picks))
    (cross,) = [fit for fit in report["cross_year"] if fit["trained_on"] == [collection]] or [{"tests": {}, "chosen": {}}]
    for other, test in cross["tests"].items():
        rows.append(row(other, test["queries"], "cross-year", "first_stage", test["methods"]["first_stage"]))
        for t in cfg["teachers"]:
            key = f"student_distilled@{t['name']}"
            if key in test["methods"]:
                rows.append(row(other, test["queries"], "cross-year", "student_distilled", test["methods"][key], t["name"]))
                notes.append(f"- cross-year -> {other}: distilled from {t['name']} on all {n} queries of {collection} "
                             f"with `{cross['chosen'][key].split('@')[0]}` (chosen by CV over them)")
    ablation = ["", f"Ablation: each trial (a variant x a teacher) on the teacher-folds, every query tested once ({n} queries), "
                f"and fitted on all of {collection}, tested on the other year. A method uses, per fold, the trial its CV chose.", "",
                "| trial | teacher-folds nDCG@10 | tau to rankvicuna-7b | " + " | ".join(f"{o} nDCG@10" for o in cross["tests"]) + " |",
                "| --- | ---: | ---: | " + " | ".join("---:" for _ in cross["tests"]) + " |"]
    first_teacher = cfg["teachers"][0]["name"]
    for key, m in table.items():
        if key.startswith("trial:"):
            trial = key.removeprefix("trial:")
            ablation.append(f"| {trial} | {m['nDCG@10']:.4f} | {m[f'tau_to_{first_teacher}']:.3f} | "
                            + " | ".join(f"{t['trials'][trial]['nDCG@10']:.4f}" for t in cross["tests"].values()) + " |")
    ablation[3] = ablation[3].replace("rankvicuna-7b", first_teacher)
    return rows, notes + ablation


def chosen(t: dict) -> str:
    """How a fit's settings were chosen, from its CV record (with the config's `cv_folds`)."""
    scores = f"held-out nDCG@10 {t['cv_score']:.4f}, first stage {t['cv_first_stage']:.4f}"
    if "ridge_lambda" in t:
        return (f"L2 {t['ridge_lambda']:g} and prior scale {t['prior_scale']:g} chosen by {t['cv_folds']}-fold CV over the "
                f"training queries ({scores})")
    return f"step {t['best_step']} kept by {t['cv_folds']}-fold CV over the training queries ({scores})"


def write(rows: list[dict], out: Path, text: str, title: str | None = "# Real text: first stage, teacher, student") -> None:
    write_rows(rows, out)
    print(text)
    out.with_suffix(".md").write_text((f"{title}\n\n" if title else "") + f"{text}\n")


def table(rows: list[dict], fields: list[str] = FIELDS[:6]) -> list[str]:
    align = {"collection": "---", "split": "---", "method": "---", "teacher": "---", "share_kept_ci95": "---"}
    return ["| " + " | ".join(fields) + " |", "| " + " | ".join(align.get(k, "---:") for k in fields) + " |"] + [
        "| " + " | ".join(f"{r[k]:.4f}" if isinstance(r[k], float) and k in ("nDCG@10", "MRR@10") else str(r.get(k, ""))
                          for k in fields) + " |" for r in rows]


def merge_section(out: Path, marker: str, section: list[str]) -> str:
    """`out`'s Markdown twin with its `marker` section (up to the next of SECTIONS) replaced by `section`, or added."""
    md = out.with_suffix(".md")
    text = md.read_text() if md.is_file() else "# Real text: first stage, teacher, student\n"
    parts, rest = {}, text
    for m in sorted((m for m in SECTIONS if f"\n{m}" in text), key=lambda m: text.index(f"\n{m}"), reverse=True):
        rest, _, body = rest.partition(f"\n{m}")
        parts[m] = m + body.rstrip()
    parts[marker] = "\n".join(section).rstrip()
    return "\n\n".join([rest.rstrip(), *(parts[m] for m in SECTIONS if m in parts)])


def add_teacher_folds(run: Path, out: Path) -> None:
    """A teacher-folds run's rows into `out` (CSV and its Markdown twin): a row of the same (collection,
    split, method, teacher) is replaced where it stands, an earlier run's section too; everything else stays."""
    rows, notes = teacher_fold_rows(run)
    cfg = json.loads((run / "config.json").read_text())
    r = cfg["ranker"]
    merged = merge_rows(rows, out)
    teachers = ", ".join(f"{t['name']} (`{Path(t['rankings']).name}`)" for t in cfg["teachers"])
    section = [
        f"{DISTILLED}: distilled from a file of the teacher's rankings (`{run}`, `hllm realtext`)", "",
        f"Teachers: {teachers}, over the first stage's top {cfg['top_n']} of `{Path(cfg['teacher_collection']).name}`. Student: "
        f"{r['model']['preset']} frozen, prompt `{r['prompt']['template']}` (passages cut to {r['prompt']['max_doc_tokens']} tokens, "
        f"the whole top {cfg['top_n']} one prompt), states after layers {cfg['layers']} from one prefill. `teacher-folds`: "
        f"{cfg['folds']} folds by query hash, every query tested once; on each fold's training queries every variant picks "
        f"its settings and each method its variant by {cfg['cv_folds']}-fold CV (nDCG@10 on those queries' qrels), the test "
        "queries read once. Methods: `teacher` is its own run on the same candidates; `student_distilled` learned from the "
        "teacher's rankings alone, `student_both` from them and the qrels, `student_judged` from the qrels alone. "
        "tau_to_teacher: mean Kendall tau over queries of the whole 100-candidate order. share_kept: (student - first "
        "stage) / (teacher - first stage) of mean nDCG@10, 95% percentile bootstrap over queries (scipy.stats.bootstrap, "
        f"{cfg['bootstrap']} resamples). MRR@10 counts grade >= {cfg['rel']} as relevant.", "", *notes[:notes.index("")], "",
        *table(rows, TEACHER_FIELDS), *notes[notes.index(""):]]
    write(merged, out, merge_section(out, DISTILLED, section), title=None)


def input_order_rows(run: Path) -> tuple[list[dict], list[str]]:
    """Rows and Markdown notes from a finished `hllm.recipes.order` run's report.json: per student, cross-year, the
    variant shipped and the students as shipped before (first-stage order only), by input order."""
    report = json.loads((run / "report.json").read_text())
    cfg = report["config"]
    test = Path(cfg["test_on"]).name
    rows, notes = [], []

    def row(method: str, order: str, declared: str, m: dict) -> dict:
        return {"collection": test, "queries": m["queries"], "split": "input-order", "method": method,
                "nDCG@10": round(m["nDCG@10"], 4), "input_order": order, "order_declared": declared,
                "nDCG@10_ci95": f"[{m['ci95'][0]:.4f}, {m['ci95'][1]:.4f}]"}

    first = report["students"][0]["variants"][report["students"][0]["chosen"]]["cross_year"]
    shuffles = cfg["shuffles"]
    rows.append(row("first_stage", "first-stage", "", first["first stage"]))
    rows += [row("first_stage", key.removesuffix(" (the order itself)"), "", m) for key, m in first.items()
             if key.endswith("(the order itself)")]
    for st in report["students"]:
        for key in dict.fromkeys([st["chosen"], st["before"]]):
            cy = st["variants"][key]["cross_year"]
            method = st["student"] if key == st["chosen"] else f"{st['student']} ({key})"
            rows.append(row(method, "first-stage", "yes", cy["first-stage, declared"]))
            served = cy["shuffled, as served (mean of the shuffles)"]
            arrived = cy["shuffled, read as they arrived (mean of the shuffles)"]
            for how, declared, mean in (("as served", "no", served), ("read as it arrived", "no, read as it arrived", arrived)):
                rows += [row(method, k.removesuffix(f", {how}"), declared, m) for k, m in cy.items() if k.endswith(f", {how}")]
                rows.append(row(method, f"shuffled (mean of {len(shuffles)})", declared, mean))
            notes.append(f"- `{method}`: {st['variants'][key]['rule']}; spread over the {len(shuffles)} shuffles "
                         f"{served['spread']:.4f} as served, {arrived['spread']:.4f} read as they arrived")
    return rows, notes


def add_input_order(run: Path, out: Path) -> None:
    """An order run's rows into `out` (CSV and its Markdown twin), as `add_teacher_folds` does."""
    rows, notes = input_order_rows(run)
    cfg = json.loads((run / "report.json").read_text())["config"]
    merged = merge_rows(rows, out)
    section = [
        f"{ORDERED}: the candidates shuffled, reversed, or in the first stage's order (`{run}`, `hllm.recipes.order`)", "",
        f"Split `input-order`: every judged query of `{Path(cfg['test_on']).name}`, the students fitted on "
        f"`{Path(cfg['train_on']).name}` (cross-year), the whole BM25 top {cfg['top_n']} in one prompt, in the order of "
        "`input_order` (`hllm.data.order`: `shuffled:SEED` a fixed per-query shuffle). `order_declared`: yes, the "
        "first-stage prior reads the ranks (`first_stage_order=true`); no, it is off and the ranking is the text's alone, "
        "the list read in its canonical order as served (any arrival order gives the same answer); \"no, read as it "
        "arrived\": the ablation, the causal prompt in the arrival order. "
        "`first_stage` rows are the order itself. A method named with a variant in brackets is that variant of the "
        "recipe's ablation (the students as shipped before); the bare name is the student as shipped now. nDCG@10_ci95: "
        f"95% percentile bootstrap over queries ({cfg['bootstrap']} resamples). Rows above this section were measured "
        "in the first stage's order (input_order first-stage), the prior reading it. Details: reports/order.md.", "",
        *notes, "", *table(rows, ORDER_FIELDS)]
    write(merged, out, merge_section(out, ORDERED, section), title=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", help="a finished job's output_dir (config.json, report.json, teacher/, student/)")
    parser.add_argument("--cross-year", metavar="RUN", help="a finished hllm realtext run's output_dir (report.json)")
    parser.add_argument("--confirm", metavar="RUN", help="with --cross-year: a second realtext run's transfer checks "
                        "(transfer_split=rest: queries never looked at) as split transfer-confirm")
    parser.add_argument("--teacher-folds", metavar="RUN", help="a finished hllm realtext run's output_dir with teacher-folds: "
                        "its rows replace an earlier such run's in --out, every other row stays")
    parser.add_argument("--input-order", metavar="RUN", help="a finished hllm.recipes.order run's output_dir: its rows "
                        "(split input-order) replace an earlier such run's in --out, every other row stays")
    parser.add_argument("--transfer", action="append", default=[], help="with --job: another BEIR-style collection to rerank")
    parser.add_argument("--transfer-queries", type=int, default=40, help="at most this many of its test queries")
    parser.add_argument("--out", default="reports/real_data.csv")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.teacher_folds or args.input_order:
        if args.job or args.cross_year:
            parser.error("--teacher-folds and --input-order add their rows to --out on their own: run the others first")
        if args.teacher_folds:
            add_teacher_folds(Path(args.teacher_folds), Path(args.out))
        if args.input_order:
            add_input_order(Path(args.input_order), Path(args.out))
        return
    if not (args.job or args.cross_year):
        parser.error("give --job, --cross-year, or both (or --teacher-folds)")
    rows, sections = [], []
    if args.cross_year:
        cross, notes = cross_year_rows(Path(args.cross_year))
        rows += cross
        if args.confirm:
            confirm, confirm_notes = cross_year_rows(Path(args.confirm), transfer_only=True)
            rows += confirm
            notes += confirm_notes
        cfg = json.loads((Path(args.cross_year) / "config.json").read_text())
        r = cfg["ranker"]
        sections += [
            f"Run `{args.cross_year}` (`hllm realtext`): {r['model']['preset']} frozen, cut after decoder layer "
            f"{r['state_layer']}, each passage read as `{r.get('pooling', 'last')}` (hllm.model.item_states.POOLINGS); "
            f"prompt `{r['prompt']['template']}`; {r['head']['kind']} head with the first-stage prior "
            f"({r['head']['prior']}), fitted over cached item states as its variants say ("
            + "; ".join(f"`{v['name']}`: {v['target']}, {v['fit']}, layer {v['layer']}, {v['pooling']}" for v in cfg["variants"])
            + f"). Every query's BM25 top {cfg['top_n']} is reranked in one pass (one prompt, passages cut to "
            f"{r['prompt']['max_doc_tokens']} tokens), as `hllm rerank` does with this model. `cross-year`: every judged "
            f"query of the test year, fitted on the other year (whose own queries choose the settings). "
            f"`transfer-test`: the shipped student (both years) on the hashed test split of "
            f"a collection never trained on" + (f"; `transfer-confirm` (`{args.confirm}`): the same student on the queries outside "
            "that split (a second sample, never looked at while the guard was built)" if args.confirm else "") + ". "
            + ("`student` carries the domain guard (`ranker.head.guard: distance`, hllm.model.heads.DomainGuard: a query whose "
               "passages' states lie farther from the training data than any held-out training query's falls back toward "
               "the first-stage order, and one whose prompt shows each passage fewer tokens than every training prompt did "
               "keeps it; thresholds from the training queries alone); `student_unguarded` is the same head "
               "without it. " if r["head"].get("guard", "none") != "none" else "")
            + f"MRR@10 counts grade >= {cfg['rel']} as relevant (transfer collections: from their grade scale, "
            "hllm.eval.runfile.relevance_threshold: 1 for Cranfield's 1-4 and ArguAna's binary qrels).", "", *notes, ""]
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
        slates = [s for s in read_slates("beir", path, top_n=cfg.data.top_n) if unit_hash(s.slate_id) < cfg.data.test_fraction]
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
