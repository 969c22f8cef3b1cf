"""The front door: a trained single-pass student that ranks documents for a query.

    from hllm import Reranker
    reranker = Reranker.load("runs/default/student")          # or "runs:/<run id>/student", "models:/name@alias"
    reranker.rank("red leather boots", ["acme red leather boots", "blue shirt"])
    # -> [RankedDocument(index=0, score=1.0), RankedDocument(index=1, score=0.5)]

One path for every caller (Serve, the evaluation, the benchmarks, the ablations): encode the
prompt -> one batched prefill + head -> an (n, min(K, n)) score matrix per query -> a decoder
(Hungarian by default) -> a permutation. The pieces are public so a server can batch across
requests (`encode`, `score_encoded`, `decode`); `rank` and `rank_batch` chain them.

Model URIs other than local paths (`runs:/`, `models:/`, ...) are resolved by plug-ins registered
under the entry-point group `hllm.model_uris` (this project registers MLflow's), so the library
itself never imports a tracking client.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import torch

from hllm.decoding import DECODERS, Decoded
from hllm.models import resolve_device
from hllm.prompts import EncodedPrompt, PromptTooLong, collate
from hllm.ranker import SinglePassRanker
from hllm.records import RerankRequest

__all__ = ["PromptTooLong", "RankedDocument", "Reranker", "resolve_model_uri"]
URI_GROUP = "hllm.model_uris"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")


@dataclass(frozen=True)
class RankedDocument:
    index: int  # position of the document in the input list
    score: float  # strictly decreasing along the ranking (from the decoder's rank, not a probability)


def resolve_model_uri(uri: str | Path) -> Path:
    """A local folder, or `scheme:/...` through the plug-in registered for that scheme."""
    match = _SCHEME.match(str(uri))
    if match is None:
        path = Path(uri).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"no trained student at {str(uri)!r} (a folder with hllm_ranker.json, "
                                    f"or a URI such as runs:/RUN_ID/student)")
        return path
    scheme = match.group(1)
    plugins = {ep.name: ep for ep in entry_points(group=URI_GROUP)}
    if scheme not in plugins:
        raise ValueError(f"no resolver for {scheme!r} URIs ({uri}); registered: {sorted(plugins)} "
                         f"(entry-point group {URI_GROUP!r})")
    return Path(plugins[scheme].load()(str(uri)))


class Reranker:
    """A single-pass student for inference. Build it with `Reranker.load`, or wrap a trained
    `SinglePassRanker` (`Reranker(ranker)`) to evaluate it as it will be served."""

    def __init__(self, model: SinglePassRanker, decoder: str = "hungarian", batch_size: int = 32):
        if decoder not in DECODERS:
            raise ValueError(f"unknown decoder {decoder!r}; known: {sorted(DECODERS)}")
        self.model, self.decoder, self.batch_size = model.eval(), decoder, batch_size

    @classmethod
    def load(cls, path_or_uri: str | Path, *, device: str = "auto", dtype: str | None = None, merge_lora: bool = True,
             decoder: str = "hungarian", batch_size: int = 32) -> "Reranker":
        """`merge_lora` folds LoRA into the base weights: the same scores, no adapter matmuls."""
        model = SinglePassRanker.load(resolve_model_uri(path_or_uri), dtype=dtype, merge_lora=merge_lora)
        return cls(model.to(resolve_device(device)), decoder, batch_size)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def positions(self) -> int:
        """K, the head's number of rank positions."""
        return self.model.cfg.head.k

    # ---- the path, piece by piece ------------------------------------------------------------
    def encode(self, query: str, documents: Sequence[str]) -> EncodedPrompt:
        """-> the prompt; raises `PromptTooLong` when the documents cannot fit the context."""
        return self.model.prompts.encode_texts(query, documents, with_answer=False)

    def encode_slate(self, slate: RerankRequest) -> EncodedPrompt:
        return self.model.prompts.encode(slate, with_answer=False)

    def tensors(self, prompts: Sequence[EncodedPrompt]) -> dict[str, torch.Tensor]:
        """Encoded prompts -> the model's padded input tensors on its device."""
        batch = collate(list(prompts), self.model.tokenizer.pad_token_id)
        return {k: v.to(self.device) for k, v in batch.items()}

    @torch.inference_mode()
    def score_encoded(self, prompts: Sequence[EncodedPrompt]) -> list[np.ndarray]:
        """One forward pass for all prompts -> per prompt its (n, min(K, n)) float32 score matrix."""
        logits = self.model(**self.tensors(prompts)).float().cpu().numpy()  # (B, N, K)
        out = []
        for row, prompt in enumerate(prompts):
            n = len(prompt.item_positions)
            out.append(logits[row, :n, : min(n, logits.shape[2])])
        return out

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[EncodedPrompt]) -> torch.Tensor:
        """The bare prefill of the same prompts (no head, no decoding): the baseline of latency tables."""
        batch = self.tensors(prompts)
        return self.model.hidden_states(batch["input_ids"], batch["attention_mask"])

    def decode(self, matrix: np.ndarray, decoder: str | None = None) -> Decoded:
        return DECODERS[decoder or self.decoder](matrix)

    # ---- whole requests ----------------------------------------------------------------------
    def score_slates(self, slates: Sequence[RerankRequest], batch_size: int | None = None) -> list[np.ndarray]:
        """Score matrices for many slates, `batch_size` per forward pass (evaluation)."""
        size = batch_size or self.batch_size
        matrices: list[np.ndarray] = []
        for start in range(0, len(slates), size):
            matrices += self.score_encoded([self.encode_slate(s) for s in slates[start: start + size]])
        return matrices

    def rank(self, query: str, documents: Sequence[str], top_k: int | None = None,
             decoder: str | None = None) -> list[RankedDocument]:
        """Documents of one query, best first (the first `top_k` when given)."""
        return self.rank_batch([query], [documents], top_k=top_k, decoder=decoder)[0]

    def rank_batch(self, queries: Sequence[str], documents: Sequence[Sequence[str]], top_k: int | None = None,
                   batch_size: int | None = None, decoder: str | None = None) -> list[list[RankedDocument]]:
        """Many queries, each with its own documents; `batch_size` queries per forward pass."""
        if len(queries) != len(documents):
            raise ValueError(f"{len(queries)} queries but {len(documents)} document lists")
        size = batch_size or self.batch_size
        out: list[list[RankedDocument]] = []
        for start in range(0, len(queries), size):
            prompts = [self.encode(q, d) for q, d in zip(queries[start: start + size], documents[start: start + size])]
            for matrix in self.score_encoded(prompts):
                decoded = self.decode(matrix, decoder)
                top = decoded.permutation[:top_k] if top_k is not None else decoded.permutation
                out.append([RankedDocument(int(i), float(decoded.item_scores[i])) for i in top])
        return out
