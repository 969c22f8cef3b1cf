"""The paper's core ablation on a lent GPU, in one command: `hllm.recipes.adaptation` (the recipe the CPU report ran)
with `configs/adaptation/gpu.yaml` — LoRA students (deeper LoRA, more steps) beside the shipped frozen probe, distilled
from RankVicuna-7B over DL19's five first stages, on SmolLM2-135M and Gemma 3 270M.

    python benchmarks/gpu/backbone_adaptation.py --pack gpu_pack --out $OUT     # on the GPU (scripts/gpu_pack.sh prints it)
    python benchmarks/gpu/backbone_adaptation.py --tiny --out /tmp/adapt         # the CPU dry run CI keeps alive

`--pack`: the backbones and data `benchmarks/gpu/pack.py` carried (each preset read as `hf` from PACK/<preset>/backbone,
the data from PACK/data). A finished (student, fold) is kept under `$OUT/run/folds`: a call that ran out of time is
resumed by carrying that folder into the next one (`--resume DIR`). Writes `$OUT/backbone_adaptation.md` and `.json`.
`--tiny`: a backbone built from config, the multistage lists' top 8, two folds, three steps a student.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hllm.config import load_config, to_dict  # noqa: E402
from hllm.recipes.adaptation import AdaptationConfig, markdown, run  # noqa: E402

TINY_MODEL = {"hidden_size": 32, "layers": 4, "heads": 2, "intermediate_size": 64, "context_length": 2048}
TINY = ["top_n=8", "folds=2", "sub_items=4", "subs_per_list=2", "bootstrap=200", "in_sample=2"]


def config(args: argparse.Namespace) -> AdaptationConfig:
    out = Path(args.out)
    overrides = [f"output_dir={out / 'run'}", f"report_to={out / 'backbone_adaptation.md'}", *args.overrides]
    if args.tiny:
        overrides += TINY + [f"data={args.data}"]
    elif args.pack:
        overrides.append(f"data={Path(args.pack) / 'data' / 'dl19-multistage'}")
    cfg = load_config(AdaptationConfig, args.config, overrides)
    for s in cfg.students:
        if args.tiny:  # the same students, each on a tiny backbone built from config (the kinds, the cuts scaled down)
            s.model = type(s.model)(**TINY_MODEL)
            s.state_layer, s.lora_layers = 3, 2
            s.head.positions, s.head.width, s.head.num_heads = 4, 32, 2
            s.train.steps, s.train.batch_size, s.train.log_every, s.train.warmup_steps = 3, 4, 3, 1
        elif args.pack:
            s.model.path, s.model.preset = str(Path(args.pack) / s.model.preset / "backbone"), "hf"
    return cfg


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "adaptation" / "gpu.yaml"))
    parser.add_argument("--pack", help="what scripts/gpu_pack.sh prepared: the backbones and the data")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "trec-dl19-passage-multistage"),
                        help="--tiny: the multistage folder")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", help="a previous call's $OUT/run/folds, carried in: its finished folds are kept")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny backbones from config, top 8, 2 folds, 3 steps")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe's config")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cfg = config(args)
    if args.resume:
        shutil.copytree(args.resume, Path(cfg.output_dir) / "folds", dirs_exist_ok=True)
    report = run(cfg)
    (Path(args.out) / "backbone_adaptation.json").write_text(json.dumps(report | {"config": to_dict(cfg)}, indent=2))
    print(markdown(cfg, report))


if __name__ == "__main__":
    main()
