"""What the project's entry points print: one line per event (`HH:MM:SS message`), progress at a steady cadence, the
summary last. The libraries' own chatter — Ray's, Ray Data's, Ray Train's, Serve's, MLflow's INFO lines, the workers'
output — stays in their log files (Ray's session folder, said once); `--verbose` or `HLLM_VERBOSE=1` brings it back.
Warnings and errors always reach the console."""

from __future__ import annotations

import logging
import os
import sys

VERBOSE = "HLLM_VERBOSE"  # set (to anything but 0/false) for the libraries' own logs on the console
# libraries whose INFO lines are chatter on a console (their warnings still show)
LIBRARIES = ("ray", "ray.data", "ray.train", "ray.serve", "ray.tune", "mlflow", "alembic", "deepspeed", "DeepSpeed",
             "matplotlib", "urllib3", "filelock", "httpx", "py.warnings",
             # Ray's job client sets these two to INFO itself ("Uploading package", "WebSocket closed")
             "ray.dashboard.modules.dashboard_sdk", "ray.dashboard.modules.job.sdk")


def is_verbose() -> bool:
    return os.environ.get(VERBOSE, "").lower() not in ("", "0", "false", "no")


def setup(verbose: bool = False) -> bool:
    """The console for an entry point: `hllm.*` at INFO, other libraries at WARNING unless verbose (`verbose` or
    HLLM_VERBOSE). -> whether verbose (also exported as HLLM_VERBOSE=1, for the processes it starts)."""
    verbose = verbose or is_verbose()
    if verbose:
        os.environ[VERBOSE] = "1"
    from hllm.job.config import console_logging

    console_logging(verbose)
    if not verbose:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow configures its loggers
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    quiet_loggers()
    return verbose


def local_ray_auth() -> None:
    """A Ray this process starts runs with token authentication, Ray's own default for a local `ray.init`, said
    explicitly so that Ray does not warn about it. Only before `import ray`: Ray caches the mode when imported, and a
    mode set later makes its client disagree with the cluster it starts."""
    if "ray" not in sys.modules:
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def quiet_loggers() -> None:
    """The libraries' loggers to WARNING, or (verbose) back to the root's level: again after `import ray`, which
    configures its own."""
    level = logging.NOTSET if is_verbose() else logging.WARNING
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(level)


def quiet_ray_data() -> None:
    """Ray Data's console handler to WARNING, after `import ray.data` (which configures its own logger): its progress
    lines and execution plans stay in its log file under Ray's session folder, which keeps everything. (Its progress
    bars stay on: off, Ray Data warns that they are; in a log, not a terminal, they are these same log lines.)"""
    if is_verbose():
        return
    for handler in logging.getLogger("ray.data").handlers:
        if "File" not in type(handler).__name__:
            handler.setLevel(logging.WARNING)


def ray_logs() -> str:
    """Where this Ray session keeps its logs."""
    try:
        from ray._private.worker import global_worker

        return f"{global_worker.node.get_session_dir_path()}/logs"
    except Exception:  # noqa: BLE001 (a hint for the console; the default location is right for a local Ray)
        return "/tmp/ray/session_latest/logs"
