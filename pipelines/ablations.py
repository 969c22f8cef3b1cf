"""The ablation study: a YAML grid of student variants, each trained per seed as a Ray task on one
teacher's rankings, compared with the baselines in one table, all under one MLflow parent run.

    ray job submit --working-dir . -- python pipelines/ablations.py --grid configs/grids/ablations.yaml \
        output_dir=/shared/runs/default [key=value ...] [grid.seeds=[0,1] ...]
    python pipelines/ablations.py                     # the embedded default grid, local Ray

The job config (`--config`, default configs/default.yaml) is the reference cell. `grid.*`
overrides change the grid, others the job. Teacher bootstrap and rankings are reused from an
earlier run in the same `output_dir` (or made); a cell x seed whose output exists for the same
config is not retrained, so a re-run resumes. Failed cells are counted, listed in the report and
make the job exit non-zero after the report is written. Latency is measured after training, on the
driver, interleaved across all cells and baselines.

Outputs: `<reports_dir>/<name>.md|.csv|_metrics.png|_decoders.png|_latency_vs_n.png`, the same files
as artifacts of the parent MLflow run, and one child run per cell x seed and per baseline with the
same metric names (`mlflow ui` compares them side by side).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `ray job submit --working-dir .`

from hllm.job.ablations import (QUALITY, REFERENCE, AblationConfig, Baseline, Cell, Row, Study, aggregate,  # noqa: E402
                                    baseline_metrics, decoder_comparison, expand_cells, flat_metrics, scores_to_perm,
                                    slates_of_size, train_cell, with_seed)
from hllm.config import from_dict, load_config, to_dict  # noqa: E402
from hllm.data.cache import fingerprint, mark_done, stage_done  # noqa: E402
from hllm.job.config import student_ranker_config  # noqa: E402
from hllm.job.stages import Rankings  # noqa: E402
from pipelines.common import PipelineConfig, cluster_has_gpus, init_ray, log_metrics, mlflow_run, parse_job  # noqa: E402
from pipelines.reports import markdown_report, plot_reports, write_csv  # noqa: E402

log = logging.getLogger("hllm.pipelines.ablations")
DEFAULT_GRID = Path(__file__).resolve().parents[1] / "configs" / "grids" / "ablations.yaml"


def cell_task(job: dict[str, Any], teacher_model: dict[str, Any], data: tuple, out_dir: str, key: str, threads: int,
              use_gpu: bool) -> dict[str, Any]:
    """A Ray task: one cell x seed, trained and evaluated by the library; writes result.json."""
    import torch

    from hllm.model.backbones import ModelConfig

    torch.set_num_threads(threads)
    cfg = from_dict(PipelineConfig, job)
    train, val, test = data
    out = Path(out_dir)
    result = train_cell(cfg, from_dict(ModelConfig, teacher_model), train, val, test, out,
                        torch.device("cuda" if use_gpu else "cpu"))
    (out / "result.json").write_text(json.dumps(result))
    mark_done(out, key, train_s=result["train_s"])
    return result


def run_cells(cfg: PipelineConfig, grid: AblationConfig, cells: list[Cell], teacher_model, data: tuple, gen_key: str
              ) -> tuple[dict[tuple[str, int], dict], list[dict[str, Any]]]:
    """Every cell x seed: reused when done, else a Ray task. -> ({(cell, seed): result}, failures)."""
    import ray

    gpu = cluster_has_gpus(cfg.cluster)
    gpus = grid.gpus_per_cell if grid.gpus_per_cell is not None else (1.0 if gpu else 0.0)
    task = ray.remote(cell_task).options(num_cpus=grid.cpus_per_cell, num_gpus=gpus, max_retries=1)
    data_ref = ray.put(data)
    results, pending, failures = {}, {}, []
    for cell in cells:
        for seed in grid.seeds:
            c = with_seed(cell.config, seed)
            out = cell_dir(cfg, cell.name, seed)
            key = fingerprint(student_ranker_config(c, teacher_model), c.student.train, c.student.loss, c.eval, gen_key)
            if stage_done(out, key) and (out / "result.json").exists():
                results[(cell.name, seed)] = json.loads((out / "result.json").read_text())
                continue
            out.mkdir(parents=True, exist_ok=True)
            ref = task.remote(to_dict(c), to_dict(teacher_model), data_ref, str(out), key, grid.threads_per_cell, gpus > 0)
            pending[ref] = (cell.name, seed)
    log.info("ablations: %d cells x %d seeds; %d reused, %d to train", len(cells), len(grid.seeds), len(results), len(pending))
    t0 = time.perf_counter()
    while pending:
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        name, seed = pending.pop(ref)
        try:
            results[(name, seed)] = ray.get(ref)
            main = results[(name, seed)]["decoders"][cfg.eval.main_decoder]
            log.info("  %s seed %d: nDCG@10 %.4f, Kendall tau %.3f (%d left, %.0fs)", name, seed, main["nDCG@10"],
                     main["kendall_tau"], len(pending), time.perf_counter() - t0)
        except Exception as err:  # a failed cell is counted and reported, the others go on
            log.error("  %s seed %d FAILED: %s", name, seed, err)
            failures.append({"variant": name, "seed": seed, "error": str(err).strip().splitlines()[-1][:300]})
    order = {(cell.name, seed): i for i, (cell, seed) in enumerate((c, s) for c in cells for s in grid.seeds)}
    failures.sort(key=lambda f: order[(f["variant"], f["seed"])])  # grid order, not completion order
    return results, failures


def cell_dir(cfg: PipelineConfig, name: str, seed: int) -> Path:
    return Path(cfg.output_dir) / "ablations" / name / f"seed{seed}"


def measure_latency(cfg: PipelineConfig, grid: AblationConfig, cells: list[Cell], results: dict, teacher, test: list
                    ) -> tuple[dict[str, dict], dict[int, dict[str, dict]]]:
    """-> ({method: p50/p95} on the test slates, {N: {method: p50/p95}}), interleaved, batch 1."""
    import torch

    from hllm.eval.evaluation import interleaved_latency
    from hllm.reranker import Reranker
    from hllm.teacher.baselines import first_style_scores

    if grid.latency_requests == 0:
        return {}, {}
    seed = grid.seeds[0]

    def single_pass(reranker: Reranker):  # the served path: encode -> one forward pass -> decode
        return lambda req: reranker.decode(reranker.score_encoded([reranker.encode_slate(req)])[0])

    rankers = {c.name: Reranker.load(cell_dir(cfg, c.name, seed), device=str(teacher.device), decoder=cfg.eval.main_decoder)
               for c in cells if (c.name, seed) in results}
    methods = {name: single_pass(r) for name, r in rankers.items()}
    methods["FIRST-style"] = lambda req: scores_to_perm(first_style_scores(teacher.model, teacher.prompts, [req])[0])
    methods["AR teacher"] = lambda req: teacher.rank([req])
    with torch.no_grad():
        by_method = interleaved_latency(methods, test[: grid.latency_requests], cfg.eval.latency_warmup)
        by_n = {}
        if REFERENCE in rankers:
            trio = {"AR teacher": methods["AR teacher"], "single pass": methods[REFERENCE], "FIRST-style": methods["FIRST-style"]}
            for n in grid.latency_sizes:
                by_n[n] = interleaved_latency(trio, slates_of_size(test, n, grid.latency_size_requests), warmup=2)
                log.info("  latency N=%d: %s", n, {k: round(v["p50_ms"], 1) for k, v in by_n[n].items()})
    return by_method, by_n


def baselines(cfg: PipelineConfig, teacher, test_rankings: Rankings) -> dict[str, Baseline]:
    """First-stage order, FIRST-style single pass on the teacher's prefill, the AR teacher itself."""
    from hllm.eval.evaluation import first_stage_order
    from hllm.teacher.baselines import first_style_orders

    test, teacher_perms = test_rankings.slates, test_rankings.permutations
    first = first_style_orders(teacher.model, teacher.prompts, test)
    rel = cfg.eval.binary_rel
    return {"first stage": baseline_metrics(test, first_stage_order(test), teacher_perms, rel),
            "FIRST-style": baseline_metrics(test, first, teacher_perms, rel),
            "AR teacher": baseline_metrics(test, teacher_perms, teacher_perms, rel)}


def run(cfg: PipelineConfig, grid: AblationConfig, parent_run_id: str | None = None) -> Study:
    """Every cell x seed (reused when done), the baselines, latency by slate size, the report, the MLflow runs."""
    import mlflow

    from hllm.model.backbones import resolve_device
    from hllm.job.stages import load_teacher
    from pipelines import teacher_gen

    cells = expand_cells(grid, cfg)  # every cell's config is checked before anything runs
    init_ray(cfg.cluster)
    teacher_model, rankings = teacher_gen.run(cfg, parent_run_id)  # reused when the main job made them
    teacher = load_teacher(teacher_model, cfg, resolve_device(cfg.device))
    test = rankings["test"].slates
    gen_key = rankings["train"].key

    data = (rankings["train"].items, rankings["val"].items, rankings["test"].items)
    results, failures = run_cells(cfg, grid, cells, teacher_model, data, gen_key)
    base = baselines(cfg, teacher, rankings["test"])
    latency, latency_by_n = measure_latency(cfg, grid, cells, results, teacher, test)
    latency["first stage"] = {"p50_ms": 0.0, "p95_ms": 0.0}  # the input order: no model runs

    main = cfg.eval.main_decoder
    rows, decoders = [], []
    for cell in cells:
        per_seed = [results[(cell.name, s)] for s in grid.seeds if (cell.name, s) in results]
        if per_seed:
            rows += [aggregate(cell.name, "+".join(cell.axes), per_seed, dec, latency.get(cell.name, {}), grid.confidence)
                     for dec in cfg.eval.decoders]
            decoders += decoder_comparison(cell.name, per_seed, main, grid.confidence)
    for name, b in base.items():
        lat = latency.get(name, {"p50_ms": float("nan"), "p95_ms": float("nan")})
        metrics = {key: (b.metrics[key], float("nan")) for key in QUALITY}
        metrics["latency_p50_ms"], metrics["latency_p95_ms"] = (lat["p50_ms"], float("nan")), (lat["p95_ms"], float("nan"))
        rows.append(Row(name, "baseline", "", None, 1, metrics))

    reports_dir = Path(grid.reports_dir or Path(cfg.output_dir) / "reports")
    reports_dir.mkdir(parents=True, exist_ok=True)
    meta = {"cells": len(cells), "seeds": len(grid.seeds), "main_decoder": main, "confidence": grid.confidence,
            "test_slates": len(test), "slate_size": max(len(r.candidates) for r in test), "latency_requests": grid.latency_requests}
    md = reports_dir / f"{grid.report_name}.md"
    table = [r for r in rows if r.decoder in (main, None)]  # the table and plots show the main decoder
    md.write_text(markdown_report(table, decoders, latency_by_n, meta, failures))
    write_csv(rows, decoders, reports_dir / f"{grid.report_name}.csv")  # every decoder
    paths = [md, reports_dir / f"{grid.report_name}.csv", *plot_reports(table, decoders, latency_by_n, reports_dir, grid.report_name)]

    with mlflow_run(cfg, "ablations", parent_run_id, hllm_grid=json.dumps(grid.axes)) as parent:
        mlflow.log_dict(to_dict(grid), "grid.json")
        for path in paths:
            mlflow.log_artifact(str(path))
        log_metrics({"cells": len(cells), "cell_runs": len(results), "failed_cell_runs": len(failures)})
        log_children(cfg, grid, cells, results, latency, base, teacher_model, parent.info.run_id)
        parent_id = parent.info.run_id
    return Study(table, rows, decoders, latency_by_n, failures, [str(p) for p in paths], parent_id)


def log_children(cfg: PipelineConfig, grid: AblationConfig, cells: list[Cell], results: dict, latency: dict, base: dict,
                 teacher_model, parent_id: str) -> None:
    """One child run per cell x seed and per baseline, with the same metric names."""
    import mlflow

    main = cfg.eval.main_decoder
    for cell in cells:
        for seed in grid.seeds:
            result = results.get((cell.name, seed))
            if result is None:
                continue
            c = with_seed(cell.config, seed)
            c = dataclasses.replace(c, tracking=dataclasses.replace(c.tracking, run_name=f"{cell.name}/seed{seed}"))
            with mlflow_run(c, "ablation-cell", parent_id, **{"ablation.variant": cell.name, "ablation.axes": "+".join(cell.axes),
                                                              "ablation.seed": str(seed), "ablation.kind": "cell"}):
                lat = latency.get(cell.name, {})
                log_metrics({**flat_metrics(result, main), "latency_p50_ms": lat.get("p50_ms", float("nan")),
                             "latency_p95_ms": lat.get("p95_ms", float("nan")), "train_s": result["train_s"]})
                log_metrics(result["decoders"], prefix="decoder.")
                mlflow.log_dict(to_dict(student_ranker_config(c, teacher_model)), "student_config.json")  # as trained
                for row in result["history"]:
                    log_metrics({"loss": row["loss"]}, step=row["step"])
    for name, b in base.items():
        c = dataclasses.replace(cfg, tracking=dataclasses.replace(cfg.tracking, run_name=f"baseline/{name}"))
        with mlflow_run(c, "ablation-baseline", parent_id, **{"ablation.variant": name, "ablation.kind": "baseline"}):
            lat = latency.get(name, {})
            log_metrics({**b.metrics,
                         "latency_p50_ms": lat.get("p50_ms", float("nan")), "latency_p95_ms": lat.get("p95_ms", float("nan"))})


def load_grid(path: str | None, overrides: list[str]) -> AblationConfig:
    return load_config(AblationConfig, path, [o.removeprefix("grid.") for o in overrides])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    grid_overrides = [a for a in argv if a.startswith("grid.")]
    cfg, args = parse_job("hLLM ablations: a grid of student variants vs baselines", [a for a in argv if a not in grid_overrides],
                          configure=lambda p: p.add_argument("--grid", default=str(DEFAULT_GRID), help="the grid YAML"))
    grid = load_grid(args.grid, grid_overrides)
    t0 = time.perf_counter()
    out = run(cfg, grid)
    print(Path(out["reports"][0]).read_text())
    print(f"reports: {', '.join(out['reports'])}\nmlflow parent run {out['mlflow_run_id']}; total {time.perf_counter() - t0:.0f}s")
    if out["failures"]:
        sys.exit(f"{len(out['failures'])} cell run(s) failed (listed in the report)")


if __name__ == "__main__":
    main()
