"""The KubeRay manifests (deploy/kuberay) are valid, strict about unknown fields, and say what the
project says: the same Ray version, the same Serve application, an entrypoint that resolves here.

The CRD schemas (the API server's openAPIV3Schema, from ../shared/kuberay/crds) allow unknown fields
(the API server prunes them silently); the check here adds `additionalProperties: false` wherever a
schema lists its properties and does not preserve unknown fields, as `kubectl apply --validate=strict`
would reject them.
"""

from __future__ import annotations

import copy
import functools
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT.parent / "shared" / "kuberay" / "crds"
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kuberay").glob("*.yaml"))
IMAGE_ROOT = "/home/ray/hllm"  # where deploy/Dockerfile puts the project
CRD_KINDS = {"RayJob", "RayService", "RayCronJob", "RayCluster"}


def documents() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def of_kind(kind: str, name: str | None = None) -> dict:
    (doc,) = [d for _, d in documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return doc


def strict(schema: dict) -> dict:
    """The schema with unknown fields rejected wherever it names its fields."""
    if not isinstance(schema, dict):
        return schema
    out = {k: (strict(v) if isinstance(v, dict) else [strict(x) for x in v] if isinstance(v, list) else v)
           for k, v in schema.items() if k != "properties"}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(kind: str, version: str) -> jsonschema.Validator:
    if not CRDS.is_dir():
        pytest.skip(f"{CRDS} is absent")
    for path in CRDS.glob("*.yaml"):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if crd["spec"]["names"]["kind"] == kind:
            (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
            return jsonschema.Draft7Validator(strict(v["schema"]["openAPIV3Schema"]))
    raise AssertionError(f"no CRD for kind {kind} in {CRDS}")


def errors(doc: dict) -> list[str]:
    group, _, version = doc["apiVersion"].partition("/")
    assert group == "ray.io", doc["apiVersion"]
    found = crd_validator(doc["kind"], version).iter_errors(doc)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in found]


def test_manifests_exist():
    kinds = {d["kind"] for _, d in documents()}
    assert {"RayJob", "RayService", "RayCronJob", "PersistentVolumeClaim", "Secret"} <= kinds


@pytest.mark.parametrize("name,doc", [(n, d) for n, d in documents() if d["kind"] in CRD_KINDS],
                         ids=[f"{n}:{d['kind']}" for n, d in documents() if d["kind"] in CRD_KINDS])
def test_every_manifest_validates_strictly_against_its_crd(name, doc):
    assert doc["metadata"]["name"]
    assert errors(doc) == []


@pytest.mark.parametrize("kind,break_it,message", [
    ("RayJob", lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(maxReplicas="eight"),
     r"workerGroupSpecs\.0\.maxReplicas: 'eight' is not of type 'integer'"),
    ("RayJob", lambda d: d["spec"].update(entrypont=d["spec"].pop("entrypoint")),
     r"spec: Additional properties are not allowed \('entrypont' was unexpected\)"),
    ("RayJob", lambda d: d["spec"]["rayClusterSpec"].update(shutdownAfterJobFinishes=True),  # a RayJob field, misplaced
     r"rayClusterSpec: Additional properties are not allowed \('shutdownAfterJobFinishes' was unexpected\)"),
    ("RayService", lambda d: d["spec"].update(serveConfigV2={"applications": []}),
     r"serveConfigV2: .* is not of type 'string'"),
    ("RayService", lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     .update(imagePullPolicey="Always"), r"Additional properties are not allowed \('imagePullPolicey' was unexpected\)"),
    ("RayCronJob", lambda d: d["spec"].pop("schedule"), r"spec: 'schedule' is a required property"),
])
def test_a_broken_manifest_fails_with_the_schemas_message(kind, break_it, message):
    doc = copy.deepcopy([d for _, d in documents() if d["kind"] == kind][0])
    break_it(doc)
    found = errors(doc)
    assert any(re.search(message, e) for e in found), found


def ray_pin() -> str:
    (pin,) = re.findall(r'^\s*"(ray\[[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)  # Python 3.10 has no tomllib
    match = re.fullmatch(r"ray\[[^\]]*\]==(\d+\.\d+\.\d+)", pin)
    assert match, f"pyproject.toml pins Ray as {pin!r}: the image and manifests need one exact version"
    return match.group(1)


def test_the_image_and_every_manifest_take_rays_version_from_the_project():
    version = ray_pin()
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(rf"^ARG RAY_VERSION={re.escape(version)}$", dockerfile, re.M), "deploy/Dockerfile's RAY_VERSION"
    assert "FROM rayproject/ray:${RAY_VERSION}" in dockerfile
    for name, doc in documents():
        if doc["kind"] not in CRD_KINDS:
            continue
        text = yaml.safe_dump(doc)
        assert re.findall(r"rayVersion: '?([\d.]+)", text) and set(re.findall(r"rayVersion: '?([\d.]+)", text)) == {version}, name
        images = set(re.findall(r"image: (\S+)", text))
        assert images and all(i.endswith(f"-ray{version}") for i in images), (name, images)


def serve_apps(config: dict) -> dict[str, dict]:
    return {a["name"]: a for a in config["applications"]}


@pytest.mark.slow  # Serve's own schema and app builder: imports Ray, so not in the fast tier
def test_the_rayservice_serves_the_application_of_serve_config_yaml():
    from ray.serve.schema import ServeDeploySchema

    from serve.app import app_builder
    from serve.common import AppArgs

    local = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())
    served = yaml.safe_load(of_kind("RayService", "hllm-serve")["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(local)  # what `serve deploy` and KubeRay hand to Serve
    ServeDeploySchema.model_validate(served)
    assert serve_apps(served).keys() == serve_apps(local).keys()
    for name, app in serve_apps(served).items():
        mine = serve_apps(local)[name]
        assert (app["import_path"], app["route_prefix"]) == (mine["import_path"], mine["route_prefix"])
        assert [d["name"] for d in app["deployments"]] == [d["name"] for d in mine["deployments"]]
        assert set(app["args"]) <= set(AppArgs.model_fields), set(app["args"]) - set(AppArgs.model_fields)
        AppArgs(**app["args"])
        app_builder(app["args"])  # builds (binds) the application without loading the model
        assert app["args"]["model"].startswith("models:/") and app["args"]["model"].endswith("@champion")
        for deployment in app["deployments"]:
            assert set(deployment.get("user_config", {})) <= {"max_batch_size", "batch_wait_timeout_s"}


@pytest.mark.slow  # Serve's own schema and app builder: imports Ray, so not in the fast tier
def test_the_many_student_rayservice_builds_its_app_and_upgrades_clusters_incrementally():
    """deploy/kuberay/rayservice-students.yaml: a Serve config Serve accepts, args AppArgs accepts (the students, the
    rollout), the three deployments the app builds, and KubeRay's incremental cluster upgrade."""
    from ray.serve.schema import ServeDeploySchema

    from serve.app import app_builder
    from serve.common import AppArgs

    doc = of_kind("RayService", "hllm-students")
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    local = yaml.safe_load((ROOT / "serve" / "students.yaml").read_text())  # the local example builds the same app
    ServeDeploySchema.model_validate(local)
    (mine,) = local["applications"]
    assert app_builder(mine["args"]) is not None
    assert [d["name"] for d in mine["deployments"]] == ["Router", "Students", "Rollout", "Shadows"]
    (app,) = config["applications"]
    args = AppArgs(**app["args"])
    assert args.students["main"] == "models:/hllm-student@champion" and args.rollout.canary.model == "challenger"
    assert args.rollout.canary.promote_alias == "champion" and args.rollout.shadow.model == "challenger"
    built = app_builder(app["args"])  # binds Router -> Students + Rollout without loading a model
    assert built is not None
    assert [d["name"] for d in app["deployments"]] == ["Router", "Students", "Rollout", "Shadows"]
    strategy = doc["spec"]["upgradeStrategy"]
    assert strategy["type"] == "NewClusterWithIncrementalUpgrade"
    assert {"gatewayClassName", "stepSizePercent", "intervalSeconds"} <= set(strategy["clusterUpgradeOptions"])


def resolve_entrypoint(entrypoint: str) -> tuple[Path, list[str]]:
    words = shlex.split(entrypoint)
    assert words[0] == "python" and words[1].startswith(IMAGE_ROOT + "/"), words
    script = ROOT / words[1][len(IMAGE_ROOT) + 1:]
    rest = [w.replace(IMAGE_ROOT, str(ROOT)) for w in words[2:]]
    return script, rest


def test_the_rayjob_entrypoint_and_config_resolve_in_this_checkout():
    from hllm.config import load_config
    from pipelines.common import PipelineConfig

    spec = of_kind("RayJob")["spec"]
    script, rest = resolve_entrypoint(spec["entrypoint"])
    assert script.is_file() and script.relative_to(ROOT).as_posix() == "pipelines/full.py"
    assert rest[0] == "--config"
    config = Path(rest[1])
    assert config.is_file(), config
    overrides = [re.sub(r"\$[A-Z_]+", "http://mlflow:5000", w) for w in rest[2:]]
    cfg = load_config(PipelineConfig, config, overrides)
    assert cfg.output_dir.startswith("/mnt/hllm/") and cfg.tracking.tracking_uri == "http://mlflow:5000"
    assert "$MLFLOW_TRACKING_URI" in spec["entrypoint"]
    assert spec["shutdownAfterJobFinishes"] is True


def test_the_scheduled_job_is_the_rayjob():
    assert of_kind("RayCronJob", "hllm-weekly")["spec"]["jobTemplate"] == of_kind("RayJob")["spec"]


def test_the_scheduled_refresh_runs_a_cycle_on_the_jobs_cluster_and_reads_what_serve_logs():
    from hllm.config import load_config
    from pipelines.common import PipelineConfig

    template = of_kind("RayCronJob", "hllm-refresh")["spec"]["jobTemplate"]
    job = of_kind("RayJob")["spec"]
    assert {k: v for k, v in template.items() if k != "entrypoint"} == {k: v for k, v in job.items() if k != "entrypoint"}
    script, rest = resolve_entrypoint(template["entrypoint"])
    assert script.relative_to(ROOT).as_posix() == "pipelines/refresh.py" and rest[0] == "--config"
    cfg = load_config(PipelineConfig, rest[1], [re.sub(r"\$[A-Z_]+", "http://mlflow:5000", w) for w in rest[2:]])
    _, job_rest = resolve_entrypoint(job["entrypoint"])
    assert (rest[1], cfg.output_dir) == (job_rest[1], load_config(PipelineConfig, job_rest[1], [
        re.sub(r"\$[A-Z_]+", "http://mlflow:5000", w) for w in job_rest[2:]]).output_dir)  # the job's rankings
    served = serve_apps(yaml.safe_load(of_kind("RayService", "hllm-serve")["spec"]["serveConfigV2"]))["hllm"]["args"]
    assert cfg.refresh.log_path == served["traffic_log"]["path"] and cfg.refresh.champion == served["model"]


def test_every_secret_and_volume_claim_referenced_is_defined():
    defined = {(d["kind"], d["metadata"]["name"]): d for _, d in documents() if d["kind"] in ("Secret", "PersistentVolumeClaim")}
    text = "\n".join(yaml.safe_dump(d) for _, d in documents() if d["kind"] in CRD_KINDS)
    refs = re.findall(r"secretKeyRef:\s+key: (\S+)\s+name: (\S+)", text)  # safe_dump sorts keys: key before name
    assert refs
    for key, name in refs:
        assert ("Secret", name) in defined, name
        assert key in defined["Secret", name]["stringData"], (name, key)
    for claim in set(re.findall(r"claimName: (\S+)", text)):
        pvc = defined["PersistentVolumeClaim", claim]
        assert "ReadWriteMany" in pvc["spec"]["accessModes"]  # every node writes output_dir
