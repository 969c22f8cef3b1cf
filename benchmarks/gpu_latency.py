"""GPU latency at real shapes: bare prefill vs single pass (prefill + head + Hungarian) vs the AR
teacher, on randomly initialised backbones of real sizes, batch 1 and 16, in one run.

    python benchmarks/gpu_latency.py                               # CUDA, bf16, the three shapes below
    python benchmarks/gpu_latency.py --tiny --device cpu --out /tmp/gpu_latency.md   # the CI smoke size
    python benchmarks/gpu_latency.py --shapes smollm2-135m --state-layer 20 --pooling last+mean --head utility
                                     # the real-text students' shape: cut backbone, utility probe

Needs only torch, transformers and peft (plus this repository and rank_bm25, which hllm's tiny
tokenizer imports): a bare GPU host has no Ray, DeepSpeed, MLflow or pretrained weights. Timings do not depend on the weights' values, so random
weights of the real shape time what a trained model would; the AR teacher writes a fixed-length
answer (`--answer-tokens-per-item` tokens per candidate, e.g. "[12] >" is 4 BPE tokens) with the
KV cache, as a real teacher writing the full ranking would. The single pass is timed through
`hllm.Reranker` (encode already done: `score_encoded` + `decode`), exactly the path Serve runs.
Writes a Markdown table (default `reports/gpu_latency.md`).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, with or without an install

from hllm.model.backbones import build_tiny_tokenizer  # noqa: E402
from hllm.model.heads import HeadConfig  # noqa: E402
from hllm.model.item_states import POOLINGS  # noqa: E402
from hllm.model.prompts import EncodedPrompt, PromptConfig  # noqa: E402
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker, cut_backbone  # noqa: E402
from hllm.reranker import Reranker  # noqa: E402

# Llama-architecture shapes of real checkpoints (hidden, intermediate, layers, heads, kv heads, vocab)
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "qwen2.5-0.5b-shape": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b-shape": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                               num_key_value_heads=2, vocab_size=151936),
    "llama2-7b-shape": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=32, vocab_size=32000),  # RankVicuna-7B's
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=1000),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build(shape: str, k: int, dtype: torch.dtype, device: torch.device, head: str = "attention",
          state_layer: int | None = None, pooling: str = "last") -> tuple[Reranker, torch.nn.Module]:
    """-> (the single-pass reranker: the backbone cut after `state_layer`, the `head` reading `pooling`;
    the whole LM, which the AR teacher runs)."""
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=16384, tie_word_embeddings=True)
    with torch.device(device):
        torch.manual_seed(0)
        lm = LlamaForCausalLM(config).to(dtype)
    backbone = cut_backbone(copy.deepcopy(lm), state_layer) if state_layer else lm
    # the tokenizer only supplies the pad id here: prompts are made of random token ids below
    prior = "logrank" if head == "utility" else "none"
    cfg = RankerConfig(adapt=AdaptConfig(mode="frozen"), head=HeadConfig(kind=head, positions=k, width=256, prior=prior),
                       prompt=PromptConfig(use_chat_template=False), state_layer=state_layer, pooling=pooling)
    return Reranker(SinglePassRanker(backbone, build_tiny_tokenizer(), cfg).to(device)), lm


def prompt(n: int, doc_tokens: int, vocab: int, seed: int) -> EncodedPrompt:
    """A RankGPT-shaped prompt: ~60 instruction tokens, n passages of `doc_tokens` (+3 for "[i]"), ~40 after."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab, (60,), generator=g).tolist()
    positions, spans = [], []
    for _ in range(n):
        ids += torch.randint(100, vocab, (doc_tokens + 3,), generator=g).tolist()
        positions.append(len(ids) - 1)
        spans.append((len(ids) - doc_tokens, len(ids)))  # the passage after its identifier
    ids += torch.randint(100, vocab, (40,), generator=g).tolist()
    return EncodedPrompt(ids, positions, item_spans=spans)


def timed_ms(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up, synchronising the device around each."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure(reranker: Reranker, lm: torch.nn.Module, n: int, batch: int, args, device: torch.device) -> dict[str, float]:
    vocab = reranker.model.backbone.config.vocab_size
    prompts = [prompt(n, args.doc_tokens, vocab, seed) for seed in range(batch)]

    def single_pass():
        for matrix in reranker.score_encoded(prompts):
            reranker.decode(matrix)

    answer = args.answer_tokens_per_item * n
    tensors = reranker.tensors(prompts)

    @torch.inference_mode()
    def ar_teacher():
        lm.generate(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"], max_new_tokens=answer,
                    min_new_tokens=answer, do_sample=False, use_cache=True, pad_token_id=0)

    return {"tokens": len(prompts[0].input_ids), "prefill": timed_ms(lambda: reranker.prefill(prompts), device, args.repeats),
            "single": timed_ms(single_pass, device, args.repeats),
            "ar": float("nan") if args.skip_ar else timed_ms(ar_teacher, device, args.ar_repeats), "answer_tokens": answer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b-shape", "qwen2.5-1.5b-shape"],
                        choices=sorted(SHAPES))
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 50, 100])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--doc-tokens", type=int, default=64, help="tokens per passage")
    parser.add_argument("--answer-tokens-per-item", type=int, default=4)
    parser.add_argument("--positions", type=int, default=20, help="K of the head (rectangular when K < N)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ar-repeats", type=int, default=3)
    parser.add_argument("--skip-ar", action="store_true", help="time prefill and single pass only (AR columns: nan)")
    parser.add_argument("--head", default="attention", choices=["attention", "utility"],
                        help="the single pass's head (utility: the shipped real-text students' probe under the prior)")
    parser.add_argument("--state-layer", type=int, help="cut the single pass's backbone after this decoder layer")
    parser.add_argument("--pooling", default="last", choices=sorted(POOLINGS), help="how each candidate is read")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--tiny", action="store_true", help="tiny shape and sizes: the CI smoke run")
    parser.add_argument("--out", default="reports/gpu_latency.md")
    args = parser.parse_args()
    if args.tiny:
        args.shapes, args.sizes, args.batches, args.doc_tokens = ["tiny"], [4, 8], [1, 2], 8
        args.repeats, args.ar_repeats, args.positions = 2, 1, 4
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    head = "2-layer attention" if args.head == "attention" else "utility probe under the logrank prior"
    cut = f" after decoder layer {args.state_layer}" if args.state_layer else ""
    lines = [f"Device: {name}, {args.dtype}, torch {torch.__version__}. Random weights of real shapes; passages of "
             f"{args.doc_tokens} tokens; single pass: the backbone{cut}, pooling `{args.pooling}`, head: {head}, K = {args.positions}; the AR teacher the whole LM; AR teacher: greedy with the KV cache, "
             f"{args.answer_tokens_per_item} answer tokens per candidate. Median of {args.repeats} (AR: {args.ar_repeats}) "
             "calls after a warm-up, all methods in one run.", "",
             "| shape | params | N | batch | prompt tokens | bare prefill ms | single pass ms | single / prefill | "
             "AR teacher ms | AR / single | bound AR / prefill |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for shape in args.shapes:
        reranker, lm = build(shape, args.positions, DTYPES[args.dtype], device, args.head, args.state_layer, args.pooling)
        params = sum(p.numel() for p in lm.parameters()) / 1e6
        for n in args.sizes:
            for batch in args.batches:
                m = measure(reranker, lm, n, batch, args, device)
                row = (f"| {shape} | {params:.0f}M | {n} | {batch} | {m['tokens']} | {m['prefill']:.2f} | {m['single']:.2f} | "
                       f"{m['single'] / m['prefill']:.3f} | {m['ar']:.0f} | {m['ar'] / m['single']:.1f}x | "
                       f"{m['ar'] / m['prefill']:.1f}x |")
                print(row, flush=True)
                lines.append(row)
        del reranker, lm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("# GPU latency: single pass vs bare prefill vs AR teacher\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
