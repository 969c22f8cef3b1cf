"""The single-pass ranker: backbone (+ LoRA) prefill -> item hidden states -> head -> N x K matrix.

One forward pass of the backbone's decoder body (no LM head, no generation) per batch of slates;
the head reads the hidden state at the last token of every candidate. This module is the model
(build, train, save, load); inference goes through `hllm.reranker.Reranker`. Saved as a directory:

    hllm_ranker.json     model / adapt / head / prompt configs (the base-model reference)
    adapter/             peft LoRA adapter (safetensors), when adapt.mode == "lora"
    backbone/            full backbone weights (safetensors), when adapt.mode == "full"
    base/                a copy of a file-backed base model (`hf`, `embedded`), when saved with bundle_base=True
    head.safetensors     head weights
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn

from hllm.config import from_dict, to_dict
from hllm.model.backbones import ModelConfig, load_backbone, save_backbone, weights_dir
from hllm.model.card import CONFIG_FILE
from hllm.model.heads import HeadConfig, RankPriorHead, build_head
from hllm.model.item_states import POOLINGS, Pooling, layers_from, pooled_item_states
from hllm.model.prompts import PromptBuilder, PromptConfig

@dataclass
class AdaptConfig:
    """How the backbone is adapted: frozen, LoRA, or full fine-tuning."""

    mode: Literal["lora", "frozen", "full"] = "lora"  # how the backbone trains
    lora_r: int = 64  # LoRA rank (the paper: 64)
    lora_alpha: int = 128  # LoRA scale numerator (scale = alpha / r)
    lora_dropout: float = 0.0  # LoRA dropout while training
    lora_targets: list[str] = field(default_factory=lambda: [  # modules LoRA adapts
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # LoRA on the top this many decoder layers of the (cut) backbone only; None: every layer. The layers below
    # stay frozen, so their output can be computed once per prompt and cached (`SinglePassRanker.frozen_below`)
    lora_layers: int | None = None

    def __post_init__(self) -> None:
        if self.mode == "lora" and self.lora_r < 1:
            raise ValueError("adapt.lora_r must be >= 1")
        if self.lora_layers is not None and self.lora_layers < 1:
            raise ValueError("adapt.lora_layers must be >= 1 (the top layers adapted), or null for all")


@dataclass
class RankerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    adapt: AdaptConfig = field(default_factory=AdaptConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    # the head reads the states after this many decoder layers (the backbone is cut there: the layers
    # above are never run); None: all of them. A frozen LM often keeps relevance in its middle layers
    state_layer: int | None = None
    # what the head reads of each candidate (hllm.model.item_states.POOLINGS): its last token's state (the
    # paper's), the mean over its own tokens, or both side by side (the head's input is then 2D wide)
    pooling: Pooling = "last"
    # the list size the model ranks in one pass by default (`Reranker.load`, `hllm rerank`); longer
    # lists go in windows of this many. None: the head's K
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 2:
            raise ValueError("window must be >= 2 (documents per pass), or null for the head's K")
        if self.state_layer is not None and self.state_layer < 1:
            raise ValueError("state_layer must be >= 1 (decoder layers kept), or null for all")


def cut_backbone(model: nn.Module, layers: int | None) -> nn.Module:
    """Keeps the first `layers` decoder layers of a causal LM (its final norm stays): the head then
    reads the states after layer `layers`, and the layers above cost nothing."""
    if layers is None:
        return model
    body = model.get_decoder()
    if layers > len(body.layers):
        raise ValueError(f"state_layer={layers} but the backbone has {len(body.layers)} decoder layers")
    body.layers = body.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    return model


@contextlib.contextmanager
def peft_on_transformers():
    """peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` alias when it wraps a model; that
    FutureWarning is about peft's code, not ours, so it is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def adapt_backbone(model: nn.Module, cfg: AdaptConfig) -> nn.Module:
    if cfg.mode == "lora":
        depth = len(model.get_decoder().layers)
        if cfg.lora_layers is not None and cfg.lora_layers > depth:
            raise ValueError(f"adapt.lora_layers={cfg.lora_layers} but the (cut) backbone has {depth} decoder layers")
        top = None if cfg.lora_layers is None else list(range(depth - cfg.lora_layers, depth))
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_targets), bias="none", layers_to_transform=top,
                          layers_pattern="layers" if top else None)
        with peft_on_transformers():
            return get_peft_model(model, lora)
    model.requires_grad_(cfg.mode == "full")
    return model


def _causal_lm(backbone: nn.Module) -> nn.Module:
    return backbone.get_base_model() if isinstance(backbone, PeftModel) else backbone


class SinglePassRanker(nn.Module):
    def __init__(self, backbone: nn.Module, tokenizer, cfg: RankerConfig):
        super().__init__()
        self.backbone, self.tokenizer, self.cfg = backbone, tokenizer, cfg
        self.merged = False  # True once LoRA is folded into the base weights (inference only)
        lm = _causal_lm(backbone)
        self.body = lm.get_decoder()  # decoder stack; LoRA layers are injected in place
        self.head = self.new_head()
        self.prompts = PromptBuilder(tokenizer, cfg.prompt, cfg.model.context_length)

    def new_head(self) -> nn.Module:
        """An untrained head for this backbone (its width and dtype), as `self.cfg.head` describes it."""
        lm = _causal_lm(self.backbone)
        width = lm.config.hidden_size * len(POOLINGS[self.cfg.pooling])  # (P * D): the pooled parts side by side
        return build_head(width, self.cfg.head).to(next(lm.parameters()).dtype)

    @classmethod
    def build(cls, cfg: RankerConfig) -> "SinglePassRanker":
        model, tokenizer = load_backbone(cfg.model)
        return cls(adapt_backbone(cut_backbone(model, cfg.state_layer), cfg.adapt), tokenizer, cfg)

    @property
    def device(self) -> torch.device:
        return next(self.head.parameters()).device

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The bare prefill: (B, T) -> (B, T, D), no LM head."""
        return self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, item_positions: torch.Tensor,
                item_mask: torch.Tensor, item_spans: torch.Tensor | None = None, declared: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) prompts, (B, N) item positions, (B, N) mask, (B, N, 2) item spans (for a `mean` pooling)
        -> (B, N, K) item-position logits. With the `last` pooling the last decoder layer runs at the N
        item positions only (`hllm.model.item_states`): the same states, less work. `declared` (B,) bool:
        whether each prompt's order is a declared first-stage ranking (None: all are; `score_states`)."""
        return self.score_states(self.item_states(input_ids, attention_mask, item_positions, item_spans), item_mask, declared)

    def item_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, item_positions: torch.Tensor,
                    item_spans: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) prompts, (B, N) item positions, (B, N, 2) spans -> (B, N, P * D): what the head reads (and
        `hllm.train.state_cache` keeps), pooled as `cfg.pooling` says."""
        return pooled_item_states(self.body, input_ids, attention_mask, item_positions, item_spans, self.cfg.pooling)

    @property
    def frozen_below(self) -> int:
        """The decoder layers under the lowest adapted one: their output never changes while this ranker trains,
        so it is computed once per prompt (`hllm.train.state_cache.cached_prefix_states`). 0: nothing frozen below."""
        depth = len(self.body.layers)
        if self.cfg.adapt.mode == "frozen":
            return depth
        if self.cfg.adapt.mode == "lora" and self.cfg.adapt.lora_layers is not None:
            return depth - self.cfg.adapt.lora_layers
        return 0

    def item_states_from(self, hidden: torch.Tensor, attention_mask: torch.Tensor, item_positions: torch.Tensor,
                         item_spans: torch.Tensor | None, start: int) -> torch.Tensor:
        """`item_states` from (B, T, D) the output of decoder layer `start` (cached): only the layers above it run.
        -> (B, N, P * D), the same as `item_states` of the prompt up to float rounding."""
        with layers_from(self.body, start) as upper:
            return pooled_item_states(upper, None, attention_mask, item_positions, item_spans, self.cfg.pooling,
                                      inputs_embeds=hidden.to(next(self.body.parameters()).dtype))

    def score_states(self, items: torch.Tensor, item_mask: torch.Tensor, declared: torch.Tensor | None = None) -> torch.Tensor:
        """(B, N, D) item states, (B, N) mask -> (B, N, K) item-position logits: the head alone. `declared` (B,)
        bool: whether each slate's input order is a declared first-stage ranking, which the head's prior may
        read (None: all are); a head without a prior reads no order, declared or not."""
        items = items.to(next(self.head.parameters()).dtype)
        if declared is None or not isinstance(self.head, RankPriorHead):
            return self.head(items, item_mask)
        return self.head(items, item_mask, declared)

    def scores_and_trust(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, item_positions: torch.Tensor,
                         item_mask: torch.Tensor, item_spans: torch.Tensor | None = None,
                         declared: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, with the head's domain-guard trust in each slate (1: the head's own ranking, 0: the
        first-stage order; `hllm.model.heads.DomainGuard`), or None for a head without one: one prefill, one head
        pass. -> ((B, N, K) logits, (B,) trust or None)."""
        if getattr(self.head, "guard", None) is None:
            return self(input_ids, attention_mask, item_positions, item_mask, item_spans, declared), None
        items = self.item_states(input_ids, attention_mask, item_positions, item_spans)
        return self.head.scores_and_trust(items.to(next(self.head.parameters()).dtype), item_mask, declared)

    # ---- persistence ---------------------------------------------------------------------
    def save(self, directory: str | Path, bundle_base: bool = False) -> None:
        """`bundle_base` copies a file-backed base model into the directory, making it self-contained."""
        if self.merged:
            raise ValueError("this ranker was loaded with merge_lora=True (for inference); save the unmerged one")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = to_dict(self.cfg)
        base = weights_dir(self.cfg.model)
        if bundle_base and base is not None:  # a file-backed base (`hf`, the shipped `embedded` teacher)
            shutil.copytree(base, directory / "base", dirs_exist_ok=True)
            cfg["model"].update(preset="hf", path="base")
        if self.cfg.adapt.mode == "lora":
            self.backbone.save_pretrained(directory / "adapter", safe_serialization=True)
        elif self.cfg.adapt.mode == "full":
            save_backbone(self.backbone, self.tokenizer, directory / "backbone")
        save_file({k: v.contiguous() for k, v in self.head.state_dict().items()}, directory / "head.safetensors")
        (directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))

    @classmethod
    def load(cls, directory: str | Path, dtype: str | None = None, merge_lora: bool = False,
             trainable: bool = False) -> "SinglePassRanker":
        """`merge_lora` folds the adapter into the base weights (`merge_and_unload`): the same scores
        up to float rounding, without the adapters' extra matmuls at inference. Such a ranker
        cannot be saved or trained further. `trainable` loads the adapter to train on (a warm start)."""
        if merge_lora and trainable:
            raise ValueError("a ranker with LoRA merged into its base cannot be trained: merge_lora or trainable")
        directory = Path(directory)
        cfg = from_dict(RankerConfig, json.loads((directory / CONFIG_FILE).read_text()))
        model_cfg = cfg.model
        if model_cfg.path and not Path(model_cfg.path).is_absolute() and (directory / model_cfg.path).exists():
            model_cfg = dataclasses.replace(model_cfg, path=str(directory / model_cfg.path))
        if cfg.adapt.mode == "full":
            model_cfg = dataclasses.replace(model_cfg, preset="hf", path=str(directory / "backbone"))
        if dtype:
            model_cfg = dataclasses.replace(model_cfg, dtype=dtype)
        model, tokenizer = load_backbone(model_cfg)
        model = cut_backbone(model, cfg.state_layer)
        if cfg.adapt.mode == "lora":
            with peft_on_transformers():
                model = PeftModel.from_pretrained(model, directory / "adapter", is_trainable=trainable)
            if merge_lora:
                model = model.merge_and_unload()
        ranker = cls(model, tokenizer, dataclasses.replace(cfg, model=model_cfg))
        ranker.merged = merge_lora and cfg.adapt.mode == "lora"
        ranker.head.load_state_dict(load_file(directory / "head.safetensors"))
        return ranker.eval()
