"""Item states computed once: a frozen backbone's states at every candidate, kept on disk.

With a frozen backbone (`adapt.mode: frozen`) the states the head reads never change while it
trains, so the prefill — nearly all of the cost (a 135M model: ~10 s for a 100-passage prompt on
2 cores, the head ~1 ms) — runs once per slate instead of once per slate per epoch. The states go
to a folder in shards (`shard-00000.safetensors`, one tensor per slate, float32 (N, P * D)), written
atomically as they are computed, so an interrupted run resumes at the first missing shard.

The folder is bound to one key (`states_key`): the backbone (preset, path, dtype, the weights' id),
where it is cut (`state_layer`), how each candidate is read (`pooling`), the prompt config, and every
slate's query, documents and order. A folder made under another key is refused with `StaleStates`,
never read: states of another model, prompt or candidate list would train a head on what it will
never see.

A backbone adapted only in its top layers (LoRA on layers F+1..C) keeps the layers below frozen too:
`cached_prefix_states` keeps, per prompt, the output of layer F at every token (`hidden`, (T, D) float32)
— the LoRA student then runs only its adapted layers on it, each training step and each test list —
and, from the same prefill, the frozen model's item states at its cut (`items`): a frozen probe's input. `cached_layer_states` fills the folders of several cut points (a layer sweep) from one
prefill per shard, each folder under the key of the ranker cut there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hllm.data.cache import fingerprint
from hllm.model.backbones import weights_id
from hllm.model.item_states import layer_outputs, pool_states, pooled_layer_states
from hllm.model.prompts import collate, document_text
from hllm.model.ranker import RankerConfig, SinglePassRanker
from hllm.records import RerankRequest

KEY_FILE = "states.json"
log = logging.getLogger("hllm")


class StaleStates(ValueError):
    """A state folder made for another model, prompt or set of slates."""


def states_key(rcfg: RankerConfig, slates: Sequence[RerankRequest]) -> str:
    """What the states depend on, and nothing else (the head and the training do not change them)."""
    if rcfg.adapt.mode != "frozen":
        raise ValueError(f"item states can be cached only for a frozen backbone (adapt.mode=frozen), "
                         f"not {rcfg.adapt.mode!r}: its states change as it trains")
    content = [(s.slate_id, s.query.text, [(c.docid, document_text(c)) for c in s.candidates]) for s in slates]
    return fingerprint(rcfg.model, weights_id(rcfg.model), rcfg.state_layer, rcfg.pooling, rcfg.prompt, content)


def _bind(directory: Path, key: str, slates: int, shard_slates: int) -> None:
    """Binds an empty folder to `key`; refuses one bound to another key."""
    marker = directory / KEY_FILE
    if marker.is_file():
        bound = json.loads(marker.read_text())
        if bound["key"] != key or bound["shard_slates"] != shard_slates:
            raise StaleStates(f"{directory} holds item states for key {bound['key']} (shards of {bound['shard_slates']}), "
                              f"not {key} (shards of {shard_slates}): another model, prompt or slate list; "
                              f"use another folder or delete this one")
        return
    directory.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"key": key, "slates": slates, "shard_slates": shard_slates}))


def _shard(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.safetensors"


@torch.inference_mode()
def compute_states(ranker: SinglePassRanker, slates: Sequence[RerankRequest], batch_size: int = 1) -> list[torch.Tensor]:
    """Per slate, its (N, D) float32 item states (one prefill per `batch_size` slates, no head)."""
    return compute_layer_states(ranker, slates, [_cut(ranker)], batch_size)[_cut(ranker)]


@torch.inference_mode()
def compute_layer_states(ranker: SinglePassRanker, slates: Sequence[RerankRequest], layers: Sequence[int],
                         batch_size: int = 1) -> dict[int, list[torch.Tensor]]:
    """{L: per slate its (N, D) float32 item states after decoder layer L}, for every L in `layers` (at
    most the ranker's cut), from one prefill per `batch_size` slates: what rankers cut at each L read."""
    out: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    for start in range(0, len(slates), batch_size):
        chunk = slates[start: start + batch_size]
        batch = collate([ranker.prompts.encode(s, with_answer=False) for s in chunk], ranker.tokenizer.pad_token_id)
        batch = {k: v.to(ranker.device) for k, v in batch.items()}
        args = (batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_spans"])
        if list(layers) == [_cut(ranker)]:  # the ranker's own read (the items-only last layer for `last`)
            states = {layers[0]: ranker.item_states(*args)}  # (B, N, P * D)
        else:
            states = pooled_layer_states(ranker.body, *args, ranker.cfg.pooling, layers)  # {L: (B, N, P * D)}
        for layer, x in states.items():
            out[layer] += [x[row, : len(s.candidates)].float().cpu() for row, s in enumerate(chunk)]
    return out


def _cut(ranker: SinglePassRanker) -> int:
    return len(ranker.body.layers)


def cached_states(ranker: SinglePassRanker, slates: Sequence[RerankRequest], directory: str | Path,
                  shard_slates: int = 8, batch_size: int = 1,
                  progress: Callable[[int, int, float], None] | None = None) -> list[torch.Tensor]:
    """-> per slate its (N, D) item states: read from `directory` where computed before under the
    same key, computed (and written shard by shard) where missing. Raises `StaleStates` for a
    folder of another key. `progress(done, total, seconds)` after each shard computed."""
    layer = _cut(ranker)
    return cached_layer_states(ranker, slates, {layer: directory}, shard_slates, batch_size, progress)[layer]


def layer_key(rcfg: RankerConfig, layer: int, slates: Sequence[RerankRequest]) -> str:
    """The key of a ranker that is `rcfg` cut after `layer`."""
    return states_key(dataclasses.replace(rcfg, state_layer=layer), slates)


def cached_layer_states(ranker: SinglePassRanker, slates: Sequence[RerankRequest], directories: dict[int, str | Path],
                        shard_slates: int = 8, batch_size: int = 1,
                        progress: Callable[[int, int, float], None] | None = None) -> dict[int, list[torch.Tensor]]:
    """`cached_states` for several layers of one ranker at once ({layer: its folder}, each folder bound
    to the key of the ranker cut at that layer): a shard missing from any folder is computed for every
    layer by one prefill (`compute_layer_states`). -> {layer: per slate its (N, D) item states}."""
    directories = {layer: Path(d) for layer, d in directories.items()}
    layers = sorted(directories)
    for layer, directory in directories.items():
        key = states_key(ranker.cfg, slates) if layer == _cut(ranker) else layer_key(ranker.cfg, layer, slates)
        _bind(directory, key, len(slates), shard_slates)
    starts = range(0, len(slates), shard_slates)
    missing = [i for i, _ in enumerate(starts) if not all(_shard(d, i).is_file() for d in directories.values())]
    if missing:
        log.info("item states: %d slates in %d shards, %d to compute (layers %s: %s)", len(slates), len(starts),
                 len(missing), layers, ", ".join(map(str, directories.values())))
    t0 = time.perf_counter()
    for done, index in enumerate(missing, start=1):
        chunk = slates[index * shard_slates: (index + 1) * shard_slates]
        for layer, states in compute_layer_states(ranker, chunk, layers, batch_size).items():
            tmp = directories[layer] / f".tmp-{os.getpid()}-{index}.safetensors"
            save_file({str(row): s.contiguous() for row, s in enumerate(states)}, tmp)
            os.replace(tmp, _shard(directories[layer], index))  # atomic: a shard is whole or absent
        if progress:
            progress(done, len(missing), time.perf_counter() - t0)
    return {layer: _read(directory, slates, shard_slates) for layer, directory in directories.items()}


def _read(directory: Path, slates: Sequence[RerankRequest], shard_slates: int) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for index, start in enumerate(range(0, len(slates), shard_slates)):
        shard = load_file(_shard(directory, index))
        out += [shard[str(row)] for row in range(len(slates[start: start + shard_slates]))]
    for s, states in zip(slates, out):
        if states.shape[0] != len(s.candidates):
            raise StaleStates(f"{directory}: slate {s.slate_id} has {len(s.candidates)} candidates but "
                              f"{states.shape[0]} cached states")
    return out


PREFIX_FILE = "prompt-{:05d}.safetensors"


def prefix_key(rcfg: RankerConfig, layer: int, slates: Sequence[RerankRequest]) -> str:
    """What a prefix cache depends on: the backbone, the layer kept, the frozen cut and pooling of the item
    states kept beside it, the prompt, and every slate's query, documents and order."""
    content = [(s.slate_id, s.query.text, [(c.docid, document_text(c)) for c in s.candidates]) for s in slates]
    return fingerprint("prefix", rcfg.model, weights_id(rcfg.model), layer, rcfg.state_layer, rcfg.pooling, rcfg.prompt, content)


class PrefixStates:
    """A prefix cache read back: per prompt its layer-F output at every token up to its last candidate
    (`hidden(i)`, (T, D)), the frozen model's item states at its cut (`items(i)`, (N, P * D)), and the
    prompt's item positions and spans (`encoded(i)`). Loaded one prompt at a time (a 100-passage prompt's
    states are ~13 MB)."""

    def __init__(self, directory: Path, ranker: SinglePassRanker, slates: Sequence[RerankRequest], layer: int):
        self.directory, self.slates, self.layer = directory, list(slates), layer
        self.prompts = ranker.prompts

    def __len__(self) -> int:
        return len(self.slates)

    def _tensor(self, i: int, name: str) -> torch.Tensor:
        with safe_open(self.directory / PREFIX_FILE.format(i), framework="pt") as f:  # reads that tensor only
            return f.get_tensor(name)

    def hidden(self, i: int) -> torch.Tensor:
        return self._tensor(i, "hidden")

    def items(self, i: int) -> torch.Tensor:
        return self._tensor(i, "items")

    def encoded(self, i: int):
        return self.prompts.encode(self.slates[i], with_answer=False)


@torch.inference_mode()
def compute_prefix(ranker: SinglePassRanker, slate: RerankRequest, layer: int) -> dict[str, torch.Tensor]:
    """One prompt through the frozen `ranker` (cut at C >= `layer`): {"hidden": (T, D) the output of decoder layer
    `layer` at its tokens up to the last candidate's, "items": (N, P * D) its item states at C, as `ranker` reads them}."""
    batch = collate([ranker.prompts.encode(slate, with_answer=False)], ranker.tokenizer.pad_token_id)
    batch = {k: v.to(ranker.device) for k, v in batch.items()}
    read = int(torch.maximum(batch["item_positions"].max(), batch["item_spans"][..., 1].max() - 1)) + 1
    cut = _cut(ranker)
    outputs = layer_outputs(ranker.body, {"input_ids": batch["input_ids"][:, :read],
                                          "attention_mask": batch["attention_mask"][:, :read]}, sorted({layer, cut}))
    items = pool_states(ranker.body, outputs[cut], batch["item_positions"], batch["item_spans"], ranker.cfg.pooling)
    return {"hidden": outputs[layer][0].float().cpu().contiguous(), "items": items[0].float().cpu().contiguous()}


def cached_prefix_states(ranker: SinglePassRanker, slates: Sequence[RerankRequest], layer: int, directory: str | Path,
                         progress: Callable[[int, int, float], None] | None = None) -> PrefixStates:
    """Per slate the output of decoder layer `layer` of the frozen `ranker` (and its item states at its cut),
    read from `directory` where computed before under the same key (`prefix_key`), computed and written one
    prompt at a time (atomically: a stopped run resumes at the first missing one) where not. Raises
    `StaleStates` for a folder of another key. `progress(done, total, seconds)` after each prompt computed."""
    if ranker.cfg.adapt.mode != "frozen":
        raise ValueError("cached_prefix_states needs the frozen backbone (adapt.mode=frozen): the states it keeps must not train")
    if not 1 <= layer <= _cut(ranker):
        raise ValueError(f"prefix layer {layer} must lie in 1..{_cut(ranker)} (the ranker's cut)")
    directory = Path(directory)
    _bind(directory, prefix_key(ranker.cfg, layer, slates), len(slates), 1)
    missing = [i for i in range(len(slates)) if not (directory / PREFIX_FILE.format(i)).is_file()]
    if missing:
        log.info("prefix states (layer %d of %d): %d of %d prompts to compute in %s", layer, _cut(ranker), len(missing),
                 len(slates), directory)
    t0 = time.perf_counter()
    for done, i in enumerate(missing, start=1):
        tmp = directory / f".tmp-{os.getpid()}-{i}.safetensors"
        save_file(compute_prefix(ranker, slates[i], layer), tmp)
        os.replace(tmp, directory / PREFIX_FILE.format(i))  # a prompt's file is whole or absent
        if progress:
            progress(done, len(missing), time.perf_counter() - t0)
    return PrefixStates(directory, ranker, slates, layer)
