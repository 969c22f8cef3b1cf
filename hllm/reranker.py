"""The front door: a trained single-pass student that ranks documents for a query.

    from hllm import Reranker
    reranker = Reranker.load("runs/default/student")          # or "runs:/<run id>/student", "models:/name@alias"
    reranker.rank("red leather boots", ["acme red leather boots", "blue shirt"])
    # -> [RankedDocument(index=0, score=1.0, relevance=...), RankedDocument(index=1, score=0.5, relevance=...)]

One path for every caller (Serve, the CLI, the evaluation, the benchmarks, the ablations): encode
the prompt -> one batched prefill + head -> an (n, min(K, n)) score matrix per query -> a decoder
(Hungarian by default) -> a permutation. The pieces are public so a server can batch across
requests (`encode`, `score_encoded`, `decode`); `rank` and `rank_batch` chain them.

Lists longer than `window` (longer than the context allows, or than the head was trained on) are
ranked in windows (`hllm.model.windows`: RankGPT sliding windows or a block tournament), one prefill per
window, every query's windows of a round in one batch; their scores are then rank-derived.

Model URIs other than local paths (`runs:/`, `models:/`, ...) are resolved by plug-ins registered
under the entry-point group `hllm.model_uris` (this project registers MLflow's), so the library
itself never imports a tracking client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from hllm.data.order import canonical_order, permuted
from hllm.data.traffic import model_key
from hllm.model.backbones import resolve_device
from hllm.model.calibration import Calibrator
from hllm.model.confidence import CascadeThresholds, Confidence, confidence
from hllm.model.decoding import DECODERS, Decoded
from hllm.model.heads import within_support
from hllm.model.prompts import EncodedPrompt, PromptTooLong, collate
from hllm.model.card import ModelCard, read_model_card
from hllm.model.ranker import SinglePassRanker
from hllm.model.windows import WINDOWINGS, rank_in_windows
from hllm.records import RerankRequest
from hllm.uris import resolve_model_uri

__all__ = ["Assessed", "PromptTooLong", "RankedDocument", "Reranker", "Windowed"]


@dataclass(frozen=True)
class RankedDocument:
    index: int  # position of the document in the input list
    score: float  # strictly decreasing along the ranking (the decoder's, or 1 - rank/N across windows): not a probability
    relevance: float | None = None  # calibrated P(relevant), non-increasing along the ranking (models saved with a calibration)


@dataclass(frozen=True)
class Assessed:
    """One query's ranking with how sure the single pass was (`hllm.model.confidence`), read off the same prefill."""

    documents: list[RankedDocument]  # best first
    confidence: Confidence  # of the pass that decided the top (a long list: its last, top window)
    trust: float | None  # the domain guard's trust (None: the model has no guard)
    windows: int = 1  # prefills the query took


CPU_MAX_BATCH_TOKENS = 8192  # "auto" on a CPU: about one 100-passage prompt a forward pass
MaxBatchTokens = int | Literal["auto"] | None


def resolve_max_batch_tokens(value: MaxBatchTokens, device: torch.device) -> int | None:
    """A forward pass's token cap on `device`: an int or None (no cap) as given; "auto" is
    `CPU_MAX_BATCH_TOKENS` on a CPU, where batching long prompts costs more than passes in a row and
    memory grows with tokens (2 cores: two 6,100-token prompts batched 0.057 queries/s against 0.089
    one a pass, reports/real_throughput.md; 16 prompts of 1,360 tokens 22.9 s uncapped, 13.9 s at
    4,096, docs/http-api.md), and no cap on an accelerator, where batching is what pays."""
    if value == "auto":
        return CPU_MAX_BATCH_TOKENS if device.type == "cpu" else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_batch_tokens must be >= 1, None (no cap) or 'auto', got {value!r}")
    return value


def token_batches(lengths: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Consecutive runs of prompt indices whose padded size (rows x the longest) stays within
    `max_tokens` (None: one run of all); a prompt longer than `max_tokens` makes a run of its own."""
    if max_tokens is None:
        return [list(range(len(lengths)))] if len(lengths) else []
    runs: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if runs and (len(runs[-1]) + 1) * max(longest, n) <= max_tokens:
            runs[-1].append(i)
            longest = max(longest, n)
        else:
            runs.append([i])
            longest = n
    return runs


class Reranker:
    """A single-pass student for inference. Build it with `Reranker.load`, or wrap a trained
    `SinglePassRanker` (`Reranker(ranker)`) to evaluate it as it will be served."""

    def __init__(self, model: SinglePassRanker, decoder: str = "hungarian", batch_size: int = 32,
                 window: int | None = None, stride: int | None = None, windowing: str = "sliding",
                 max_batch_tokens: MaxBatchTokens = "auto"):
        """`window`: lists longer than this are ranked in windows of this many documents (None: every
        list in one pass); `stride` (sliding; default window // 2); `windowing`: sliding or blocks;
        `max_batch_tokens`: a forward pass holds at most this many (padded) tokens, however many prompts
        a caller hands over at once (memory grows with tokens, not prompts; a longer prompt goes alone);
        None: no cap; "auto": `resolve_max_batch_tokens` for the model's device at each call."""
        if decoder not in DECODERS:
            raise ValueError(f"unknown decoder {decoder!r}; known: {sorted(DECODERS)}")
        if windowing not in WINDOWINGS:
            raise ValueError(f"unknown windowing {windowing!r}; known: {sorted(WINDOWINGS)}")
        if window is not None and not (2 <= window and 1 <= (stride or window // 2) <= window):
            raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window={window}, stride={stride}")
        resolve_max_batch_tokens(max_batch_tokens, torch.device("cpu"))  # a bad value fails here, not at the first call
        self.max_batch_tokens = max_batch_tokens
        self.model, self.decoder, self.batch_size = model.eval(), decoder, batch_size
        self.window, self.stride, self.windowing = window, stride, windowing
        self.card: ModelCard | None = None  # what the model knows (`Reranker.load` reads the saved model card)
        self.calibrator: Calibrator | None = None  # P(relevant) from the matrix (`Reranker.load` reads calibration.json)
        # its confidence's quantiles on training-side queries: a cascade's threshold for a share of traffic (cascade.json)
        self.cascade_thresholds: CascadeThresholds | None = None

    @classmethod
    def load(cls, path_or_uri: str | Path, *, device: str = "auto", dtype: str | None = None, merge_lora: bool = True,
             decoder: str = "hungarian", batch_size: int = 32, window: int | None = None, stride: int | None = None,
             windowing: str = "sliding", max_batch_tokens: MaxBatchTokens = "auto") -> "Reranker":
        """`merge_lora` folds LoRA into the base weights: the same scores, no adapter matmuls."""
        path = resolve_model_uri(path_or_uri)
        model = SinglePassRanker.load(path, dtype=dtype, merge_lora=merge_lora)
        reranker = cls(model.to(resolve_device(device)), decoder, batch_size, window, stride, windowing, max_batch_tokens)
        reranker.card = read_model_card(path)
        reranker.calibrator = Calibrator.load(path)
        reranker.cascade_thresholds = CascadeThresholds.load(path)
        return reranker

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def positions(self) -> int:
        """K, the head's number of rank positions."""
        return self.model.cfg.head.k

    @property
    def default_window(self) -> int:
        """The list size the model was made to rank in one pass (its config's `window`), else K."""
        return self.model.cfg.window or self.positions

    # ---- the path, piece by piece ------------------------------------------------------------
    def encode(self, query: str, documents: Sequence[str], max_doc_tokens: int | None = None, *,
               first_stage_order: bool = False) -> EncodedPrompt:
        """-> the prompt; raises `PromptTooLong` when the documents cannot fit the context.
        `max_doc_tokens` caps each document below the model's own budget (cuts are counted).
        `first_stage_order`: the documents come as a first-stage ranking, best first, and the model's prior may
        read it; False (the default): they are a set, read in their canonical order (`hllm.data.order`), so any
        arrival order of the same documents gives this same prompt (its scores come back in the order given)."""
        if first_stage_order:
            return self.model.prompts.encode_texts(query, documents, with_answer=False, max_doc_tokens=max_doc_tokens)
        order = canonical_order(documents)
        prompt = self.model.prompts.encode_texts(query, [documents[i] for i in order], with_answer=False,
                                                 max_doc_tokens=max_doc_tokens)
        return dataclasses.replace(prompt, first_stage_order=False, reading_order=tuple(order))

    def encode_slate(self, slate: RerankRequest) -> EncodedPrompt:
        """A slate's prompt: its candidates are in first-stage order by definition (`RerankRequest`), declared."""
        return self.model.prompts.encode(slate, with_answer=False)

    def tensors(self, prompts: Sequence[EncodedPrompt]) -> dict[str, torch.Tensor]:
        """Encoded prompts -> the model's padded input tensors on its device."""
        batch = collate(list(prompts), self.model.tokenizer.pad_token_id)
        return {k: v.to(self.device) for k, v in batch.items()}

    def score_encoded(self, prompts: Sequence[EncodedPrompt]) -> list[np.ndarray]:
        """One forward pass for all prompts (several under `max_batch_tokens`) -> per prompt its
        (n, min(K, n)) float32 score matrix."""
        return [matrix for matrix, _ in self.score_with_trust(prompts)]

    @torch.inference_mode()
    def score_with_trust(self, prompts: Sequence[EncodedPrompt]) -> list[tuple[np.ndarray, float | None]]:
        """`score_encoded`, each matrix with the model's domain-guard trust in that prompt (1: its own
        ranking; below 1 it leans toward the input order, 0: the input order), None for a model without a guard.
        A prompt that showed each passage fewer tokens than the guard's support gets trust 0: its matrix is
        the head's prior alone (`hllm.model.heads.within_support`), whose assignment is the input order.
        A prompt whose order is not a declared first-stage ranking (`EncodedPrompt.first_stage_order`) is scored
        without the prior, and its guard's trust is reported but falls back to no order (there is none). A matrix's
        rows are the documents as given (a prompt that read them in another order, `reading_order`, is mapped back)."""
        out = []
        cap = resolve_max_batch_tokens(self.max_batch_tokens, self.device)
        for part in token_batches([len(p.input_ids) for p in prompts], cap):
            chunk = [prompts[i] for i in part]
            declared = torch.tensor([p.first_stage_order for p in chunk], device=self.device)  # (B,)
            logits, trust = self.model.scores_and_trust(**self.tensors(chunk), declared=declared)
            logits = logits.float().cpu().numpy()  # (B, N, K)
            trust = None if trust is None else trust.float().cpu().tolist()  # (B,)
            for row, prompt in enumerate(chunk):
                n = len(prompt.item_positions)
                matrix, ok = within_support(self.model.head, logits[row, :n, : min(n, logits.shape[2])], prompt.doc_budget,
                                            prompt.first_stage_order)
                if prompt.reading_order is not None:  # (n, K) rows in prompt order -> the documents' order
                    matrix = matrix[np.argsort(prompt.reading_order)]
                out.append((matrix, None if trust is None else trust[row] if ok else 0.0))
        return out

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[EncodedPrompt]) -> torch.Tensor:
        """The bare prefill of the same prompts (no head, no decoding): the baseline of latency tables."""
        batch = self.tensors(prompts)
        return self.model.hidden_states(batch["input_ids"], batch["attention_mask"])

    def cut_documents(self, documents: Sequence[str]) -> list[str]:
        """Documents as the model reads them at most: each cut to the prompt's `max_doc_tokens`
        (a traffic log keeps no more of a document than the model could use)."""
        budget, tokenizer = self.model.prompts.cfg.max_doc_tokens, self.model.tokenizer
        ids = tokenizer([" " + d for d in documents], add_special_tokens=False)["input_ids"]
        return [d if len(i) <= budget else tokenizer.decode(i[:budget]).strip() for d, i in zip(documents, ids)]

    @property
    def model_key(self) -> str:
        """The model's prompt and vocabulary as a key: traffic it answered can train students of the same key."""
        return model_key(self.model.cfg.prompt, self.model.tokenizer)

    def decode(self, matrix: np.ndarray, decoder: str | None = None, reading_order: Sequence[int] | None = None) -> Decoded:
        """A score matrix (rows: the documents as given) -> the ranking. `reading_order` (a set's prompt order,
        `EncodedPrompt.reading_order`): decoded in that order, so even exact ties do not depend on the arrival order."""
        if reading_order is None:
            return DECODERS[decoder or self.decoder](matrix)
        r = np.asarray(reading_order)
        decoded = DECODERS[decoder or self.decoder](matrix[r])  # rows in reading order
        return dataclasses.replace(decoded, permutation=r[decoded.permutation], item_scores=decoded.item_scores[np.argsort(r)])

    def relevance(self, matrix: np.ndarray, permutation: Sequence[int]) -> np.ndarray | None:
        """(N,) calibrated P(relevant) in input order, non-increasing along `permutation`; None
        for a model saved without a calibration."""
        return None if self.calibrator is None else self.calibrator.probabilities(matrix, permutation)

    def assess(self, matrix: np.ndarray, trust: float | None = None, decoder: str | None = None, *,
               first_stage_order: bool, reading_order: Sequence[int] | None = None) -> Assessed:
        """A query's score matrix -> its ranking: the last step every caller shares (`rank_assessed`, Serve's replicas):
        decode (in the prompt's `reading_order`, where it read a set) -> calibrated relevance (where the model has a
        calibration) -> the confidence signals of this pass (`agreement` only for a declared first-stage order)."""
        read = np.arange(len(matrix)) if reading_order is None else np.asarray(reading_order)  # prompt row -> document
        matrix = matrix[read]  # (n, K) rows in the order the prompt read them: every step below is the prompt's alone
        decoded = self.decode(matrix, decoder)
        rel = self.relevance(matrix, decoded.permutation)
        docs = [RankedDocument(int(read[j]), float(decoded.item_scores[j]), None if rel is None else float(rel[j]))
                for j in decoded.permutation]
        return Assessed(docs, confidence(matrix, decoded.permutation, trust, first_stage_order=first_stage_order), trust)

    # ---- whole requests ----------------------------------------------------------------------
    def score_slates(self, slates: Sequence[RerankRequest], batch_size: int | None = None, *,
                     first_stage_order: bool = True) -> list[np.ndarray]:
        """Score matrices for many slates, `batch_size` per forward pass (evaluation). A slate's candidates are in
        first-stage order (declared); `first_stage_order=False` reads them as a set, as `encode` does (in their
        canonical order; e.g. slates shuffled to measure)."""
        size = batch_size or self.batch_size
        matrices: list[np.ndarray] = []
        for start in range(0, len(slates), size):
            matrices += self.score_encoded([self.encode_slate(s) if first_stage_order else self._encode_set(s)
                                            for s in slates[start: start + size]])
        return matrices

    def _encode_set(self, slate: RerankRequest) -> EncodedPrompt:
        order = canonical_order([c.shown for c in slate.candidates])
        prompt = self.encode_slate(permuted(slate, order))
        return dataclasses.replace(prompt, first_stage_order=False, reading_order=tuple(order))

    def rank(self, query: str, documents: Sequence[str], top_k: int | None = None,
             decoder: str | None = None, *, first_stage_order: bool = False) -> list[RankedDocument]:
        """Documents of one query, best first (the first `top_k` when given). `first_stage_order=True` declares that
        the documents come as a first-stage ranking, best first, which the model's prior may then read; by default
        they are a set (a rerank API's contract), ranked by their text alone."""
        return self.rank_batch([query], [documents], top_k=top_k, decoder=decoder, first_stage_order=first_stage_order)[0]

    def rank_batch(self, queries: Sequence[str], documents: Sequence[Sequence[str]], top_k: int | None = None,
                   batch_size: int | None = None, decoder: str | None = None, *,
                   first_stage_order: bool = False) -> list[list[RankedDocument]]:
        """Many queries, each with its own documents; `batch_size` prompts per forward pass. Lists
        longer than `self.window` go through windows (see the module docstring)."""
        return [a.documents for a in self.rank_assessed(queries, documents, top_k, batch_size, decoder,
                                                        first_stage_order=first_stage_order)]

    def rank_assessed(self, queries: Sequence[str], documents: Sequence[Sequence[str]], top_k: int | None = None,
                      batch_size: int | None = None, decoder: str | None = None, *,
                      first_stage_order: bool = False) -> list[Assessed]:
        """`rank_batch`, each query with its confidence signals and the guard's trust (no extra forward pass)."""
        if len(queries) != len(documents):
            raise ValueError(f"{len(queries)} queries but {len(documents)} document lists")
        size = batch_size or self.batch_size
        long = [i for i, d in enumerate(documents) if self.window is not None and len(d) > self.window]
        short = sorted(set(range(len(queries))) - set(long))
        out: dict[int, Assessed] = {}
        for start in range(0, len(short), size):
            chunk = short[start: start + size]
            prompts = [self.encode(queries[i], documents[i], first_stage_order=first_stage_order) for i in chunk]
            for i, prompt, (matrix, trust) in zip(chunk, prompts, self.score_with_trust(prompts)):
                out[i] = self.assess(matrix, trust, decoder, first_stage_order=first_stage_order,
                                     reading_order=prompt.reading_order)
        if long:
            ranked = self.windowed_orders([queries[i] for i in long], [documents[i] for i in long], size, decoder,
                                          first_stage_order=first_stage_order)
            for q, i in enumerate(long):
                out[i] = Assessed([RankedDocument(j, s) for j, s in zip(ranked.orders[q], ranked.scores(q))],
                                  ranked.confidence[q], ranked.trust[q], ranked.windows[q])
        return [dataclasses.replace(out[i], documents=out[i].documents[:top_k]) if top_k is not None else out[i]
                for i in range(len(queries))]

    def windowed_orders(self, queries: Sequence[str], documents: Sequence[Sequence[str]], batch_size: int | None = None,
                        decoder: str | None = None, max_doc_tokens: int | None = None, *,
                        first_stage_order: bool) -> "Windowed":
        """Each query's order of all its documents, ranked window by window (see the module docstring). The windows
        follow the declared first-stage order, or a set's canonical order (`hllm.data.order`): then any arrival order
        of the same documents gives the same windows and the same answer."""
        if self.window is None:
            raise ValueError("windowed ranking needs a window (Reranker(window=...))")
        # a set is windowed in its canonical order; the orders come back as indices into the documents as given
        reading = [list(range(len(d))) if first_stage_order else canonical_order(d) for d in documents]
        documents = [[d[i] for i in r] for d, r in zip(documents, reading)]
        size = batch_size or self.batch_size
        tokens, truncated, shown, unknown = ([0] * len(queries) for _ in range(4))
        last: list[tuple[np.ndarray, np.ndarray, float | None] | None] = [None] * len(queries)  # each query's latest (top) window

        def rank_windows(flat: list[tuple[int, list[int]]]) -> list[list[int]]:
            prompts = [self.encode(queries[i], [documents[i][j] for j in idx], max_doc_tokens, first_stage_order=first_stage_order)
                       for i, idx in flat]
            for (i, _), prompt in zip(flat, prompts):
                tokens[i] += len(prompt.input_ids)
                truncated[i] += prompt.doc_tokens_truncated
                shown[i] += prompt.content_tokens
                unknown[i] += prompt.unknown_tokens
            scored = []
            for start in range(0, len(prompts), size):
                scored += self.score_with_trust(prompts[start: start + size])
            perms = []
            for (i, _), prompt, (matrix, trust) in zip(flat, prompts, scored):
                perm = self.decode(matrix, decoder, prompt.reading_order).permutation
                last[i] = (matrix, perm, trust)  # rounds go bottom-up: the last one decides the top
                perms.append(perm.tolist())
            return perms

        stride = self.stride or self.window // 2
        orders, windows = rank_in_windows([len(d) for d in documents], rank_windows, self.window, stride, self.windowing)
        orders = [[r[j] for j in o] for r, o in zip(reading, orders)]
        return Windowed(orders, windows, tokens, truncated, [u / max(c, 1) for u, c in zip(unknown, shown)], unknown, shown,
                        [confidence(*window, first_stage_order=first_stage_order) for window in last], [window[2] for window in last])


@dataclass(frozen=True)
class Windowed:
    orders: list[list[int]]  # per query: document indices, best first
    windows: list[int]  # per query: windows ranked = prefills
    prompt_tokens: list[int]  # per query: tokens over all its windows
    truncated_documents: list[int]  # per query: documents cut to the token budget, over all its windows
    unknown_token_share: list[float]  # per query: share of its shown tokens outside the vocabulary
    unknown_tokens: list[int]  # per query: its shown tokens outside the vocabulary, over all its windows
    shown_tokens: list[int]  # per query: the query's and documents' tokens shown, over all its windows
    confidence: list[Confidence]  # per query: the confidence signals of its last (top) window
    trust: list[float | None]  # per query: the guard's trust in that window (None: no guard)

    def scores(self, query: int) -> list[float]:
        """The rank-derived scores along query `query`'s order: 1 - rank / N (no matrix spans all windows)."""
        n = len(self.orders[query])
        return [1.0 - r / n for r in range(n)]
