"""Data splits: the embedded data set's own, or a file source split by query id.

File sources are split by a hash of the query id (not by position), so a query lands in the same
split whatever the file order or `top_n`, and no test query is ever trained on.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Literal

from hllm.config import ConfigError
from hllm.data.readers import read_slates
from hllm.data.synthetic import SyntheticConfig, generate
from hllm.records import RerankRequest

log = logging.getLogger("hllm")
SPLITS = ("train", "val", "test")


@dataclass
class DataConfig:
    """Where slates come from. `synthetic` is the embedded default; files are split by query id."""

    source: Literal["synthetic", "beir", "rank_llm", "hllm"] = "synthetic"  # a reader in hllm.data.readers.READERS
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    path: str | None = None  # file sources: the BEIR folder or JSONL file
    run_file: str | None = None  # beir: first-stage run (default runs/bm25_top100.tsv)
    top_n: int = 20  # file sources: first-stage candidates per slate (N)
    val_fraction: float = 0.1  # file sources: share of queries held out for validation ...
    test_fraction: float = 0.2  # ... and for the test split
    # file sources: rows with bad input (hllm.data.plane.REASONS: an unreadable line, a missing passage, a query
    # without text, a repeated candidate) are counted per reason; past this share of the run's rows the job stops
    max_bad_share: float = 0.0

    def __post_init__(self) -> None:
        if self.source != "synthetic" and not self.path:
            raise ConfigError(f"data.path is required for data.source={self.source!r}")
        if self.source == "synthetic" and (self.path or self.run_file):
            raise ConfigError("data.path / data.run_file are read only by file sources; data.source is 'synthetic'")
        if self.run_file and self.source != "beir":
            raise ConfigError(f"data.run_file is read only by data.source=beir, not {self.source!r}")
        if not (0 <= self.val_fraction and 0 < self.test_fraction and self.val_fraction + self.test_fraction < 1):
            raise ConfigError("data.val_fraction and data.test_fraction must leave queries for training")
        if not 0 <= self.max_bad_share < 1:
            raise ConfigError("data.max_bad_share must be in [0, 1)")


def unit_hash(key: str) -> float:
    """A key -> a number in [0, 1], the same on every machine and every run: the project's one hash of an id.
    `unit_hash(k) < share` keeps about `share` of the keys, always the same ones: a query's split, its fold (a salt
    prefixed), a canary's tenants, the requests a traffic sample keeps or holds out. A salt prefixed to the key draws
    an independent coin from the same keys."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF



def split_by_hash(slates: list[RerankRequest], fraction: float) -> tuple[list[RerankRequest], list[RerankRequest]]:
    """-> (queries with a hash >= fraction, the others): the same split on every machine."""
    return [s for s in slates if unit_hash(s.slate_id) >= fraction], [s for s in slates if unit_hash(s.slate_id) < fraction]

def load_splits(cfg: DataConfig) -> dict[str, list[RerankRequest]]:
    """-> {"train", "val", "test"}: slates to train on, held out while training, and to report on."""
    if cfg.source == "synthetic":
        splits, stats = generate(cfg.synthetic)
        log.info("embedded data: %s slates, redrawn for lack of relevant candidates: %d",
                 {k: len(v) for k, v in splits.items()}, stats.redrawn_no_relevant)
        return splits
    kwargs = {"run_file": cfg.run_file} if cfg.run_file else {}
    if cfg.source == "beir":
        kwargs["max_bad_share"] = cfg.max_bad_share
    splits: dict[str, list[RerankRequest]] = {name: [] for name in SPLITS}
    for s in read_slates(cfg.source, cfg.path, top_n=cfg.top_n, **kwargs):
        splits[split_of(s.slate_id, cfg)].append(s)
    return splits


def split_of(qid: str, cfg: DataConfig) -> str:
    """A file source's query -> its split, by the hash of its id."""
    b = unit_hash(qid)
    return "test" if b < cfg.test_fraction else "val" if b < cfg.test_fraction + cfg.val_fraction else "train"
