"""`ray job submit` for this project's entry points, with one line of its own instead of the CLI's banner: submits a
command as a Ray job (this checkout as the working directory), streams the job's output, and exits with its status.

    python -m pipelines.submit --address http://127.0.0.1:8265 -- python pipelines/full.py [key=value ...]

Ctrl-C stops the job. The job's console follows pipelines.console: HLLM_VERBOSE=1 (or --verbose) travels with it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
import time

from pipelines import console

log = logging.getLogger("hllm.pipelines.submit")
# the working directory travels without these (what .gitignore names is left out by Ray as well); said explicitly,
# so Ray has no default of its own to warn about
EXCLUDES = [".git", ".venv", "runs", "mlruns", "**/__pycache__", ".pytest_cache", ".hypothesis", "build", "*.egg-info"]
# the job manager's own two lines at the top of every job's log (Ray's chatter, not the job's)
JOB_MANAGER_LINES = ("Runtime env is setting up.", "Running entrypoint for job ")


def _job_line(line: str) -> bool:
    return not any(marker in line for marker in JOB_MANAGER_LINES)


async def _tail(client, job: str) -> None:
    pending = ""
    async for chunk in client.tail_job_logs(job):
        pending += chunk
        *lines, pending = pending.split("\n")
        for line in lines:
            if _job_line(line):
                print(line, flush=True)
    if pending and _job_line(pending):
        print(pending, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the Ray dashboard's address (http://HOST:8265)")
    parser.add_argument("--working-dir", default=".", help="shipped to the cluster as the job's working directory")
    parser.add_argument("--verbose", action="store_true", help="Ray's own logs on the console too (the job's as well)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the job's command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give one after --")
    verbose = console.setup(args.verbose)
    os.environ.setdefault("RAY_OVERRIDE_RUNTIME_ENV_DEFAULT_EXCLUDES", "")  # EXCLUDES says what stays behind
    from ray.job_submission import JobStatus, JobSubmissionClient

    console.quiet_loggers()  # again: importing ray configures its logger

    client = JobSubmissionClient(args.address)
    runtime_env = {"working_dir": args.working_dir, "excludes": EXCLUDES,
                   "env_vars": {console.VERBOSE: "1"} if verbose else {}}
    t0 = time.perf_counter()
    job = client.submit_job(entrypoint=shlex.join(command), runtime_env=runtime_env)
    log.info("job %s submitted to %s: %s", job, args.address, shlex.join(command))
    try:
        asyncio.run(_tail(client, job))
    except KeyboardInterrupt:
        client.stop_job(job)
        log.warning("job %s stopped (Ctrl-C)", job)
        return 130
    status = client.get_job_status(job)
    while not status.is_terminal():  # the log stream can close a moment before the status is final
        time.sleep(0.5)
        status = client.get_job_status(job)
    if status != JobStatus.SUCCEEDED:
        info = client.get_job_info(job)
        log.error("job %s %s after %.0f s: %s", job, status.value.lower(), time.perf_counter() - t0, info.message)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
