"""What a saved student says about itself: its model card (`model_card.json`, read by `hllm.Reranker` and shown by
Serve's `/v1/models`) and, for a shipped one, its provenance (`provenance.json`: what made it, what it was measured at,
the hashes of its files and of the base model it needs). One typed card for every recipe that saves a student (the
job, the real-text recipes): the fields every card has, typed; what a recipe measured, in `figures`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hllm.model.backbones import GGUF_FILES, PROVENANCE, ModelConfig, file_sha256, gguf_path, weights_dir

if TYPE_CHECKING:  # the saved objects' own modules import this one
    from hllm.model.calibration import Calibrator
    from hllm.model.confidence import CascadeThresholds
    from hllm.model.ranker import SinglePassRanker

CONFIG_FILE = "hllm_ranker.json"  # the student's own config (hllm.model.ranker)
CARD_FILE = "model_card.json"  # what the model knows (written by the recipe that saved it; optional)


@dataclass(frozen=True)
class PromptCard:
    """The prompt a student reads: its template, the tokens each document shows, the context."""

    template: str
    max_doc_tokens: int
    context_length: int


@dataclass(frozen=True)
class ModelCard:
    """What a served student knows: its base model, what it was trained on and how, its limits, and what its recipe
    measured. `figures` keeps each recipe's own measurements (cross-validated nDCG@10, transfer, calibration...) as
    they are saved: the card's JSON is the typed fields (those set) followed by them."""

    base_model: str
    positions: int  # K: the head's positions
    prompt: PromptCard
    training_data: dict[str, Any] | str  # what it was fitted on (a string where that is unknown)
    teacher: dict[str, Any] | str | None = None  # whose rankings it learned from (or that it learned from labels)
    vocabulary: str | None = None
    window: int | None = None  # candidates a pass reads (None: what the context allows)
    adapt: str | None = None  # lora | frozen | full
    head: str | None = None
    pooling: str | None = None
    input: str | None = None  # what the input order must mean for the head (a first-stage prior reads ranks)
    figures: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("prompt", "figures")}
        out = {k: v for k, v in out.items() if v is not None}
        return {**out, "prompt": dataclasses.asdict(self.prompt), **self.figures}

    @classmethod
    def from_json(cls, card: dict[str, Any]) -> ModelCard:
        names = {f.name for f in dataclasses.fields(cls)} - {"figures", "prompt"}
        return cls(prompt=PromptCard(**card["prompt"]), **{k: v for k, v in card.items() if k in names},
                   figures={k: v for k, v in card.items() if k not in names | {"prompt"}})


def write_model_card(directory: str | Path, card: ModelCard) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / CARD_FILE).write_text(json.dumps(card.to_json(), indent=2))


def read_model_card(directory: str | Path) -> ModelCard:
    """The saved card, or what the model's own config tells (base model, K, prompt) for one without."""
    path = Path(directory) / CARD_FILE
    if path.is_file():
        return ModelCard.from_json(json.loads(path.read_text()))
    cfg = json.loads((Path(directory) / CONFIG_FILE).read_text())
    return ModelCard(base_model=cfg["model"]["preset"], positions=cfg["head"]["positions"],
                     prompt=PromptCard(cfg["prompt"]["template"], cfg["prompt"]["max_doc_tokens"], cfg["model"]["context_length"]),
                     training_data="unknown (saved without a model card)")


def write_provenance(directory: str | Path, model: ModelConfig, made_by: str, recipe: dict, **measured) -> None:
    """`provenance.json` of a shipped student: what made it (`made_by`, the whole `recipe`), what it was
    measured at (`measured`), the hashes of its own files and of the base model file it needs."""
    target = Path(directory)
    base = weights_dir(model) or (gguf_path(model.preset) if model.preset in GGUF_FILES else None)
    base_file = base if base is not None and base.is_file() else None
    provenance = {
        "made_by": made_by, "recipe": recipe, **measured,
        "sha256": {f.name: file_sha256(f) for f in sorted(target.iterdir()) if f.suffix in (".safetensors", ".json")
                   and f.name not in (PROVENANCE, CARD_FILE)},
        "base_model": {"preset": model.preset, "file": base_file.name if base_file else None,
                       "sha256": file_sha256(base_file) if base_file else None},
    }
    (target / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")


def ship_student(directory: str | Path, ranker: SinglePassRanker, card: ModelCard, thresholds: CascadeThresholds,
                 made_by: str, recipe: dict, calibrator: Calibrator | None = None, **measured: Any) -> Path:
    """A shipped student's folder, whole, in the one order that keeps its provenance true: the weights and config, the
    cascade thresholds, the calibration (where one was fitted), the model card, then `provenance.json` (which hashes
    the files written before it). -> the folder."""
    target = Path(directory)
    ranker.save(target)
    thresholds.save(target)
    if calibrator is not None:
        calibrator.save(target)
    write_model_card(target, card)
    write_provenance(target, ranker.cfg.model, made_by, recipe, **measured)
    return target


def record_in_provenance(directory: str | Path, name: str, made_by: str) -> None:
    """A file added to a shipped student after its recipe ran (e.g. its cascade thresholds): its hash joins
    `provenance.json`'s, with what wrote it."""
    path = Path(directory) / PROVENANCE
    provenance = json.loads(path.read_text())
    provenance["sha256"][name] = file_sha256(Path(directory) / name)
    provenance.setdefault("added", {})[name] = made_by
    path.write_text(json.dumps(provenance, indent=2) + "\n")
