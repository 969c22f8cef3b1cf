"""Distillation: Ray Train + DeepSpeed trains the single-pass student on the teacher's rankings.

    ray job submit --working-dir . -- python pipelines/distill.py [--config configs/default.yaml] [key=value ...]
    python pipelines/distill.py cluster.train_workers=2           # local Ray, 2 CPU workers

Each worker builds the student from the library (backbone + LoRA + head), wraps it with
`deepspeed.initialize` (ZeRO stage from config; fp32 + gloo on CPU, bf16 + NCCL on CUDA), reads its
shard of the teacher-ranking Parquet through `ray.train.get_dataset_shard`, and trains with the
library's losses. Every `checkpoint_every` steps all ranks save a DeepSpeed checkpoint and report
it; a failed worker group restarts from the latest one (`FailureConfig`). Only world rank 0 logs
to MLflow. The driver then evaluates the student against the teacher on the test split.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from hllm.config import from_dict, to_dict
from hllm.models import ModelConfig
from pipelines.common import DistillConfig, parse_job, PipelineConfig, cluster_has_gpus, init_ray, log_metrics, mlflow_run, tracking_uri

log = logging.getLogger("hllm.pipelines.distill")


def deepspeed_config(cfg: PipelineConfig, distill: DistillConfig, gpu: bool) -> dict[str, Any]:
    t = cfg.student.train
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": distill.zero_stage},
        "bf16": {"enabled": gpu},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _rows_to_examples(rows: dict[str, Any], builder) -> list:
    from hllm.records import request_from_dict
    from hllm.training import StudentExample

    out = []
    for slate, perm in zip(rows["slate"], rows["permutation"]):
        req = request_from_dict(json.loads(slate))
        perm = None if perm is None else [int(p) for p in perm]
        out.append(StudentExample(builder.encode(req, with_answer=False), perm, req.grades))
    return out


def train_func(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker; everything it needs comes through `config`."""
    import deepspeed
    import ray.train
    import torch

    from hllm.ranker import SinglePassRanker
    from hllm.training import make_optimizer, student_batch, student_loss
    from hllm.workflow import student_config

    cfg = from_dict(PipelineConfig, config["job"])
    distill = from_dict(DistillConfig, config["distill"])
    teacher_model = from_dict(ModelConfig, config["teacher_model"])
    ctx = ray.train.get_context()
    rank, gpu = ctx.get_world_rank(), config["use_gpu"]
    torch.manual_seed(cfg.student.train.seed + rank)
    torch.set_num_threads(cfg.threads or 1)
    device = torch.device(f"cuda:{ctx.get_local_rank()}" if gpu else "cpu")

    ranker = SinglePassRanker.build(student_config(cfg, teacher_model)).to(device)
    t = cfg.student.train
    groups = [(list(ranker.backbone.parameters()), t.lr), (list(ranker.head.parameters()), t.head_lr or t.lr)]
    optimizer, scheduler = make_optimizer(groups, t)  # a torch AdamW: no fused_adam build on CPU
    engine, _, _, _ = deepspeed.initialize(model=ranker, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, distill, gpu))
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

    shard = ray.train.get_dataset_shard("train")
    pad = ranker.tokenizer.pad_token_id
    t0 = time.perf_counter()
    while step < t.steps:
        for rows in shard.iter_batches(batch_size=t.batch_size, batch_format="numpy", drop_last=True):
            examples = [e for e in _rows_to_examples(rows, ranker.prompts) if e.perm is not None or not cfg.student.loss.needs_teacher]
            batch = {k: v.to(device) for k, v in student_batch(examples, pad).items()}
            loss, parts = student_loss(engine, batch, cfg.student.loss)
            engine.backward(loss)
            engine.step()
            step += 1
            metrics = {"loss": float(loss.detach()), "lr": scheduler.get_last_lr()[0], "step": step,
                       "resumed_from_step": resumed_from,
                       "elapsed_s": time.perf_counter() - t0, **{f"loss.{k}": v for k, v in parts.items()}}
            if mlflow is not None:
                mlflow.log_metrics({k: v for k, v in metrics.items() if k not in ("step", "resumed_from_step")}, step=step)
            if step % distill.checkpoint_every == 0 or step == t.steps:
                with tempfile.TemporaryDirectory() as directory:
                    engine.save_checkpoint(directory, tag=f"step{step}", client_state={"step": step})  # every rank
                    (Path(directory) / f"node.rank{rank}").write_text(ray.get_runtime_context().get_node_id())
                    if step == t.steps and rank == 0:
                        ranker.save(Path(directory) / "student", bundle_base=True)
                    # one name for all ranks: their files (ZeRO shards) land in one checkpoint
                    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                                     checkpoint_dir_name=f"checkpoint_{step:06d}")
            if step >= t.steps:
                break
    if mlflow is not None:
        mlflow.end_run()


def train(cfg: PipelineConfig, distill: DistillConfig, teacher_model: ModelConfig, rankings_dir: Path,
          mlflow_run_id: str | None = None):
    """-> ray.train.Result; the trained student is in the final checkpoint's `student/`."""
    import ray
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    init_ray(cfg.cluster)
    gpu = cluster_has_gpus(cfg.cluster)
    dataset = ray.data.read_parquet(str(rankings_dir), columns=["slate_id", "slate", "permutation"])
    storage = Path(cfg.output_dir).resolve() / "ray_train"
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "hllm_torch_extensions")),
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"job": to_dict(cfg), "distill": to_dict(distill), "teacher_model": to_dict(teacher_model),
                           "use_gpu": gpu, "mlflow_run_id": mlflow_run_id, "tracking_uri": tracking_uri(cfg)},
        torch_config=TorchConfig(backend="nccl" if gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.cluster.train_workers, use_gpu=gpu,
            placement_strategy="SPREAD" if cfg.cluster.spread else "PACK",
            resources_per_worker=None if gpu else {"CPU": cfg.cluster.train_cpus_per_worker}),
        run_config=ray.train.RunConfig(
            name="distill", storage_path=str(storage),
            failure_config=ray.train.FailureConfig(max_failures=distill.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2),
            worker_runtime_env={"env_vars": env}),
        datasets={"train": dataset},
    )
    return trainer.fit()


def run(cfg: PipelineConfig, parent_run_id: str | None = None) -> dict[str, Any]:
    """Teacher rankings (generated if missing) -> Ray Train + DeepSpeed -> evaluation, all in MLflow."""
    import mlflow

    from hllm.workflow import (evaluate_stage, fingerprint, generation_key, load_splits, load_teacher, mark_done, prepare_teacher,
                               resolve_device, stage_done, student_config, teacher_rankings)
    from pipelines import teacher_gen

    device = resolve_device(cfg.device)
    splits = load_splits(cfg.data)
    teacher_model = prepare_teacher(cfg, splits, device)
    gen_key = generation_key(cfg, teacher_model)
    rankings_dir = Path(cfg.output_dir) / "rankings" / f"train-{gen_key}"
    gen_stats = teacher_gen.generate(cfg, teacher_model, splits["train"], rankings_dir)
    student_dir = Path(cfg.output_dir) / "student"
    perms = [(r["slate_id"], r["permutation"]) for r in teacher_gen.read_rankings(rankings_dir)]
    key = fingerprint(student_config(cfg, teacher_model), cfg.student.train, cfg.student.loss, cfg.distill, perms)
    with mlflow_run(cfg, "distill", parent_run_id, teacher_rankings=str(rankings_dir.resolve())) as run:
        log_metrics(gen_stats, prefix="teacher_gen.")
        if stage_done(student_dir, key):
            log.info("student: reusing %s (same config and teacher rankings)", student_dir)
            steps = json.loads((student_dir / "stage.json").read_text())["steps"]
        else:
            result = train(cfg, cfg.distill, teacher_model, rankings_dir, run.info.run_id)
            if result.error:
                raise RuntimeError(f"distillation failed: {result.error}")
            with result.checkpoint.as_directory() as directory:
                shutil.copytree(Path(directory) / "student", student_dir, dirs_exist_ok=True)
            steps = result.metrics.get("step")
            mark_done(student_dir, key, steps=steps)
        teacher = load_teacher(teacher_model, cfg, device)
        test_rankings = teacher_rankings(teacher, splits["test"], Path(cfg.output_dir) / "rankings_test" / "test.jsonl", gen_key)
        report = evaluate_stage(cfg, teacher, student_dir, splits["test"], test_rankings, device)
        log_metrics(report, prefix="eval.")
        (Path(cfg.output_dir) / "report.json").write_text(json.dumps(report, indent=2))
        mlflow.log_artifact(str(Path(cfg.output_dir) / "report.json"))
        mlflow.log_artifacts(str(student_dir), artifact_path="student")
        report["mlflow_run_id"] = run.info.run_id
        report["train_steps"] = steps
    return report


def main(argv: list[str] | None = None) -> None:
    from hllm.workflow import summary_lines

    cfg, _ = parse_job("Ray Train + DeepSpeed distillation of the single-pass student", argv)
    report = run(cfg)
    for line in summary_lines(report, cfg.eval.main_decoder):
        print(line)
    print(f"mlflow run: {report['mlflow_run_id']} ({tracking_uri(cfg)})")


if __name__ == "__main__":
    main()
