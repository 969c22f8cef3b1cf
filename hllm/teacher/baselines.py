"""Single-pass baselines that need no trained head.

FIRST-style (Reddy et al., 2024, "FIRST: Faster Improved Listwise Reranking with Single Token
Decoding"): one prefill of the teacher's prompt, then rank candidates by the logit the LM gives
to the first token of each identifier `[i]` at the position where the answer would start.
"""

from __future__ import annotations

import numpy as np
import torch

from hllm.model.prompts import PromptBuilder, collate
from hllm.records import RerankRequest


def identifier_first_tokens(tokenizer, n: int) -> list[int]:
    """First token of `[i]` for i = 1..n. With multi-token ids ("[", "1", "]") the first *distinct*
    token is used: the one after the shared prefix."""
    seqs = [tokenizer(f"[{i}]", add_special_tokens=False)["input_ids"] for i in range(1, n + 1)]
    shared = 0
    while n > 1 and all(len(s) > shared + 1 for s in seqs) and len({s[shared] for s in seqs}) == 1:
        shared += 1
    return [s[min(shared, len(s) - 1)] for s in seqs]


@torch.no_grad()
def first_style_scores(causal_lm, builder: PromptBuilder, requests: list[RerankRequest]) -> list[np.ndarray]:
    """-> per request (n,) scores: the identifier logits at the answer's first position.

    With a shared prefix (`[` before the digits) the prefix is appended to the prompt first, so
    the logits are read where the digits are predicted.
    """
    tok = builder.tokenizer
    n_max = max(len(r.candidates) for r in requests)
    firsts = identifier_first_tokens(tok, n_max)
    prefix = tok("[1]", add_special_tokens=False)["input_ids"][:-1] if firsts[0] != tok(
        "[1]", add_special_tokens=False)["input_ids"][0] else []
    encoded = [builder.encode(r, with_answer=True) for r in requests]
    for e in encoded:
        e.input_ids = e.input_ids + prefix
    batch = collate(encoded, tok.pad_token_id, padding_side="left")
    device = next(causal_lm.parameters()).device
    out = causal_lm(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                    logits_to_keep=1, use_cache=False)
    last = out.logits[:, -1].float().cpu().numpy()  # (B, V)
    return [last[row, firsts[: len(r.candidates)]] for row, r in enumerate(requests)]


def first_style_orders(causal_lm, builder: PromptBuilder, requests: list[RerankRequest], batch_size: int = 32
                       ) -> list[list[int]]:
    """-> per request the FIRST-style ranking (identifiers by their logit, best first), in batches."""
    orders = []
    for start in range(0, len(requests), batch_size):
        for scores in first_style_scores(causal_lm, builder, requests[start: start + batch_size]):
            orders.append(np.argsort(-scores, kind="stable").tolist())
    return orders
