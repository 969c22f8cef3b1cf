"""Fault drills under bounded load: SIGKILL a Serve replica (count failed requests, time the recovery);
swap the served model (count failed requests, time until only the new version answers).

    python benchmarks/replica_failure.py --model-dir runs/default/student   # the figures in reports/

Load is closed-loop: `clients` threads each send one request, wait for it, pause `pause_s`, repeat,
so the offered load stays bounded whatever happens to latency. After `kill_after_s` one replica
process of the deployment is killed with SIGKILL (no graceful shutdown). A request fails when it
raises or returns a non-200. Recovery is the time from the kill until Serve reports the target
number of RUNNING replicas again with a new process in place of the killed one.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import psutil
import requests


def replica_processes(app: str, deployment: str) -> list[psutil.Process]:
    """Live replica processes of `app`'s `deployment` (Ray titles them ray::ServeReplica:<app>:<deployment>)."""
    tag = f"ServeReplica:{app}:{deployment}"
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if tag in cmdline and proc.status() != psutil.STATUS_ZOMBIE:
            out.append(proc)
    return out


def running_replicas(app: str, deployment: str) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return int(status.deployments[deployment].replica_states.get("RUNNING", 0))


class ClosedLoopLoad:
    """`clients` threads, each sending one request (cycling through `bodies`), waiting for it,
    pausing `pause_s`, and again, until the `with` block ends: the offered load stays bounded
    whatever happens to latency. `record(done, ms, response, error)` runs under `self.lock` for
    every request; a request failed when it raised or returned a non-200 (`error` says which)."""

    def __init__(self, url: str, bodies: list[dict], record, clients: int = 2, pause_s: float = 0.02):
        self.url, self.bodies, self.record, self.pause_s = url, bodies, record, pause_s
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, offset: int) -> None:
        session, k = requests.Session(), offset
        while not self.stop.is_set():
            t0 = time.perf_counter()
            response, error = None, None
            try:
                response = session.post(self.url, json=self.bodies[k % len(self.bodies)], timeout=60)
                error = None if response.status_code == 200 else f"HTTP {response.status_code}"
            except requests.RequestException as err:
                error = type(err).__name__
            k += 1
            done = time.perf_counter()
            with self.lock:
                self.record(done, 1000 * (done - t0), response, error)
            time.sleep(self.pause_s)

    def __enter__(self) -> "ClosedLoopLoad":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=70)


@dataclass
class DrillResult:
    requests: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    killed_pid: int | None = None
    recovery_s: float | None = None  # None: not recovered within the drill
    latency_ms: list[float] = field(default_factory=list)
    failure_times_s: list[float] = field(default_factory=list)  # relative to the kill

    @property
    def failure_rate(self) -> float:
        return self.failed / max(self.requests, 1)

    def summary(self) -> dict:
        lat = np.asarray(self.latency_ms) if self.latency_ms else np.asarray([np.nan])
        return {"requests": self.requests, "failed": self.failed, "failure_rate": self.failure_rate, "errors": self.errors,
                "recovery_s": self.recovery_s, "p50_ms": float(np.median(lat)), "p99_ms": float(np.percentile(lat, 99)),
                "failures_after_kill_s": [round(t, 2) for t in self.failure_times_s]}


def kill_replica_under_load(url: str, body: dict, app: str, deployment: str, target_replicas: int, clients: int = 2,
                            pause_s: float = 0.02, kill_after_s: float = 5.0, duration_s: float = 20.0,
                            recovery_timeout_s: float = 120.0) -> DrillResult:
    """Runs the drill against a deployed app; the load runs at least `duration_s` and until recovery."""
    result = DrillResult()
    t_kill: list[float] = []

    def record(done: float, ms: float, response, error: str | None) -> None:
        result.requests += 1
        if error:
            result.failed += 1
            result.errors[error] = result.errors.get(error, 0) + 1
            result.failure_times_s.append(done - t_kill[0] if t_kill else -1.0)
        else:
            result.latency_ms.append(ms)

    before = replica_processes(app, deployment)
    if len(before) != target_replicas:
        raise RuntimeError(f"expected {target_replicas} replica processes of {app}:{deployment}, found {len(before)}")
    start = time.perf_counter()
    with ClosedLoopLoad(url, [body], record, clients, pause_s):
        time.sleep(kill_after_s)
        victim = before[0]
        result.killed_pid = victim.pid
        t_kill.append(time.perf_counter())
        os.kill(victim.pid, signal.SIGKILL)
        while time.perf_counter() - t_kill[0] < recovery_timeout_s:
            alive = [p.pid for p in replica_processes(app, deployment)]
            if (victim.pid not in alive and len(alive) == target_replicas
                    and running_replicas(app, deployment) == target_replicas):
                result.recovery_s = time.perf_counter() - t_kill[0]
                break
            time.sleep(0.1)
        time.sleep(max(0.0, duration_s - (time.perf_counter() - start)))
    return result


@dataclass
class SwapResult:
    """A model swap under load: what was sent, what failed, how long until only the new version answered."""

    requests: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)  # meta.model_version -> answers
    swap_s: float | None = None  # from the trigger to the first answer of the new version after which no old one came
    latency_ms: list[tuple[float, float]] = field(default_factory=list)  # (seconds after the trigger, ms)

    def summary(self) -> dict:
        during = [ms for t, ms in self.latency_ms if 0 <= t <= (self.swap_s or 0)] or [np.nan]
        every = [ms for _, ms in self.latency_ms] or [np.nan]
        return {"requests": self.requests, "failed": self.failed, "errors": self.errors, "versions": self.versions,
                "swap_s": self.swap_s, "p50_ms": float(np.median(every)), "p99_ms": float(np.percentile(every, 99)),
                "p99_during_swap_ms": float(np.percentile(during, 99)), "requests_during_swap": len(during)}


def swap_under_load(url: str, bodies: list[dict], trigger, new_version: str, clients: int = 2, pause_s: float = 0.02,
                    before_s: float = 2.0, timeout_s: float = 180.0, after_s: float = 3.0) -> SwapResult:
    """Closed-loop load (`ClosedLoopLoad`) on `url`, cycling through `bodies`; after
    `before_s`, `trigger()` (e.g. move a registry alias); the load runs until every answer for
    `after_s` came from `new_version` (meta.model_version), or `timeout_s`."""
    result = SwapResult()
    t_trigger: list[float] = []
    answers: list[tuple[float, str]] = []  # (time, version) of every 200

    def record(done: float, ms: float, response, error: str | None) -> None:
        result.requests += 1
        if error:
            result.failed += 1
            result.errors[error] = result.errors.get(error, 0) + 1
            return
        version = str(response.json()["meta"].get("model_version"))
        result.versions[version] = result.versions.get(version, 0) + 1
        answers.append((done, version))
        result.latency_ms.append((done - t_trigger[0] if t_trigger else -1.0, ms))

    with ClosedLoopLoad(url, bodies, record, clients, pause_s) as load:
        time.sleep(before_s)
        t_trigger.append(time.perf_counter())
        trigger()
        while time.perf_counter() - t_trigger[0] < timeout_s:
            with load.lock:
                old = [t for t, v in answers if v != new_version]
                new = [t for t, v in answers if v == new_version and (not old or t > max(old))]
            if new and time.perf_counter() - new[0] >= after_s:
                result.swap_s = new[0] - t_trigger[0]
                break
            time.sleep(0.1)
    return result


@dataclass
class RolloutResult:
    """A rollout drill: every request's outcome, who answered, and each candidate's final decision."""

    requests: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    by_version: dict[str, int] = field(default_factory=dict)  # meta.model_version -> requests answered
    by_arm: dict[str, int] = field(default_factory=dict)  # meta.rollout_arm -> requests answered
    latency_ms: list[float] = field(default_factory=list)
    outcomes: list[dict] = field(default_factory=list)  # per candidate: label, version, the deciding row, seconds

    def summary(self) -> dict:
        lat = np.asarray(self.latency_ms) if self.latency_ms else np.asarray([np.nan])
        return {"requests": self.requests, "failed": self.failed, "errors": self.errors, "by_version": self.by_version,
                "by_arm": self.by_arm, "p50_ms": float(np.median(lat)), "p99_ms": float(np.percentile(lat, 99)),
                "outcomes": [{k: o[k] for k in ("label", "action", "reason", "seconds")} for o in self.outcomes]}


def rollout_under_load(url: str, bodies: list[dict], candidates: list[tuple[str, str]], move_candidate,
                       clients: int = 2, pause_s: float = 0.01, timeout_s: float = 120.0) -> RolloutResult:
    """Closed-loop load on a many-student app (`url`: its root) while each candidate in turn is rolled out:
    `move_candidate(version)` points the rollout's candidate alias at `models:/NAME/<version>`, then the drill waits
    for that version's rollback or promotion (GET /v1/rollout) before the next. -> every request's outcome."""
    result = RolloutResult()

    def record(done, ms, response, error):
        result.requests += 1
        if error is not None:
            result.failed += 1
            result.errors[error] = result.errors.get(error, 0) + 1
            return
        meta = response.json()["meta"]
        result.latency_ms.append(ms)
        result.by_version[meta.get("model_version")] = result.by_version.get(meta.get("model_version"), 0) + 1
        arm = meta.get("rollout_arm") or "none"
        result.by_arm[arm] = result.by_arm.get(arm, 0) + 1

    with ClosedLoopLoad(url.rstrip("/") + "/v1/rerank", bodies, record, clients=clients, pause_s=pause_s):
        for label, version in candidates:
            t0 = time.perf_counter()
            uri = move_candidate(version)
            decision = None
            while decision is None and time.perf_counter() - t0 < timeout_s:
                time.sleep(0.25)
                rows = requests.get(url.rstrip("/") + "/v1/rollout", timeout=30).json()["decisions"]
                decision = next((d for d in rows if d["version"] == uri and d["action"] in ("rollback", "promote")), None)
            result.outcomes.append({"label": label, "version": uri, "action": decision and decision["action"],
                                    "reason": decision and decision["reason"], "row": decision,
                                    "seconds": round(time.perf_counter() - t0, 2)})
    return result
