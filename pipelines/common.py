"""Ray and MLflow glue shared by the pipelines: the pipeline config, Ray start-up, tracking, and the
`runs:/` / `models:/` resolver that `hllm.Reranker.load` finds through the `hllm.model_uris` entry points."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hllm.config import flatten, load_config, to_dict
from hllm.job.refresh import RefreshConfig
from hllm.job.config import JobConfig, add_config_args

log = logging.getLogger("hllm.pipelines")


@dataclass
class ClusterConfig:
    """Where and how wide the Ray stages run."""

    address: str | None = None  # None: RAY_ADDRESS or a running cluster, else start a local one
    local_cpus: int = 4  # logical CPUs of a local Ray (more than cores, so Data's I/O tasks never starve)
    teacher_actors: int = 2  # Ray Data actors generating teacher rankings (a GPU each where present)
    teacher_cpus_per_actor: float = 1.0  # CPUs reserved per teacher actor
    data_partitions: int | None = None  # hash partitions of the data stage's two shuffles (None: by input size below)
    data_partition_mb: float = 64.0  # None partitions: one per this many MB of input, at most 2 per cluster CPU
    teacher_batch_slates: int = 32  # slates per map_batches batch (and per output shard)
    train_workers: int = 2  # Ray Train workers (DeepSpeed data parallel)
    train_cpus_per_worker: float = 1.0  # CPUs reserved per train worker
    use_gpu: bool | None = None  # None: use GPUs when the cluster has them
    serve_port: int = 8000  # full.py's deployment (bound to 127.0.0.1)
    spread: bool = False  # place teacher actors and train workers on as many nodes as possible
    actor_start_timeout_s: float = 600.0  # an actor pool waits for all its actors before the first batch (0: not)

    def __post_init__(self) -> None:
        if self.teacher_actors < 1 or self.train_workers < 1:
            raise ValueError("cluster.teacher_actors and cluster.train_workers must be >= 1")


@dataclass
class TrackingConfig:
    """MLflow: local sqlite by default, any tracking URI by config."""

    tracking_uri: str | None = None  # None: sqlite:///<output_dir>/mlflow.db
    experiment: str = "hllm"  # MLflow experiment
    run_name: str | None = None  # MLflow run name (None: the stage's name)
    registered_model: str | None = "hllm-student"  # Model Registry name the student is registered under (None: not)
    model_alias: str | None = "candidate"  # alias moved to each new version (promote to champion: pipelines.registry.promote)


@dataclass
class DistillConfig:
    """Ray Train / DeepSpeed settings (the optimisation itself is `student.train`)."""

    zero_stage: Literal[0, 1, 2] = 2  # ZeRO-3 would need a parameter gather before saving
    checkpoint_every: int = 50  # steps between Ray Train checkpoints (a failed worker resumes from the last)
    max_failures: int = 2  # worker failures Ray Train recovers from before the stage fails
    # the train rankings are materialised in the object store (read once, not every epoch) when their decoded
    # size is at most this; a larger store streams from storage to the workers each epoch (read_parquet + shards)
    materialize_mb: float = 1024.0


@dataclass
class PipelineConfig(JobConfig):
    """The job config plus what the Ray stages need."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    refresh: RefreshConfig = field(default_factory=RefreshConfig)  # the flywheel's cycle (pipelines/refresh.py)


def parse_job(description: str, argv: list[str] | None = None, configure=None) -> tuple["PipelineConfig", Any]:
    """The entry points' shared start: arguments -> logging -> resolved config (logged first) ->
    driver threads. A Ray job's driver inherits OMP_NUM_THREADS=1, yet the teacher bootstrap and
    the evaluation run in it. `configure(parser)` adds an entry point's own flags."""
    import argparse

    import torch

    from pipelines import console

    parser = argparse.ArgumentParser(description=description)
    if configure:
        configure(parser)
    add_config_args(parser)
    parser.add_argument("--verbose", action="store_true", help="Ray's, Ray Data's, Ray Train's, Serve's and MLflow's "
                        f"own logs on the console too (or {console.VERBOSE}=1)")
    args = parser.parse_intermixed_args(argv)
    console.setup(args.verbose)
    cfg = load_config(PipelineConfig, args.config, args.overrides)
    log.info("config: %s", json.dumps(to_dict(cfg)))
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    return cfg, args


@dataclass
class RecipeJob:
    """What `mlflow_run` records for a recorded recipe's parent run: the recipe's config and where MLflow keeps it."""

    recipe: Any  # the recipe's config dataclass (it has an output_dir)
    tracking: TrackingConfig

    @property
    def output_dir(self) -> str:
        return self.recipe.output_dir


def parse_recipe_job(recipe_cls: type, doc: str, default_tracking: list[str], example: str,
                     argv: list[str] | None = None) -> tuple[Any, TrackingConfig, str | None]:
    """A recorded recipe's command line (`hllm realtext`): `--config FILE`, `--report` (record a
    finished run's report.json instead of running), `key=value` overrides for the recipe and `tracking.key=value` for
    MLflow. Logging set up. -> (the recipe's config, the tracking config, the report path or None)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", required=True, help=f"YAML (e.g. {example})")
    parser.add_argument("--report", help="record this finished run's report.json instead of running the recipe")
    parser.add_argument("overrides", nargs="*", help="key=value for the recipe; tracking.key=value for MLflow")
    args = parser.parse_args(argv)
    from pipelines import console

    console.setup()
    tracking = [o.removeprefix("tracking.") for o in args.overrides if o.startswith("tracking.")]
    recipe = load_config(recipe_cls, args.config, [o for o in args.overrides if not o.startswith("tracking.")])
    return recipe, load_config(TrackingConfig, None, [*default_tracking, *tracking]), args.report


def init_ray(cfg: ClusterConfig) -> None:
    """Joins `cluster.address` (or RAY_ADDRESS: a `ray job submit` driver), else starts a local Ray. The workers' output
    and Ray's own INFO lines stay in Ray's session folder (said once) unless HLLM_VERBOSE (pipelines.console)."""
    from pipelines import console

    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if not address:
        console.local_ray_auth()
    import ray

    if ray.is_initialized():
        return
    verbose = console.is_verbose()
    quiet = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.WARNING}
    if address:
        ray.init(address=address, **quiet)
    else:  # local: dashboard (and job server) on loopback only
        from serve.common import thin_ingress

        thin_ingress()
        ray.init(num_cpus=cfg.local_cpus, include_dashboard=False, dashboard_host="127.0.0.1", **quiet)
    import ray.data  # noqa: F401 (configures its logger: quieted next)

    console.quiet_loggers()
    console.quiet_ray_data()
    if not verbose:
        log.info("ray: %s; the workers' output and Ray's logs are in %s (--verbose or %s=1 shows them here)",
                 address or "a local instance", console.ray_logs(), console.VERBOSE)


def wait_for_actors(ds: Any, cfg: ClusterConfig) -> None:
    """Make `ds`'s actor pools start every actor before the first batch: otherwise the first actor up
    takes the whole queue of a short stage (the others sit idle), and a cluster that cannot place the
    pool hangs instead of failing with Ray Data's timeout error."""
    ds.context.wait_for_min_actors_s = cfg.actor_start_timeout_s if cfg.actor_start_timeout_s > 0 else -1


def cluster_has_gpus(cfg: ClusterConfig) -> bool:
    import ray

    if cfg.use_gpu is not None:
        return cfg.use_gpu
    return ray.cluster_resources().get("GPU", 0) > 0


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tracking_uri(cfg: PipelineConfig) -> str:
    if cfg.tracking.tracking_uri:
        return cfg.tracking.tracking_uri
    path = Path(cfg.output_dir).resolve() / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def set_experiment(cfg: PipelineConfig) -> None:
    """The job's experiment; with the default sqlite store its artifacts live beside it in
    `output_dir/mlartifacts` (MLflow's default, `./mlruns`, is the Ray job's temporary working copy:
    `runs:/` and `models:/` URIs would not outlive the job)."""
    import mlflow

    if cfg.tracking.tracking_uri is None and mlflow.get_experiment_by_name(cfg.tracking.experiment) is None:
        location = (Path(cfg.output_dir).resolve() / "mlartifacts").as_uri()
        try:
            mlflow.create_experiment(cfg.tracking.experiment, artifact_location=location)
        except mlflow.exceptions.MlflowException:  # created meanwhile by another process: theirs stands
            if mlflow.get_experiment_by_name(cfg.tracking.experiment) is None:
                raise
    experiment = mlflow.set_experiment(cfg.tracking.experiment)
    where = experiment.artifact_location
    local = Path(where.removeprefix("file://"))
    if cfg.tracking.tracking_uri is None and not local.resolve().is_relative_to(Path(cfg.output_dir).resolve()):
        log.warning("MLflow experiment %r keeps its artifacts at %s, outside output_dir (it was created before "
                    "artifacts moved to output_dir/mlartifacts): a relative location is the Ray job's temporary "
                    "working copy, so runs:/ and models:/ URIs may not outlive the job; use a new "
                    "tracking.experiment or output_dir", cfg.tracking.experiment, where)


@contextmanager
def mlflow_run(cfg: PipelineConfig, stage: str, parent_run_id: str | None = None, **tags: str):
    """An MLflow run for a stage (nested under `parent_run_id` when given), params = the config."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(cfg))
    set_experiment(cfg)
    all_tags = {"hllm.stage": stage, "git_commit": git_commit(), **tags}
    active = mlflow.active_run()
    if parent_run_id and not (active and active.info.run_id == parent_run_id):
        all_tags["mlflow.parentRunId"] = parent_run_id  # a parent that is not active in this process
    nested = bool(active and parent_run_id and active.info.run_id == parent_run_id)
    with mlflow.start_run(run_name=cfg.tracking.run_name or stage, tags=all_tags, nested=nested) as run:
        params = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in flatten(cfg).items()}
        items = list(params.items())
        for start in range(0, len(items), 100):  # MLflow caps params per batch
            mlflow.log_params(dict(items[start: start + 100]))
        yield run


def log_metrics(metrics: dict[str, Any], step: int | None = None, prefix: str = "") -> None:
    import mlflow

    clean = {}
    for k, v in flatten(metrics).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v:  # drop NaN
            clean[(prefix + k).replace("@", "_at_").replace("(", "_").replace(")", "").replace("=", "")] = float(v)
    mlflow.log_metrics(clean, step=step)


def download_mlflow_model(uri: str) -> str:
    """`runs:/RUN_ID/student` or `models:/NAME@ALIAS` -> a local folder (MLflow's tracking URI from
    MLFLOW_TRACKING_URI). Registered in pyproject.toml under the entry-point group `hllm.model_uris`."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no bar per model loaded
    import mlflow

    from pipelines.registry import student_folder

    return str(student_folder(mlflow.artifacts.download_artifacts(artifact_uri=uri)))
