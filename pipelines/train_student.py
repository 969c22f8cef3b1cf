"""Distillation: Ray Train + DeepSpeed trains the single-pass student on the teacher's rankings.

    ray job submit --working-dir . -- python pipelines/train_student.py [--config configs/default.yaml] [key=value ...]
    python pipelines/train_student.py cluster.train_workers=2           # local Ray, 2 CPU workers

The library's student stage (`hllm.job.stages.train_student_stage`) decides whether to train and
records the result; this module supplies the fit: each Ray Train worker builds the student from
the library, wraps it with `deepspeed.initialize` (ZeRO stage from config; fp32 + gloo on CPU,
bf16 + NCCL on CUDA), reads its shard of the rankings store through `ray.train.get_dataset_shard`
and runs the library's one training loop (`hllm.train.loop.train_loop`) with the engine's
backward/step passed in. Every `checkpoint_every` steps all ranks save a DeepSpeed checkpoint and
report it; a failed worker group restarts from the latest one (`FailureConfig`). Only world rank
0 logs to MLflow. The student is then evaluated against the teacher on the test split, streamed
through an actor pool (`pipelines/evaluate.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `ray job submit --working-dir .`

from hllm.config import from_dict, to_dict  # noqa: E402
from hllm.data import store  # noqa: E402
from hllm.model.ranker import RankerConfig  # noqa: E402
from hllm.job.stages import EvalReport, Fit, Rankings, StudentFit  # noqa: E402
from pipelines import console  # noqa: E402
from pipelines.common import (PipelineConfig, cluster_has_gpus, init_ray, log_metrics,  # noqa: E402
                              mlflow_run, parse_job, tracking_uri)

log = logging.getLogger("hllm.pipelines.train_student")


def say(line: str) -> None:
    """One line of a Train worker's progress, once: Ray Train v2 patches `print` in its workers to log the text
    *and* tee it to the wrapped stdout, so a print reaches the driver twice; a write to stdout is seen once."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def deepspeed_config(cfg: PipelineConfig, gpu: bool) -> dict[str, Any]:
    t = cfg.student.train
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": cfg.distill.zero_stage},
        "bf16": {"enabled": gpu},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def make_engine(ranker, cfg: PipelineConfig, gpu: bool):
    """`deepspeed.initialize` around a student with the library's optimiser groups -> (engine, its schedule). A torch
    AdamW: no fused_adam build on CPU."""
    import deepspeed

    from hllm.train.loop import make_optimizer, param_groups

    optimizer, scheduler = make_optimizer(param_groups(ranker, cfg.student.train), cfg.student.train)
    engine, _, _, _ = deepspeed.initialize(model=ranker, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, gpu))
    return engine, scheduler


class EngineOptimizer:
    """The library loop's `Optimizer`, stepping a DeepSpeed engine (clipping and the schedule are its)."""

    def __init__(self, engine, scheduler):
        self.engine, self.scheduler = engine, scheduler

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]


def shard_chunks(shard, builder, cfg: PipelineConfig) -> Iterator[list]:
    """Endless batches of student examples from this worker's shard of the rankings store."""
    from hllm.train.loop import student_examples

    while True:
        size = cfg.student.train.batch_size
        for batch in shard.iter_batches(batch_size=size, batch_format="pyarrow", drop_last=True):
            # each slate once per order of student.train_orders: batches of the configured size, as in one process
            examples, _ = student_examples(builder, store.from_rows(batch.to_pylist()), cfg.student.loss,
                                           cfg.student.train_orders)
            for start in range(0, len(examples), size):
                if examples[start:start + size]:
                    yield examples[start:start + size]


def all_ranks_agree(stop: bool) -> bool:
    """One worker past the time budget stops every worker (a step is a collective)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(stop)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def train_func(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker; everything it needs comes through `config`."""
    import ray.train
    import torch

    from hllm.model.ranker import SinglePassRanker
    from hllm.train.loop import student_batch, student_examples, student_loss, train_loop, validation_loss

    # DeepSpeed's ZeRO-2 gathers call torch's deprecated `all_gather_into_tensor`: not ours to change
    warnings.filterwarnings("ignore", message="`torch.distributed.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    cfg = from_dict(PipelineConfig, config["job"])
    rcfg = from_dict(RankerConfig, config["ranker"])
    ctx = ray.train.get_context()
    rank, gpu = ctx.get_world_rank(), config["use_gpu"]
    t = cfg.student.train
    torch.set_num_threads(cfg.threads or 1)
    device = torch.device(f"cuda:{ctx.get_local_rank()}" if gpu else "cpu")

    torch.manual_seed(t.seed)  # the head's initialisation (DeepSpeed broadcasts rank 0's weights anyway)
    if config.get("init_from"):  # a warm start: the champion's weights (the flywheel's fine-tuning)
        ranker = SinglePassRanker.load(config["init_from"], trainable=True).to(device)
    else:
        ranker = SinglePassRanker.build(rcfg).to(device)
    engine, scheduler = make_engine(ranker, cfg, gpu)
    torch.manual_seed(t.seed + rank)
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            _, client = engine.load_checkpoint(directory)  # the tag comes from its `latest` file
            step = int(client["step"])
    resumed_from = step

    mlflow = None
    if rank == 0 and config.get("mlflow_run_id"):
        import mlflow

        mlflow.set_tracking_uri(config["tracking_uri"])
        mlflow.start_run(run_id=config["mlflow_run_id"])
    held_out = []
    if rank == 0:
        held_out, _ = student_examples(ranker.prompts, store.read_rankings(config["val_dir"]), cfg.student.loss)

    def on_step(row: dict, last: bool) -> None:
        metrics = {**row, "resumed_from_step": resumed_from,
                   "worker_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if mlflow is not None:
            mlflow.log_metrics({k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))},
                               step=row["step"])
        if row["step"] % cfg.distill.checkpoint_every == 0 or last:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as directory:
                engine.save_checkpoint(directory, tag=f"step{row['step']}", client_state={"step": row["step"]})  # every rank
                (Path(directory) / f"node.rank{rank}").write_text(ray.get_runtime_context().get_node_id())
                if last and rank == 0:
                    ranker.save(Path(directory) / "student", bundle_base=True)
                # one name for all ranks: their files (ZeRO shards) land in one checkpoint
                t1 = time.perf_counter()
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                                 checkpoint_dir_name=f"checkpoint_{row['step']:06d}")
            if rank == 0:
                say(f"distill checkpoint at step {row['step']}: save {t1 - t0:.1f}s, report {time.perf_counter() - t1:.1f}s")

    relay, last_said = config.get("progress"), [0.0]

    def progress(step: int, row: dict) -> None:  # to the driver's console through the relay queue, every ~15 s
        held_out = f", held-out loss {row['val_loss']:.4f}" if "val_loss" in row else ""
        line = f"distill step {step}/{t.steps} loss {row['loss']:.4f}{held_out} ({row['elapsed_s']:.0f}s)"
        say(line)  # the worker's log (Ray's session folder; the console too with --verbose)
        if relay is not None and (row["elapsed_s"] - last_said[0] >= PROGRESS_EVERY_S or step >= t.steps):
            last_said[0] = row["elapsed_s"]
            relay.put(line)

    pad = ranker.tokenizer.pad_token_id
    ranker.train()
    train_loop(lambda chunk: student_loss(engine, student_batch(chunk, pad, device), cfg.student.loss),
               shard_chunks(ray.train.get_dataset_shard("train"), ranker.prompts, cfg),
               EngineOptimizer(engine, scheduler), t, device.type, start_step=step,
               validate=(lambda: validation_loss(ranker, held_out, cfg.student.loss)) if held_out else None,
               on_step=on_step, agree=all_ranks_agree if t.time_budget_s else (lambda stop: stop),
               log=progress if rank == 0 else None)
    if mlflow is not None:
        mlflow.end_run()


PROGRESS_EVERY_S = 15.0  # the rank-0 worker's progress reaches the driver's console this often (and at the end)


class Relay:
    """Lines from the rank-0 train worker to the driver's log, through a Ray queue drained by a driver thread: the
    workers' own output stays in Ray's log folder (pipelines.console), their progress does not."""

    def __init__(self):
        import threading

        from ray.util.queue import Queue

        self.queue = Queue(actor_options={"num_cpus": 0})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="hllm-train-progress", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        from ray.util.queue import Empty

        while not self._stop.is_set() or not self.queue.empty():
            try:
                log.info("%s", self.queue.get(timeout=0.5))
            except Empty:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.queue.shutdown()


def torch_extensions_dir() -> str:
    """Where DeepSpeed's JIT-built CPU ops (its shared-memory all-reduce) are kept: TORCH_EXTENSIONS_DIR, else a folder
    per DeepSpeed install. The build records the install's absolute paths, so two checkouts sharing one folder rebuild
    each other's op (~40 s on 2 cores each time)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    import hashlib
    import importlib.util

    where = importlib.util.find_spec("deepspeed").origin or ""
    return str(Path.home() / ".cache" / "hllm_torch_extensions" / hashlib.sha256(where.encode()).hexdigest()[:12])


def build_cpu_ops() -> str | None:
    """Builds DeepSpeed's CPU shared-memory all-reduce now (scripts/setup.sh), rather than in the first distillation's
    workers -> where it is, or None where it does not apply (a GPU host; an op this DeepSpeed does not have)."""
    import torch

    if torch.cuda.is_available():
        return None
    os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return None
    builder.load(verbose=False)
    return os.environ["TORCH_EXTENSIONS_DIR"]


def train(cfg: PipelineConfig, rcfg: RankerConfig, train_dir: Path, val_dir: Path, mlflow_run_id: str | None = None,
          init_from: Path | None = None, name: str = "distill"):
    """-> ray.train.Result; the trained student is in the final checkpoint's `student/`. `init_from`:
    a student folder to start from (its config, adapter and head) instead of `rcfg` built fresh;
    `name`: the run's folder under `output_dir/ray_train`, where its checkpoints are kept."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    init_ray(cfg.cluster)
    gpu = cluster_has_gpus(cfg.cluster)
    storage = Path(cfg.output_dir).resolve() / "ray_train"
    env = {"TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
           "MLFLOW_DISABLE_TELEMETRY": "true",
           "DS_ACCELERATOR": "cuda" if gpu else "cpu"}  # said, not guessed: DeepSpeed warns when it has to guess CPU
    relay = Relay()
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"job": to_dict(cfg), "ranker": to_dict(rcfg), "val_dir": str(val_dir), "use_gpu": gpu,
                           "mlflow_run_id": mlflow_run_id, "tracking_uri": tracking_uri(cfg),
                           "init_from": str(init_from.resolve()) if init_from else None, "progress": relay.queue},
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.cluster.train_workers, use_gpu=gpu,
            placement_strategy="SPREAD" if cfg.cluster.spread else "PACK",
            resources_per_worker=None if gpu else {"CPU": cfg.cluster.train_cpus_per_worker}),
        run_config=ray.train.RunConfig(
            name=name, storage_path=str(storage),
            failure_config=ray.train.FailureConfig(max_failures=cfg.distill.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            # Ray Train's INFO lines (a "Reporting training result" dict per report and worker) in its log files only
            logging_config=ray.train.LoggingConfig(log_level="INFO" if console.is_verbose() else "WARNING"),
            worker_runtime_env={"env_vars": env}),
        datasets={"train": train_dataset(cfg, train_dir)},
        dataset_config=ray.train.DataConfig(execution_options=ingest_options()),
    )
    try:
        return trainer.fit()
    finally:
        relay.close()


def ingest_options():
    """Ray Train's default ingest options less `exclude_resources` (Train 2.60 copies it into every dataset's
    options, and Ray Data warns it is deprecated): the current context's limits, order and progress settings."""
    from ray.data import DataContext, ExecutionOptions

    current = DataContext.get_current().execution_options
    return ExecutionOptions(resource_limits=current.resource_limits, preserve_order=current.preserve_order,
                            verbose_progress=current.verbose_progress)


def train_dataset(cfg: PipelineConfig, train_dir: Path) -> Any:
    """The train rankings as a Ray dataset, streamed from the store's shards to the workers
    (`get_dataset_shard`; decoded and tokenised per batch there). Materialised once when the store fits
    `distill.materialize_mb` decoded: a streamed dataset re-runs the read and the split every epoch
    (~13 s an epoch on 2 cores for the embedded default's few MB)."""
    import ray

    ds = ray.data.read_parquet([str(p) for p in store.shards(train_dir)])
    size_mb = store.arrow_bytes(train_dir) / 2**20
    if size_mb <= cfg.distill.materialize_mb:
        log.info("distill: train rankings %.1f MB decoded <= distill.materialize_mb %.0f: materialised once", size_mb,
                 cfg.distill.materialize_mb)
        return ds.materialize()
    log.info("distill: train rankings %.1f MB decoded > distill.materialize_mb %.0f: streamed every epoch", size_mb,
             cfg.distill.materialize_mb)
    return ds


def ray_fit(cfg: PipelineConfig, mlflow_run_id: str | None) -> Fit:
    """The student stage's `Fit` on Ray Train: trains, then copies the student out of the final checkpoint."""
    def fit(rcfg: RankerConfig, train_rankings: Rankings, val: Rankings, out: Path) -> StudentFit:
        result = train(cfg, rcfg, train_rankings.directory, val.directory, mlflow_run_id)
        if result.error:
            raise RuntimeError(f"distillation failed: {result.error}")
        with result.checkpoint.as_directory() as directory:
            shutil.copytree(Path(directory) / "student", out, dirs_exist_ok=True)
        m = result.metrics
        return StudentFit(m["step"], m["elapsed_s"], m["loss"], m.get("val_loss"), bool(m.get("stopped_early")),
                          resumed_from_step=m["resumed_from_step"], worker_peak_mb=m["worker_peak_mb"],
                          slates_per_s=m["step"] * cfg.student.train.batch_size * cfg.cluster.train_workers / m["elapsed_s"])
    return fit


def run(cfg: PipelineConfig, parent_run_id: str | None = None) -> tuple[EvalReport, str]:
    """Teacher rankings of every split (Ray Data) -> student (Ray Train + DeepSpeed) -> evaluation,
    all in MLflow. -> (the report, the distill run's MLflow id)."""
    import mlflow

    from hllm.model.backbones import resolve_device
    from hllm.job.config import student_ranker_config
    from hllm.job.stages import evaluate_stage, load_teacher, train_student_stage
    from pipelines import evaluate, teacher_gen
    from pipelines.registry import log_student

    device = resolve_device(cfg.device)
    teacher_model, rankings = teacher_gen.run(cfg, parent_run_id)
    with mlflow_run(cfg, "distill", parent_run_id, teacher_rankings=str(rankings["train"].directory.resolve())) as run:
        mlflow.log_dict(to_dict(student_ranker_config(cfg, teacher_model)), "student_config.json")  # as trained
        student_dir = train_student_stage(cfg, teacher_model, rankings["train"], rankings["val"],
                                          ray_fit(cfg, run.info.run_id), fit_key=cfg.distill)
        log_metrics(json.loads((student_dir / "stage.json").read_text()), prefix="student.")
        t0 = time.perf_counter()
        report = evaluate_stage(cfg, load_teacher(teacher_model, cfg, device), student_dir, rankings["test"], device,
                                evaluate.ray_scorer(cfg, teacher_model))
        seconds = time.perf_counter() - t0
        log_metrics({**dataclasses.asdict(report), "seconds": seconds, "slates_per_s": report.test_slates / seconds,
                     "driver_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, prefix="eval.")
        (Path(cfg.output_dir) / "report.json").write_text(json.dumps(dataclasses.asdict(report), indent=2))
        mlflow.log_artifact(str(Path(cfg.output_dir) / "report.json"))
        if report.calibration:  # the reliability diagram of relevance_score on the test split
            from pipelines.reports import plot_reliability

            mlflow.log_artifact(str(plot_reliability({"test": report.calibration}, Path(cfg.output_dir) / "calibration.png")))
        registered = log_student(student_dir, cfg.tracking.registered_model, cfg.tracking.model_alias)
        log.info("student logged as an MLflow pyfunc: %s (alias %s)", registered, cfg.tracking.model_alias)
    return report, run.info.run_id


def main(argv: list[str] | None = None) -> None:
    from hllm.job.stages import summary_lines

    cfg, _ = parse_job("Ray Train + DeepSpeed distillation of the single-pass student", argv)
    report, run_id = run(cfg)
    for line in summary_lines(report, cfg.eval.main_decoder):
        print(line)
    print(f"mlflow run: {run_id} ({tracking_uri(cfg)})")


if __name__ == "__main__":
    main()
