"""HTTP schemas, compatible with the Cohere v2 / Jina / vLLM rerank API, plus hLLM extensions."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DocumentObject(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str


class RerankBody(BaseModel):
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | DocumentObject] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    decoder: Literal["hungarian", "sort", "expected_position", "greedy", "argmax_repair"] | None = None  # extension

    @model_validator(mode="after")
    def _top_n_within_documents(self) -> "RerankBody":
        if self.top_n is not None and self.top_n > len(self.documents):
            raise ValueError(f"top_n={self.top_n} exceeds the {len(self.documents)} documents given")
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    truncated_documents: int = 0  # documents cut to the per-document token budget
    query_truncated: bool = False


class ResultDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    rank: int  # extension: 1-based position in the ranking
    document: ResultDocument | None = None


class Meta(BaseModel):
    decoder: str
    timings_ms: dict[str, float]
    batch_size: int  # requests that shared this forward pass
    windows: int = 1  # prefills this request took (more than one: a list longer than the window)


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: Usage
    results: list[RerankResult]
    meta: Meta


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "hllm"
    max_documents: int
    positions: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
