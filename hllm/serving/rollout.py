"""Many students behind one endpoint, and a candidate rolled out on live traffic: the library half.

Serve's glue (`serve/students.py`) routes, calls and counts; what it decides with lives here, plain Python with an
injectable clock, tested without Ray:

- `ModelCatalog`: a request's `model` (a configured short name, `NAME/VERSION` or `NAME@ALIAS` of a registered model
  the app serves, a folder it was told about, nothing: the default) -> a `Route` naming one immutable model (an
  alias pinned to its version, re-pinned every `pin_ttl_s`). An unknown name raises `UnknownModel` with the names the
  app knows.
- who is shadowed, who is in the canary (sticky by tenant or query): `hllm.data.splits.unit_hash` of the key, salted.
- `pair_agreement`: how far two rankings of the same request agree (Kendall tau, top-10 overlap).
- `Rollout`: the state machine of one candidate: shadow (ranked beside the champion, never answering) -> canary
  (answering a growing, sticky share) -> promoted, or rolled back the moment a guard breaks (error rate, p99 latency
  against the champion's, agreement with the champion, judged once a window holds `min_requests`). Every change of
  state is a `Decision`: a log line, a metric and a row in the rollout log (`read_decisions`, `hllm rollout status`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from hllm.eval.metrics import kendall_tau
from hllm.uris import registry_alias

_REGISTRY_NAME = re.compile(r"^(?:models:/)?(?P<name>[A-Za-z0-9][\w.\-]*)(?:/(?P<version>\d+)|@(?P<alias>[\w.\-]+))$")


class UnknownModel(LookupError):
    """A request named a model this app does not serve (the server answers 404 with `known`)."""

    def __init__(self, requested: str, known: Sequence[str]):
        self.requested, self.known = requested, list(known)
        super().__init__(f"model {requested!r} is not served here; known: {', '.join(self.known)}")


@dataclass(frozen=True)
class Route:
    """Where a request goes: `name` as the app calls it, `uri` an immutable model (a version, a run, a folder)."""

    name: str
    uri: str


class ModelCatalog:
    """The students an app serves. `students`: short name -> model (a folder, a named model, `runs:/...`,
    `models:/NAME/VERSION`, `models:/NAME@ALIAS`); `pin`: `models:/NAME@ALIAS` -> `models:/NAME/VERSION` (the
    registry's answer; the library imports no tracking client), asked again once a pin is `pin_ttl_s` old. A registry
    that cannot be reached keeps the last pin (counted in `pin_failures`); with none yet, the error is raised."""

    def __init__(self, students: Mapping[str, str], default: str | None = None,
                 pin: Callable[[str], str] | None = None, pin_ttl_s: float = 15.0,
                 clock: Callable[[], float] = time.monotonic):
        if not students:
            raise ValueError("an app serves at least one student")
        self.students = dict(students)
        self.default = default or next(iter(self.students))
        if self.default not in self.students:
            raise ValueError(f"default student {self.default!r} is not one of {list(self.students)}")
        self.pin, self.pin_ttl_s, self.clock = pin, pin_ttl_s, clock
        self.registry_names = {m["name"] for uri in self.students.values() if (m := _REGISTRY_NAME.match(uri))
                               and uri.startswith("models:/")}
        for uri in self.students.values():
            if registry_alias(uri) and pin is None:
                raise ValueError(f"{uri}: an alias needs the registry (pin) to resolve it")
        self._pins: dict[str, tuple[str, float]] = {}  # alias URI -> (pinned URI, when)
        self.pin_failures = 0

    def names(self) -> list[str]:
        """What a request may name: the short names, then the registered models' `NAME@ALIAS` / `NAME/VERSION`."""
        return list(self.students) + [f"{n}@<alias>" for n in sorted(self.registry_names)] + \
            [f"{n}/<version>" for n in sorted(self.registry_names)]

    def resolve(self, requested: str | None) -> Route:
        name = requested or self.default
        if name in self.students:
            return Route(name, self.pinned(self.students[name]))
        for short, uri in self.students.items():  # a folder or URI the app was told about, named as configured
            if name == uri:
                return Route(short, self.pinned(uri))
        m = _REGISTRY_NAME.match(name)
        if m is not None and m["name"] in self.registry_names:
            uri = f"models:/{m['name']}/{m['version']}" if m["version"] else f"models:/{m['name']}@{m['alias']}"
            return Route(name.removeprefix("models:/"), self.pinned(uri))
        raise UnknownModel(name, self.names())

    def pinned(self, uri: str) -> str:
        """An alias -> the version it points at (cached `pin_ttl_s`); any other model as it is."""
        if registry_alias(uri) is None:
            return uri
        now = self.clock()
        cached = self._pins.get(uri)
        if cached is not None and now - cached[1] < self.pin_ttl_s:
            return cached[0]
        try:
            pinned = self.pin(uri)
        except Exception:  # noqa: BLE001 (registry unreachable: keep the last pin, counted; none yet: raise)
            self.pin_failures += 1
            if cached is None:
                raise
            pinned = cached[0]
        self._pins[uri] = (pinned, now)
        return pinned

    def forget(self, uri: str) -> None:
        """Drops a cached pin (an alias this app just moved): the next request asks the registry."""
        self._pins.pop(uri, None)


def pair_agreement(champion: Sequence[int], candidate: Sequence[int], k: int = 10) -> tuple[float, float]:
    """Two full rankings of one request -> (Kendall tau, the share of the champion's top k the candidate also has in
    its top k). A request of one document agrees fully."""
    if sorted(champion) != sorted(candidate):
        raise ValueError("pair_agreement: the two rankings are not of the same documents")
    if len(champion) < 2:
        return 1.0, 1.0
    k = min(k, len(champion))
    return kendall_tau(candidate, champion), len(set(champion[:k]) & set(candidate[:k])) / k


# ---------------------------------------------------------------------------------------------- the rollout


@dataclass
class Guards:
    """A candidate's health, judged on each window once it holds `min_requests` of the candidate's calls and pairs
    (errors may end it sooner: more errors than the rate allows over `min_requests` is a breach at once). Latency is
    compared with the champion's in the same window, in the canary phase (in the shadow phase the candidate runs in a
    lower-priority pool of its own, so its times say nothing of what a user would wait): the median always, the p99
    once both arms have `p99_min_calls` (a p99 of 20 calls is their maximum: one stall of a shared CPU would decide it —
    measured here, same-size models breached a 2x p99 guard at 20 calls)."""

    max_error_rate: float = 0.01  # the candidate's failed calls / calls
    max_p50_ratio: float = 1.5  # the candidate's median latency / the champion's, same window ...
    p50_slack_ms: float = 2.0  # ... plus this
    max_p99_ratio: float = 1.5  # the candidate's p99 latency / the champion's ...
    p99_slack_ms: float = 5.0  # ... plus this (a p99 of a few ms is noise on a shared CPU) ...
    p99_min_calls: int = 100  # ... judged once both arms have this many calls in the window
    min_agreement: float = 0.3  # mean Kendall tau of the candidate's ranking to the champion's, same requests
    min_requests: int = 50  # a window is judged once it holds this many of the candidate's calls (and pairs)

    def __post_init__(self) -> None:
        if not (0 <= self.max_error_rate < 1 and self.max_p50_ratio > 0 and self.max_p99_ratio > 0
                and -1 <= self.min_agreement <= 1 and self.min_requests >= 1 and self.p99_min_calls >= 1):
            raise ValueError("rollout.guards: need 0 <= max_error_rate < 1, max_p50_ratio > 0, max_p99_ratio > 0, "
                             "-1 <= min_agreement <= 1, min_requests >= 1, p99_min_calls >= 1")


@dataclass
class ShadowConfig:
    """`rollout.shadow`: `share` of requests also ranked by `model`, off the response path; never answers."""

    model: str  # a name the catalog resolves (a configured student, NAME@ALIAS, NAME/VERSION)
    share: float = 1.0
    queue: int = 64  # shadow calls waiting at most, per router replica; a full queue drops (counted), never waits
    workers: int = 2  # shadow calls in flight at once, per router replica
    timeout_s: float = 30.0  # a shadow call longer than this counts as an error

    def __post_init__(self) -> None:
        if not 0 < self.share <= 1 or self.queue < 1 or self.workers < 1 or self.timeout_s <= 0:
            raise ValueError("rollout.shadow: need 0 < share <= 1, queue >= 1, workers >= 1, timeout_s > 0")


@dataclass
class CanaryConfig:
    """`rollout.canary`: `share` of traffic answered by `model`, sticky by a hash of `sticky_by` (`query`, or
    `header:<name>`, e.g. `header:x-tenant`, the query where the header is absent); each healthy window steps the
    share up by `step_share` to `max_share`, then (`promote_alias`) the registry alias moves to the candidate."""

    model: str
    share: float = 0.05
    sticky_by: str = "query"
    step_share: float = 0.1
    max_share: float = 0.5
    promote_alias: str | None = "champion"  # None: stay at max_share, a person decides

    def __post_init__(self) -> None:
        if not (0 < self.share <= self.max_share <= 1 and self.step_share > 0):
            raise ValueError("rollout.canary: need 0 < share <= max_share <= 1, step_share > 0")
        if self.sticky_by != "query" and not self.sticky_by.startswith("header:"):
            raise ValueError(f"rollout.canary.sticky_by {self.sticky_by!r}: `query` or `header:<name>`")

    def shares(self) -> list[float]:
        """The canary's steps: share, share + step, ..., max_share."""
        out = [self.share]
        while out[-1] < self.max_share - 1e-9:
            out.append(min(round(out[-1] + self.step_share, 6), self.max_share))
        return out


@dataclass
class RolloutConfig:
    """`args.rollout` of a many-student app: shadow, canary, or both (the same model: shadow first, then canary)."""

    shadow: ShadowConfig | None = None
    canary: CanaryConfig | None = None
    guards: Guards = field(default_factory=Guards)
    interval_s: float = 30.0  # the guards are checked this often; a healthy, judged window steps up
    log_path: str | None = None  # the decisions as JSON lines (`hllm rollout status`); None: Serve's log only
    report_s: float = 1.0  # each router replica sends its observations this often

    def __post_init__(self) -> None:
        if isinstance(self.shadow, dict):
            self.shadow = ShadowConfig(**self.shadow)
        if isinstance(self.canary, dict):
            self.canary = CanaryConfig(**self.canary)
        if isinstance(self.guards, dict):
            self.guards = Guards(**self.guards)
        if self.shadow is None and self.canary is None:
            raise ValueError("rollout: give shadow, canary or both")
        if self.shadow is not None and self.canary is not None and self.shadow.model != self.canary.model:
            raise ValueError(f"rollout: shadow ({self.shadow.model}) and canary ({self.canary.model}) roll out one "
                             "candidate: name the same model")
        if self.interval_s <= 0 or self.report_s <= 0:
            raise ValueError("rollout: interval_s and report_s must be > 0")

    @property
    def candidate(self) -> str:
        return (self.canary or self.shadow).model


Phase = Literal["shadow", "canary", "promoted", "rolled_back"]


@dataclass
class Window:
    """What the routers saw of both arms since the last decision: calls, failures, latencies, agreement pairs."""

    calls: dict[str, int] = field(default_factory=lambda: {"champion": 0, "candidate": 0})
    errors: dict[str, int] = field(default_factory=lambda: {"champion": 0, "candidate": 0})
    latency_ms: dict[str, list[float]] = field(default_factory=lambda: {"champion": [], "candidate": []})
    taus: list[float] = field(default_factory=list)
    overlaps: list[float] = field(default_factory=list)

    def add(self, other: "Window") -> None:
        for arm in ("champion", "candidate"):
            self.calls[arm] += other.calls[arm]
            self.errors[arm] += other.errors[arm]
            self.latency_ms[arm] += other.latency_ms[arm]
        self.taus += other.taus
        self.overlaps += other.overlaps

    def record(self, arm: str, ms: float | None, ok: bool = True) -> None:
        self.calls[arm] += 1
        if ok:
            self.latency_ms[arm].append(ms)
        else:
            self.errors[arm] += 1

    def pair(self, tau: float, overlap: float) -> None:
        self.taus.append(tau)
        self.overlaps.append(overlap)

    def quantile(self, arm: str, q: float) -> float | None:
        values = self.latency_ms[arm]
        return float(np.percentile(values, q)) if values else None

    def summary(self) -> dict:
        out = {f"{arm}_calls": self.calls[arm] for arm in self.calls} | \
              {f"{arm}_errors": self.errors[arm] for arm in self.errors}
        for arm in self.calls:
            for q in (50, 99):
                value = self.quantile(arm, q)
                out[f"{arm}_p{q}_ms"] = None if value is None else round(value, 2)
        out["pairs"] = len(self.taus)
        out["kendall_tau"] = round(float(np.mean(self.taus)), 4) if self.taus else None
        out["top10_overlap"] = round(float(np.mean(self.overlaps)), 4) if self.overlaps else None
        return out

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Window":
        return cls(**d)


@dataclass(frozen=True)
class Decision:
    """A change of the rollout's state: one log line, one metric, one row of the rollout log."""

    time: float  # unix seconds
    candidate: str  # the candidate as configured
    version: str  # the immutable model it resolved to
    action: Literal["start", "step", "rollback", "promote"]
    phase: str  # the phase after the decision
    share: float  # the candidate's share of answers after it (0 in shadow and after a rollback)
    reason: str
    window: dict  # the figures it was decided on (`Window.summary`)

    def line(self) -> str:
        w = self.window
        figures = ", ".join(f"{k} {v}" for k, v in w.items() if v is not None)
        return (f"rollout {self.action}: {self.candidate} ({self.version}) -> {self.phase}, share {self.share:.2f}: "
                f"{self.reason}" + (f" [{figures}]" if figures else ""))


class Rollout:
    """One candidate's rollout, driven by `observe` (routers' windows) and `tick` (every `interval_s`). `share` is
    what the routers answer with the candidate now."""

    def __init__(self, cfg: RolloutConfig, version: str, clock: Callable[[], float] = time.time):
        self.cfg, self.version, self.clock = cfg, version, clock
        self.window = Window()
        self.step = 0
        self.phase: Phase = "shadow" if cfg.shadow is not None else "canary"
        self.decisions: list[Decision] = []
        self._decide("start", "shadow from the first request" if self.phase == "shadow" else "canary from the first request")

    @property
    def share(self) -> float:
        return self.cfg.canary.shares()[self.step] if self.phase == "canary" else 0.0

    @property
    def shadowing(self) -> bool:
        """The shadow queue runs in the shadow phase (and in a shadow-only rollout until it is judged)."""
        return self.phase == "shadow"

    @property
    def done(self) -> bool:
        return self.phase in ("promoted", "rolled_back")

    def observe(self, window: Window) -> Decision | None:
        """A router's window: added; an error rate already past what `min_requests` calls allow rolls back now."""
        if self.done:
            return None
        self.window.add(window)
        g, w = self.cfg.guards, self.window
        if w.errors["candidate"] > g.max_error_rate * max(g.min_requests, w.calls["candidate"]):
            return self._rollback(f"error rate {w.errors['candidate']}/{w.calls['candidate']} over {g.max_error_rate}")
        return None

    def tick(self) -> Decision | None:
        """The guards on the window since the last decision: a breach rolls back; a judged healthy window steps up
        (shadow -> canary's first share -> ... -> promote); too few calls yet: nothing."""
        if self.done:
            return None
        breach = self.breach()
        if breach:
            return self._rollback(breach)
        if not self.judged():
            return None
        if self.phase == "shadow":
            if self.cfg.canary is None:  # shadow alone: judged healthy, nothing more to do but say so
                return self._decide("promote", "shadow healthy; no canary configured", phase="promoted")
            self.phase, self.step = "canary", 0
            return self._decide("step", "shadow healthy")
        if self.step + 1 < len(self.cfg.canary.shares()):
            self.step += 1
            return self._decide("step", "window healthy")
        if not self.cfg.canary.promote_alias:  # healthy at max share, nothing to move: a person decides
            return None
        return self._decide("promote", f"healthy at max share; alias {self.cfg.canary.promote_alias} moves",
                            phase="promoted")

    def judged(self) -> bool:
        g, w = self.cfg.guards, self.window
        return w.calls["candidate"] >= g.min_requests and len(w.taus) >= g.min_requests

    def breach(self) -> str | None:
        """The first guard the window breaks, said with its figures; None while healthy or too small to judge."""
        g, w = self.cfg.guards, self.window
        if not self.judged():
            return None
        calls = w.calls["candidate"]
        if w.errors["candidate"] > g.max_error_rate * calls:
            return f"error rate {w.errors['candidate']}/{calls} over {g.max_error_rate}"
        latency = [(50, g.max_p50_ratio, g.p50_slack_ms, g.min_requests), (99, g.max_p99_ratio, g.p99_slack_ms,
                                                                            g.p99_min_calls)]
        for q, ratio, slack, least in latency if self.phase == "canary" else []:  # `Guards`: in the canary only
            cand, champ = w.quantile("candidate", q), w.quantile("champion", q)
            judged = min(len(w.latency_ms["candidate"]), len(w.latency_ms["champion"])) >= least
            if judged and cand > ratio * champ + slack:
                return f"p{q} {cand:.1f} ms over {ratio} x the champion's {champ:.1f} ms + {slack} ms"
        tau = float(np.mean(w.taus))
        if tau < g.min_agreement:
            return f"agreement with the champion (Kendall tau) {tau:.3f} under {g.min_agreement}"
        return None

    def _rollback(self, reason: str) -> Decision:
        return self._decide("rollback", reason, phase="rolled_back")

    def _decide(self, action: str, reason: str, phase: Phase | None = None) -> Decision:
        summary = self.window.summary()
        if phase is not None:
            self.phase = phase
        self.window = Window()
        decision = Decision(self.clock(), self.cfg.candidate, self.version, action, self.phase, self.share, reason, summary)
        self.decisions.append(decision)
        return decision

    def state(self) -> dict:
        """What a router needs: the phase, the candidate's answer share, whether to shadow, the version."""
        return {"phase": self.phase, "share": self.share, "shadowing": self.shadowing, "version": self.version,
                "candidate": self.cfg.candidate, "decisions": len(self.decisions)}


# a router's state while no rollout runs (none configured, or the candidate is the champion)
NO_ROLLOUT = {"phase": "none", "share": 0.0, "shadowing": False, "version": None}


def registry_version(uri: str) -> tuple[str, str]:
    """`models:/NAME/VERSION` -> (NAME, VERSION): what a promotion moves an alias to."""
    m = _REGISTRY_NAME.match(uri)
    if m is None or not m["version"] or not uri.startswith("models:/"):
        raise ValueError(f"{uri!r} is not a registered model version (models:/NAME/VERSION): nothing to promote")
    return m["name"], m["version"]


def write_decision(path: str | Path, decision: Decision) -> None:
    """Appends a decision to the rollout log (JSON lines; one write, so rows never interleave)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(dataclasses.asdict(decision)) + "\n")


def read_decisions(path: str | Path) -> list[Decision]:
    """The rollout log's rows, oldest first (a torn last line, from a crash mid-write, is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(Decision(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return out


def status_table(decisions: Sequence[Decision]) -> str:
    """`hllm rollout status`: each decision as a row a person reads, and where each candidate stands now."""
    if not decisions:
        return "no rollout decisions yet"
    rows = ["time                 candidate -> version                      action    phase        share  reason"]
    for d in decisions:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.time))
        rows.append(f"{stamp}  {d.candidate} -> {d.version:<28} {d.action:<9} {d.phase:<12} {d.share:5.2f}  {d.reason}")
    latest: dict[str, Decision] = {}
    for d in decisions:
        latest[d.version] = d
    rows.append("")
    rows += [f"now: {v} {d.phase} (share {d.share:.2f}) since {time.strftime('%H:%M:%S', time.gmtime(d.time))}"
             for v, d in latest.items()]
    return "\n".join(rows)
