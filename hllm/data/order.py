"""The order candidates arrive in: as the first stage ranked them, shuffled, or reversed.

A rerank API's `documents` is a set to most callers (merged retrievers, rows from a database); only a caller
who says so hands over a ranking. `InputOrder` names the orders a measurement or a training list is read in,

    InputOrder.parse("first-stage")   # the slate as the first stage ranked it (declared: the prior may read it)
    InputOrder.parse("shuffled:3")    # a fixed shuffle per query, drawn from seed 3 and the query's id
    InputOrder.parse("reversed")      # worst first

    InputOrder.parse("canonical")     # by a hash of each document's text: how a set (no order declared) is read

and `reorder` applies one to a slate, its grades with it (a slate's target is its documents' ids and grades, so
a teacher's ranking, by ids, stays aligned with the shuffled documents by construction). Only `first-stage` is a
*declared* order: a shuffle or a reversal is not a ranking anybody made, so nothing may lean on it.

A set has no order, but a causal prompt must put its documents in one, and a document's hidden state depends on
what came before it. So an undeclared list is read in its `canonical_order` — a function of the texts alone — and
the answer mapped back: the same documents in any arrival order give the same prompt, hence the same ranking,
exactly (only documents of identical text keep their arrival order among themselves).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from hllm.data.splits import unit_hash
from hllm.records import RerankRequest

OrderKind = Literal["first-stage", "shuffled", "reversed", "canonical"]
ORDER_KINDS: tuple[str, ...] = ("first-stage", "shuffled", "reversed", "canonical")
KNOWN = "first-stage, shuffled[:SEED], reversed, canonical"


@dataclass(frozen=True)
class InputOrder:
    kind: OrderKind = "first-stage"
    seed: int = 0  # shuffled: one fixed permutation per (seed, query id)

    def __post_init__(self) -> None:
        if self.kind not in ORDER_KINDS:
            raise ValueError(f"unknown input order {self.kind!r}; known: {KNOWN}")

    @classmethod
    def parse(cls, text: str) -> "InputOrder":
        """'first-stage' | 'shuffled' | 'shuffled:SEED' | 'reversed' | 'canonical' -> the order (a clear error otherwise)."""
        kind, _, seed = text.strip().partition(":")
        if seed and kind != "shuffled":
            raise ValueError(f"input order {text!r}: only shuffled takes a seed (shuffled:SEED)")
        try:
            return cls(kind, int(seed) if seed else 0)  # type: ignore[arg-type]
        except ValueError as err:
            raise ValueError(f"input order {text!r}: {err}" if "unknown" not in str(err)
                             else f"unknown input order {text!r}; known: {KNOWN}") from None

    def __str__(self) -> str:
        return f"shuffled:{self.seed}" if self.kind == "shuffled" else self.kind

    @property
    def declared(self) -> bool:
        """Whether this order is a ranking a caller may declare (the first stage's): the only one a prior may read."""
        return self.kind == "first-stage"

    def permutation(self, n: int, key: str, texts: Sequence[str] | None = None) -> list[int]:
        """-> `perm` with perm[new position] = old position, for a list of `n` under the query id `key`
        (`canonical` reads the documents' `texts`)."""
        if self.kind == "first-stage":
            return list(range(n))
        if self.kind == "reversed":
            return list(range(n - 1, -1, -1))
        if self.kind == "canonical":
            if texts is None or len(texts) != n:
                raise ValueError("the canonical order is the documents' texts' order: give their n texts")
            return canonical_order(texts)
        rng = np.random.default_rng(int(unit_hash(f"order-{self.seed}:{key}") * 0xFFFFFFFF))
        return [int(i) for i in rng.permutation(n)]


FIRST_STAGE = InputOrder("first-stage")
CANONICAL = InputOrder("canonical")


def canonical_order(texts: Sequence[str]) -> list[int]:
    """How a set of documents is read: -> perm with perm[position in the prompt] = the document's index, sorted by a
    64-bit BLAKE2 hash of each text (ties, identical texts: in the order given). A function of the texts alone, so every
    arrival order of the same documents gives the same prompt; and no order a caller could mean (not the first
    stage's, not the texts' alphabet or length), so a model cannot learn to lean on it."""
    keys = [hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest() for t in texts]
    return sorted(range(len(texts)), key=lambda i: (keys[i], i))


def reorder(slate: RerankRequest, order: InputOrder) -> RerankRequest:
    """The slate with its candidates (and their grades) in `order`; the query, the judged documents outside it
    and every candidate's id unchanged, so targets by id (qrels, a teacher's ranking) stay aligned."""
    if order == FIRST_STAGE:
        return slate
    return permuted(slate, order.permutation(len(slate.candidates), slate.slate_id, [c.shown for c in slate.candidates]))


def permuted(slate: RerankRequest, perm: Sequence[int]) -> RerankRequest:
    """The slate with candidate perm[k] (and its grade) at position k; everything else unchanged."""
    grades = None if slate.grades is None else [slate.grades[i] for i in perm]
    return dataclasses.replace(slate, candidates=[slate.candidates[i] for i in perm], grades=grades)


def first_stage_ranks(slate: RerankRequest, original: RerankRequest) -> list[int]:
    """Each candidate of `slate` (a reordering of `original`) -> its 0-based rank in `original`'s first-stage order."""
    where = {c.docid: r for r, c in enumerate(original.candidates)}
    return [where[c.docid] for c in slate.candidates]
