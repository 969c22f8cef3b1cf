"""The student as an MLflow model in the Model Registry: a pyfunc around `hllm.Reranker`.

    from pipelines.registry import log_student, promote
    with mlflow.start_run():
        log_student("runs/default/student", registered_name="hllm-student", alias="candidate")
    promote("hllm-student", version=1, alias="champion")                         # one call
    Reranker.load("models:/hllm-student@champion")      # also: serve args.model, hllm rerank --model

The logged model holds the student folder as an artifact, a signature (query: string, documents:
list of strings -> ranking: indices best first, scores; param top_n) and its pip requirements, so
`mlflow.pyfunc.load_model(...).predict(df)` ranks without this repository. `models:/` and `runs:/`
URIs resolve to the student folder inside it (`pipelines.common.download_mlflow_model`).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# one console line per event: no "Downloading artifacts" bar for every model logged, loaded or served from the registry
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

import mlflow  # noqa: E402
import pandas as pd  # noqa: E402
from mlflow.models import infer_signature  # noqa: E402

from hllm.uris import registry_alias  # noqa: E402

ARTIFACT = "student"  # the student folder's name inside the logged model's artifacts
MODEL_NAME = "student_model"  # the logged model's name in its run


def _requirements() -> list[str]:
    """hllm's own dependencies (pyproject's, without extras), pinned to the installed versions."""
    from packaging.requirements import Requirement

    pins = []
    for spec in requires("hllm") or []:
        req = Requirement(spec)
        if req.marker is None:  # extras (ray, smollm2, dev) are not needed to rank
            try:
                pins.append(f"{req.name}=={version(req.name).split('+')[0]}")
            except PackageNotFoundError:
                pins.append(str(req))
    return pins


def log_student(student_dir: str | Path, registered_name: str | None = None, alias: str | None = None,
                artifact_path: str = "student") -> str:
    """Logs the student into the active MLflow run as a pyfunc model at `artifact_path` (so
    `runs:/RUN_ID/student` is both the model and, inside it, the student folder); with
    `registered_name` registers it as a new version and points `alias` at it. -> the model URI
    (`models:/NAME/VERSION` when registered, else `runs:/RUN_ID/student`)."""
    import tempfile

    example = pd.DataFrame({"query": ["red leather boots"], "documents": [["acme red leather boots", "blue shirt"]]})
    output = pd.DataFrame({"ranking": [[0, 1]], "scores": [[1.0, 0.5]]})
    hllm_dir = Path(__file__).resolve().parents[1] / "hllm"
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "model"
        mlflow.pyfunc.save_model(
            path=str(local), python_model=str(Path(__file__).with_name("registry_model.py")),
            artifacts={ARTIFACT: str(student_dir)}, signature=infer_signature(example, output, params={"top_n": 0}),
            input_example=example, pip_requirements=_requirements(), code_paths=[str(hllm_dir)])
        mlflow.log_artifacts(str(local), artifact_path=artifact_path)
    uri = f"runs:/{mlflow.active_run().info.run_id}/{artifact_path}"
    if not registered_name:
        return uri
    registered = register(registered_name, artifact_path)
    if alias:
        promote(registered_name, registered.version, alias)
    return f"models:/{registered_name}/{registered.version}"


def register(name: str, artifact_path: str):
    """A new version of the registered model `name` (created if absent) from the active run's `artifact_path`: what
    `mlflow.register_model` does for a logged pyfunc, without its two lines printed to stderr. -> the ModelVersion."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    client = mlflow.MlflowClient()
    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    run = mlflow.active_run().info.run_id
    return client.create_model_version(name, mlflow.get_artifact_uri(artifact_path), run_id=run)


def pin(uri: str) -> str:
    """`models:/NAME@ALIAS` -> `models:/NAME/VERSION`, the version the alias points at now."""
    name, alias = registry_alias(uri)
    return f"models:/{name}/{mlflow.MlflowClient().get_model_version_by_alias(name, alias).version}"


def promote(name: str, model_version: int | str, alias: str = "champion") -> None:
    """Points `models:/NAME@ALIAS` at a version (moving the alias from any other)."""
    mlflow.MlflowClient().set_registered_model_alias(name, alias, str(model_version))


def student_folder(downloaded: str | Path) -> Path:
    """A downloaded MLflow URI -> the student folder: the folder itself, or the one a logged pyfunc
    holds (its MLmodel names where: `artifacts/<the folder's original name>`)."""
    import yaml

    downloaded = Path(downloaded)
    mlmodel = downloaded / "MLmodel"
    if not mlmodel.is_file():
        return downloaded
    artifacts = yaml.safe_load(mlmodel.read_text()).get("flavors", {}).get("python_function", {}).get("artifacts", {})
    if ARTIFACT not in artifacts:
        raise ValueError(f"{downloaded} is an MLflow model without an hLLM student (no {ARTIFACT!r} artifact)")
    return downloaded / artifacts[ARTIFACT]["path"]
