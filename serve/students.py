"""Many students behind one endpoint: routing by the request's `model`, Serve model multiplexing, shadow and canary.

    serve run serve/students.yaml        # args.students: {name: model, ...}; args.rollout: shadow / canary (optional)

Three deployments, four with a rollout (`students_app`), built from the same `serve.common.AppArgs` as the one-student
app:

- `Router` (the HTTP ingress; light, any number of replicas): reads `model` from the body, resolves it to one immutable
  model (`hllm.serving.rollout.ModelCatalog`: an alias pinned to its version), picks the canary's arm (sticky), calls
  `Students` with `handle.options(multiplexed_model_id=<that model>)`, and answers. Off the response path it hands
  the shadow's and the canary's pairs to a bounded queue (a full queue drops, counted; it never waits), ranks them
  with the other model, and records their agreement (Kendall tau, top-10 overlap), latencies and errors in Prometheus,
  the traffic log and the rollout window it sends to `Rollout` every `rollout.report_s`.
- `Students` (the models; `@serve.multiplexed`): at most `max_models_per_replica` students a replica, least recently
  used evicted; Serve's router prefers a replica that holds the requested model. Each answer is `serve.common.Answerer`'s,
  as in the one-student app; a batch holds one forward pass per model, never a mixed one.
- `Rollout` (one replica): the candidate's `hllm.serving.rollout.Rollout` — warm-up, shadow, canary steps, rollback on
  a guard, promotion (the registry alias moved) — each decision a log line, a metric and a row of `rollout.log_path`.
- `Shadows` (with a rollout): Students replicas of their own, at a lower CPU priority, for the calls off the response
  path (the shadow, the champion beside a canary answer): a replica runs one forward pass at a time, so a shadow's
  pass on an answering replica would hold a user's request behind it.

A canary call that fails is answered by the champion (counted as the candidate's error): the canary never fails a user's
request. The single-student app (`serve.app.RerankDeployment`) keeps its one-hop path: nothing here touches it.
"""

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from hllm.serving.rollout import (NO_ROLLOUT, Decision, ModelCatalog, Rollout, RolloutConfig, Route, UnknownModel,
                                  Window, pair_agreement, registry_version, write_decision)
from hllm.data.splits import unit_hash
from hllm.uris import registry_alias
from serve.common import (ERRORS, AppArgs, Answerer, Failure, LimitsAndAuth, error_response, framework_errors, json_response,
                          model_listing, replica_args, replica_name)
from serve.schemas import ModelCard, ModelList, ModelNotFoundBody, RerankBody, RerankResponse, ResultDocument

logger = logging.getLogger("ray.serve")


def _pin(uri: str) -> str:
    from pipelines.registry import pin

    return pin(uri)


def catalog_for(args: AppArgs) -> ModelCatalog:
    """The app's students as a catalog; aliases pinned through the MLflow registry."""
    needs_registry = any(registry_alias(u) for u in args.students.values())
    return ModelCatalog(args.students, args.default_student, pin=_pin if needs_registry else None,
                        pin_ttl_s=args.alias_poll_s or 15.0)


def serving_ms(timings: dict[str, float], call_ms: float) -> float:
    """What a student's answer cost, as the rollout's latency guard compares it: tokenize + its model's forward pass +
    decode inside the Students replica. Not the routing queue, a batch's other models' passes or a cold load: at a
    canary's small share the candidate sits on fewer replicas than the champion and queues more — that is placement,
    not the model (measured: same-size candidates judged end to end breached p99 at 2x). A windowed answer: its total."""
    if "forward_batch" in timings:
        return timings.get("tokenize", 0.0) + timings["forward_batch"] + timings.get("decode", 0.0)
    return timings.get("total", call_ms)


@dataclass
class Answered:
    """What `Students.answer` returns: the full ranking (every document, no texts) and the model's key."""

    response: RerankResponse
    model_key: str


# how much lower than the answering replicas the Shadows pool runs (Ray's workers start at nice 15; +4 is 19, the
# lowest: on a shared CPU the kernel then gives an answering replica ~2.4x the Shadows pool's share)
BACKGROUND_NICE = 4


@serve.deployment(name="Students", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=16)
class Students:
    """A replica holds up to `max_models_per_replica` students (`@serve.multiplexed`, LRU); it answers a request with
    the student its multiplexed model id names."""

    def __init__(self, args: dict, background: bool = False):
        self.args = replica_args(args)
        if background:  # the Shadows pool: on a shared node the OS gives the answering replicas the CPU first
            os.nice(BACKGROUND_NICE)
        self.answerer = Answerer(self.args)
        self.loads: list[dict] = []  # every load: model, seconds (for the benchmark and the tests)
        # wired at init (max_num_models_per_replica comes from the args), on a plain function: Serve keeps its LRU
        # wrapper on the function object and detects multiplexing on instance attributes (ray.serve._private.utils)
        async def load(model: str):
            return await self._load(model)

        self._loader = load
        self._get = serve.multiplexed(max_num_models_per_replica=self.args.max_models_per_replica)(load)

    def _load_and_run(self, model: str):
        """Loads a student and runs it once: its first request's one-off costs (allocations at new shapes, lazy
        initialisation) are paid here, not by a user's request (they were 100 ms on a 16 ms model)."""
        served = self.answerer.load(model)
        served.reranker.score_with_trust([served.reranker.encode("warm-up", ["a warm-up document", "another one"])])
        return served

    async def _load(self, model: str):
        t0 = time.perf_counter()
        served = await asyncio.to_thread(self._load_and_run, model)  # off the loop: other students keep answering
        self.loads.append({"model": model, "seconds": round(time.perf_counter() - t0, 3), "replica": replica_name()})
        logger.info("loaded student %s in %.1f s", model, time.perf_counter() - t0)
        return served

    def reconfigure(self, user_config: dict) -> None:
        self.answerer.reconfigure(user_config)

    async def answer(self, body: RerankBody) -> Answered | Failure:
        t0 = time.perf_counter()
        served = await self._get(serve.get_multiplexed_model_id())
        waited = 1000 * (time.perf_counter() - t0)  # a held student: microseconds; else its load (or a wait on it)
        out = await self.answerer.answer(body, time.perf_counter(), served)
        if isinstance(out, Failure):
            return out
        if waited > 1.0:
            out.meta.timings_ms["load"] = round(waited, 3)
        return Answered(out, served.model_key)

    async def warm(self) -> float:
        """Loads the student this call names and ranks one small request with it (before a rollout sends it users:
        their first answers should not pay its load) -> seconds."""
        t0 = time.perf_counter()
        out = await self.answer(RerankBody(query="warm-up", documents=["a warm-up document", "another one"]))
        if isinstance(out, Failure):
            raise RuntimeError(f"warm-up refused: {out.status} {out.message}")
        return time.perf_counter() - t0

    async def card(self, name: str) -> ModelCard:
        return model_listing(name, await self._get(serve.get_multiplexed_model_id()), self.args)

    async def held(self) -> dict:
        """This replica's loaded students (most recently used last) and its load history."""
        wrapper = getattr(self._loader, "__serve_multiplex_wrapper", None)  # Serve's LRU (an OrderedDict, oldest first)
        models = list(wrapper.models) if wrapper is not None else []
        return {"replica": replica_name(), "models": models, "loads": self.loads}


# ------------------------------------------------------------------------------------------------ the rollout


@serve.deployment(name="Rollout", num_replicas=1, ray_actor_options={"num_cpus": 0})
class RolloutController:
    """The one place a rollout is decided: routers send their windows, it runs `hllm.serving.rollout.Rollout`, moves
    the registry alias on promotion, and starts a new rollout when the candidate's alias moves to a new version."""

    def __init__(self, args: dict, students: DeploymentHandle, shadows: DeploymentHandle):
        from ray.serve import metrics

        self.args, self.students, self.shadows = replica_args(args, threads=False), students, shadows
        self.cfg: RolloutConfig = self.args.rollout
        self.catalog = catalog_for(self.args)
        self.rollout: Rollout | None = None
        self.history: list[Decision] = []  # every decision of every rollout this controller ran (the last 1,000)
        self.errors = 0
        self._loop: asyncio.Task | None = None
        self._following = asyncio.Lock()
        self.decisions = metrics.Counter("hllm_rollout_decisions", description="rollout decisions, by action "
                                         "(start, step, rollback, promote) and reason's guard", tag_keys=("action",))
        self.share = metrics.Gauge("hllm_rollout_share", description="the candidate's share of answers now")

    async def _candidate(self) -> Route:
        return await asyncio.to_thread(self.catalog.resolve, self.cfg.candidate)

    async def _follow(self) -> None:
        """(Re)starts the rollout when the candidate resolves to a version it has not rolled out yet. The candidate is
        warmed first (loaded and run once on a Students replica): users never pay its cold load, and one that cannot
        load is a failed call — the error-rate guard rolls it back before any user is sent to it."""
        async with self._following:  # one warm-up at a time, however many routers report meanwhile
            route = await self._candidate()
            champion = await asyncio.to_thread(self.catalog.resolve, None)
            if self.rollout is not None and self.rollout.version == route.uri:
                return
            if route.uri == champion.uri:  # the candidate is the champion already: nothing to roll out
                return
            warm = Window()
            try:  # on both pools: the canary answers on Students, the shadow and the canary's pairs run on Shadows
                seconds = [await pool.options(multiplexed_model_id=route.uri).warm.remote()
                           for pool in (self.students, self.shadows)]
                logger.info("rollout: %s warmed in %.1f s", route.uri, sum(seconds))
            except Exception as err:  # noqa: BLE001 (a candidate that cannot load or answer: a failed call, judged)
                logger.warning("rollout: warming %s failed: %s", route.uri, str(err).splitlines()[-1][:300])
                warm.record("candidate", None, ok=False)
            self.rollout = Rollout(self.cfg, route.uri)
            self._apply(self.rollout.decisions[-1])
            decision = self.rollout.observe(warm) if warm.calls["candidate"] else None
            if decision is not None:
                await self._act(decision)

    async def report(self, windows: dict[str, dict]) -> dict:
        """A router's windows (by the candidate version its requests were routed under) -> the rollout's state. Only
        the current candidate's window counts; the others (requests routed under an earlier rollout) are dropped."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._ticks())
        try:
            await self._follow()
        except Exception as err:  # noqa: BLE001 (registry unreachable: the rollout goes on as it was)
            self.errors += 1
            logger.warning("rollout: could not resolve %s (%s)", self.cfg.candidate, err)
        if self.rollout is None:
            return dict(NO_ROLLOUT)
        window = windows.get(self.rollout.version)
        decision = self.rollout.observe(Window.from_dict(window)) if window else None
        if decision is not None:
            await self._act(decision)
        return self.rollout.state()

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            if self.rollout is not None:
                decision = self.rollout.tick()
                if decision is not None:
                    await self._act(decision)

    async def _act(self, decision: Decision) -> None:
        if decision.action == "promote" and self.cfg.canary is not None and self.cfg.canary.promote_alias:
            from pipelines.registry import promote

            try:
                name, version = registry_version(self.rollout.version)
            except ValueError as err:  # a folder candidate: healthy, but no alias to move (said, and the row says so)
                logger.warning("rollout: %s", err)
                decision = dataclasses.replace(decision, reason=f"{decision.reason}; not moved: {err}")
            else:
                await asyncio.to_thread(promote, name, version, self.cfg.canary.promote_alias)
                self.catalog.forget(f"models:/{name}@{self.cfg.canary.promote_alias}")
        self._apply(decision)

    def _apply(self, decision: Decision) -> None:
        self.history = (self.history + [decision])[-1000:]
        logger.info(decision.line())
        self.decisions.inc(tags={"action": decision.action})
        self.share.set(decision.share)
        if self.cfg.log_path:
            write_decision(self.cfg.log_path, decision)

    async def status(self) -> dict:
        return {"state": None if self.rollout is None else self.rollout.state(),
                "decisions": [dataclasses.asdict(d) for d in self.history],
                "registry_errors": self.errors}


# ------------------------------------------------------------------------------------------------ the router
# (no `from __future__ import annotations` in this module: FastAPI reads the routes' annotations as types)

router_api = FastAPI(title="hLLM rerank (many students)", version="1",
                     description="Single-pass generative reranking; a request's `model` picks the student")
router_api.add_middleware(LimitsAndAuth)
# a path no route matches (e.g. /v1/models/ with no name) is a 404 in the shape the model routes document
framework_errors(router_api, lambda app, message: {"message": message, "detail": message,
                                                   "known_models": getattr(app.state, "known_models", [])})
ROUTER_ERRORS = {**ERRORS, 404: {"model": ModelNotFoundBody, "description": "The request's `model` is not served here "
                                 "(the body lists the names it knows; GET /v1/models lists them too).",
                                 "content": {"application/json": {"example": {
                                     "message": "model 'x' is not served here; known: default, other",
                                     "known_models": ["default", "other"]}}}}}


class RouterMetrics:
    """The router's figures, labelled by the model version that answered."""

    def __init__(self):
        from ray.serve import metrics

        self.requests = metrics.Counter("hllm_routed_requests", description="rerank requests by the model version that "
                                        "answered, the rollout arm and the status", tag_keys=("model", "arm", "status"))
        self.latency = metrics.Histogram("hllm_routed_latency_ms", description="time in the router per request (ms), "
                                         "by model version", boundaries=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000],
                                         tag_keys=("model",))
        self.shadow = metrics.Counter("hllm_shadow_pairs", description="pairs ranked off the response path (shadow, "
                                      "or the champion beside a canary answer), by outcome (ok, error, dropped)",
                                      tag_keys=("outcome",))
        # Ray's histograms take positive bounds only: 1 - Kendall tau (0 the same ranking, 2 turned round)
        self.disagreement = metrics.Histogram("hllm_shadow_disagreement", description="1 - Kendall tau between the "
                                              "champion's and the candidate's ranking of one request (0: the same)",
                                              boundaries=[0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0])
        self.overlap = metrics.Histogram("hllm_shadow_top10_overlap", description="share of the champion's top 10 "
                                         "in the candidate's top 10", boundaries=[0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.99])
        self.loads = metrics.Counter("hllm_student_loads", description="calls that waited on a student's cold load "
                                     "(a Students replica that did not hold it)", tag_keys=("model",))
        self.shadow_latency = metrics.Histogram("hllm_shadow_latency_ms", description="the other model's call, off "
                                                "the response path (ms)", boundaries=[5, 10, 20, 50, 100, 200, 500,
                                                                                     1000, 5000])


@dataclass
class Pair:
    """A request to rank again with the other arm, off the response path."""

    body: RerankBody
    answered: RerankResponse  # what the user got (full ranking)
    arm: str  # who answered: champion (shadowed by the candidate) or candidate (the canary; the champion ranks it)
    version: str  # the candidate version the request was routed under (its rollout's window)
    other: str  # the model to ask
    log: object  # the traffic record to complete, or None


@serve.deployment(name="Router", ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)
@serve.ingress(router_api)
class Router:
    """The ingress of a many-student app: resolve `model`, pick the arm, call `Students`, answer; shadow off-path."""

    def __init__(self, args: dict, students: DeploymentHandle, controller: DeploymentHandle | None = None,
                 shadows: DeploymentHandle | None = None):
        self.args = replica_args(args, threads=False)
        self.catalog = catalog_for(self.args)
        self.students, self.controller, self.shadows = students, controller, shadows
        self.rollout: RolloutConfig | None = self.args.rollout
        self.state: dict = dict(NO_ROLLOUT)
        self.windows: dict[str, Window] = {}  # what this replica saw since its last report, by candidate version
        self.metrics = RouterMetrics()
        self.dropped = 0
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        router_api.state.max_body_bytes = self.args.max_body_bytes
        router_api.state.max_documents = self.args.max_documents
        router_api.state.known_models = self.catalog.names()
        self.traffic = None
        if self.args.traffic_log is not None:
            from hllm.data.traffic import TrafficLog

            self.traffic = TrafficLog(self.args.traffic_log, writer=replica_name())
        try:  # the reporter starts with the replica: a rollout begins (warm-up, shadow) before the first request
            asyncio.get_running_loop()
            self._start()
        except RuntimeError:  # constructed off the replica's loop: started by the first health check or request
            pass

    def __del__(self):
        if getattr(self, "traffic", None) is not None:
            self.traffic.close()

    async def check_health(self) -> None:
        """Serve's periodic health check: also starts the reporter if the constructor could not."""
        self._start()

    def _start(self) -> None:
        """The shadow workers and the reporter, on the replica's loop."""
        if self._queue is not None or self.rollout is None:
            return
        shadow = self.rollout.shadow
        self._queue = asyncio.Queue(maxsize=shadow.queue if shadow else 64)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._pairs()) for _ in range(shadow.workers if shadow else 2)]
        self._tasks.append(loop.create_task(self._report()))

    # ---- the request path

    async def _rerank(self, body: RerankBody, request: Request) -> Response:
        t0 = time.perf_counter()
        self._start()
        try:
            route = self.catalog.resolve(body.model)
        except UnknownModel as err:
            return JSONResponse(status_code=404, content={"message": str(err), "detail": str(err),
                                                          "known_models": err.known})
        except Exception as err:  # noqa: BLE001 (the registry cannot pin an alias and never has: 503, said)
            return error_response(503, f"model {body.model!r} cannot be resolved now: {err}")
        arm, champion_route, version = "", route, self.state["version"]  # the rollout this request belongs to
        if self.rollout is not None and route.name == self.catalog.default and version:
            arm = "champion"
            if self.state["share"] > 0 and unit_hash(f"{version}:{self._sticky_key(body, request)}") < self.state["share"]:
                arm, route = "candidate", Route(self.rollout.candidate, version)
        full = body.model_copy(update={"top_n": None, "return_documents": False})
        answered, ms = await self._ask(route.uri, full)
        if arm == "candidate":  # a refusal (4xx: the request's fault) is an answer; a failed call is the candidate's
            self._window(version).record("candidate", ms, ok=answered is not None)
            if answered is None:  # the canary never fails a user: the champion answers
                self.metrics.requests.inc(tags={"model": route.uri, "arm": arm, "status": "error"})
                arm, route = "champion_after_candidate_error", champion_route
                answered, ms = await self._ask(route.uri, full)
        elif arm == "champion":
            self._window(version).record("champion", ms, ok=answered is not None)
        if isinstance(answered, Failure):
            self.metrics.requests.inc(tags={"model": route.uri, "arm": arm, "status": str(answered.status)})
            return error_response(answered.status, answered.message)
        if answered is None:
            self.metrics.requests.inc(tags={"model": route.uri, "arm": arm, "status": "503"})
            return error_response(503, f"student {route.name!r} ({route.uri}) could not answer; try again")
        response = self._shaped(answered.response, body, route, arm)
        total = 1000 * (time.perf_counter() - t0)
        self.metrics.requests.inc(tags={"model": answered.response.meta.model_version or route.uri, "arm": arm,
                                        "status": "200"})
        self.metrics.latency.observe(total, tags={"model": answered.response.meta.model_version or route.uri})
        record = self._record(answered, body, arm, total) if self.traffic is not None else None
        pair = self._pair(body, answered.response, arm, champion_route, version, record)
        if pair is None and record is not None:
            self.traffic.append(record)
        return json_response(response)

    def _sticky_key(self, body: RerankBody, request: Request) -> str:
        sticky = self.rollout.canary.sticky_by if self.rollout.canary else "query"
        if sticky.startswith("header:"):
            value = request.headers.get(sticky.removeprefix("header:"))
            if value:
                return "h:" + value
        return "q:" + body.query

    async def _ask(self, uri: str, body: RerankBody, pool: DeploymentHandle | None = None):
        """One call to the student `uri` -> (its answer, a Failure, or None when the call itself failed; the ms the
        rollout judges: `serving_ms`). A cold load on the way is counted apart (`hllm_student_loads`)."""
        t = time.perf_counter()
        try:
            out = await (pool or self.students).options(multiplexed_model_id=uri).answer.remote(body)
        except Exception as err:  # noqa: BLE001 (a replica died, a model would not load: counted by the caller, said)
            logger.warning("student %s failed: %s", uri, str(err).splitlines()[-1][:300])
            out = None
        ms = 1000 * (time.perf_counter() - t)
        if not isinstance(out, Answered):
            return out, ms
        timings = out.response.meta.timings_ms
        if timings.get("load"):
            self.metrics.loads.inc(tags={"model": uri})
        return out, serving_ms(timings, ms)

    def _shaped(self, full: RerankResponse, body: RerankBody, route: Route, arm: str) -> RerankResponse:
        """The full answer cut to what the request asked: top_n, the documents' texts; `model` as it was named."""
        texts = body.texts()
        results = full.results[: body.top_n or len(full.results)]
        if body.return_documents:
            results = [r.model_copy(update={"document": ResultDocument(text=texts[r.index])}) for r in results]
        meta = full.meta.model_copy(update={"rollout_arm": arm or None})
        return full.model_copy(update={"results": results, "model": body.model or route.name, "meta": meta})

    # ---- off the response path

    def _pair(self, body: RerankBody, answered: RerankResponse, arm: str, champion: Route, version: str | None,
              record) -> Pair | None:
        """Queues the request for the other arm where the rollout wants it: never waits, a full queue drops."""
        if self._queue is None or not version:
            return None
        if arm == "champion" and self.state["shadowing"] and self.rollout.shadow is not None \
                and unit_hash(f"shadow:{answered.id}") < self.rollout.shadow.share:
            pair = Pair(body, answered, arm, version, version, record)
        elif arm == "candidate":
            pair = Pair(body, answered, arm, version, champion.uri, record)
        else:
            return None
        try:
            self._queue.put_nowait(pair)
        except asyncio.QueueFull:
            self.dropped += 1
            self.metrics.shadow.inc(tags={"outcome": "dropped"})
            return None
        return pair

    async def _pairs(self) -> None:
        timeout = self.rollout.shadow.timeout_s if self.rollout.shadow else 30.0
        while True:
            pair: Pair = await self._queue.get()
            try:
                await self._rank_pair(pair, timeout)
            except Exception as err:  # noqa: BLE001 (a worker must outlive anything a pair does: counted, said)
                logger.warning("shadow pair failed unexpectedly: %s", err)
                self.metrics.shadow.inc(tags={"outcome": "error"})

    async def _rank_pair(self, pair: Pair, timeout: float) -> None:
        try:
            other, ms = await asyncio.wait_for(self._ask(pair.other, pair.body, self.shadows), timeout)
        except asyncio.TimeoutError:
            other, ms = None, 1000 * timeout
        ok = isinstance(other, Answered)
        if pair.arm == "champion":  # the shadow: the candidate's call is what is judged
            self._window(pair.version).record("candidate", ms, ok=ok)
        self.metrics.shadow.inc(tags={"outcome": "ok" if ok else "error"})
        fields = {"shadow_model": pair.other, "shadow_latency_ms": round(ms, 3)}
        if ok:
            mine = [r.index for r in pair.answered.results]
            theirs = [r.index for r in other.response.results]
            champion, candidate = (mine, theirs) if pair.arm == "champion" else (theirs, mine)
            tau, overlap = pair_agreement(champion, candidate)
            self._window(pair.version).pair(tau, overlap)
            self.metrics.disagreement.observe(1.0 - tau)
            self.metrics.overlap.observe(overlap)
            self.metrics.shadow_latency.observe(ms)
            fields |= {"shadow_order": theirs, "shadow_kendall_tau": tau, "shadow_top10_overlap": overlap}
        else:
            fields["shadow_error"] = "timeout" if other is None and ms >= 1000 * timeout else \
                (f"http_{other.status}" if isinstance(other, Failure) else "call_failed")
        if pair.log is not None:
            self.traffic.append(dataclasses.replace(pair.log, **fields))

    def _window(self, version: str) -> Window:
        return self.windows.setdefault(version, Window())

    async def _report(self) -> None:
        """Sends this replica's windows to the controller every `report_s` (each tagged with the candidate version its
        requests were routed under: a pair of a rolled-back candidate still in the queue never counts for the next),
        and takes the rollout's state back."""
        while True:
            await asyncio.sleep(self.rollout.report_s)
            windows, self.windows = self.windows, {}
            try:
                state = await self.controller.report.remote({v: w.to_dict() for v, w in windows.items()})
            except Exception as err:  # noqa: BLE001 (controller restarting: the windows are kept for the next report)
                logger.warning("rollout controller unreachable: %s", err)
                for v, w in windows.items():
                    self._window(v).add(w)
                continue
            if state["phase"] == "promoted" and self.state.get("phase") != "promoted":
                self.catalog.forget(self.args.students[self.catalog.default])  # the champion alias moved: re-pin now
            self.state = state

    def _record(self, answered: Answered, body: RerankBody, arm: str, ms: float):
        from hllm.data.traffic import TrafficRecord

        r = answered.response
        return TrafficRecord(request_id=r.id, time=time.time(), model=r.meta.model_version or "", model_key=answered.model_key,
                             query=body.query, documents=body.texts(), order=[x.index for x in r.results],
                             scores=[x.relevance_score for x in r.results], n=len(body.documents), latency_ms=ms,
                             unknown_token_share=r.meta.unknown_token_share, warnings=list(r.meta.warnings), arm=arm)

    # ---- routes

    @router_api.post("/v1/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ROUTER_ERRORS)
    async def rerank_v1(self, body: RerankBody, request: Request):
        return await self._rerank(body, request)

    @router_api.post("/v2/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ROUTER_ERRORS)
    async def rerank_v2(self, body: RerankBody, request: Request):
        return await self._rerank(body, request)

    @router_api.post("/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ROUTER_ERRORS)
    async def rerank(self, body: RerankBody, request: Request):
        return await self._rerank(body, request)

    @router_api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok"}

    @router_api.get("/v1/models", response_model=ModelList, response_model_exclude_none=True)
    async def models(self) -> ModelList:
        """Every student this app serves (OpenAI's list shape): its name, the version it resolves to now, its role."""
        data = []
        for name in self.args.students:
            try:
                uri = self.catalog.resolve(name).uri
            except Exception as err:  # noqa: BLE001 (an alias the registry cannot pin now: listed, said)
                uri = f"unresolved ({err})"
            role = "default" if name == self.catalog.default else None
            if self.rollout is not None and name == self.rollout.candidate:
                role = f"candidate ({self.state['phase']}, share {self.state['share']:.2f})"
            data.append(ModelCard(id=name, model_version=uri, max_documents=self.args.max_documents, role=role,
                                  model_uri=self.args.students[name]))
        return ModelList(data=data)

    @router_api.get("/v1/models/{name:path}", response_model=ModelCard, response_model_exclude_none=True,
                    responses={404: ROUTER_ERRORS[404]})
    async def model(self, name: str):
        """One student's whole card (loads it where no replica holds it)."""
        try:
            route = self.catalog.resolve(name)
        except UnknownModel as err:
            return JSONResponse(status_code=404, content={"message": str(err), "detail": str(err), "known_models": err.known})
        return await self.students.options(multiplexed_model_id=route.uri).card.remote(route.name)

    @router_api.get("/v1/rollout")
    async def rollout_status(self) -> dict:
        """The rollout's state and decisions (what `hllm rollout status --url` prints)."""
        self._start()
        if self.controller is None:
            return {"state": None, "decisions": [], "dropped": self.dropped}
        return {**await self.controller.status.remote(), "dropped_here": self.dropped}


def students_app(args: AppArgs, students_options: dict | None = None) -> Application:
    """Router -> Students (multiplexed) [+ Rollout, Shadows]: the many-student app `serve.app.app_builder` builds
    (`students_options`: Serve deployment options for Students from code; a config file sets them per deployment).
    With a rollout, the calls off the response path (the shadow, the champion beside a canary answer) go to Shadows:
    Students replicas of their own, at a lower CPU priority, so a shadow never queues a user's request behind it."""
    dumped = args.model_dump()
    students = Students.options(**(students_options or {})).bind(dumped)
    if args.rollout is None:
        return Router.bind(dumped, students)
    shadows = Students.options(name="Shadows", ray_actor_options={"num_cpus": 0.5}).bind(dumped, background=True)
    return Router.bind(dumped, students, RolloutController.bind(dumped, students, shadows), shadows)
