"""HTTP schemas, compatible with the Cohere v2 / Jina / vLLM rerank API, plus hLLM extensions."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr


def _json_integer(value):
    """JSON Schema's integer: 3 and 3.0, never "3", true or 3.5 (pydantic's lax int takes the first two wrong)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("Input should be a valid integer")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError("Input should be a valid integer, got a number with a fractional part")
    return int(value)


PositiveJsonInt = Annotated[int, Field(ge=1), BeforeValidator(_json_integer)]


class DocumentObject(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: StrictStr


class RerankBody(BaseModel):
    """Cohere v2 / vLLM rerank request. Types are strict: `"return_documents": 0` or `"top_n": "3"` is a 422."""

    model: StrictStr | None = None
    query: StrictStr = Field(min_length=1)
    documents: list[StrictStr | DocumentObject] = Field(min_length=1)
    # the best top_n results; above the number of documents, all of them (as Cohere and vLLM); < 1 is a 422
    top_n: PositiveJsonInt | None = None
    return_documents: StrictBool = False
    # Cohere's per-document token cap: documents are cut to min(this, the model's budget), cuts counted in usage
    max_tokens_per_doc: PositiveJsonInt | None = None
    decoder: Literal["hungarian", "sort", "expected_position", "greedy", "argmax_repair"] | None = None  # extension
    # TEI's name: relevance_score is the uncalibrated decoder score (strictly decreasing, not a probability)
    raw_scores: StrictBool = False
    # extension: true declares that `documents` come as a first-stage ranking, best first (a retriever's order), which
    # the model's first-stage prior may then read; false (the Cohere/Jina contract): `documents` is a set, ranked by
    # its text alone, and nothing in the answer leans on the order it arrived in (confidence.agreement is null)
    first_stage_order: StrictBool = False

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ErrorBody(BaseModel):
    detail: str


class ModelNotFoundBody(BaseModel):
    """A 404 for an unknown `model`: Cohere's error shape (`message`), FastAPI's (`detail`), and the names served."""

    message: str
    detail: str
    known_models: list[str]


class ValidationErrorBody(BaseModel):
    """A 422: FastAPI's list of schema errors, or one message (more documents than `maxItems`)."""

    detail: str | list[dict[str, Any]]


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    truncated_documents: int = 0  # documents cut to the per-document token budget
    query_truncated: bool = False


class ResultDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    # calibrated P(relevant) in [0, 1], non-increasing along the results, for a calibrated model and
    # raw_scores false; otherwise the decoder's score (strictly decreasing, rank-derived)
    relevance_score: float
    rank: int  # extension: 1-based position in the ranking
    document: ResultDocument | None = None


class Meta(BaseModel):
    decoder: str
    timings_ms: dict[str, float]
    batch_size: int  # requests that shared this forward pass
    windows: int = 1  # prefills this request took (more than one: a list longer than the window)
    calibrated: bool = False  # relevance_score is a calibrated probability
    unknown_token_share: float = 0.0  # share of the query's and documents' tokens outside the vocabulary
    warnings: list[str] = []
    model_version: str | None = None  # which model answered: models:/NAME/VERSION, a run URI, or folder#hash
    # the model's domain-guard trust in this request (hllm.model.heads.DomainGuard): 1 its own ranking, below 1 it
    # leans toward the first-stage (input) order, 0 the input order (with first_stage_order declared; otherwise there
    # is no order to lean toward, and trust only says how unlike the training data the request is); absent for a
    # model without a guard
    trust: float | None = None
    # how sure the single pass was, read off the same matrix (hllm.model.confidence, each higher = surer): the
    # assignment's margin over its best one-move alternative in the top 10, the top positions' sharpness, the
    # share of the top 10 the first stage also has there (null unless first_stage_order was declared), the guard's
    # trust (1 without a guard)
    confidence: dict[str, float | None] | None = None
    first_stage_order: bool = False  # the request declared its documents a first-stage ranking (the prior read it)
    # the online cascade (deployments with args.cascade): who answered — student, teacher, or the student after the
    # teacher missed the deadline / failed / while its circuit breaker is open / with its slots busy
    # (student_after_teacher_timeout, student_after_teacher_error, student_breaker_open, student_teacher_busy) —
    # and whether the request was escalated (its confidence below the threshold); timings_ms.teacher: the wait on it
    answered_by: str | None = None
    escalated: bool | None = None
    # a many-student app with a rollout (docs/rollout.md): which arm answered — champion, candidate (the canary), or
    # champion_after_candidate_error (the canary's call failed and the champion answered instead)
    rollout_arm: str | None = None


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: Usage
    results: list[RerankResult]
    meta: Meta


class ModelCard(BaseModel):
    id: str
    model_version: str | None = None  # what answers now: models:/NAME/VERSION, a run URI, or folder#hash
    object: Literal["model"] = "model"
    owned_by: str = "hllm"
    max_documents: int  # per request
    positions: int | None = None  # K, the head's rank positions (GET /v1/models/{id} of a many-student app)
    window: int | None = None  # longer requests are ranked in windows of this many documents
    base_model: str | None = None
    training_data: dict | str | None = None  # source, path, top_n, train slates and queries
    vocabulary: str | None = None
    relevance_score: str | None = None  # what the score means (rank-derived or calibrated)
    calibration: dict | None = None  # how relevance_score was calibrated: held-out slates, items, relevant
    card: dict = {}  # the whole saved model card
    model_uri: str | None = None  # a many-student app: the model as configured (an alias, a folder, ...)
    role: str | None = None  # a many-student app: "default", or the rollout's candidate and its phase


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
