"""The RankGPT / RankZephyr listwise prompt, tokenised piece by piece.

The prompt is built from token segments rather than one string, so that (1) every candidate
gets its own token budget and the whole prompt fits the model's context, with room left for
the teacher's answer, and (2) we know the index of the last token of every candidate: where the
single-pass head reads the hidden state. RankGPT puts each identifier before its passage
(`[3] text`); the compact template puts it after (`text [3]`), so the identifier token, the one
an answer copies, has read its passage (causal attention) and is the candidate's last token.
The chat template is used when the tokenizer has one (the user turn is framed around a sentinel,
so its tokens are exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import jinja2
import torch

from hllm.records import Candidate, RerankRequest

SYSTEM = ("You are RankLLM, an intelligent assistant that can rank passages based on their "
          "relevancy to the query.")
PREFIX = ("I will provide you with {num} passages, each indicated by a numerical identifier []. "
          "Rank the passages based on their relevance to the search query: {query}.\n")
SUFFIX = ("Search Query: {query}.\nRank the {num} passages above based on their relevance to the "
          "search query. All the passages should be included and listed using identifiers, in "
          "descending order of relevance. The output format should be [] > [], e.g., [2] > [1], "
          "Only respond with the ranking results, do not say any word or explain.")
_SENTINEL = "\u2063HLLM_USER_TURN\u2063"


@dataclass(frozen=True)
class Template:
    prefix: str  # before the candidates; {num} and {query} are filled in
    suffix: str  # after the candidates
    label_after: bool = False  # each candidate's identifier follows its text ("text [3]") instead of preceding it
    # restated after each candidate's text (e.g. " Query: {query}"): that candidate's last token, where the
    # single-pass head reads, then follows the passage *and* the query, which a causal model otherwise saw
    # only thousands of tokens earlier; None: not restated
    item_query: str | None = None


TEMPLATES = {
    # RankGPT / RankZephyr (rank_llm's wording): for real instruction-tuned LLMs
    "rankgpt": Template(PREFIX, SUFFIX),
    # the same structure with a one-line instruction, for models trained from scratch (the ~90
    # boilerplate tokens carry no meaning and cost a third of every training step), and each
    # identifier after its passage: a from-scratch teacher learns to write rankings from it within
    # the bootstrap's budget, where `[3] text` left its answer at the first stage's level (README)
    "compact": Template("Query: {query}\n", "Rank the {num} passages above by relevance to the query: {query}.",
                        label_after=True),
    # RankGPT's wording with the query restated after every passage: for a frozen LM read at each passage's
    # last token (a probe of SmolLM2's layer-20 states on TREC DL19, 5-fold CV over queries, top 100: 0.530
    # nDCG@10 with the restated query, 0.415 without; BM25 0.506; docs/real-text.md)
    "rankgpt-query": Template(PREFIX, SUFFIX, item_query=" Query: {query}"),
}


def template_text() -> str:
    """All fixed words of the prompts (the tiny tokenizer's vocabulary includes them)."""
    return " ".join([SYSTEM, *(t.prefix + " " + t.suffix for t in TEMPLATES.values()), "Answer system user assistant"])


@dataclass
class PromptConfig:
    """How slates become prompts."""

    template: Literal["rankgpt", "compact", "rankgpt-query"] = "rankgpt"  # prompt wording (hllm.model.prompts.TEMPLATES)
    max_doc_tokens: int = 96  # per-candidate cap, before the context budget is applied
    max_query_tokens: int = 48  # longer queries are cut (and counted)
    use_chat_template: bool = True  # when the tokenizer has one

    def __post_init__(self) -> None:
        if self.max_doc_tokens < 1 or self.max_query_tokens < 1:
            raise ValueError("prompt.max_doc_tokens and prompt.max_query_tokens must be >= 1")


@dataclass
class EncodedPrompt:
    input_ids: list[int]
    item_positions: list[int]  # (N,) index of the last token of each candidate
    doc_tokens_truncated: int = 0  # candidates cut to the budget
    query_truncated: bool = False
    content_tokens: int = 0  # tokens of the query and the documents as shown
    unknown_tokens: int = 0  # of those, the tokenizer's unknown token (words outside its vocabulary)
    # (N,) [start, stop) of each candidate's own tokens (its text as shown, without identifier or restated
    # query): what a `mean` pooling averages; a candidate cut to no tokens spans its last token
    item_spans: list[tuple[int, int]] = field(default_factory=list)
    doc_budget: int = 0  # the tokens each document could show (the config's cap, or less where the context is short)
    # whether the documents' order is a declared first-stage ranking (best first), which a head's prior may read;
    # a slate (`encode`) is one by definition, a request's documents are a set unless its caller says so
    first_stage_order: bool = True
    # a set read in its canonical order (`hllm.data.order.canonical_order`): the documents' indices in prompt order,
    # so the prompt's rows map back to the documents as given; None: the prompt reads them as given
    reading_order: tuple[int, ...] | None = None


UNKNOWN_TOKEN_WARNING = 0.1  # warn when more of the shown tokens than this are outside the model's vocabulary


def vocabulary_warning(share: float, vocabulary: str | None, threshold: float = UNKNOWN_TOKEN_WARNING) -> str | None:
    """The warning for text the model cannot read (Serve's `meta.warnings`, `hllm rerank`'s stderr), or None."""
    if share <= threshold:
        return None
    return (f"{share:.0%} of the query's and documents' tokens are unknown to this model's vocabulary "
            f"({vocabulary or 'see its model card'}): its ranking of them means little")


class PromptTooLong(ValueError):
    """The slate cannot fit the context even at one token per candidate."""


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_frame(tokenizer, use_chat_template: bool) -> tuple[str, str]:
    """(text before the user turn's content, text after it up to the assistant's answer)."""
    if not (use_chat_template and getattr(tokenizer, "chat_template", None)):
        return "", "\nAnswer:"
    user = {"role": "user", "content": _SENTINEL}
    try:
        text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, user],
                                             tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError:  # templates that reject a system turn
        text = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    before, after = text.split(_SENTINEL)
    return before, after


def answer_reserve(tokenizer, n: int) -> int:
    """Tokens the teacher's full answer `[1] > [2] > ... > [n]` needs, plus end-of-sequence."""
    return len(_ids(tokenizer, " > ".join(f"[{i}]" for i in range(1, n + 1)))) + 2


class PromptBuilder:
    """Encodes slates for one tokenizer; the fixed parts are tokenised once."""

    def __init__(self, tokenizer, cfg: PromptConfig, context_length: int):
        self.tokenizer, self.cfg, self.context_length = tokenizer, cfg, context_length
        before, after = chat_frame(tokenizer, cfg.use_chat_template)
        self._before, self._after = _ids(tokenizer, before), _ids(tokenizer, after)
        self._newline = _ids(tokenizer, "\n")
        self._id_tokens: dict[int, list[int]] = {}

    def id_tokens(self, i: int) -> list[int]:
        if i not in self._id_tokens:
            self._id_tokens[i] = _ids(self.tokenizer, f"[{i}]")
        return self._id_tokens[i]

    def doc_budget(self, n: int, fixed: int, with_answer: bool, per_item_extra: int = 0) -> int:
        reserve = answer_reserve(self.tokenizer, n) if with_answer else 0
        per_item = (self.context_length - fixed - reserve) // n - len(self.id_tokens(n)) - len(self._newline) - per_item_extra
        if per_item < 1:
            raise PromptTooLong(
                f"{n} candidates do not fit a context of {self.context_length} tokens "
                f"({fixed} fixed prompt tokens, {reserve} reserved for the answer); use fewer "
                f"candidates per window")
        return min(self.cfg.max_doc_tokens, per_item)

    def encode(self, request: RerankRequest, with_answer: bool = True) -> EncodedPrompt:
        """`with_answer` reserves room for the teacher's generated ranking."""
        if not request.candidates:
            raise ValueError(f"slate {request.slate_id!r} has no candidates")
        return self.encode_texts(request.query.text, [document_text(c) for c in request.candidates], with_answer)

    def encode_texts(self, query: str, documents: Sequence[str], with_answer: bool = True,
                     max_doc_tokens: int | None = None) -> EncodedPrompt:
        """A query and its documents (in first-stage order) -> the prompt's tokens and item positions.
        `max_doc_tokens` cuts documents shorter than the config does (a request's own cap)."""
        n = len(documents)
        if n == 0:
            raise ValueError("no documents to rank")
        query_ids = _ids(self.tokenizer, query)
        query_truncated = len(query_ids) > self.cfg.max_query_tokens
        if query_truncated:
            query = self.tokenizer.decode(query_ids[: self.cfg.max_query_tokens])
        template = TEMPLATES[self.cfg.template]
        head = self._before + _ids(self.tokenizer, template.prefix.format(num=n, query=query))
        tail = _ids(self.tokenizer, template.suffix.format(num=n, query=query)) + self._after
        restated = _ids(self.tokenizer, template.item_query.format(query=query)) if template.item_query else []
        budget = self.doc_budget(n, len(head) + len(tail), with_answer, len(restated))
        if max_doc_tokens is not None:
            budget = min(budget, max_doc_tokens)
        docs = self.tokenizer([" " + d for d in documents], add_special_tokens=False)["input_ids"]
        ids, positions, spans, cut = list(head), [], [], 0
        for i, doc in enumerate(docs, start=1):
            cut += len(doc) > budget
            text = doc[:budget]
            start = len(ids) + (0 if template.label_after else len(self.id_tokens(i)))
            ids += text + self.id_tokens(i) if template.label_after else self.id_tokens(i) + text
            ids += restated
            positions.append(len(ids) - 1)
            spans.append((start, start + len(text)) if text else (positions[-1], positions[-1] + 1))
            ids += self._newline
        shown = query_ids[: self.cfg.max_query_tokens], *(doc[:budget] for doc in docs)  # the query's and documents' tokens
        unk = self.tokenizer.unk_token_id
        unknown = sum(part.count(unk) for part in shown) if unk is not None else 0
        return EncodedPrompt(ids + tail, positions, cut, query_truncated, sum(map(len, shown)), unknown, spans, budget)


def prompt_messages(cfg: PromptConfig, query: str, documents: Sequence[str]) -> list[dict[str, str]]:
    """The same prompt as chat messages, for a teacher behind an API (`hllm.teacher.endpoint`), whose
    tokenizer is the server's: the system turn, then the template's words around the numbered documents.
    Without the tokenizer, the caps count whitespace words: the query is cut to `max_query_tokens` words
    and each document to `max_doc_tokens` words (a word is one token or more, so the cut is never
    looser than the local prompt's)."""
    if not documents:
        raise ValueError("no documents to rank")
    template, n = TEMPLATES[cfg.template], len(documents)
    query = " ".join(query.split()[: cfg.max_query_tokens])
    restated = template.item_query.format(query=query) if template.item_query else ""
    lines = []
    for i, doc in enumerate(documents, start=1):
        text = " ".join(doc.split()[: cfg.max_doc_tokens])
        lines.append((f"{text} [{i}]" if template.label_after else f"[{i}] {text}") + restated)
    user = template.prefix.format(num=n, query=query) + "\n".join(lines) + "\n" + template.suffix.format(num=n, query=query)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def answer_chars(n: int) -> int:
    """Characters of the full answer `[1] > [2] > ... > [n]`: a bound on its tokens under any tokenizer
    that spends at most one token per ASCII character (byte-level BPE, SentencePiece with byte fallback)."""
    return len(" > ".join(f"[{i}]" for i in range(1, n + 1)))


def document_text(candidate: Candidate) -> str:
    """What the prompt shows of a candidate (`Candidate.shown`)."""
    return candidate.shown


def collate(prompts: list[EncodedPrompt], pad_id: int, padding_side: str = "right") -> dict[str, torch.Tensor]:
    """Pads token and item dimensions. Left padding (for generation) shifts item positions.

    Returns input_ids (B, T), attention_mask (B, T), item_positions (B, N), item_mask (B, N) and
    item_spans (B, N, 2) ([start, stop) of each candidate's own tokens); padded items point at token 0
    (span [0, 1)) and are masked out.
    """
    t_max = max(len(p.input_ids) for p in prompts)
    n_max = max(len(p.item_positions) for p in prompts)
    b = len(prompts)
    input_ids = torch.full((b, t_max), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((b, t_max), dtype=torch.long)  # (B, T)
    item_positions = torch.zeros((b, n_max), dtype=torch.long)  # (B, N)
    item_mask = torch.zeros((b, n_max), dtype=torch.bool)  # (B, N)
    item_spans = torch.zeros((b, n_max, 2), dtype=torch.long)  # (B, N, 2)
    item_spans[:, :, 1] = 1
    for row, p in enumerate(prompts):
        t, n = len(p.input_ids), len(p.item_positions)
        offset = t_max - t if padding_side == "left" else 0
        input_ids[row, offset: offset + t] = torch.tensor(p.input_ids)
        attention_mask[row, offset: offset + t] = 1
        item_positions[row, :n] = torch.tensor(p.item_positions) + offset
        item_mask[row, :n] = True
        if len(p.item_spans) != n:
            raise ValueError(f"prompt {row}: {len(p.item_spans)} item spans for {n} items (build prompts with PromptBuilder)")
        item_spans[row, :n] = torch.tensor(p.item_spans) + offset
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "item_positions": item_positions, "item_mask": item_mask, "item_spans": item_spans}
