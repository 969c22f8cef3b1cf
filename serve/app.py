"""Ray Serve reranking API: one prefill + head + decoder per request, batched across requests.

    hllm serve runs/default/student                # or a shipped name, runs:/RUN_ID/student, models:/NAME@ALIAS
    serve run serve/config.yaml                    # or: serve deploy serve/config.yaml

`POST /v1/rerank` (also `/rerank`, `/v2/rerank`) speaks the Cohere v2 / Jina / vLLM rerank schema;
`GET /healthz`, `GET /v1/models`, OpenAPI at `/docs`. Requests that arrive together share one
forward pass (`@serve.batch`; size and wait set through `user_config`). Bad input is a 4xx with a
message: never a 500. Set `HLLM_API_TOKEN` to require `Authorization: Bearer <token>`.
"""

import asyncio
import logging
import threading
import time

from fastapi import FastAPI
from fastapi.responses import Response
from ray import serve
from ray.serve import Application

from hllm.serving.cascade import Escalation, OnlineCascade
from hllm.uris import registry_alias
from serve.common import (ERRORS, AppArgs, Answerer, Failure, LimitsAndAuth, RerankMetrics, Served, error_response, escalated,
                          framework_errors, json_response, model_listing, model_id, pinned_model, replica_args, replica_name,
                          traffic_record)
from serve.schemas import ModelList, RerankBody, RerankResponse

logger = logging.getLogger("ray.serve")
api = FastAPI(title="hLLM rerank", version="1", description="Single-pass generative reranking")
api.add_middleware(LimitsAndAuth)
framework_errors(api)


@serve.deployment(name="Reranker", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=16)
@serve.ingress(api)
class RerankDeployment:
    """A replica wraps one `hllm.Reranker` (`Answerer`): encode per request, one batched forward pass, decode."""

    def __init__(self, args: dict):
        self.args = replica_args(args)
        self.cascade = OnlineCascade(self.args.cascade) if self.args.cascade is not None else None
        self.answerer = Answerer(self.args, self.cascade)
        self._opens_counted = 0  # the breaker's openings already counted in Prometheus
        self.served = self.answerer.load(pinned_model(self.args.model))
        api.state.max_body_bytes = self.args.max_body_bytes
        api.state.max_documents = self.args.max_documents
        self.metrics = RerankMetrics()
        self.traffic = None
        if self.args.traffic_log is not None:
            from hllm.data.traffic import TrafficLog

            self.traffic = TrafficLog(self.args.traffic_log, cut=lambda docs: self.served.reranker.cut_documents(docs),
                                      writer=replica_name())
        if self.args.alias_poll_s and registry_alias(self.args.model):
            threading.Thread(target=self._watch_alias, name="hllm-alias-watch", daemon=True).start()

    def _watch_alias(self) -> None:
        """Resolves `models:/NAME@ALIAS` every `alias_poll_s`; a new version is loaded here, off the
        request path, then swapped in with one assignment: requests in flight finish on the version
        they started with. A registry that cannot be reached leaves the serving version (counted)."""
        while True:
            time.sleep(self.args.alias_poll_s)
            try:
                uri = pinned_model(self.args.model)
                if model_id(uri) != self.served.model_id:
                    self.served = self.answerer.load(uri)
                    self.metrics.swaps.inc(tags={"outcome": "swapped"})
                    logger.info("serving %s (alias %s moved)", uri, self.args.model)
            except Exception as err:  # noqa: BLE001 (registry down, a bad version: keep serving, count, say)
                self.metrics.swaps.inc(tags={"outcome": "failed"})
                logger.warning("could not follow %s: %s; still serving %s", self.args.model, err, self.served.model_id)

    @property
    def reranker(self):
        return self.served.reranker

    def __del__(self):
        """Serve's graceful shutdown: the traffic log's buffer is written out."""
        if getattr(self, "traffic", None) is not None:
            self.traffic.close()

    def reconfigure(self, user_config: dict) -> None:
        self.answerer.reconfigure(user_config)

    async def _rerank(self, body: RerankBody) -> Response:
        t0 = time.perf_counter()
        served = self.served  # one model for the whole request, whatever a swap does meanwhile
        response = await self.answerer.answer(body, t0, served)
        if isinstance(response, Failure):
            self.metrics.record(response.status, 1000 * (time.perf_counter() - t0), len(body.documents))
            return error_response(response.status, response.message)
        escalation = None
        if self.cascade is not None:
            response, escalation = await self._cascade(response, body, served)
        ms = 1000 * (time.perf_counter() - t0)
        self.metrics.record(200, ms, len(body.documents), response.meta.batch_size, response.usage.prompt_tokens,
                            response.meta.windows)
        if self.traffic is not None:
            self._log(response, body, served, ms, escalation)
        return json_response(response)

    async def _cascade(self, response: RerankResponse, body: RerankBody, served: "Served"):
        """The online cascade: below the threshold, the teacher within the deadline (it never raises)."""
        meta = response.meta
        if not self.cascade.wants(meta.confidence, served.cascade_threshold):
            self.metrics.cascade.inc(tags={"answered_by": "student"})
            return response.model_copy(update={"meta": meta.model_copy(update={"answered_by": "student", "escalated": False})}), None
        e = await self.cascade.ask(body.query, body.texts())
        opened, self._opens_counted = self.cascade.breaker.opens - self._opens_counted, self.cascade.breaker.opens
        self.metrics.record_escalation(e, opened)
        if e.late is not None:
            t_ask = time.perf_counter() - (e.teacher_ms or 0.0) / 1000
            e.late.add_done_callback(lambda task: self._late(task, t_ask))
        return escalated(response, body, e), e

    def _late(self, task: "asyncio.Task", t_ask: float) -> None:
        """A teacher answer that missed the deadline, when it comes: its latency (or its failure's reason) counted."""
        if task.cancelled():
            return
        order, reason = task.result()
        if order is not None:
            self.metrics.teacher_latency.observe(1000 * (time.perf_counter() - t_ask))
        else:
            self.metrics.teacher_errors.inc(tags={"reason": reason or "unknown"})

    def _log(self, response: RerankResponse, body: RerankBody, served: "Served", ms: float, e: Escalation | None) -> None:
        """The traffic log's record, with the teacher's ranking: now, or (an answer still on its way past the
        deadline) when it comes, so the flywheel sees the teacher's label on exactly the queries escalated."""
        if e is None or e.late is None:
            self.traffic.append(traffic_record(response, body, served, ms, e.order if e is not None else None))
            return

        def append(task: "asyncio.Task") -> None:
            order = None if task.cancelled() else task.result()[0]
            self.traffic.append(traffic_record(response, body, served, ms, order))

        e.late.add_done_callback(append)

    @api.post("/v1/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ERRORS)
    async def rerank_v1(self, body: RerankBody):
        return await self._rerank(body)

    @api.post("/v2/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ERRORS)
    async def rerank_v2(self, body: RerankBody):
        return await self._rerank(body)

    @api.post("/rerank", response_model=RerankResponse, response_model_exclude_none=True, responses=ERRORS)
    async def rerank(self, body: RerankBody):
        return await self._rerank(body)

    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models", response_model=ModelList)
    async def models(self) -> ModelList:
        return ModelList(data=[model_listing(self.args.model_name, self.served, self.args)])


def app_builder(args: dict) -> Application:
    """The typed builder `serve run/deploy` calls with the YAML's `args`."""
    parsed = AppArgs(**args)
    if parsed.students is not None:
        from serve.students import students_app

        return students_app(parsed)
    return RerankDeployment.bind(parsed.model_dump())


if __name__ == "__main__":  # the one command that serves: `hllm serve` (serve/launch.py)
    from serve.launch import main

    raise SystemExit(main())
