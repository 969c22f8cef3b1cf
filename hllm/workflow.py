"""The single-process job: data -> teacher bootstrap -> teacher rankings -> student -> evaluation.

    python -m hllm.workflow [--config configs/default.yaml] [key=value ...]

Each stage writes its output under `output_dir` with a `stage.json` fingerprint of the config
that produced it; a re-run with the same config reuses it (delete the folder to redo a stage).
The Ray pipelines call the same stage functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from hllm.config import load_config, to_dict
from hllm.evaluation import EvalConfig, evaluate_student, evaluate_teacher, latency_profile, quality
from hllm.models import ModelConfig, load_backbone, save_backbone
from hllm.prompts import PromptBuilder, PromptConfig
from hllm.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.readers import read_slates
from hllm.records import ParseCounts, RerankRequest, TeacherRanking, record_to_dict
from hllm.synthetic import SyntheticConfig, generate
from hllm.teacher import ARTeacher, TeacherConfig
from hllm.training import BootstrapConfig, LossConfig, TrainConfig, bootstrap_teacher, student_examples, train_student

log = logging.getLogger("hllm")


@dataclass
class DataConfig:
    """Where slates come from. `synthetic` is the embedded default; files are split by query id."""

    source: Literal["synthetic", "beir", "rank_llm", "hllm"] = "synthetic"
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    path: str | None = None
    run_file: str | None = None  # beir: first-stage run (default runs/bm25_top100.tsv)
    top_n: int = 20
    val_fraction: float = 0.1  # file sources: share of queries for validation / test
    test_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"data.path is required for data.source={self.source!r}")


@dataclass
class TeacherStageConfig:
    """The AR teacher: bootstrapped from the tiny model, or any causal LM (`bootstrap: false`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    bootstrap: bool = True
    bootstrap_cfg: BootstrapConfig = field(default_factory=BootstrapConfig)
    generation: TeacherConfig = field(default_factory=lambda: TeacherConfig(repair=True))


@dataclass
class StudentStageConfig:
    """The single-pass student. `init_from_teacher` starts the backbone from the teacher's weights."""

    init_from_teacher: bool = True
    ranker: RankerConfig = field(default_factory=lambda: RankerConfig(adapt=AdaptConfig(lora_r=16, lora_alpha=32)))
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=300, batch_size=16, lr=1e-3))
    loss: LossConfig = field(default_factory=LossConfig)
    min_teacher_validity: float = 0.0  # fail the stage if fewer teacher answers parsed cleanly


@dataclass
class JobConfig:
    output_dir: str = "runs/default"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    teacher: TeacherStageConfig = field(default_factory=TeacherStageConfig)
    student: StudentStageConfig = field(default_factory=StudentStageConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def resolve_device(name: str) -> torch.device:
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else ("cpu" if name == "auto" else name))


def fingerprint(*parts: Any) -> str:
    blob = json.dumps([to_dict(p) if dataclasses.is_dataclass(p) else p for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_done(directory: Path, key: str) -> bool:
    marker = directory / "stage.json"
    return marker.exists() and json.loads(marker.read_text()).get("fingerprint") == key


def mark_done(directory: Path, key: str, **info: Any) -> None:
    (directory / "stage.json").write_text(json.dumps({"fingerprint": key, **info}, indent=2))


# ---- stages ------------------------------------------------------------------------------------
def load_splits(cfg: DataConfig) -> dict[str, list[RerankRequest]]:
    if cfg.source == "synthetic":
        splits, stats = generate(cfg.synthetic)
        log.info("embedded data: %s slates, redrawn for lack of relevant candidates: %d",
                 {k: len(v) for k, v in splits.items()}, stats.redrawn_no_relevant)
        return splits
    kwargs = {"run_file": cfg.run_file} if cfg.source == "beir" and cfg.run_file else {}
    slates = read_slates(cfg.source, cfg.path, top_n=cfg.top_n, **kwargs)
    def bucket(qid: str) -> float:
        return int(hashlib.sha256(qid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    splits = {"train": [], "val": [], "test": []}
    for s in slates:
        b = bucket(s.slate_id)
        splits["test" if b < cfg.test_fraction else "val" if b < cfg.test_fraction + cfg.val_fraction else "train"].append(s)
    return splits


def prepare_teacher(cfg: JobConfig, splits: dict[str, list[RerankRequest]], device: torch.device) -> ModelConfig:
    """-> the ModelConfig that loads the teacher (bootstrapped and saved, or as configured)."""
    t = cfg.teacher
    if not t.bootstrap:
        return t.model
    out = Path(cfg.output_dir) / "teacher"
    key = fingerprint(cfg.data, cfg.prompt, t.model, t.bootstrap_cfg)
    saved = dataclasses.replace(t.model, preset="hf", path=str(out / "model"))
    if stage_done(out, key):
        log.info("teacher bootstrap: reusing %s", out)
        return saved
    model, tokenizer = load_backbone(t.model)
    model.to(device)
    builder = PromptBuilder(tokenizer, cfg.prompt, t.model.context_length)
    log.info("teacher bootstrap: fine-tuning %s on %d gold rankings", t.model.preset, len(splits["train"]))
    history = bootstrap_teacher(model, builder, splits["train"], t.bootstrap_cfg,
                                log=lambda step, row: log.info("  bootstrap step %d loss %.4f (%.0fs)", step, row["loss"], row["elapsed_s"]))
    save_backbone(model, tokenizer, out / "model")
    mark_done(out, key, steps=len(history), seconds=history[-1]["elapsed_s"], final_loss=history[-1]["loss"])
    return saved


def generation_key(cfg: JobConfig, teacher_model: ModelConfig) -> str:
    """Identifies a teacher's rankings: data, prompt, teacher weights and decoding settings."""
    marker = Path(cfg.output_dir) / "teacher" / "stage.json"
    weights = marker.read_text() if cfg.teacher.bootstrap and marker.exists() else ""
    return fingerprint(cfg.data, cfg.prompt, teacher_model, cfg.teacher.generation, weights)


def load_teacher(model_cfg: ModelConfig, cfg: JobConfig, device: torch.device) -> ARTeacher:
    model, tokenizer = load_backbone(model_cfg)
    tokenizer.padding_side = "left"
    return ARTeacher(model.to(device), tokenizer, cfg.prompt, model_cfg.context_length, cfg.teacher.generation)


def write_rankings(rankings: list[TeacherRanking], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for r in rankings:
            fh.write(json.dumps(record_to_dict(r)) + "\n")


def read_rankings(path: Path) -> list[TeacherRanking]:
    out = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        d["counts"] = ParseCounts(**d["counts"])
        out.append(TeacherRanking(**d))
    return out


def teacher_rankings(teacher: ARTeacher, requests: list[RerankRequest], path: Path, key: str) -> list[TeacherRanking]:
    if stage_done(path.parent, key) and path.exists():
        return read_rankings(path)
    t0 = time.perf_counter()
    rankings = teacher.rank(requests)
    write_rankings(rankings, path)
    counts = ParseCounts()
    for r in rankings:
        counts.add(r.counts)
    elapsed = time.perf_counter() - t0
    log.info("teacher rankings %s: %d slates in %.1fs (%.1f slates/s), parse %s", path.name, len(rankings), elapsed,
             len(rankings) / elapsed, counts)
    mark_done(path.parent, key, slates=len(rankings), seconds=elapsed, counts=dataclasses.asdict(counts))
    return rankings


def student_config(cfg: JobConfig, teacher_model: ModelConfig) -> RankerConfig:
    s = cfg.student.ranker
    model = teacher_model if cfg.student.init_from_teacher else s.model
    return dataclasses.replace(s, model=model, prompt=cfg.prompt)


def train_student_stage(cfg: JobConfig, teacher_model: ModelConfig, train: list[RerankRequest],
                        rankings: list[TeacherRanking], device: torch.device) -> Path:
    out = Path(cfg.output_dir) / "student"
    rcfg = student_config(cfg, teacher_model)
    key = fingerprint(rcfg, cfg.student.train, cfg.student.loss, [r.permutation for r in rankings])
    if stage_done(out, key):
        log.info("student: reusing %s", out)
        return out
    counts = ParseCounts()
    for r in rankings:
        counts.add(r.counts)
    if counts.validity < cfg.student.min_teacher_validity:
        raise RuntimeError(f"teacher validity {counts.validity:.3f} < student.min_teacher_validity "
                           f"{cfg.student.min_teacher_validity}: refusing to distil")
    ranker = SinglePassRanker.build(rcfg).to(device)
    examples = student_examples(ranker.prompts, train, [r.permutation for r in rankings])
    if cfg.student.loss.needs_teacher:
        examples = [e for e in examples if e.perm is not None]  # dropped slates are counted above
    log.info("student: training %s head, %s backbone on %d slates", rcfg.head.kind, rcfg.adapt.mode, len(examples))
    history = train_student(ranker, examples, cfg.student.train, cfg.student.loss,
                            log=lambda step, row: log.info("  student step %d loss %.4f (%.0fs)", step, row["loss"], row["elapsed_s"]))
    ranker.save(out, bundle_base=True)
    mark_done(out, key, steps=len(history), seconds=history[-1]["elapsed_s"], final_loss=history[-1]["loss"])
    return out


def evaluate_stage(cfg: JobConfig, teacher: ARTeacher, student_dir: Path, test: list[RerankRequest],
                   test_rankings: list[TeacherRanking], device: torch.device) -> dict[str, Any]:
    ranker = SinglePassRanker.load(student_dir, merge_lora=True).to(device)  # evaluated as it is served
    teacher_perms = [r.permutation for r in test_rankings]
    report = {
        "first_stage": quality(test, [list(range(len(r.candidates))) for r in test], cfg.eval.binary_rel),
        "teacher": evaluate_teacher(test, test_rankings, cfg.eval.binary_rel),
        "teacher_decoding": "constrained" if teacher.cfg.constrained else "free",
        # validity is only informative without the grammar: measure free decoding too
        "teacher_free": (evaluate_teacher(test, teacher.with_config(constrained=False).rank(test), cfg.eval.binary_rel)
                         if teacher.cfg.constrained else None),
        "student": evaluate_student(ranker, test, teacher_perms, cfg.eval),
        "latency": latency_profile(ranker, teacher, test, cfg.eval),
        "slate_size": max(len(r.candidates) for r in test),
    }
    return report


def summary_lines(report: dict[str, Any], main_decoder: str) -> list[str]:
    s, t, lat = report["student"][main_decoder], report["teacher"], report["latency"]
    ar, pre, single = (lat[k]["p50_ms"] for k in ("ar_teacher", "bare_prefill", "single_pass"))
    return [
        f"nDCG@10   first stage {report['first_stage']['nDCG@10']:.4f} | teacher {t['nDCG@10']:.4f} | "
        f"student ({main_decoder}) {s['nDCG@10']:.4f}",
        f"student vs teacher: Kendall tau {s['kendall_tau']:.3f}, top-1 agreement {s['top1_agreement']:.3f}",
        f"validity  teacher {(report['teacher_free'] or t)['validity']:.3f} (free decoding, before repair; "
        f"{report['teacher_decoding']} decoding gives the rankings) | student {s['validity']:.3f}",
        f"latency p50 @ N={report['slate_size']}, batch 1: AR teacher {ar:.1f} ms | bare prefill {pre:.1f} ms | "
        f"single pass {single:.1f} ms  -> AR/single {ar / single:.1f}x (bound AR/prefill {ar / pre:.1f}x), "
        f"single/prefill {single / pre:.3f}",
        "decoders: " + ", ".join(f"{k} {v['nDCG@10']:.4f}" for k, v in report["student"].items() if k != "matrix")
        + f" | rank-1 energy {report['student']['matrix']['rank1_energy_mean']:.3f}",
    ]


def run(cfg: JobConfig) -> dict[str, Any]:
    """The whole job; -> the evaluation report (also written to output_dir/report.json)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = resolve_device(cfg.device)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    splits = load_splits(cfg.data)
    teacher_model = prepare_teacher(cfg, splits, device)
    teacher = load_teacher(teacher_model, cfg, device)
    gen_key = generation_key(cfg, teacher_model)
    train_rankings = teacher_rankings(teacher, splits["train"], out / "rankings_local" / "train.jsonl", gen_key)
    test_rankings = teacher_rankings(teacher, splits["test"], out / "rankings_test" / "test.jsonl", gen_key)
    student_dir = train_student_stage(cfg, teacher_model, splits["train"], train_rankings, device)
    report = evaluate_stage(cfg, teacher, student_dir, splits["test"], test_rankings, device)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    parser.add_argument("--config", default=str(default) if default.exists() else None,
                        help="YAML file (default: configs/default.yaml); key=value overrides win over it")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. student.train.steps=100")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cfg = load_config(JobConfig, args.config, args.overrides)
    log.info("config: %s", json.dumps(to_dict(cfg)))
    t0 = time.perf_counter()
    report = run(cfg)
    for line in summary_lines(report, cfg.eval.main_decoder):
        print(line)
    print(f"total {time.perf_counter() - t0:.0f}s; report: {Path(cfg.output_dir) / 'report.json'}")


if __name__ == "__main__":
    main()
