"""The paper's core ablation on a lent GPU, in one command: the real-text recipe (`hllm.recipes.realtext`, the one the
CPU report ran) with `configs/realtext/gpu/*.yaml` — LoRA students (deeper LoRA, more steps) beside the frozen probe,
distilled from RankVicuna-7B over DL19's five first stages, on SmolLM2-135M and Gemma 3 270M (a config each).

    python benchmarks/gpu/backbone_adaptation.py --pack gpu_pack --out $OUT     # on the GPU (scripts/gpu_pack.sh prints it)
    python benchmarks/gpu/backbone_adaptation.py --tiny --out /tmp/adapt         # the CPU dry run CI keeps alive

`--pack`: the backbones and data `benchmarks/gpu/pack.py` carried (each preset read as `hf` from PACK/<preset>/backbone,
the data from PACK/data). A finished (trial, fold) is kept under `$OUT/<config>/folds`: a call that ran out of time is
resumed by carrying that folder into the next one (`--resume DIR`: the $OUT of that call). Writes
`$OUT/backbone_adaptation.md` and `.json`. `--tiny`: a backbone built from config, the multistage lists' top 8, two
folds, three steps a student.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hllm.config import from_dict, load_config, to_dict  # noqa: E402
from hllm.recipes.realtext import RealTextConfig, run, stage_markdown  # noqa: E402

CONFIGS = sorted((ROOT / "configs" / "realtext" / "gpu").glob("*.yaml"))
TINY_MODEL = {"hidden_size": 32, "layers": 4, "heads": 2, "intermediate_size": 64, "context_length": 2048}
TINY = {"top_n": 8, "folds": 2, "cv_folds": 2, "sub_slates": {"items": 4, "per_list": 2, "orders": ["first-stage", "shuffled"]},
        "bootstrap": 200, "in_sample": 2, "layers": [3]}


def config(args: argparse.Namespace, path: Path) -> RealTextConfig:
    out = Path(args.out) / path.stem
    cfg = load_config(RealTextConfig, path, [f"output_dir={out}", *args.overrides])
    data = Path(args.pack) / "data" / "dl19-multistage" if args.pack else Path(args.data) if args.tiny else None
    tree = to_dict(cfg)
    if data is not None:
        tree["teacher_collection"] = str(data)
        for t in tree["teachers"]:
            t["rankings"] = str(data / "teacher-runs" / Path(t["rankings"]).name)
    if args.tiny:  # the same variants, on a tiny backbone built from config (the fits, the cuts scaled down)
        tree |= TINY
        tree["ranker"] |= {"model": TINY_MODEL, "state_layer": 3, "head": tree["ranker"]["head"] | {"positions": 4}}
        for v in tree["variants"]:
            v |= {"layer": 3, "lora_layers": 2}
            if v["head"] is not None:
                v["head"] |= {"positions": 4, "width": 32, "num_heads": 2}
            if v["train"] is not None:
                v["train"] |= {"steps": 3, "batch_size": 4, "log_every": 3, "warmup_steps": 1}
    elif args.pack:
        tree["ranker"]["model"] |= {"path": str(Path(args.pack) / cfg.ranker.model.preset / "backbone"), "preset": "hf"}
    return from_dict(RealTextConfig, tree)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="a recipe config (default: every one of configs/realtext/gpu)")
    parser.add_argument("--pack", help="what scripts/gpu_pack.sh prepared: the backbones and the data")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "trec-dl19-passage-multistage"),
                        help="--tiny: the multistage folder")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", help="a previous call's $OUT, carried in: its finished (trial, fold) files are kept")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny backbones from config, top 8, 2 folds, 3 steps")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of every config")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    reports, text = {}, []
    for path in map(Path, args.config or CONFIGS):
        cfg = config(args, path)
        if args.resume and (Path(args.resume) / path.stem / "folds").is_dir():
            shutil.copytree(Path(args.resume) / path.stem / "folds", Path(cfg.output_dir) / "folds", dirs_exist_ok=True)
        reports[path.stem] = run(cfg) | {"config": to_dict(cfg)}
        text.append(stage_markdown(cfg, reports[path.stem]))
        (Path(args.out) / "backbone_adaptation.json").write_text(json.dumps(reports, indent=2))  # each config's, as it ends
        (Path(args.out) / "backbone_adaptation.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
