"""One flywheel cycle: served traffic -> teacher labels -> a challenger fine-tuned from the champion
-> side by side -> the gate moves the serving alias, or says why not.

    ray job submit --working-dir . -- python pipelines/refresh.py [--config configs/default.yaml] \
        refresh.log_path=/mnt/hllm/traffic refresh.champion=models:/hllm-student@champion [key=value ...]
    hllm refresh refresh.log_path=runs/traffic           # the same, on a local or the current Ray

Ray Data reads the traffic log (files Parquet could not open are skipped and counted), classifies
and hashes every row in parallel; the driver deduplicates and samples (`hllm.job.refresh`). The new
slates are labelled by the job's teacher through the same generation stage as the main job (an
actor pool, Parquet shards: a rerun resumes), mixed with a replay share of the original training
rankings, and Ray Train + DeepSpeed fine-tunes the champion's own weights on them. Champion and
challenger are then ranked side by side on the original test split and on held-out new traffic;
the challenger is registered as a new version, and the alias moves only through the gate. One
MLflow run per cycle holds the counts, every figure, the thresholds, the verdict and both versions.
A deployment serving `models:/NAME@ALIAS` picks the moved alias up by itself (`AppArgs.alias_poll_s`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `ray job submit --working-dir .`

import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from hllm.data import store, traffic  # noqa: E402
from hllm.eval.evaluation import first_stage_order  # noqa: E402
from hllm.job.refresh import (Cycle, NothingToRefresh, Verdict, gate, refuse_foreign, replay_mix,  # noqa: E402
                                   reused_rankings, select_slates, side_by_side)
from hllm.uris import registry_alias  # noqa: E402
from pipelines.common import PipelineConfig, init_ray, log_metrics, mlflow_run, parse_job, tracking_uri  # noqa: E402

log = logging.getLogger("hllm.pipelines.refresh")


def read_traffic(log_path: str, model_key: str, share: float) -> tuple[list[dict[str, Any]], dict[str, int], set[str]]:
    """The log through Ray Data -> (the rows to label, counts by status and skipped files, the model keys seen). The
    tasks run library functions (`hllm.data.traffic`): a worker imports that, not this job's modules."""
    import ray

    scan = traffic.scan(log_path)
    for path, why in scan.skipped:
        log.warning("traffic log: skipping %s (%s)", path, why)
    counts = {"files": len(scan.files), "files_skipped": len(scan.skipped), "rows": 0, **dict.fromkeys(traffic.STATUSES, 0)}
    if not scan.files:
        return [], counts, set()
    # the cascade's teacher_order is read where a file has it (a log written before the cascade reads as empty)
    has = {str(p): "teacher_order" in pq.read_schema(p).names for p in scan.files}
    with_teacher, without = [p for p, yes in has.items() if yes], [p for p, yes in has.items() if not yes]
    parts = ([ray.data.read_parquet(with_teacher, columns=traffic.REQUIRED + ["teacher_order"])] if with_teacher else []) + \
        ([ray.data.read_parquet(without, columns=traffic.REQUIRED).map_batches(traffic.with_empty_teacher_order, batch_format="pyarrow")]
         if without else [])
    ds = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    ds = ds.map_batches(traffic.classify_batch, fn_kwargs={"model_key": model_key, "share": share}, batch_format="pyarrow")
    # one streamed pass: the `ok` rows come to the driver anyway (to be labelled), so the counts and the model keys are
    # read beside them, not by a group-by and a unique (each a hash shuffle: an aggregator actor per partition)
    rows, keys = [], set()
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        for status, n in Counter(batch.column("status").to_pylist()).items():
            counts[status] += n
        keys |= set(batch.column("model_key").to_pylist())
        rows += batch.filter(pc.equal(batch.column("status"), "ok")).drop_columns(["status"]).to_pylist()
    counts["rows"] = sum(counts[s] for s in traffic.STATUSES)
    return rows, counts, keys


def champion_folder(cfg: PipelineConfig, uri: str) -> Path:
    """The pinned champion, downloaded once into the cycle's folder (every Ray worker reads it there)."""
    from pipelines.common import download_mlflow_model

    out = Path(cfg.output_dir) / "refresh" / "models" / uri.removeprefix("models:/").replace("/", "-v")
    if not (out / "hllm_ranker.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(download_mlflow_model(uri), tmp)
        tmp.rename(out)
    return out


def rank_all(folder: Path, items: list) -> list[list[int]]:
    from hllm import Reranker

    reranker = Reranker.load(folder)
    return [reranker.decode(m).permutation.tolist() for m in reranker.score_slates([i.slate for i in items])]


def run(cfg: PipelineConfig, parent_run_id: str | None = None) -> Cycle:
    """One cycle; -> what it did (counts, figures, verdict, versions, seconds by stage), also in MLflow."""
    import mlflow

    from hllm import Reranker
    from hllm.job.config import student_ranker_config
    from hllm.job.stages import teacher_rankings_stage
    from pipelines import teacher_gen, train_student
    from pipelines.registry import log_student, pin, promote

    r, seconds = cfg.refresh, {}
    name, alias = registry_alias(r.champion)
    init_ray(cfg.cluster)
    mlflow.set_tracking_uri(tracking_uri(cfg))
    t0 = time.perf_counter()
    champion_uri = pin(r.champion)
    champion_dir = champion_folder(cfg, champion_uri)
    champion_key = Reranker.load(champion_dir).model_key
    rows, counts, keys = read_traffic(r.log_path, champion_key, r.sample_share)
    refuse_foreign(counts, keys, champion_key, r.log_path)
    selection = select_slates(rows, counts, r)
    seconds["read_log"] = time.perf_counter() - t0
    log.info("refresh: cycle %s, champion %s; log %s", selection.cycle, champion_uri, json.dumps(selection.counts))

    with mlflow_run(cfg, "refresh", parent_run_id, **{"hllm.cycle": selection.cycle, "champion_version": champion_uri,
                                                      "traffic_log": str(r.log_path)}) as run:
        log_metrics(selection.counts, prefix="log.")
        t0 = time.perf_counter()
        teacher_model, original = teacher_gen.run(cfg, run.info.run_id)  # the job's rankings: reused, not redone
        new = {split: teacher_rankings_stage(cfg, teacher_model, f"traffic-{selection.cycle}-{split}", slates,
                                             teacher_gen.ray_ranker(cfg, teacher_model),
                                             known=reused_rankings(slates, selection.teacher_orders))
               for split, slates in (("train", selection.train), ("test", selection.test))}
        seconds["label"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        name_of_cycle = f"{champion_uri.rsplit('/', 1)[1]}-{selection.cycle}"  # the champion's version, the slates' hash
        out = Path(cfg.output_dir) / "refresh" / f"v{name_of_cycle}"
        mix_dir = out / "train_mix"
        if not store.shards(mix_dir):
            mix = replay_mix(new["train"].items, original["train"].items, r.replay_share, r.seed)
            for start in range(0, len(mix), 256):
                store.write_shard(mix[start: start + 256], mix_dir)
        tuned = dataclasses.replace(cfg, student=dataclasses.replace(cfg.student, train=dataclasses.replace(
            cfg.student.train, steps=r.steps, lr=r.lr, warmup_steps=min(cfg.student.train.warmup_steps, r.steps // 5))))
        challenger_dir = out / "challenger"
        if not (challenger_dir / "hllm_ranker.json").is_file():
            result = train_student.train(tuned, student_ranker_config(cfg, teacher_model), mix_dir, original["val"].directory,
                                   run.info.run_id, init_from=champion_dir, name=f"refresh-v{name_of_cycle}")
            if result.error:
                raise RuntimeError(f"refresh fine-tuning failed: {result.error}")
            with result.checkpoint.as_directory() as directory:
                shutil.copytree(Path(directory) / "student", challenger_dir, dirs_exist_ok=True)
        seconds["fine_tune"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        test, held = original["test"].items, new["test"].items
        perms = {"champion": rank_all(champion_dir, test + held), "challenger": rank_all(challenger_dir, test + held),
                 "first_stage": first_stage_order([i.slate for i in test + held])}
        figures = side_by_side(perms, test, held)
        verdict = gate(figures["champion"], figures["challenger"], r)
        seconds["evaluate"] = time.perf_counter() - t0

        challenger_uri = log_student(challenger_dir, name)
        version = challenger_uri.rsplit("/", 1)[1]
        if verdict.promote and pin(r.champion) != champion_uri:  # another cycle or a person moved it meanwhile
            verdict = Verdict(False, verdict.reasons + [f"{r.champion} moved to {pin(r.champion)} during the cycle: "
                                                        f"the challenger was compared with {champion_uri}, not with it"])
        moved = f"models:/{name}@{r.rollout_alias or alias}"  # the champion, or the alias a serving rollout takes on
        if verdict.promote:
            promote(name, version, r.rollout_alias or alias)
        for who, row in figures.items():
            log_metrics(row, prefix=f"{who}.")
        log_metrics({"tolerance": r.tolerance, "min_gain": r.min_gain, "promoted": int(verdict.promote),
                     **{f"seconds.{k}": v for k, v in seconds.items()}})
        mlflow.set_tags({"challenger_version": challenger_uri, "verdict": verdict.text(), "gate_metric": r.gate_metric,
                         "alias_now": f"{r.champion} -> {pin(r.champion)}",
                         **({"rollout_alias": f"{moved} -> {version}"} if r.rollout_alias and verdict.promote else {})})
        record = Cycle(selection.cycle, champion_uri, challenger_uri, verdict.promote, moved if verdict.promote else None,
                       verdict.text(), selection.counts, figures, seconds, run.info.run_id, str(out),
                       {split: str(rk.directory) for split, rk in new.items()}, dataclasses.asdict(r),
                       {who: {i.slate.slate_id: order for i, order in zip(held, p[len(test):])} for who, p in perms.items()})
        (out / "cycle.json").write_text(json.dumps(record.to_json(), indent=2))
        mlflow.log_artifact(str(out / "cycle.json"))
    return record


def main(argv: list[str] | None = None) -> None:
    cfg, _ = parse_job("hLLM: one flywheel cycle (traffic -> labels -> challenger -> gate)", argv)
    try:
        record = run(cfg)
    except (NothingToRefresh, FileNotFoundError) as err:
        sys.exit(f"refresh: {err}")
    print(f"cycle {record.cycle}: {record.verdict}")
    rollout = " (the serving app's rollout takes it on: shadow, canary, promotion)" if cfg.refresh.rollout_alias else ""
    print(f"champion {record.champion} -> challenger {record.challenger}"
          f"{' (now ' + record.moved + rollout + ')' if record.promoted else ''}; mlflow run {record.mlflow_run_id}")


if __name__ == "__main__":
    main()
