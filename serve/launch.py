"""`hllm serve`: one command from a model to an HTTP rerank endpoint on Ray Serve.

    hllm serve smollm2-trec-dl                                  # one student: the one-student app (serve.app)
    hllm serve runs/default/student --replicas 2 --port 8080
    hllm serve main=models:/hllm-student@champion trec=smollm2-trec-dl   # several: the many-student app (serve.students)
    HLLM_KEY=s3cret hllm serve smollm2-trec-dl --api-key-env HLLM_KEY   # requests need `Authorization: Bearer s3cret`

Starts a local Ray (or joins `--address` / RAY_ADDRESS), deploys, prints the URL, the routes and a `curl` line, and
serves until Ctrl-C (or SIGTERM), when it deletes the app, stops Serve and the Ray it started. Ray's own logs stay in
its session folder (printed once); `--verbose` brings them to the console. What `serve run serve/config.yaml` does with
a YAML, this does with flags, for the common case.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

APP_NAME = "hllm"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a student's short name (what a request's `model` says)


@dataclass(frozen=True)
class Plan:
    """What `hllm serve` deploys: one model, or several by name (the first is the default)."""

    model: str | None = None
    students: dict[str, str] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.students) if self.students else []


def _model(spec: str) -> str:
    """A folder becomes an absolute path (replicas do not share this shell's working directory); a URI or a shipped
    name stays as it is. A model that cannot be found is an error now, before Ray starts."""
    from hllm.uris import resolve_model_uri

    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "hllm_ranker.json").is_file():
            raise FileNotFoundError(f"{spec!r} holds no trained student (no hllm_ranker.json)")
        return str(path.resolve())
    if ":/" not in spec:
        resolve_model_uri(spec)  # a shipped name, or FileNotFoundError naming the shipped ones
    return spec


def _short_name(spec: str) -> str:
    if ":/" in spec:
        raise ValueError(f"name a model URI when serving several: NAME={spec}")
    name = Path(spec).name or spec
    if not NAME.match(name):
        raise ValueError(f"cannot name {spec!r} from its folder: give NAME={spec}")
    return name


def plan(specs: list[str]) -> Plan:
    """`MODEL` alone -> the one-student app; several, or any `NAME=MODEL` -> the many-student app, keyed by name."""
    if len(specs) == 1 and "=" not in specs[0].split(":/")[0]:
        return Plan(model=_model(specs[0]))
    students: dict[str, str] = {}
    for spec in specs:
        name, sep, model = spec.partition("=")
        if not sep or ":/" in name:  # MODEL alone (a URI's own '=' is not a name)
            name, model = _short_name(spec), spec
        if not NAME.match(name):
            raise ValueError(f"{name!r} is not a usable model name (letters, digits, '_', '.', '-')")
        if name in students:
            raise ValueError(f"two students are named {name!r}: give each its own NAME=MODEL")
        students[name] = _model(model)
    return Plan(students=students)


def routes(url: str, p: Plan) -> list[str]:
    """The lines printed once the app answers: where, what, and one request to try."""
    body = {"query": "red leather boots", "documents": ["acme red leather boots", "blue cotton shirt"], "top_n": 2}
    if p.students:
        body = {"model": p.names[0], **body}
    lines = [f"  POST {url}/v1/rerank      Cohere v2 / Jina / vLLM rerank (also /v2/rerank, /rerank)",
             f"  GET  {url}/v1/models      the served student{'s' if p.students else ''} and {'their' if p.students else 'its'} card",
             f"  GET  {url}/healthz        liveness;  OpenAPI: {url}/docs"]
    if p.students:
        lines.append(f"  GET  {url}/v1/rollout     shadow / canary state (none unless a serve YAML sets args.rollout)")
    lines.append(f"  try: curl -s {url}/v1/rerank -H 'Content-Type: application/json' -d '{json.dumps(body)}'")
    return lines


def build(p: Plan, replicas: int, api_key_env: str | None, joined: bool):
    """The Serve application: the one-student or many-student app from the same builder as `serve run`'s YAML."""
    from serve.app import RerankDeployment
    from serve.common import AppArgs
    from serve.students import students_app

    options: dict = {"num_replicas": replicas}
    if api_key_env and joined:  # a cluster we did not start: the replica gets the key through its runtime env
        options["ray_actor_options"] = {"num_cpus": 1, "runtime_env": {"env_vars": {
            "HLLM_API_TOKEN": os.environ[api_key_env]}}}
    if p.students is None:
        return RerankDeployment.options(**options).bind(AppArgs(model=p.model).model_dump())
    return students_app(AppArgs(students=p.students), students_options=options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hllm serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", metavar="MODEL|NAME=MODEL",
                        help="a student: a shipped name (smollm2-trec-dl), a folder, runs:/RUN_ID/student or "
                        "models:/NAME@ALIAS; several (NAME=MODEL each, the first the default) serve behind one "
                        "endpoint, a request's `model` picking one")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of the student deployment")
    parser.add_argument("--api-key-env", metavar="VAR", help="require `Authorization: Bearer $VAR` on every route but "
                        "/healthz (the key is read from this environment variable, never from the command line)")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="join this Ray cluster (default: RAY_ADDRESS, else start a local Ray)")
    parser.add_argument("--tracking-uri", help="MLflow, where runs:/ and models:/ resolve (default: MLFLOW_TRACKING_URI)")
    parser.add_argument("--verbose", action="store_true", help="Ray's and Serve's own logs on the console too "
                        "(or HLLM_VERBOSE=1)")


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop()


def run(args: argparse.Namespace) -> int:
    """Deploys, prints where, waits for Ctrl-C or SIGTERM, and cleans up. -> exit status."""
    if args.replicas < 1:
        raise ValueError("--replicas: at least 1")
    if args.api_key_env and not os.environ.get(args.api_key_env):
        raise ValueError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    if args.tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = args.tracking_uri
    from pipelines import console

    p = plan(args.models)
    joined = bool(args.address)
    if args.api_key_env and joined and p.students is not None:  # its Router would need the key too: code cannot say so
        raise ValueError("--api-key-env with --address serves one student only: for several, set HLLM_API_TOKEN in "
                         "the cluster's environment (or the Serve YAML's runtime_env) and leave --api-key-env out")
    verbose = console.setup(args.verbose)
    if not joined:
        console.local_ray_auth()
    import ray
    from ray import serve

    from serve.common import start_serve, thin_ingress

    console.quiet_loggers()

    t0 = time.perf_counter()
    if args.api_key_env and not joined:  # replicas of a Ray started here inherit this environment
        os.environ["HLLM_API_TOKEN"] = os.environ[args.api_key_env]
    if not joined:
        thin_ingress()
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")  # Ctrl-C: no 30 s drain
    ray.init(address=args.address, include_dashboard=False, log_to_driver=verbose,
             logging_level=logging.INFO if verbose else logging.WARNING)
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        start_serve({"host": args.host, "port": args.port})
        serve.run(build(p, args.replicas, args.api_key_env, joined), name=APP_NAME, route_prefix="/", blocking=False)
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host}:{args.port}"
        what = (f"{p.model}" if p.students is None else
                f"{len(p.students)} students ({', '.join(p.names)}; default {p.names[0]})")
        print(f"hllm serve: {what}, {args.replicas} replica{'s' if args.replicas > 1 else ''}, ready in "
              f"{time.perf_counter() - t0:.0f} s at {url}" + ("  (bearer key required)" if args.api_key_env else ""),
              flush=True)
        for line in routes(url, p):
            print(line, flush=True)
        print(f"ray: {args.address or 'a local instance'}; its logs (the replicas' too) in {console.ray_logs()}"
              + ("" if verbose else f" (--verbose or {console.VERBOSE}=1 shows them here)"), flush=True)
        print("Ctrl-C stops it.", flush=True)
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, _Stop):
        print("hllm serve: stopping ...", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _shutdown(joined)
    print("hllm serve: stopped", flush=True)
    return 0


def _shutdown(joined: bool) -> None:
    """Deletes the app; a Ray started here goes with Serve (its HAProxy included), a joined cluster keeps Serve."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
