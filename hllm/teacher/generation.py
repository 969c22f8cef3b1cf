"""The autoregressive listwise teacher: prompt -> greedy generation -> parsed permutation.

Batched (left padding), greedy, with the KV cache (`model.generate(use_cache=True)`). Optional
constrained decoding allows, at each step, only the tokens that continue a valid answer: one of
the identifiers not yet emitted, the separator, and the end of sequence once all N are out.
The text is parsed by `hllm.teacher.parsing` with its counts; `repair` is the caller's choice.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hllm.model.prompts import PromptBuilder, PromptConfig, answer_reserve, collate
from hllm.model.windows import rank_with_windows
from hllm.records import RerankRequest, TeacherRanking
from hllm.teacher.parsing import parse_ranking



@dataclass
class TeacherConfig:
    """How the AR teacher generates."""

    batch_size: int = 32  # slates per generate() call
    constrained: bool = False  # only valid continuations at each step
    repair: bool = False  # turn flawed answers into permutations (missing ids appended)
    max_new_tokens: int | None = None  # default: the full answer's length + 2
    window: int | None = None  # slates longer than this are ranked in windows (hllm.model.windows)
    stride: int = 10  # sliding windows: how far each window moves up
    windowing: Literal["sliding", "blocks"] = "sliding"  # RankGPT sliding windows, or a block tournament

    def __post_init__(self) -> None:
        if self.window is not None and not (2 <= self.window and 1 <= self.stride <= self.window):
            raise ValueError("teacher generation: need window >= 2 and 1 <= stride <= window")


class AnswerGrammar:
    """Token-level automaton for `[a] > [b] > ... > [z]</s>` over N identifiers.

    Identifiers and the separator are token sequences (one token each for the tiny tokenizer,
    several for BPE tokenizers). Ids end with "]", so no id's tokens are a prefix of another's.
    """

    def __init__(self, tokenizer, n: int):
        def toks(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

        self.n, self.eos = n, tokenizer.eos_token_id
        self.first = {i: toks(f"[{i}]") for i in range(1, n + 1)}  # the answer's first id
        self.later = {i: toks(f" [{i}]") for i in range(1, n + 1)}  # ids after a separator
        self.sep = toks(" >")

    def allowed(self, generated: list[int]) -> set[int]:
        """Allowed next tokens after `generated` (the tokens this row emitted so far)."""
        emitted: set[int] = set()
        pos = 0
        while True:
            if emitted:
                if len(emitted) == self.n:
                    return {self.eos}
                rest = tuple(generated[pos: pos + len(self.sep)])
                if rest != self.sep:
                    return {self.sep[len(rest)]} if rest == self.sep[: len(rest)] else {self.eos}
                pos += len(self.sep)
            pieces = self.later if emitted else self.first
            rest = tuple(generated[pos:])
            done = next((i for i, seq in pieces.items() if i not in emitted and rest[: len(seq)] == seq), None)
            if done is None:
                return {seq[len(rest)] for i, seq in pieces.items()
                        if i not in emitted and len(seq) > len(rest) and seq[: len(rest)] == rest} or {self.eos}
            emitted.add(done)
            pos += len(pieces[done])


class ConstrainedAnswer(LogitsProcessor):
    def __init__(self, grammars: list[AnswerGrammar], prompt_len: int):
        self.grammars, self.prompt_len = grammars, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        mask = torch.full_like(scores, float("-inf"))
        for row, grammar in enumerate(self.grammars):
            allowed = list(grammar.allowed(input_ids[row, self.prompt_len:].tolist()))
            mask[row, allowed] = 0.0
        return scores + mask


class ARTeacher:
    def __init__(self, model, tokenizer, prompt_cfg: PromptConfig, context_length: int, cfg: TeacherConfig):
        self.model, self.tokenizer, self.cfg = model.eval(), tokenizer, cfg
        self.prompts = PromptBuilder(tokenizer, prompt_cfg, context_length)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def decoding(self) -> str:
        """How its rankings are produced: "constrained" (the answer grammar) or "free"."""
        return "constrained" if self.cfg.constrained else "free"

    def rank_summarized(self, requests: list[RerankRequest]) -> tuple[list[TeacherRanking], dict]:
        """`rank`, and figures for the rankings store's shard footer beyond the rankings' own (none here)."""
        return self.rank(requests), {}

    def with_config(self, **changes) -> "ARTeacher":
        """The same model under other generation settings (e.g. free vs constrained)."""
        return ARTeacher(self.model, self.tokenizer, self.prompts.cfg, self.prompts.context_length,
                         dataclasses.replace(self.cfg, **changes))

    @torch.no_grad()
    def generate(self, requests: list[RerankRequest]) -> list[tuple[str, int, int]]:
        """One batch -> [(answer text, prompt tokens, output tokens)]."""
        encoded = [self.prompts.encode(r, with_answer=True) for r in requests]
        batch = collate(encoded, self.tokenizer.pad_token_id, padding_side="left")
        input_ids = batch["input_ids"].to(self.device)
        n_max = max(len(r.candidates) for r in requests)
        max_new = self.cfg.max_new_tokens or answer_reserve(self.tokenizer, n_max)
        processors = LogitsProcessorList()
        if self.cfg.constrained:
            grammars = [AnswerGrammar(self.tokenizer, len(r.candidates)) for r in requests]
            processors.append(ConstrainedAnswer(grammars, input_ids.shape[1]))
        out = self.model.generate(
            input_ids=input_ids, attention_mask=batch["attention_mask"].to(self.device),
            max_new_tokens=max_new, do_sample=False, use_cache=True, logits_processor=processors,
            pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
        )[:, input_ids.shape[1]:]
        results = []
        for row, enc in enumerate(encoded):
            tokens = out[row].tolist()
            if self.tokenizer.eos_token_id in tokens:
                tokens = tokens[: tokens.index(self.tokenizer.eos_token_id) + 1]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            results.append((text, len(enc.input_ids), len(tokens)))
        return results

    def rank(self, requests: list[RerankRequest]) -> list[TeacherRanking]:
        """Slates longer than `window` go through windows (`cfg.windowing`); the rest in one prompt."""
        if self.cfg.window and any(len(r.candidates) > self.cfg.window for r in requests):
            return rank_with_windows(self.rank_direct, requests, self.cfg.window, self.cfg.stride, self.cfg.windowing)
        return self.rank_direct(requests)

    def rank_direct(self, requests: list[RerankRequest]) -> list[TeacherRanking]:
        rankings = []
        for start in range(0, len(requests), self.cfg.batch_size):
            chunk = requests[start: start + self.cfg.batch_size]
            t0 = time.perf_counter()
            generated = self.generate(chunk)
            per_request = (time.perf_counter() - t0) / len(chunk)
            for req, (text, n_prompt, n_out) in zip(chunk, generated):
                parsed = parse_ranking(text, len(req.candidates), repair=self.cfg.repair)
                rankings.append(TeacherRanking(req.slate_id, parsed.permutation, text, parsed.counts,
                                               n_prompt, n_out, per_request))
        return rankings
