"""LoRA over cached prefix states: the paper's student (LoRA on the top decoder layers + a head) trained where a
forward pass through the whole backbone per step does not fit the budget.

A backbone cut after layer C adapts only its top `lora_layers`; the layers below (1..F, F = C - lora_layers) never
change, so their output at every token of a prompt is computed once (`hllm.train.state_cache.cached_prefix_states`):
for whole lists (what a student ranks: one pass, N candidates, K positions) and for sub-slates of them (what it trains
on: a few candidates of a list with the teacher's relative order). The same prefill keeps the frozen model's item
states at C, which a closed-form probe reads. A training step runs layers F+1..C with LoRA, the head and the loss —
the project's loop (`hllm.train.loop.train_loop`), no second one.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hllm.data.order import InputOrder
from hllm.model.prompts import collate
from hllm.model.ranker import SinglePassRanker
from hllm.records import RerankRequest
from hllm.train.loop import LossConfig, TorchOptimizer, TrainConfig, batches, padded_targets, param_groups, train_loop
from hllm.train.losses import mixed_loss
from hllm.train.state_cache import PrefixStates

log = logging.getLogger("hllm")


@dataclass
class SubSlateConfig:
    """What a LoRA student trains on: `per_list` sub-slates of `items` candidates of each training list, the j-th read
    in `orders[j % len(orders)]` (`hllm.data.order`: `first-stage` as drawn, `shuffled` each its own shuffle, undeclared
    to the prior), each with the teacher's relative order of its candidates."""

    items: int = 20
    per_list: int = 2
    orders: list[str] = field(default_factory=lambda: ["first-stage"])

    def __post_init__(self) -> None:
        if self.items < 2 or self.per_list < 1:
            raise ValueError("sub-slates: items >= 2 and per_list >= 1")
        if not self.orders:
            raise ValueError("sub-slates: at least one order (first-stage: as drawn)")
        for o in self.orders:
            InputOrder.parse(o)


def sub_slates(slates: Sequence[RerankRequest], perms: Sequence[list[int]], keys: Sequence[str], cfg: SubSlateConfig,
               seed: int) -> tuple[list[RerankRequest], list[list[int]], list[bool]]:
    """`cfg.per_list` sub-slates of each list (its teacher permutation in `perms`), drawn by a seed of the list's own key
    (the same sub-slates whichever lists are asked) -> (sub-slates, the teacher's relative order of each, whether each
    is read in a declared first-stage order), list-major."""
    orders = [InputOrder.parse(o) for o in cfg.orders]
    out, out_perms, declared = [], [], []
    for slate, perm, key in zip(slates, perms, keys):
        rng = random.Random(f"{seed}/{key}")
        n = len(slate.candidates)
        for j in range(cfg.per_list):
            order = orders[j % len(orders)]
            keep = sorted(rng.sample(range(n), min(cfg.items, n)))
            if order.kind == "shuffled":
                rng.shuffle(keep)
            elif order.kind == "reversed":
                keep.reverse()
            where = {c: i for i, c in enumerate(keep)}
            out.append(dataclasses.replace(slate, candidates=[slate.candidates[c] for c in keep],
                                           grades=[slate.grades[c] for c in keep] if slate.grades else None))
            out_perms.append([where[c] for c in perm if c in where])
            declared.append(order.declared)
    return out, out_perms, declared


@dataclass
class SubSlates:
    """Training sub-slates with their prefix states: the teacher's relative order of each, whether its order is declared."""

    states: PrefixStates
    perms: list[list[int]]
    declared: list[bool]


@dataclass
class PrefixRef:
    """Where one list's prefix states are: its whole prompt (`whole`, prompt `at`) and its training sub-slates
    (`sub_index` into `subs`; empty where no LoRA student trains on its stage)."""

    whole: PrefixStates
    at: int
    subs: SubSlates | None = None
    sub_index: list[int] = field(default_factory=list)


def prefix_batch(ranker: SinglePassRanker, cache: PrefixStates, index: list[int]) -> dict[str, torch.Tensor]:
    """Prompts `index` of a prefix cache -> the ranker's batch with `hidden` (B, T, D): each prompt's cached layer-F
    states, right-padded (the padding masked out)."""
    encoded = [cache.encoded(i) for i in index]
    batch = collate(encoded, ranker.tokenizer.pad_token_id)
    states = [cache.hidden(i) for i in index]  # each (T_i, D), T_i: up to the prompt's last candidate
    t = max(len(h) for h in states)
    hidden = torch.zeros(len(index), t, states[0].shape[1])  # (B, T, D)
    mask = torch.zeros(len(index), t, dtype=batch["attention_mask"].dtype)  # (B, T)
    for row, h in enumerate(states):
        hidden[row, : len(h)], mask[row, : len(h)] = h, 1
    batch |= {"hidden": hidden, "attention_mask": mask}
    return {k: v.to(ranker.device) for k, v in batch.items()}


def prefix_logits(ranker: SinglePassRanker, batch: dict[str, torch.Tensor], declared: torch.Tensor | None = None) -> torch.Tensor:
    """(B, N, K) the ranker's logits from cached layer-F states: only its adapted layers run. `declared` (B,): whether
    each prompt's order is a declared first-stage ranking (None: all are)."""
    items = ranker.item_states_from(batch["hidden"], batch["attention_mask"], batch["item_positions"], batch["item_spans"],
                                    ranker.frozen_below)
    return ranker.score_states(items, batch["item_mask"], declared)


def train_lora(ranker: SinglePassRanker, subs: SubSlates, examples: list[int], train: TrainConfig, loss: LossConfig,
               name: str) -> list[dict]:
    """Trains `ranker` (LoRA adapters and head) on sub-slates `examples` of `subs` over their cached prefix states, by
    the project's loop; -> its history rows."""
    device = ranker.device

    def loss_fn(chunk: list[int]):
        batch = prefix_batch(ranker, subs.states, chunk)
        perm, grades = padded_targets([subs.perms[j] for j in chunk], [subs.states.slates[j].grades for j in chunk],
                                      batch["item_mask"].shape[1])
        declared = torch.tensor([subs.declared[j] for j in chunk], device=device)  # (B,) a shuffled sub-slate: no prior
        return mixed_loss(prefix_logits(ranker, batch, declared), batch["item_mask"], loss.terms, perm=perm.to(device),
                          grades=grades.to(device))

    def progress(step: int, row: dict) -> None:
        log.info("    %s step %d/%d: loss %.4f, %.1f s a step", name, step, train.steps, row["loss"], row["elapsed_s"] / step)

    ranker.train()
    history = train_loop(loss_fn, batches(examples, train.batch_size, train.seed), TorchOptimizer(param_groups(ranker, train), train),
                         train, device.type, log=progress)
    ranker.eval()
    return history


@torch.inference_mode()
def lora_matrices(ranker: SinglePassRanker, refs: Sequence[PrefixRef]) -> list[np.ndarray]:
    """Whole lists, one pass each from their cached prefix: (N, min(N, K)) matrices."""
    out = []
    for r in refs:
        logits = prefix_logits(ranker, prefix_batch(ranker, r.whole, [r.at]))[0].float().cpu().numpy()  # (N, K)
        out.append(logits[:, : min(logits.shape[0], logits.shape[1])])
    return out
