"""Typed configs: dataclasses loaded from YAML, `key=value` overrides, unknown keys rejected.

The command line always wins: `load_config(JobConfig, "configs/default.yaml", ["train.steps=50"])`
reads the file, applies each override by dotted path, then builds the nested dataclasses, whose
`__post_init__` checks reject impossible combinations with a message that names the field.
Configs cross the Ray driver -> worker boundary as plain dicts (`to_dict` / `from_dict`).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


class ConfigError(ValueError):
    """A config key, value or combination is wrong; the message names the dotted key."""


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["train.steps=50", "model.preset=tiny"]` -> `{"train.steps": 50, "model.preset": "tiny"}`.

    Values are parsed as YAML scalars/lists (`50` -> int, `[1, 2]` -> list, `null` -> None).
    """
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, _, raw = item.partition("=")
        if not key.strip():
            raise ConfigError(f"override {item!r} has an empty key")
        value = yaml.safe_load(raw) if raw.strip() else ""
        if isinstance(value, str) and _FLOAT.match(value):  # YAML 1.1 reads "3e-3" as a string
            value = float(value)
        out[key.strip()] = value
    return out


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets `tree["a"]["b"] = value` for `dotted = "a.b"`; a mapping value replaces, never merges."""
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        if node.get(part) is None:  # an unset optional section (e.g. `student.model`) is created
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
    node[parts[-1]] = value


def _coerce(tp: Any, value: Any, where: str) -> Any:
    """Checks/converts a YAML value to the annotated type; raises ConfigError naming `where`."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a section (mapping), got {value!r}")
        return _build(tp, value, where)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError("; ".join(errors))
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return type(value)(_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)) \
            if origin is list else tuple(_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def _build(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key(s) {[prefix + u for u in unknown]}; "
            f"{cls.__name__} accepts {sorted(names)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(hints[name], value, key)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{where + ': ' if where else ''}{err}") from None


def from_dict(cls: type[T], data: dict[str, Any] | None) -> T:
    """Builds a (nested) config dataclass from plain data; unknown keys are an error."""
    return _build(cls, dict(data or {}))


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """YAML file (optional) + `key=value` overrides -> validated dataclass."""
    tree: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        tree = loaded
    for key, value in parse_overrides(overrides or []).items():
        set_dotted(tree, key, value)
    try:
        return from_dict(cls, tree)
    except ConfigError as err:
        raise ConfigError(f"{path or '<overrides>'}: {err}") from None


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """`{"train": {"steps": 5}}` -> `{"train.steps": 5}`; for logging configs as params."""
    tree = to_dict(config) if dataclasses.is_dataclass(config) else config
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def field_docs(cls: type) -> dict[str, str]:
    """A config dataclass's one-line field docs, read from its source (and its bases'): the comment
    at the end of the field's line, else the comment lines right above it."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        docs.update({k: v for k, v in _own_field_docs(klass).items() if v or k not in docs})
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    import inspect
    import io
    import tokenize

    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    for lineno, line in enumerate(lines, start=1):
        head = line.strip().split(":", 1)[0]
        if head not in names or head in docs or not line.strip().startswith(f"{head}:"):
            continue
        if lineno in comments and not lines[lineno - 1].strip().startswith("#"):
            docs[head] = comments[lineno]
            continue
        above, k = [], lineno - 1
        while k in comments and lines[k - 1].strip().startswith("#"):
            above.insert(0, comments[k])
            k -= 1
        docs[head] = " ".join(above)
    return docs


def describe(cls: type, config: Any = None, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """Every key of a (nested) config dataclass -> [(dotted key, value in `config`, default, doc)]."""
    defaults = cls()
    config = defaults if config is None else config
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        value, default = getattr(config, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value) or dataclasses.is_dataclass(default):
            sub = type(value if dataclasses.is_dataclass(value) else default)
            if value is not None and default is not None:
                rows += describe(sub, value, f"{prefix}{f.name}.")
                continue
        rows.append((f"{prefix}{f.name}", value, default, docs.get(f.name, "")))
    return rows
