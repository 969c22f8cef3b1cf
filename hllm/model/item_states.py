"""The final hidden states at the N item positions, with the last decoder layer run only there.

The head reads the final layer at N positions of a T-token prompt (N << T), and no LM head is
needed. Every layer but the last runs as usual; in the last one, keys and values still come from
all T tokens, but queries, the attention output, the MLP and the final norm are computed for the
N item positions only. The result equals the full prefill's hidden states at those positions up
to float rounding (tested against it, LoRA merged and unmerged).

Nothing after the last candidate reaches an item state (the model is causal), so the prompt's
tail (the closing instruction and the answer cue, which the AR teacher needs) is not run at
all: the body reads the tokens up to the last item position of the batch, exactly.

The last layer's inputs (hidden states, rotary embeddings) are taken by a forward pre-hook as the
model's own code made them, then the body stops: no private model internals are re-implemented
except the one layer's arithmetic, which exists for the decoder-layer classes in
`LAST_LAYER_AT_ITEMS` (Llama-style: pre-norm, rotary attention with grouped KV heads, gated MLP).
Other architectures take the full prefill.

`pooled_item_states` reads each candidate otherwise (`POOLINGS`): the mean of its own tokens' states
(`mean`), or that beside the last token's (`last+mean`, 2D wide). A mean needs the last layer at every
passage token, so that path runs the whole body: the last layer over all T tokens instead of N.
`pooled_layer_states` reads several layers from one pass (the cached states of a layer sweep).

A backbone adapted only above layer F (LoRA on its top layers) is run from cached states: `layers_from(body, F)`
narrows the body to its layers F+1.. and every function here takes `inputs_embeds` — the output of layer F at
every token, computed once by the frozen layers below (`hllm.train.state_cache.cached_prefix_states`) — instead
of `input_ids`. The model's own forward builds the masks and rotary embeddings from them, so the result is the
full model's (tested: LoRA over cached states against the whole backbone, Llama and Gemma 3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, rotate_half
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

LAST_LAYER_AT_ITEMS: tuple[type[nn.Module], ...] = (LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer)


class _LastLayerInputs(Exception):
    """Carries the last layer's inputs out of the body (raised by the pre-hook, caught below)."""

    def __init__(self, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.hidden, self.position_embeddings = hidden, position_embeddings


def supports_items_only(body: nn.Module) -> bool:
    layer = body.layers[-1]
    window = getattr(getattr(layer.self_attn, "config", None), "sliding_window", None)
    return isinstance(layer, LAST_LAYER_AT_ITEMS) and not window and hasattr(body, "norm")


def _last_layer_at(layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """The last decoder layer's output at the item positions. h: (B, T, D); positions: (B, N)."""
    attn = layer.self_attn
    b, t, _ = h.shape
    n, d = positions.shape[1], attn.head_dim
    rows = torch.arange(b, device=h.device)[:, None]  # (B, 1): with positions, indexes (B, N) states
    x = layer.input_layernorm(h)  # (B, T, D): keys and values need every token
    q = attn.q_proj(x[rows, positions]).view(b, n, -1, d).transpose(1, 2)  # (B, H, N, d)
    k = attn.k_proj(x).view(b, t, -1, d).transpose(1, 2)  # (B, Hkv, T, d)
    v = attn.v_proj(x).view(b, t, -1, d).transpose(1, 2)  # (B, Hkv, T, d)
    cos, sin = cos.expand(b, -1, -1), sin.expand(b, -1, -1)  # (B, T, d): shared positions come as (1, T, d)
    q = q * cos[rows, positions][:, None] + rotate_half(q) * sin[rows, positions][:, None]
    k = k * cos[:, None] + rotate_half(k) * sin[:, None]
    # causal at the item positions; right padding puts every pad token after every real one, so
    # the keys up to an item's position are all real tokens
    allowed = torch.arange(t, device=h.device) <= positions[:, None, :, None]  # (B, 1, N, T)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=attn.scaling,
                                         enable_gqa=k.shape[1] != q.shape[1])  # (B, H, N, d)
    hidden = h[rows, positions] + attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))  # (B, N, D)
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


@contextlib.contextmanager
def layers_from(body: nn.Module, start: int) -> Iterator[nn.Module]:
    """The body narrowed to its decoder layers start+1.. (1-based), for as long as the block runs: fed the output
    of layer `start` as `inputs_embeds`, it computes what the whole body computes from the prompt. Its config's
    per-layer lists (`layer_types`: Gemma 3's sliding and full attention) are narrowed with it. `start` 0: the body."""
    if start == 0:
        yield body
        return
    if not 0 < start < len(body.layers):
        raise ValueError(f"layers_from: start {start} must lie in 0..{len(body.layers) - 1} (the body's decoder layers)")
    layers, cfg = body.layers, body.config
    count, types = cfg.num_hidden_layers, getattr(cfg, "layer_types", None)
    body.layers = layers[start:]
    cfg.num_hidden_layers = len(layers) - start
    if types:
        cfg.layer_types = types[start:]
    try:
        yield body
    finally:
        body.layers, cfg.num_hidden_layers = layers, count
        if types:
            cfg.layer_types = types


def _inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, attention_mask: torch.Tensor,
            read: int) -> dict[str, torch.Tensor]:
    """The body's keyword inputs cut to the first `read` tokens: the prompt's ids, or the states of a lower layer."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds")
    tokens = {"input_ids": input_ids[:, :read]} if input_ids is not None else {"inputs_embeds": inputs_embeds[:, :read]}
    return tokens | {"attention_mask": attention_mask[:, :read]}  # (B, T') T' <= T


def item_hidden_states(body: nn.Module, input_ids: torch.Tensor | None, attention_mask: torch.Tensor,
                       item_positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) prompt (or (B, T, D) `inputs_embeds`: a lower layer's states, under `layers_from`), (B, N) item
    positions -> (B, N, D) final hidden states at the items. Right padding only (the ranker's prompts)."""
    read = int(item_positions.max()) + 1  # causal: the tokens after the last item cannot reach it
    inputs = _inputs(input_ids, inputs_embeds, attention_mask, read)
    if not supports_items_only(body):
        h = body(**inputs, use_cache=False).last_hidden_state  # (B, T', D)
        return h[torch.arange(len(h), device=h.device)[:, None], item_positions]
    last = body.layers[-1]

    def stop(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        raise _LastLayerInputs(hidden, kwargs["position_embeddings"])

    handle = last.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        body(**inputs, use_cache=False)
        raise RuntimeError("the decoder body finished without reaching its last layer")
    except _LastLayerInputs as inputs:
        cos, sin = inputs.position_embeddings  # (B or 1, T, d) each
        hidden = _last_layer_at(last, inputs.hidden, cos, sin, item_positions)
    finally:
        handle.remove()
    return body.norm(hidden)  # (B, N, D)


# how a candidate's states become what the head reads: the parts, concatenated in this order, each
# through the final norm. `last`: its last token (the paper's); `mean`: the mean over its own tokens
POOLINGS: dict[str, tuple[str, ...]] = {"last": ("last",), "mean": ("mean",), "last+mean": ("last", "mean")}
Pooling = Literal["last", "mean", "last+mean"]


def span_means(h: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """(B, T, D) states, (B, N, 2) [start, stop) spans -> (B, N, D) the mean state over each span."""
    t = torch.arange(h.shape[1], device=h.device)  # (T,)
    inside = (t >= spans[..., :1]) & (t < spans[..., 1:])  # (B, N, T)
    weights = inside.to(h.dtype) / inside.sum(-1, keepdim=True).clamp_min(1).to(h.dtype)  # (B, N, T)
    return weights @ h  # (B, N, D)


class _Done(Exception):
    """Raised after the deepest layer asked for: the layers above it are not run."""


def layer_outputs(body: nn.Module, inputs: dict[str, torch.Tensor], layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """The body's keyword inputs (`input_ids` or `inputs_embeds`, `attention_mask`) -> {L: (B, T, D)} the output
    of decoder layer L (1-based) at every token, before the final norm, for each L in `layers`: one forward
    pass of the body, stopped after the deepest of them."""
    out: dict[int, torch.Tensor] = {}
    deepest = max(layers)

    def keeper(layer: int):
        def keep(module, args, output):
            out[layer] = output[0] if isinstance(output, tuple) else output
            if layer == deepest and deepest < len(body.layers):
                raise _Done
        return keep

    handles = [body.layers[layer - 1].register_forward_hook(keeper(layer)) for layer in layers]
    try:
        body(**inputs, use_cache=False)
    except _Done:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return out


def pooled_item_states(body: nn.Module, input_ids: torch.Tensor | None, attention_mask: torch.Tensor, item_positions: torch.Tensor,
                       item_spans: torch.Tensor | None, pooling: Pooling = "last",
                       inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) prompt (or `inputs_embeds`, under `layers_from`), (B, N) item positions, (B, N, 2) item spans
    -> (B, N, P * D) what the head reads, P = len(POOLINGS[pooling]). `last` is `item_hidden_states` (the
    items-only last layer)."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; one of {sorted(POOLINGS)}")
    if pooling == "last":
        return item_hidden_states(body, input_ids, attention_mask, item_positions, inputs_embeds)
    return pooled_layer_states(body, input_ids, attention_mask, item_positions, item_spans, pooling, [len(body.layers)],
                               inputs_embeds)[len(body.layers)]


def pooled_layer_states(body: nn.Module, input_ids: torch.Tensor | None, attention_mask: torch.Tensor, item_positions: torch.Tensor,
                        item_spans: torch.Tensor | None, pooling: Pooling, layers: Sequence[int],
                        inputs_embeds: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """The same as `pooled_item_states` of the body cut after each layer L in `layers`, from one forward
    pass: {L: (B, N, P * D)}, every layer's states through the body's final norm (as a body cut at L
    reads them). The last layer runs over all T tokens here, so `last` agrees with the items-only path
    up to float rounding."""
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; one of {sorted(POOLINGS)}")
    if not layers or min(layers) < 1 or max(layers) > len(body.layers):
        raise ValueError(f"layers {list(layers)} must lie in 1..{len(body.layers)} (the body's decoder layers)")
    if "mean" in POOLINGS[pooling] and item_spans is None:
        raise ValueError(f"pooling {pooling!r} needs item_spans (hllm.model.prompts.collate makes them)")
    last_read = item_positions.max() if item_spans is None else torch.maximum(item_positions.max(), item_spans[..., 1].max() - 1)
    read = int(last_read) + 1  # causal: nothing later matters
    outputs = layer_outputs(body, _inputs(input_ids, inputs_embeds, attention_mask, read), layers)  # {L: (B, T', D)}
    return {layer: pool_states(body, h, item_positions, item_spans, pooling) for layer, h in outputs.items()}


def pool_states(body: nn.Module, h: torch.Tensor, item_positions: torch.Tensor, item_spans: torch.Tensor | None,
                pooling: Pooling) -> torch.Tensor:
    """(B, T, D) a layer's output at every token -> (B, N, P * D): each candidate read as `pooling` says, every
    part through the body's final norm (as a body cut at that layer reads it)."""
    rows = torch.arange(len(h), device=h.device)[:, None]  # (B, 1)

    def part(name: str) -> torch.Tensor:  # -> (B, N, D)
        return h[rows, item_positions] if name == "last" else span_means(h, item_spans)

    return torch.cat([body.norm(part(p)) for p in POOLINGS[pooling]], dim=-1)  # (B, N, P * D)
