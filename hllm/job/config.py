"""The job's configuration: one typed section per stage, checked as a whole before anything runs.

`JobConfig` is what `configs/*.yaml` and `key=value` overrides build (`hllm.config.load_config`).
Every key is read by some stage; a combination under which a key would be ignored is an error
that names the key and says why (`JobConfig.__post_init__`), never a silent overwrite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hllm.config import ConfigError, load_config, to_dict
from hllm.data.splits import DataConfig
from hllm.eval.evaluation import EvalConfig
from hllm.model.backbones import ModelConfig, resolve_device
from hllm.model.heads import HeadConfig
from hllm.model.prompts import PromptConfig
from hllm.model.ranker import AdaptConfig, RankerConfig, SinglePassRanker
from hllm.teacher.endpoint import EndpointConfig
from hllm.teacher.generation import TeacherConfig
from hllm.train.loop import BootstrapConfig, LossConfig, TrainConfig


@dataclass
class TeacherStageConfig:
    """The AR teacher: bootstrapped from the tiny model, or any causal LM (`bootstrap: false`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    bootstrap: bool = True  # fine-tune `model` on the train queries' gold rankings first
    bootstrap_cfg: BootstrapConfig = field(default_factory=BootstrapConfig)
    generation: TeacherConfig = field(default_factory=lambda: TeacherConfig(repair=True))
    # the teacher's rankings from a file instead of generated (`hllm.teacher.external`): exclusive with
    # bootstrapping and generating, and with a student that starts from the teacher's weights
    rankings: str | None = None
    rankings_format: Literal["run", "rank_llm", "responses"] = "run"  # a TREC / BEIR run, rank_llm JSONL, raw answers
    # or an OpenAI-compatible server as the teacher (`hllm.teacher.endpoint`): `endpoint.url` and `endpoint.model`;
    # `generation` gives its windows and repair, nothing is loaded or bootstrapped
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    # a split stops once more than this share of its slates failed (a served teacher's retries ran out, or its
    # answer had no ranking), naming the reason; the slates within it get no permutation (the student skips them)
    max_failed_share: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_failed_share <= 1.0:
            raise ConfigError(f"teacher.max_failed_share={self.max_failed_share}: a share in [0, 1]")
        if self.endpoint.url is not None:
            conflicts = [f"teacher.{name}" for name, unused in (
                ("bootstrap", self.bootstrap), ("model", self.model != ModelConfig()), ("rankings", self.rankings is not None),
                ("generation.constrained", self.generation.constrained)) if unused]
            if conflicts:
                raise ConfigError(
                    f"teacher.endpoint.url={self.endpoint.url} asks a served teacher, so no local teacher is bootstrapped, "
                    f"loaded or read from a file, and {', '.join(conflicts)} would be ignored (constrained decoding needs "
                    "the model's logits): set teacher.bootstrap=false and leave teacher.model, teacher.rankings unset, "
                    "teacher.generation.constrained=false")
            return
        if self.rankings is None:
            return
        conflicts = [f"teacher.{name}" for name, unused in (
            ("bootstrap", self.bootstrap), ("model", self.model != ModelConfig()),
            ("generation", self.generation != TeacherConfig(repair=True))) if unused]
        if conflicts:
            raise ConfigError(
                f"teacher.rankings={self.rankings} takes the teacher's rankings from a file, so no teacher is bootstrapped "
                f"or run, and {', '.join(conflicts)} would be ignored: it is exclusive with generation. Set "
                "teacher.bootstrap=false and leave teacher.model / teacher.generation unset (a config without a "
                "teacher section, e.g. not configs/default.yaml)")


@dataclass
class StudentStageConfig:
    """The single-pass student. Its prompt is always the job's `prompt` section (one prompt for
    teacher and student); its backbone is the teacher's weights (`init_from_teacher`) or `model`."""

    init_from_teacher: bool = True  # the student's backbone starts from the teacher's weights
    model: ModelConfig | None = None  # only with init_from_teacher: false
    adapt: AdaptConfig = field(default_factory=lambda: AdaptConfig(lora_r=16, lora_alpha=32))
    head: HeadConfig = field(default_factory=HeadConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=300, batch_size=16, lr=1e-3))
    loss: LossConfig = field(default_factory=LossConfig)
    # permutation augmentation: each training slate seen in these orders (hllm.data.order), its teacher ranking moved
    # with its documents; only the first stage's is declared (the head's prior reads no other). The default: as the
    # student will be asked, a ranking declared and a set (read in its canonical order); measured in docs/results.md
    train_orders: list[str] = field(default_factory=lambda: ["first-stage", "canonical"])
    # gates before distillation, on the teacher's train rankings (`hllm.job.stages.check_teacher`)
    min_teacher_validity: float = 0.0  # fail if fewer teacher answers parsed cleanly
    max_teacher_same_as_input: float = 0.5  # fail if more answers repeat the first-stage order
    max_teacher_tau_to_input: float = 0.9  # fail if the mean Kendall tau to the first-stage order is higher

    def __post_init__(self) -> None:
        from hllm.data.order import InputOrder

        if not self.train_orders or len(set(self.train_orders)) != len(self.train_orders):
            raise ConfigError(f"student.train_orders: at least one order, none twice (got {self.train_orders})")
        try:
            [InputOrder.parse(o) for o in self.train_orders]
        except ValueError as err:
            raise ConfigError(f"student.train_orders: {err}") from None
        if self.init_from_teacher and self.model is not None:
            raise ConfigError("student.model would be ignored: student.init_from_teacher is true, so the student "
                              "starts from the teacher's weights; set student.init_from_teacher=false to use it")
        if not self.init_from_teacher and self.model is None:
            raise ConfigError("student.model is required when student.init_from_teacher is false")


@dataclass
class JobConfig:
    output_dir: str = "runs/default"  # every stage's outputs (shared storage on a multi-node cluster)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda where available
    threads: int | None = None  # torch intra-op threads (None: torch's default)
    seed: int = 0  # data splits and anything else not seeded by its own section
    data: DataConfig = field(default_factory=DataConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    teacher: TeacherStageConfig = field(default_factory=TeacherStageConfig)
    student: StudentStageConfig = field(default_factory=StudentStageConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # the model preset whose costs the step counts, batch sizes and latency-request counts were
    # chosen for. Sizes made for the tiny model would run for hours on a real LM, so a job whose
    # models are another preset is refused until a config sized for it (or this key) says so
    sized_for: str = "tiny"

    def __post_init__(self) -> None:
        # the teacher's preset: its bootstrap and generation are what the sizes make cheap or hours long (a
        # student with its own backbone is an explicit choice in the same config, as in ablation cells)
        remote = self.teacher.rankings is not None or self.teacher.endpoint.url is not None
        if remote and self.student.init_from_teacher:
            which = (f"teacher.rankings={self.teacher.rankings}: the teacher is a file" if self.teacher.rankings is not None
                     else f"teacher.endpoint.url={self.teacher.endpoint.url}: the teacher is a server")
            raise ConfigError(f"{which}, it has no weights to start the student from; set student.init_from_teacher=false "
                              "and student.model")
        presets = {self.student.model.preset if remote else self.teacher.model.preset}
        if presets != {self.sized_for}:
            raise ConfigError(
                f"the job's models are {sorted(presets)} but its step counts, batch sizes and latency requests were "
                f"sized for {self.sized_for!r} (sized_for): use a config sized for the model (e.g. "
                f"configs/dl19-smollm2.yaml for smollm2-135m), or set teacher.bootstrap_cfg.train.*, "
                f"student.train.*, eval.latency_requests for it and sized_for={'/'.join(sorted(presets))}")


def student_ranker_config(cfg: JobConfig, teacher_model: ModelConfig) -> RankerConfig:
    """The student's resolved model config: what is trained, saved with it and logged."""
    s = cfg.student
    model = teacher_model if s.init_from_teacher else s.model
    return RankerConfig(model=dataclasses.replace(model), adapt=s.adapt, head=s.head, prompt=cfg.prompt)


DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


def console_logging(verbose: bool = False) -> None:
    """A command's console: `hllm.*` at INFO as `HH:MM:SS message`, the libraries' INFO only when `verbose` (their
    warnings always). What the Ray glue adds for Ray's own logs is `pipelines.console`."""
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger().setLevel(level)  # also where a handler was there before (basicConfig then does nothing)
    logging.getLogger("hllm").setLevel(logging.INFO)


def recipe_config(cls: type, doc: str, argv: list[str] | None, example: str):
    """A recipe's command line: `--config FILE` (required) and `key=value` overrides -> its config
    (logging set up, the config logged)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", required=True, help=f"YAML (e.g. {example}); key=value overrides win")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    console_logging()
    cfg = load_config(cls, args.config, args.overrides)
    logging.getLogger("hllm").info("config: %s", json.dumps(to_dict(cfg)))
    return cfg


def start_recipe(cfg) -> SinglePassRanker:
    """A states recipe's start: torch threads set, `output_dir` made with the config in it
    (`config.json`), the frozen ranker built on the device -> that ranker, in eval mode."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    return SinglePassRanker.build(cfg.ranker).to(resolve_device(cfg.device)).eval()


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` (default: configs/default.yaml where it exists) and `key=value` overrides."""
    parser.add_argument("--config", default=str(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else None,
                        help="YAML file (default: configs/default.yaml); key=value overrides win over it")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. student.train.steps=100")
