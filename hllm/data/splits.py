"""Data splits: the embedded data set's own, or a file source split by query id.

File sources are split by a hash of the query id (not by position), so a query lands in the same
split whatever the file order or `top_n`, and no test query is ever trained on.
"""

from __future__ import annotations

import hashlib
import logging

from hllm.job import DataConfig
from hllm.readers import read_slates
from hllm.records import RerankRequest
from hllm.synthetic import generate

log = logging.getLogger("hllm")
SPLITS = ("train", "val", "test")


def query_bucket(qid: str) -> float:
    """A query id -> a number in [0, 1], the same on every machine."""
    return int(hashlib.sha256(qid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def load_splits(cfg: DataConfig) -> dict[str, list[RerankRequest]]:
    """-> {"train", "val", "test"}: slates to train on, held out while training, and to report on."""
    if cfg.source == "synthetic":
        splits, stats = generate(cfg.synthetic)
        log.info("embedded data: %s slates, redrawn for lack of relevant candidates: %d",
                 {k: len(v) for k, v in splits.items()}, stats.redrawn_no_relevant)
        return splits
    kwargs = {"run_file": cfg.run_file} if cfg.run_file else {}
    splits: dict[str, list[RerankRequest]] = {name: [] for name in SPLITS}
    for s in read_slates(cfg.source, cfg.path, top_n=cfg.top_n, **kwargs):
        b = query_bucket(s.slate_id)
        splits["test" if b < cfg.test_fraction else "val" if b < cfg.test_fraction + cfg.val_fraction else "train"].append(s)
    return splits
