"""The path `pipelines/train_student.py` takes on a GPU cluster, in one process and without Ray: the library loop stepping a
ZeRO-2 DeepSpeed engine around a LoRA student, then the checkpoint saved, loaded into a fresh engine and stepped again.

    python benchmarks/gpu/deepspeed_step.py --pack gpu_pack     # on the GPU (DeepSpeed carried as a wheel: scripts/gpu_pack.sh)
    python benchmarks/gpu/deepspeed_step.py                     # CPU: the tiny backbone, gloo

The engine (`make_engine`: its config and a torch AdamW, as the Train workers build it, so no DeepSpeed op is
compiled) and the optimiser wrapper (`EngineOptimizer`) are the pipeline's own. Prints one line a phase and exits non-zero if the
loaded weights differ from the saved ones.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hllm.config import load_config  # noqa: E402
from hllm.data.synthetic import SyntheticConfig, generate  # noqa: E402
from hllm.model.backbones import ModelConfig  # noqa: E402
from hllm.model.heads import HeadConfig  # noqa: E402
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker  # noqa: E402
from hllm.train.loop import (LossConfig, StudentExample, TrainConfig, batches, gold_permutation,  # noqa: E402
                             student_batch, student_loss, train_loop)
from pipelines.common import PipelineConfig  # noqa: E402
from pipelines.train_student import EngineOptimizer, make_engine, torch_extensions_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", help="the packed SmolLM2 backbone (benchmarks/gpu/pack.py unpack made PACK/smollm2-135m/backbone)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda:0" if gpu else "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())  # DeepSpeed's CPU op as setup.sh built it
    deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo")
    cfg = load_config(PipelineConfig, None, ["distill.zero_stage=2", f"student.train.steps={args.steps}",
                                             "student.train.batch_size=4", "student.train.warmup_steps=1"])
    model = ModelConfig(preset="hf", path=str(Path(args.pack) / "smollm2-135m" / "backbone"), dtype="float32") if args.pack else \
        ModelConfig(hidden_size=32, layers=2, heads=2, intermediate_size=64, context_length=512)
    rcfg = RankerConfig(model=model, adapt=AdaptConfig(mode="lora", lora_r=8, lora_alpha=16),
                        head=HeadConfig(positions=8, width=64, num_heads=2), state_layer=4 if args.pack else None)
    splits, _ = generate(SyntheticConfig(catalogue_size=200, slate_size=8, train_slates=16, val_slates=1, test_slates=1))
    torch.manual_seed(0)
    ranker = SinglePassRanker.build(rcfg).to(device)
    examples = [StudentExample(ranker.prompts.encode(s, with_answer=False), gold_permutation(s.grades), s.grades)
                for s in splits["train"]]
    loss_cfg, t = LossConfig({"sinkhorn_ce": 1.0}), cfg.student.train
    pad = ranker.tokenizer.pad_token_id

    def step(engine, scheduler, steps: int) -> list[dict]:
        return train_loop(lambda chunk: student_loss(engine, student_batch(chunk, pad, device), loss_cfg),
                          batches(examples, t.batch_size, t.seed), EngineOptimizer(engine, scheduler),
                          TrainConfig(steps=steps, batch_size=t.batch_size), device.type)

    engine, scheduler = make_engine(ranker, cfg, gpu)
    t0 = time.perf_counter()
    history = step(engine, scheduler, args.steps)
    per_step = (time.perf_counter() - t0) / args.steps
    print(f"deepspeed zero-{cfg.distill.zero_stage} lora steps on {torch.cuda.get_device_name() if gpu else 'cpu'}: "
          f"loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}, {per_step * 1000:.0f} ms a step", flush=True)
    saved = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    with tempfile.TemporaryDirectory() as directory:
        engine.save_checkpoint(directory, tag="last", client_state={"step": args.steps})
        torch.manual_seed(1)  # the fresh engine starts from other weights: the load must bring them back
        fresh, fresh_scheduler = make_engine(SinglePassRanker.build(rcfg).to(device), cfg, gpu)
        _, client = fresh.load_checkpoint(directory, tag="last")
    loaded = {n: p.detach().float().cpu() for n, p in fresh.module.named_parameters() if p.requires_grad}
    differ = [n for n in saved if not torch.equal(saved[n], loaded[n])]
    more = step(fresh, fresh_scheduler, 1)
    print(f"checkpoint saved and loaded (step {client['step']}): {len(saved) - len(differ)} of {len(saved)} trainable "
          f"tensors equal; one more step from it: loss {more[-1]['loss']:.4f}", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
