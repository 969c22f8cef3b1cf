"""The AR teacher behind any OpenAI-compatible server (`/v1/chat/completions`): vLLM, SGLang, TGI, Ray
Serve LLM, llama.cpp, or a hosted API. It stands where an `ARTeacher` stands (`rank`, `rank_summarized`,
`decoding`), so every stage that asks a teacher — the rankings stage in one process or on Ray Data's actor
pool, `hllm rerank`, the flywheel's labelling — asks the server through this one client.

    teacher = EndpointTeacher(EndpointConfig(url="http://gpu-host:8000/v1", model="castorini/rank_vicuna_7b_v1"),
                              PromptConfig(), TeacherConfig(window=20, stride=10, repair=True), cache_dir="runs/x/answers")
    rankings, figures = teacher.rank_summarized(slates)

What it does, per slate: the project's RankGPT prompt as chat messages (`hllm.model.prompts.prompt_messages`),
temperature 0, `max_tokens` sized from the window's answer; a list longer than `window` goes through the
windows of `hllm.model.windows` in sequence, each window seeing the previous one's result. All slates of a
call run at once (asyncio), at most `concurrency` requests in flight and `qps` request starts a second
(retries included). The answer is parsed by `hllm.teacher.parsing` (flags counted, `repair` as configured).

Paid for once: every answer that gave a permutation is kept in the answer cache (`cache_dir`, JSON lines keyed
by a hash of the model, the messages and the sampling settings), so a crash, a rerun or a second split with
the same slates asks nothing twice.

Nothing lost: the HTTP client is the `openai` SDK (timeouts; retries with exponential backoff that honour
`Retry-After`; 401/403 never retried). 401/403 stop the run at once (`EndpointAuthError`). A slate whose
retries run out (429, 5xx, timeout, connection) or whose answer has no ranking gets no permutation and a
`failure` reason (`FAILURE_REASONS`) with the error in `raw_text`; `FailureBudget` stops a split past
`max_failed_share`, naming the reason, the count and an example. The API key is read from the environment
variable the config names and is never written anywhere (configs, logs, errors: it is masked).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import hashlib
import json
import math
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from hllm.config import ConfigError
from hllm.model.prompts import PromptConfig, answer_chars, document_text, prompt_messages
from hllm.model.windows import WINDOWINGS, merge_counts, rank_with_windows
from hllm.records import ParseCounts, RerankRequest, TeacherRanking
from hllm.teacher.parsing import extract_ids, parse_ranking

# the figures of the call a request belongs to: the HTTP client's hooks count into it (one client may serve many calls)
_TALLY: contextvars.ContextVar["_Tally"] = contextvars.ContextVar("hllm_endpoint_tally")
FAILURE_REASONS = ("http_429", "http_5xx", "http_4xx", "timeout", "connection", "unparseable")
_ENV_REF = re.compile(r"^\$\{(\w+)\}$")


@dataclass
class EndpointConfig:
    """An OpenAI-compatible chat-completions server as the AR teacher."""

    url: str | None = None  # base URL ending in /v1 (e.g. http://host:8000/v1); None: no endpoint teacher
    model: str = ""  # the served model's name: sent with each request, part of the rankings' fingerprint
    api_key_env: str | None = None  # name of the environment variable holding the API key (the key is never in a config)
    headers: dict[str, str] = field(default_factory=dict)  # extra headers; a value "${VAR}" is read from the environment
    timeout_s: float = 60.0  # per attempt
    max_retries: int = 4  # per request, on 429 / 5xx / timeouts / connection errors (backoff, Retry-After honoured)
    concurrency: int = 8  # requests in flight (the whole job's: Ray divides it among the teacher actors)
    qps: float | None = None  # request starts per second, retries included (the whole job's); None: no cap
    max_tokens: int | None = None  # None: the window's full answer `[1] > ... > [n]` in characters, + 8
    schedule: Literal["per_query", "rounds"] = "per_query"  # windows: each query's chain on its own, or all queries a round at a time
    price_prompt_per_m: float | None = None  # price per million prompt tokens (cost in the figures)
    price_completion_per_m: float | None = None  # price per million completion tokens
    cache: bool = True  # keep answers (see the module docstring); false: ask every time

    def __post_init__(self) -> None:
        if self.url is None:
            return
        if not re.match(r"^https?://", self.url):
            raise ConfigError(f"teacher.endpoint.url {self.url!r}: expected an http(s) URL such as http://host:8000/v1")
        if not self.model:
            raise ConfigError("teacher.endpoint.model is required with teacher.endpoint.url (the served model's name)")
        if self.concurrency < 1 or self.max_retries < 0 or self.timeout_s <= 0 or (self.qps is not None and self.qps <= 0):
            raise ConfigError("teacher.endpoint: need concurrency >= 1, max_retries >= 0, timeout_s > 0, qps > 0 or null")

    def split_among(self, workers: int) -> "EndpointConfig":
        """This job's share for one of `workers` processes (Ray's teacher actors): concurrency and qps divided."""
        return dataclasses.replace(self, concurrency=max(1, math.ceil(self.concurrency / workers)),
                                   qps=None if self.qps is None else self.qps / workers)


class EndpointAuthError(RuntimeError):
    """The server refused the credentials (401/403): every request would fail, so the run stops at once."""


class TeacherFailed(RuntimeError):
    """More slates failed than `max_failed_share` allows."""


# ---- figures -------------------------------------------------------------------------------------------
def latency_bin(seconds: float) -> str:
    """A request's latency -> its histogram bin (20 a decade, ~12% wide), a string key so that histograms
    add up in the rankings store's footers like every other figure."""
    return str(math.floor(20 * math.log10(max(seconds, 1e-4) * 1000)))


def latency_quantile(hist: dict[str, int], q: float) -> float:
    """The `q` quantile (seconds) of a latency histogram: its bin's geometric centre; NaN when empty."""
    total = sum(hist.values())
    if not total:
        return float("nan")
    seen = 0
    for key in sorted(hist, key=int):
        seen += hist[key]
        if seen >= q * total:
            return 10 ** ((int(key) + 0.5) / 20) / 1000
    return float("nan")


def endpoint_figures(summary: dict[str, Any], seconds: float | None = None, slates: int | None = None,
                     cfg: EndpointConfig | None = None) -> dict[str, Any]:
    """The footers' additive `endpoint` summary -> what a run reports: requests, retries, failures per reason,
    tokens, latency p50/p95, slates/s over `seconds`, cost where prices are set."""
    hist = summary.get("latency_hist", {})
    out = {k: summary.get(k, 0) for k in ("requests", "attempts", "cached", "prompt_tokens", "completion_tokens")}
    out["retries"] = out["attempts"] - out["requests"]
    out["retried"] = dict(summary.get("retried", {}))
    out["failures"] = {r: summary.get("failures", {}).get(r, 0) for r in FAILURE_REASONS}
    out["latency_p50_s"], out["latency_p95_s"] = latency_quantile(hist, 0.5), latency_quantile(hist, 0.95)
    if seconds and slates is not None:
        out["slates_per_s"] = slates / seconds
        out["completion_tokens_per_s"] = out["completion_tokens"] / seconds
    if cfg is not None and (cfg.price_prompt_per_m is not None or cfg.price_completion_per_m is not None):
        out["cost"] = (out["prompt_tokens"] * (cfg.price_prompt_per_m or 0.0)
                       + out["completion_tokens"] * (cfg.price_completion_per_m or 0.0)) / 1e6
    return out


def endpoint_line(fig: dict[str, Any]) -> str:
    """`endpoint_figures` as one console line."""
    failures = {k: v for k, v in fig["failures"].items() if v}
    return (f"{fig['requests']} requests ({fig['retries']} retries{', ' + str(fig['retried']) if fig['retried'] else ''}; "
            f"{fig['cached']} answers from the cache), failed slates {failures or 'none'}, tokens {fig['prompt_tokens']} "
            f"prompt + {fig['completion_tokens']} completion, latency p50 {fig['latency_p50_s']:.2f}s p95 "
            f"{fig['latency_p95_s']:.2f}s" + (f", {fig['slates_per_s']:.2f} slates/s" if "slates_per_s" in fig else "")
            + (f", cost {fig['cost']:.4f}" if "cost" in fig else ""))


@dataclass
class FailureBudget:
    """Stops a split once its failed slates exceed `max_share` of its `slates`: from then on, no run of the
    rest could end within the budget, so the endpoint is not asked further."""

    split: str
    slates: int
    max_share: float
    failures: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    @property
    def allowed(self) -> int:
        return math.floor(self.max_share * self.slates)

    def add(self, rankings: Sequence[TeacherRanking]) -> None:
        self.add_counts(*failure_counts(rankings))

    def add_counts(self, failures: dict[str, int], examples: dict[str, str]) -> None:
        for reason, n in failures.items():
            self.failures[reason] = self.failures.get(reason, 0) + n
        for reason, text in examples.items():
            self.examples.setdefault(reason, text)
        failed = sum(self.failures.values())
        if failed > self.allowed:
            top = max(self.failures, key=self.failures.get)
            raise TeacherFailed(
                f"teacher rankings {self.split}: {failed} of {self.slates} slates failed, more than "
                f"teacher.max_failed_share {self.max_share} allows ({self.allowed}); most: {top} x{self.failures[top]}, "
                f"e.g. {self.examples.get(top, '')!r}; all: {dict(sorted(self.failures.items()))}. "
                "Rerun to resume: answered windows come from the answer cache, only what failed is asked again")


def failure_counts(rankings: Sequence[TeacherRanking]) -> tuple[dict[str, int], dict[str, str]]:
    """-> ({reason: slates}, {reason: an example}) of the failed rankings."""
    counts: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in rankings:
        if r.failure:
            counts[r.failure] = counts.get(r.failure, 0) + 1
            examples.setdefault(r.failure, f"slate {r.slate_id!r}: {r.raw_text[:300]}")
    return counts, examples


# ---- the answer cache ----------------------------------------------------------------------------------
class AnswerCache:
    """Answers kept on disk: a folder of JSON-lines files, one per writing process (so Ray actors on shared
    storage never write the same file), read whole when opened. A line cut short by a crash is skipped."""

    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory) if directory is not None else None
        self.answers: dict[str, dict[str, Any]] = {}
        self._file = None
        if self.directory is not None and self.directory.is_dir():
            for path in sorted(self.directory.glob("answers-*.jsonl")):
                for line in path.read_text(encoding="utf-8").splitlines():
                    try:
                        row = json.loads(line)
                        self.answers[row["key"]] = row
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue  # the last line of a writer that crashed mid-line

    @staticmethod
    def key(request: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()

    def get(self, key: str) -> dict[str, Any] | None:
        return self.answers.get(key)

    def put(self, key: str, text: str, prompt_tokens: int, completion_tokens: int) -> None:
        row = {"key": key, "text": text, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        self.answers[key] = row
        if self.directory is None:
            return
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._file = open(self.directory / f"answers-{uuid.uuid4().hex[:12]}.jsonl", "a", encoding="utf-8")
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()


# ---- the teacher ---------------------------------------------------------------------------------------
@dataclass
class _Answer:
    permutation: list[int] | None
    text: str
    counts: ParseCounts
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    failure: str = ""


@dataclass
class _Tally:
    """One call's figures (additive: the rankings store sums them over shards)."""

    requests: int = 0  # answers asked of the server (not from the cache)
    attempts: int = 0  # HTTP requests sent, retries included
    cached: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_hist: dict[str, int] = field(default_factory=dict)
    retried: dict[str, int] = field(default_factory=dict)  # status of each attempt that failed ("429", "500", ...)
    failures: dict[str, int] = field(default_factory=dict)

    def as_summary(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _reason(err: Exception) -> str:
    import openai

    if isinstance(err, openai.APITimeoutError):
        return "timeout"
    if isinstance(err, openai.APIConnectionError):
        return "connection"
    if isinstance(err, openai.RateLimitError):
        return "http_429"
    if isinstance(err, openai.APIStatusError):
        return "http_5xx" if err.status_code >= 500 else "http_4xx"
    raise err


class EndpointTeacher:
    """See the module docstring. `generation` brings the window settings and `repair` (constrained decoding
    is a local teacher's; a server is asked for text)."""

    decoding = "endpoint"

    def __init__(self, cfg: EndpointConfig, prompt: PromptConfig, generation, cache_dir: str | Path | None = None):
        if cfg.url is None:
            raise ValueError("EndpointTeacher needs teacher.endpoint.url")
        if generation.constrained:
            raise ValueError("teacher.generation.constrained: a served teacher writes free text; set it false")
        self.cfg, self.prompt, self.generation = cfg, prompt, generation
        self.cache = AnswerCache(cache_dir) if cfg.cache else None  # no cache: nothing kept, not even in memory
        self._key = self._read_key()
        self._headers()  # an unset "${VAR}" header fails here, not at the first request
        import openai  # noqa: F401 — imported now (seconds on a busy machine), not inside a request's event loop

        self._kept = None  # (event loop, HTTP client) of `arank`

    def _read_key(self) -> str:
        if self.cfg.api_key_env is None:
            return "none"  # servers started without a key ignore it; the SDK needs a value
        key = os.environ.get(self.cfg.api_key_env)
        if not key:
            raise EndpointAuthError(f"teacher.endpoint.api_key_env names {self.cfg.api_key_env}, which is not set "
                                    "in this process's environment (on Ray: every node's)")
        return key

    def _headers(self) -> dict[str, str]:
        out = {}
        for name, value in self.cfg.headers.items():
            ref = _ENV_REF.match(value)
            if ref and ref.group(1) not in os.environ:
                raise ValueError(f"teacher.endpoint.headers.{name}: environment variable {ref.group(1)} is not set")
            out[name] = os.environ[ref.group(1)] if ref else value
        return out

    def _mask(self, text: str) -> str:
        secrets = [self._key] if self._key != "none" else []
        secrets += [v for k, v in self._headers().items() if _ENV_REF.match(self.cfg.headers[k])]
        for s in secrets:
            text = text.replace(s, "***")
        return text

    # -- the public surface ------------------------------------------------------------------------------
    def rank(self, requests: Sequence[RerankRequest]) -> list[TeacherRanking]:
        return self.rank_summarized(requests)[0]

    def rank_summarized(self, requests: Sequence[RerankRequest]) -> tuple[list[TeacherRanking], dict]:
        """`rank`, and this call's endpoint figures for the rankings store's footer (`endpoint_figures`)."""
        tally = _Tally()
        if self.cfg.schedule == "rounds" and self.generation.window:
            rankings = rank_with_windows(lambda subs: asyncio.run(self._rank_all(subs, tally, windowed=False)),
                                         list(requests), self.generation.window, self.generation.stride,
                                         self.generation.windowing)
        else:
            rankings = asyncio.run(self._rank_all(requests, tally))
        tally.failures = failure_counts(rankings)[0]
        return rankings, {"endpoint": tally.as_summary()}

    async def arank(self, requests: Sequence[RerankRequest]) -> tuple[list[TeacherRanking], dict]:
        """`rank_summarized` inside a running event loop (a Serve replica): one HTTP client kept for the loop, so a
        call costs no client set-up (tens of ms of TLS context, on the loop) and the `qps` pace holds across calls."""
        tally = _Tally()
        loop = asyncio.get_running_loop()
        if self._kept is None or self._kept[0] is not loop:
            self._kept = (loop, self._client())
        rankings = await self._rank_all(requests, tally, client=self._kept[1])
        tally.failures = failure_counts(rankings)[0]
        return rankings, {"endpoint": tally.as_summary()}

    # -- the work ----------------------------------------------------------------------------------------
    def _client(self):
        import openai

        interval = 1.0 / self.cfg.qps if self.cfg.qps else 0.0
        pace = {"next": 0.0}

        async def on_request(request) -> None:  # every attempt, retries too: counted and paced
            _TALLY.get().attempts += 1
            if interval:
                now = time.monotonic()
                wait, pace["next"] = pace["next"] - now, max(now, pace["next"]) + interval
                if wait > 0:
                    await asyncio.sleep(wait)

        async def on_response(response) -> None:
            if response.status_code >= 400:
                retried = _TALLY.get().retried
                retried[str(response.status_code)] = retried.get(str(response.status_code), 0) + 1

        http = openai.DefaultAsyncHttpxClient(event_hooks={"request": [on_request], "response": [on_response]})
        return openai.AsyncOpenAI(base_url=self.cfg.url, api_key=self._key, default_headers=self._headers(),
                                  timeout=self.cfg.timeout_s, max_retries=self.cfg.max_retries, http_client=http)

    async def _rank_all(self, requests: Sequence[RerankRequest], tally: _Tally, windowed: bool = True, client=None
                        ) -> list[TeacherRanking]:
        """Every slate at once, at most `concurrency` requests in flight; on `client` (kept by the caller), else on a
        client of this call's own."""
        slots = asyncio.Semaphore(self.cfg.concurrency)
        _TALLY.set(tally)  # this task's, and the tasks gather makes from it
        if client is None:
            async with self._client() as client:
                return await self._rank_all(requests, tally, windowed, client)
        ask = lambda docs, query: self._ask(client, slots, tally, query, docs)  # noqa: E731
        return list(await asyncio.gather(*(self._rank_slate(ask, r, windowed) for r in requests)))

    async def _rank_slate(self, ask, slate: RerankRequest, windowed: bool) -> TeacherRanking:
        """One query: its windows in sequence (each round's windows at once), stopping at the first failure."""
        n, g = len(slate.candidates), self.generation
        if n < 2:
            return TeacherRanking(slate.slate_id, list(range(n)), "", ParseCounts(total=1, ok=1))
        window = g.window if (windowed and g.window and n > g.window) else n
        rounds = WINDOWINGS[g.windowing](n, window, min(g.stride, window))
        docs = [document_text(c) for c in slate.candidates]
        answers: list[_Answer] = []
        spans: list[list[int]] = []
        pending = next(rounds)
        while True:
            got = await asyncio.gather(*(ask([docs[i] for i in idx], slate.query.text) for idx in pending))
            answers += got
            spans += [sorted(idx) for idx in pending]
            failed = next((a for a in got if a.failure), None)
            if failed is not None:
                order = None
                break
            try:
                pending = rounds.send([a.permutation for a in got])
            except StopIteration as done:
                order = done.value
                break
        return TeacherRanking(
            slate.slate_id, order, failed.text if failed else " || ".join(a.text for a in answers),
            merge_counts([a.counts for a in answers]), sum(a.prompt_tokens for a in answers),
            sum(a.completion_tokens for a in answers), sum(a.latency_s for a in answers),
            spans if len(spans) > 1 else [], failure=failed.failure if failed else "")

    async def _ask(self, client, slots: asyncio.Semaphore, tally: _Tally, query: str, docs: list[str]) -> _Answer:
        """One window -> its parsed answer, from the cache or the server."""
        messages = prompt_messages(self.prompt, query, docs)
        max_tokens = self.cfg.max_tokens or self.generation.max_new_tokens or answer_chars(len(docs)) + 8
        request = {"model": self.cfg.model, "messages": messages, "temperature": 0.0, "max_tokens": max_tokens}
        key = AnswerCache.key(request)
        kept = self.cache.get(key) if self.cache is not None else None
        if kept is not None:
            tally.cached += 1
            parsed = parse_ranking(kept["text"], len(docs), repair=self.generation.repair)
            return _Answer(parsed.permutation, kept["text"], parsed.counts, kept["prompt_tokens"], kept["completion_tokens"])
        import openai

        async with slots:
            tally.requests += 1
            t0 = time.perf_counter()
            try:
                response = await client.chat.completions.create(**request)
            except (openai.AuthenticationError, openai.PermissionDeniedError) as err:
                raise EndpointAuthError(
                    f"the teacher endpoint {self.cfg.url} refused the credentials (HTTP {err.status_code}): "
                    f"{self._mask(str(err))[:300]}; check the key in ${self.cfg.api_key_env or '(no api_key_env set)'}"
                ) from None
            except openai.APIError as err:
                return _Answer(None, self._mask(f"{type(err).__name__}: {err}")[:500], ParseCounts(total=1),
                               failure=_reason(err))
            latency = time.perf_counter() - t0
        text = (response.choices[0].message.content or "") if response.choices else ""
        usage = response.usage
        prompt_tokens, completion_tokens = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
        tally.prompt_tokens += prompt_tokens
        tally.completion_tokens += completion_tokens
        b = latency_bin(latency)
        tally.latency_hist[b] = tally.latency_hist.get(b, 0) + 1
        parsed = parse_ranking(text, len(docs), repair=self.generation.repair)
        if parsed.permutation is None or not any(1 <= i <= len(docs) for i in extract_ids(text)[0]):
            # no ranking in it (a repair would only restate the input order): a failure, not kept, asked again on a rerun
            return _Answer(None, text, parsed.counts, prompt_tokens, completion_tokens, latency, "unparseable")
        if self.cache is not None:
            self.cache.put(key, text, prompt_tokens, completion_tokens)
        return _Answer(parsed.permutation, text, parsed.counts, prompt_tokens, completion_tokens, latency)
