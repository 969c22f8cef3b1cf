"""The stage cache: a stage's output folder holds `stage.json` with the fingerprint of what made it.

A stage whose folder has the same fingerprint is reused, not redone; delete the folder to redo it.
The fingerprint covers every input that changes the output (configs, upstream stage fingerprints).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from hllm.config import to_dict


def fingerprint(*parts: Any) -> str:
    blob = json.dumps([to_dict(p) if dataclasses.is_dataclass(p) else p for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fields_key(config: Any, fields: tuple[str, ...], *extra: Any) -> str:
    """The fingerprint of a config's named fields (what a cached result depends on, no more), and of `extra`."""
    whole = to_dict(config)
    return fingerprint({k: whole[k] for k in fields}, *extra)


def stage_info(directory: str | Path) -> dict[str, Any] | None:
    """The `stage.json` of a finished stage, or None."""
    marker = Path(directory) / "stage.json"
    return json.loads(marker.read_text()) if marker.exists() else None


def stage_done(directory: str | Path, key: str) -> bool:
    info = stage_info(directory)
    return info is not None and info.get("fingerprint") == key


def mark_done(directory: str | Path, key: str, **info: Any) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / "stage.json").write_text(json.dumps({"fingerprint": key, **info}, indent=2, default=str))
