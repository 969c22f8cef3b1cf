"""What the benchmark scripts share: a local Ray (+ Serve on loopback) and the report they write.

Scripts run as `python benchmarks/<name>.py`, which puts this folder on sys.path: `from bench import ...`.
"""

from __future__ import annotations

import time
from pathlib import Path


def local_ray(serve_port: int | None = None) -> None:
    """A local Ray with 4 logical CPUs and no dashboard; Serve's HTTP ingress (HAProxy, `serve.common.THIN_INGRESS`) on
    127.0.0.1 when a port is given."""
    import ray

    from serve.common import thin_ingress

    thin_ingress()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    if serve_port is not None:
        from serve.common import start_serve

        start_serve({"host": "127.0.0.1", "port": serve_port})


def write_report(name: str, title: str, text: str, path: str | Path | None = None) -> Path:
    """Prints `text` and writes it as `reports/<name>.md` (or `path`) under `# title`."""
    print(text)
    path = Path(path) if path else Path("reports") / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {title}\n\n{text.rstrip()}\n")
    return path


def post_all(url: str, bodies: list[dict], timeout: float = 120, session=None) -> list[float]:
    """Each body POSTed in turn over one keep-alive session (`session`, or a new one; sequential: no request waits on
    another) -> ms each."""
    import requests

    session, ms = session or requests.Session(), []
    for body in bodies:
        t0 = time.perf_counter()
        r = session.post(url, json=body, timeout=timeout)
        r.raise_for_status()
        ms.append(1000 * (time.perf_counter() - t0))
    return ms
