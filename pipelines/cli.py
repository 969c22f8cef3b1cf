"""`hllm`: rerank any collection into a TREC run, evaluate runs, show the config, run the job, refresh it.

    hllm rerank --model runs/default/student --data ../shared/data/trec-dl19-passage-bm25top100 --out dl19.trec
    hllm rerank --teacher runs/default --data DIR --out teacher.trec       # the AR teacher, for comparison
    hllm rerank --model M --data DIR --out c.trec --cascade ~25% --cascade-url http://gpu:8000/v1 --teacher-model NAME
    hllm evaluate --run dl19.trec --qrels DIR/qrels/test.tsv
    hllm config show [--config configs/dl19-smollm2.yaml] [key=value ...]
    hllm serve smollm2-trec-dl                                            # an HTTP rerank endpoint (Ctrl-C stops it)
    hllm serve main=runs/default/student trec=smollm2-trec-dl --port 8080  # several students behind one endpoint
    hllm promote --name hllm-student --version 3 --alias champion           # then --model models:/hllm-student@champion
    hllm run [--config FILE] [key=value ...]                              # = python pipelines/full.py
    hllm realtext --config configs/realtext/smollm2-trec-dl.yaml           # MLflow: pipelines/recorded_recipes.py
    hllm realtext --config configs/realtext/smollm2-dl19-rankvicuna.yaml   # (hllm distilltext: its old name, an alias)
    hllm order --config configs/order/smollm2.yaml                         # = python -m hllm.recipes.order
    hllm realtext --config configs/realtext/smollm2-dl19-multistage.yaml   # (alias: hllm adaptation) MLflow: pipelines/recorded_recipes.py
    hllm refresh refresh.log_path=runs/traffic                            # = python pipelines/refresh.py: one flywheel cycle
    hllm export-teacher runs/embedded-teacher                             # a bootstrapped teacher -> preset embedded

Bad input (a missing model, a malformed file, ids that do not match, a query with no candidates)
is one line on stderr naming the file and the exit status 2; nothing is half-written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hllm.job.collection import CollectionRun

USAGE_ERROR = 2
READ_FORMATS = ("auto", "beir", "rank_llm", "tsv", "hllm")


def _load_slates(args: argparse.Namespace):
    """-> (slates, qrels path or None, data settings recorded with the run)."""
    from hllm.data.readers import DataFormatError, read_beir, read_qrels, read_slates

    data = Path(args.data)
    if not data.exists():
        raise FileNotFoundError(f"no input at {args.data!r}")
    fmt = args.format
    if fmt == "auto":
        fmt = "beir" if data.is_dir() else {".jsonl": "rank_llm", ".tsv": "tsv"}.get(data.suffix)
        if fmt is None:
            raise DataFormatError(f"cannot tell the format of {args.data!r} from its name: pass --format "
                                  f"({', '.join(READ_FORMATS[1:])})")
    if fmt == "beir":
        slates = read_beir(data, args.run, top_n=args.top_n, split=args.split)
        qrels = Path(args.qrels) if args.qrels else data / "qrels" / f"{args.split}.tsv"
        missing = sorted(set(read_qrels(qrels)) - {s.slate_id for s in slates})
        if missing and not args.skip_missing:
            raise DataFormatError(f"{len(missing)} judged queries of {qrels} have no candidates in the run "
                                  f"{args.run or data / 'runs' / 'bm25_top100.tsv'} (e.g. {missing[:3]}); "
                                  f"--skip-missing reranks the others")
    else:
        kwargs = {"queries": args.queries} if fmt == "tsv" else {}
        slates = read_slates(fmt, data, top_n=args.top_n, **kwargs)
        qrels = Path(args.qrels) if args.qrels else None
    return slates, qrels, {"data": str(data.resolve()), "format": fmt, "run": args.run, "top_n": args.top_n,
                           "split": args.split}


def _table(rows: dict[str, dict]) -> str:
    names = [k for k in next(iter(rows.values())) if k not in ("queries", "unjudged", "rel")]
    lines = ["| run | queries | " + " | ".join(names) + " |", "| --- | ---: | " + " | ".join("---:" for _ in names) + " |"]
    for label, m in rows.items():
        lines.append(f"| {label} | {m['queries']} | " + " | ".join(f"{m[n]:.4f}" for n in names) + " |")
    return "\n".join(lines)


def cmd_rerank(args: argparse.Namespace) -> int:
    from hllm.data.readers import read_qrels
    from hllm.eval.runfile import evaluate, evaluate_run
    from hllm.job.collection import RerankSpec, rerank_collection

    served = args.teacher_url or args.cascade_url
    if (served is None) != (args.teacher_model is None):
        raise ValueError("--teacher-url (or --cascade-url) and --teacher-model go together (the server's URL and its model's name)")
    rule = None
    if args.cascade is not None:
        from hllm.model.confidence import CascadeThresholds
        from hllm.serving.cascade import CascadeRule
        from hllm.uris import resolve_model_uri

        if args.model is None or (args.teacher_rankings is None) == (args.cascade_url is None):
            raise ValueError("--cascade needs the student that answers first (--model) and one teacher: its rankings "
                             "(--teacher-rankings FILE) or a served one (--cascade-url URL --teacher-model NAME)")
        thresholds = CascadeThresholds.load(resolve_model_uri(args.model)) if args.cascade.startswith("~") else None
        rule = CascadeRule.parse(args.cascade, args.cascade_signal, thresholds)
    elif args.cascade_url is not None:
        raise ValueError("--cascade-url is the cascade's teacher: give --cascade SHARE%|THRESHOLD too")
    spec = RerankSpec(model=args.model, teacher=args.teacher, teacher_url=args.teacher_url,
                      teacher_model=args.teacher_model if args.teacher_url else None,  # (--cascade-url's is the cascade's)
                      teacher_api_key_env=args.teacher_api_key_env if args.teacher_url else None, concurrency=args.concurrency, qps=args.qps,
                      max_failed_share=args.max_failed_share, window=args.window, stride=args.stride,
                      windowing=args.windowing, batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens,
                      device=args.device, threads=args.threads, tag=args.tag, input_order=args.input_order,
                      declare_order=False if args.undeclared else None)
    slates, qrels, settings = _load_slates(args)
    out = Path(args.out)
    final = out
    if rule is not None:  # the student's own run beside the cascade's
        out = out.with_name(out.name + ".student")
    map_shards = None
    if args.ray:
        from pipelines.rerank import ray_map_shards

        map_shards = ray_map_shards(args.actors, args.cpus_per_actor, args.address)
    done = rerank_collection(spec, slates, out, args.shard_size, settings, map_shards, progress=not args.quiet)
    path = done.path
    print(f"wrote {path}: {done.queries} queries, {sum(len(s.candidates) for s in slates)} documents, "
          f"{done.windows} windows ({done.windows / max(done.queries, 1):.1f} per query), "
          f"{done.resumed_shards} of {done.shards} shards resumed"
          + (f"; {done.failed} teacher answers without a permutation kept the first-stage order" if done.failed else ""))
    if done.endpoint is not None:
        from hllm.teacher.endpoint import endpoint_figures, endpoint_line

        print(f"teacher endpoint: {endpoint_line(endpoint_figures(done.endpoint))}")
    notes = path.with_name(path.name + ".queries.jsonl")
    if args.model is not None and notes.exists():
        print(f"per query (confidence, trust): {final.with_name(final.name + '.queries.jsonl')}"
              + (f"; the domain guard sent {done.fell_back} of {done.queries} queries toward the first-stage order"
                 if done.fell_back else ""))
    if rule is not None:
        from hllm.serving.cascade import cascade

        counts = cascade(path, notes, slates, _cascade_teacher(args, final), rule, final, args.tag + "-cascade")
        notes.replace(final.with_name(final.name + ".queries.jsonl"))
        which = f"below {rule.threshold:.4g}" if rule.threshold is not None else "the least confident"
        print(f"cascade: {counts.escalated} of {counts.queries} queries ({counts.escalated / max(counts.queries, 1):.0%})"
              f" went to the teacher, {which} by {rule.signal}"
              + (f"; {counts.teacher_missing} of them had no teacher ranking (the student's stands)" if counts.teacher_missing else "")
              + f"; wrote {final}")
        if "endpoint" in counts.teacher_figures:
            from hllm.teacher.endpoint import endpoint_figures, endpoint_line

            print(f"cascade teacher endpoint: {endpoint_line(endpoint_figures(counts.teacher_figures['endpoint']))}")
    _warn_vocabulary(spec, done, args.unknown_token_warning)
    if qrels is None:
        return 0
    from hllm.data.order import InputOrder, reorder

    order = InputOrder.parse(args.input_order)
    first_stage = {s.slate_id: [(c.docid, 0.0) for c in s.candidates] for s in slates}  # the data's own order
    judged = read_qrels(qrels)
    rel, why = _threshold(args.rel, judged)
    as_given = order.declared and spec.first_stage_order  # the default: the first stage's order, declared
    rows = {"first stage" + (" (input order)" if order.declared else ""):
            evaluate(first_stage, judged, rel, None, "the first stage", str(qrels))}
    if not order.declared:  # what the candidates were handed over in, itself a ranking to compare with
        handed = {s.slate_id: [(c.docid, 0.0) for c in reorder(s, order).candidates] for s in slates}
        rows[f"input order ({order})"] = evaluate(handed, judged, rel, None, f"the {order} input", str(qrels))
    label = "teacher" if args.teacher or args.teacher_url else "reranked"
    if not as_given:
        label += f" ({order} input, {'declared' if spec.first_stage_order else 'undeclared'})"
    rows[label] = evaluate_run(path, qrels, rel)
    if rule is not None:
        rows[f"cascade ({args.cascade} by {rule.signal})"] = evaluate_run(final, qrels, rel)
    _report(rows, args.json, why)
    return 0


def _cascade_teacher(args: argparse.Namespace, final: Path):
    """The cascade's teacher: a rankings file, or a served LLM (its answers kept beside the run: a rerun asks nothing twice)."""
    if args.teacher_rankings is not None:
        from hllm.teacher.external import FileTeacher

        return FileTeacher(args.teacher_format, args.teacher_rankings)
    from hllm.job.collection import RerankSpec, answers_folder, served_teacher

    spec = RerankSpec(teacher_url=args.cascade_url, teacher_model=args.teacher_model, teacher_api_key_env=args.teacher_api_key_env,
                      concurrency=args.concurrency, qps=args.qps, stride=None, windowing=args.windowing)  # its windows: 20 by 10
    return served_teacher(spec, answers_folder(final))


def _warn_vocabulary(spec, done: CollectionRun, threshold: float) -> None:
    """Once per run, as Serve does per request: the share of the shown tokens the model cannot read."""
    from hllm.model.card import read_model_card
    from hllm.model.prompts import vocabulary_warning
    from hllm.uris import resolve_model_uri

    if spec.model is None or not done.shown_tokens:
        return
    share = done.unknown_tokens / done.shown_tokens
    warning = vocabulary_warning(share, read_model_card(resolve_model_uri(spec.model)).vocabulary, threshold)
    if warning:
        print(f"warning: {warning} ({done.unknown_tokens} of {done.shown_tokens} tokens; "
              f"threshold {threshold:.0%})", file=sys.stderr)


def _threshold(rel: int | None, qrels: dict[str, dict[str, int]]) -> tuple[int, str]:
    """`--rel` as given, else read off the qrels' grade scale (`hllm.eval.runfile.relevance_threshold`)."""
    from hllm.eval.runfile import relevance_threshold

    if rel is not None:
        return rel, "--rel"
    threshold, why = relevance_threshold(qrels)
    return threshold, f"from the {why}; --rel to change"


def _report(rows: dict[str, dict], json_path: str | None, why: str = "--rel") -> None:
    from hllm.eval.runfile import atomic_write

    any_row = next(iter(rows.values()))
    print(_table(rows))
    print(f"(means over {any_row['queries']} judged queries; MRR@10 and R@100 count grade >= {any_row['rel']} as relevant"
          f" ({why})" + (f"; {any_row['unjudged']} run queries have no judgments" if any_row["unjudged"] else "") + ")")
    if json_path:
        atomic_write(json_path, json.dumps(rows, indent=2) + "\n")


def cmd_evaluate(args: argparse.Namespace) -> int:
    from hllm.eval.runfile import evaluate_run

    from hllm.data.readers import read_qrels

    rel, why = _threshold(args.rel, read_qrels(args.qrels))
    rows = {run: evaluate_run(run, args.qrels, rel) for run in args.run}
    _report(rows, args.json, why)
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    import dataclasses

    from hllm.config import describe, load_config, to_dict
    from pipelines.common import PipelineConfig

    def dumps(value) -> str:  # a key unset by default (None) whose value is a whole config, e.g. student.model
        return json.dumps(to_dict(value) if dataclasses.is_dataclass(value) else value)

    cfg = load_config(PipelineConfig, args.config, args.overrides)
    for key, value, default, doc in describe(PipelineConfig, cfg):
        shown = dumps(value)
        changed = "" if value == default else f"  (default {dumps(default)})"
        print(f"{key} = {shown}{changed}" + (f"\n    {doc}" if doc else ""))
    return 0


def cmd_promote(args: argparse.Namespace) -> int:
    import mlflow

    from pipelines.registry import promote

    if args.tracking_uri:
        mlflow.set_tracking_uri(args.tracking_uri)
    promote(args.name, args.version, args.alias)
    print(f"models:/{args.name}@{args.alias} -> version {args.version}")
    return 0


def cmd_rollout_status(args: argparse.Namespace) -> int:
    """The rollout's decisions, from its log (rollout.log_path) or a running app (GET /v1/rollout)."""
    from hllm.serving.rollout import Decision, read_decisions, status_table

    if args.url:
        import urllib.request

        with urllib.request.urlopen(args.url.rstrip("/") + "/v1/rollout", timeout=30) as r:
            decisions = [Decision(**d) for d in json.load(r)["decisions"]]
    else:
        if not Path(args.log).is_file():
            raise FileNotFoundError(f"no rollout log at {args.log} (serve with args.rollout.log_path={args.log})")
        decisions = read_decisions(args.log)
    print(status_table(decisions))
    return 0


def cmd_export_teacher(args: argparse.Namespace) -> int:
    from hllm.model.backbones import EMBEDDED_TEACHER
    from hllm.job.stages import export_teacher

    provenance = export_teacher(args.run_dir, args.to or EMBEDDED_TEACHER)
    test = provenance["test"]
    print(f"teacher of {args.run_dir} -> {args.to or EMBEDDED_TEACHER} (sha256 {provenance['sha256'][:12]}, "
          f"{provenance['bootstrap'].get('steps')} steps" + (f"; test nDCG@10 {test['teacher_nDCG@10']:.4f} vs first "
                                                             f"stage {test['first_stage_nDCG@10']:.4f}" if test else "") + ")")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from serve import launch

    return launch.run(args)


def cmd_run(args: argparse.Namespace) -> int:
    from pipelines import full

    full.main(([f"--config={args.config}"] if args.config else []) + list(args.overrides))
    return 0


def cmd_realtext(args: argparse.Namespace) -> int:
    from pipelines import recorded_recipes

    recorded_recipes.main("realtext", [f"--config={args.config}", *([f"--report={args.report}"] if args.report else []), *args.overrides])
    return 0


def cmd_order(args: argparse.Namespace) -> int:
    from hllm.recipes import order

    order.main([f"--config={args.config}", *args.overrides])
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    from pipelines import refresh

    refresh.main(([f"--config={args.config}"] if args.config else []) + list(args.overrides))
    return 0


def batch_tokens(text: str) -> int | str | None:
    """--max-batch-tokens: a positive int, auto (the device's default) or none (no cap)."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, auto or none, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, auto or none, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from hllm.model.confidence import SIGNALS  # numpy only: the parser stays quick to build

    parser = argparse.ArgumentParser(prog="hllm", description="hLLM: single-pass generative reranking.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Examples:\n" + __doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fmt = argparse.ArgumentDefaultsHelpFormatter

    r = sub.add_parser("rerank", help="rerank a collection into a TREC run (and evaluate it where there are qrels)",
                       formatter_class=fmt, description="Rerank every query's first-stage candidates with a trained "
                       "student (one prefill per window) or a job's AR teacher; write a TREC run; print nDCG@10, "
                       "MRR@10, R@100 beside the first-stage order when the data has qrels.")
    who = r.add_mutually_exclusive_group(required=True)
    who.add_argument("--model", help="student: a folder (runs/default/student), runs:/RUN_ID/student or models:/NAME@ALIAS")
    who.add_argument("--teacher", help="a job's output folder (runs/default): rerank with its AR teacher instead")
    who.add_argument("--teacher-url", help="an OpenAI-compatible server's base URL (http://host:8000/v1): rerank with "
                     "the AR teacher it serves (RankGPT prompt, sliding windows; answers kept in OUT.answers/)")
    r.add_argument("--teacher-model", help="--teacher-url, --cascade-url: the served model's name")
    r.add_argument("--teacher-api-key-env", metavar="VAR", help="--teacher-url, --cascade-url: the environment variable "
                   "holding its API key")
    r.add_argument("--concurrency", type=int, default=8, help="--teacher-url, --cascade-url: requests in flight (all actors together)")
    r.add_argument("--qps", type=float, help="--teacher-url, --cascade-url: request starts a second, retries included (default: no cap)")
    r.add_argument("--cascade", metavar="SHARE%|~SHARE%|THRESHOLD", help="--model: hand the least confident queries to the "
                   "teacher: 25%% (that share of these queries, least confident first), ~25%% (below the model's own threshold "
                   "for about 25%%: cascade.json, fitted on its training-side queries) or 0.8 (below it)")
    r.add_argument("--cascade-url", metavar="URL", help="--cascade: the teacher is the LLM this OpenAI-compatible server "
                   "serves (with --teacher-model; RankGPT prompt, windows of 20 by 10; answers kept in OUT.answers/)")
    r.add_argument("--cascade-signal", default="margin", choices=SIGNALS,
                   help="--cascade: which confidence signal orders the queries (hllm.model.confidence)")
    r.add_argument("--teacher-rankings", metavar="FILE", help="--cascade: the teacher's rankings (a file FileTeacher reads)")
    r.add_argument("--teacher-format", default="run", choices=("run", "rank_llm", "responses"),
                   help="--teacher-rankings: its format")
    r.add_argument("--max-failed-share", type=float, default=0.05, metavar="SHARE",
                   help="--teacher-url: stop once more queries failed (retries ran out, or no ranking in the answer)")
    r.add_argument("--data", required=True, help="a BEIR folder (corpus.jsonl, queries.jsonl, qrels/, runs/), a rank_llm "
                   "request JSONL, a TSV of (qid, docid, text) or (qid, query, docid, text), or an hllm JSONL")
    r.add_argument("--format", choices=READ_FORMATS, default="auto", help="auto: folder -> beir, .jsonl -> rank_llm, .tsv -> tsv")
    r.add_argument("--run", help="beir: the first-stage run file (default DATA/runs/bm25_top100.tsv)")
    r.add_argument("--queries", help="tsv with 3 columns: the query texts (qid<TAB>text TSV or BEIR queries.jsonl)")
    r.add_argument("--split", default="test", help="beir: the qrels split (DATA/qrels/SPLIT.tsv)")
    r.add_argument("--qrels", help="qrels to evaluate against (default for beir: DATA/qrels/SPLIT.tsv)")
    r.add_argument("--skip-missing", action="store_true", help="beir: rerank the queries that have candidates even "
                   "when some judged queries have none (default: an error)")
    r.add_argument("--top-n", type=int, default=100, help="first-stage candidates reranked per query")
    r.add_argument("--out", required=True, help="the TREC run file to write (shards beside it until done)")
    r.add_argument("--tag", default="hllm", help="the run tag (6th column)")
    r.add_argument("--input-order", default="first-stage", metavar="first-stage|shuffled[:SEED]|reversed",
                   help="hand each query's candidates over in this order: the first stage's (declared: the student's prior "
                   "reads it), a fixed shuffle per query, or reversed (neither declared: the student ranks the set by its text)")
    r.add_argument("--undeclared", action="store_true", help="hand the first-stage order over without declaring it (as an "
                   "HTTP request without first_stage_order does): how the student ranks the same list read as a set")
    r.add_argument("--window", type=int, help="documents per window (default: the student head's K positions; teacher: 20)")
    r.add_argument("--stride", type=int, help="sliding: how far each window moves up (default: window // 2)")
    r.add_argument("--windowing", choices=("sliding", "blocks"), default="sliding",
                   help="sliding: RankGPT windows back to front; blocks: rank blocks, then their best together")
    r.add_argument("--batch-size", type=int, default=16, help="windows per forward pass")
    r.add_argument("--max-batch-tokens", type=batch_tokens, default="auto", metavar="N|auto|none",
                   help="and at most this many padded tokens per forward pass (bounds memory whatever the window count; "
                   "auto, the default: 8192 on a CPU, where batching long prompts costs more than passes in a row, no cap on a GPU)")
    r.add_argument("--shard-size", type=int, default=64, help="queries per shard (the unit a re-run resumes from)")
    r.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    r.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    r.add_argument("--rel", type=int, help="MRR and recall count grade >= REL as relevant (default: from the qrels' "
                   "grades: 2 on a 0-3 scale as TREC DL, 1 on binary qrels)")
    r.add_argument("--unknown-token-warning", type=float, default=0.1, metavar="SHARE",
                   help="warn when more of the shown tokens than this are unknown to the student's vocabulary (as Serve)")
    r.add_argument("--json", help="also write the metrics as JSON here")
    r.add_argument("--ray", action="store_true", help="fan the shards out over a Ray Data actor pool")
    r.add_argument("--actors", type=int, default=2, help="--ray: actors (each loads the model once)")
    r.add_argument("--cpus-per-actor", type=float, default=1.0, help="--ray: CPUs reserved per actor (GPUs: one each where present)")
    r.add_argument("--address", help="--ray: the cluster (default: RAY_ADDRESS, else a local Ray)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_rerank)

    e = sub.add_parser("evaluate", help="nDCG@10, MRR@10, R@100 of TREC runs against qrels", formatter_class=fmt,
                       description="Evaluate TREC run files with trec_eval's code (ir_measures / pytrec_eval): means "
                       "over the run's judged queries, like trec_eval without -c.")
    e.add_argument("--run", required=True, action="append", help="a TREC run file (repeat to compare runs)")
    e.add_argument("--qrels", required=True, help="qrels: TREC (qid 0 docid grade) or BEIR TSV (query-id corpus-id score)")
    e.add_argument("--rel", type=int, help="MRR and recall count grade >= REL as relevant (default: from the qrels' "
                   "grades: 2 on a 0-3 scale as TREC DL, 1 on binary qrels)")
    e.add_argument("--json", help="also write the metrics as JSON here")
    e.set_defaults(func=cmd_evaluate)

    c = sub.add_parser("config", help="the job's configuration keys")
    csub = c.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="every key with its value, default and doc", formatter_class=fmt,
                           description="Every key of the job config (pipelines/full.py) with its value, its default "
                           "where they differ, and its doc. Set keys in a YAML file (--config) or as key=value.")
    show.add_argument("--config", help="a YAML config (e.g. configs/dl19-smollm2.yaml); default: the built-in defaults")
    show.add_argument("overrides", nargs="*", help="key=value overrides, as the job takes them")
    show.set_defaults(func=cmd_config_show)

    p = sub.add_parser("promote", help="point a registry alias (e.g. champion) at a model version", formatter_class=fmt,
                       description="Moves models:/NAME@ALIAS to VERSION in the MLflow Model Registry (the job "
                       "registers each student as a new version under tracking.model_alias, 'candidate').")
    p.add_argument("--name", default="hllm-student", help="registered model name")
    p.add_argument("--version", required=True, help="the version to promote")
    p.add_argument("--alias", default="champion", help="the alias to move")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI)")
    p.set_defaults(func=cmd_promote)

    o = sub.add_parser("rollout", help="a many-student app's rollouts (shadow, canary, promotion, rollback)")
    osub = o.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")
    st = osub.add_parser("status", help="every decision as a row, and where each candidate stands", formatter_class=fmt,
                         description="Reads the rollout log (serve args.rollout.log_path: one JSON line per decision) "
                         "or asks a running app (GET /v1/rollout). See docs/rollout.md.")
    st.add_argument("--log", default="runs/rollout.jsonl", help="the rollout log")
    st.add_argument("--url", help="a running app instead, e.g. http://127.0.0.1:8000")
    st.set_defaults(func=cmd_rollout_status)

    x = sub.add_parser("export-teacher", help="a job's bootstrapped teacher -> the shipped embedded teacher",
                       formatter_class=fmt, description="Copies RUN_DIR/teacher/model (a job run with "
                       "teacher.bootstrap=true, e.g. configs/embedded-teacher.yaml) to the folder preset 'embedded' "
                       "loads, with provenance.json: the recipe, the bootstrap's record, the job's test figures, "
                       "the weights' SHA-256.")
    x.add_argument("run_dir", help="the job's output_dir")
    x.add_argument("--to", help="destination (default: hllm/assets/embedded-teacher)")
    x.set_defaults(func=cmd_export_teacher)

    from serve import launch  # the standard library only until it runs

    v = sub.add_parser("serve", help="serve students over HTTP on Ray Serve (Cohere v2 / Jina / vLLM rerank API)",
                       formatter_class=fmt, description=launch.__doc__.split("\n\n")[0])
    launch.add_arguments(v)
    v.set_defaults(func=cmd_serve)

    j = sub.add_parser("run", help="run the whole job (pipelines/full.py) on a local or the current Ray cluster")
    j.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    j.add_argument("overrides", nargs="*", help="key=value overrides")
    j.set_defaults(func=cmd_run)

    f = sub.add_parser("refresh", help="one flywheel cycle (pipelines/refresh.py): the Serve traffic log -> teacher "
                       "labels -> a challenger fine-tuned from the champion -> the gate moves the alias, or says why not")
    f.add_argument("--config", help="YAML config of the champion's job (default: configs/default.yaml)")
    f.add_argument("overrides", nargs="*", help="key=value overrides, e.g. refresh.log_path=runs/traffic")
    f.set_defaults(func=cmd_refresh)

    t = sub.add_parser("realtext", aliases=["distilltext", "adaptation"], help="real text: a frozen LM's cached states, "
                       "students fitted on the judgments, a teacher's rankings (a file) or both — closed-form probes, heads by "
                       "SGD, LoRA over cached prefix states; one or several first stages; teacher-folds, the first-stage blend, "
                       "cross-year, the shipped student, MLflow runs (hllm.recipes.realtext; distilltext, adaptation: old names)")
    t.add_argument("--config", required=True, help="YAML config (e.g. configs/realtext/smollm2-trec-dl.yaml, "
                   "configs/realtext/smollm2-dl19-rankvicuna.yaml, configs/realtext/smollm2-dl19-multistage.yaml)")
    t.add_argument("--report", help="record this finished run's report.json in MLflow instead of running")
    t.add_argument("overrides", nargs="*", help="key=value overrides; tracking.key=value for MLflow")
    t.set_defaults(func=cmd_realtext)

    o = sub.add_parser("order", help="the shipped real-text students under shuffled input orders: measured, re-fitted "
                       "with permutation augmentation, re-shipped (hllm.recipes.order)")
    o.add_argument("--config", required=True, help="YAML config (e.g. configs/order/smollm2.yaml)")
    o.add_argument("overrides", nargs="*", help="key=value overrides")
    o.set_defaults(func=cmd_order)

    return parser


def quiet_libraries() -> None:
    """Our progress bar and table only: no weight-loading bars or deprecation notes from libraries."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import logging

    loads = logging.getLogger("hllm.model.backbones")  # one line per model loaded (what, how long) instead of bars
    if not loads.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))  # as console_logging's lines
        loads.addHandler(handler)
        loads.setLevel(logging.INFO)
        loads.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    from hllm.config import ConfigError
    from hllm.data.readers import DataFormatError

    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        return args.func(args)
    except (FileNotFoundError, DataFormatError, ConfigError, ValueError) as err:
        print(f"hllm {args.command}: error: {err}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
