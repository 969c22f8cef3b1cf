"""`hllm serve` (serve/launch.py): what a command line deploys, its errors before Ray starts, and end to end — a real
`hllm serve` process with its own Ray answering the Cohere v2 SDK and raw HTTP, behind a bearer key, stopped by Ctrl-C."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from pipelines.cli import main as cli
from serve.launch import Plan, plan, routes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def folders(tmp_path):
    for name in ("champion", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "hllm_ranker.json").write_text("{}")
    return tmp_path


def test_one_model_is_the_one_student_app_and_a_folder_becomes_absolute(folders, monkeypatch):
    monkeypatch.chdir(folders)
    assert plan(["champion"]) == Plan(model=str(folders / "champion"))
    assert plan(["models:/fleet@champion"]) == Plan(model="models:/fleet@champion")
    assert plan(["smollm2-trec-dl"]) == Plan(model="smollm2-trec-dl")  # a shipped name, as Reranker.load takes it


def test_several_or_named_models_are_the_many_student_app_the_first_the_default(folders, monkeypatch):
    monkeypatch.chdir(folders)
    p = plan(["main=champion", "b=other", "reg=models:/fleet@champion"])
    assert p.students == {"main": str(folders / "champion"), "b": str(folders / "other"), "reg": "models:/fleet@champion"}
    assert p.names[0] == "main" and p.model is None
    assert plan(["champion", "other"]).names == ["champion", "other"]  # named by their folders
    assert plan(["only=champion"]).students == {"only": str(folders / "champion")}  # a named one: many-student


@pytest.mark.parametrize("specs, error, needle", [
    (["champion", "runs:/abc/student"], ValueError, "NAME=runs:/abc/student"),
    (["a=champion", "a=other"], ValueError, "two students are named 'a'"),
    (["nowhere"], FileNotFoundError, "no trained student at 'nowhere'"),
    (["a=champion", "b=empty"], FileNotFoundError, "'empty' holds no trained student"),
    (["bad name=champion", "other"], ValueError, "not a usable model name"),
])
def test_what_cannot_be_served_is_said_before_ray_starts(folders, monkeypatch, specs, error, needle):
    monkeypatch.chdir(folders)
    (folders / "empty").mkdir()
    with pytest.raises(error, match=re.escape(needle)):
        plan(specs)


def test_the_command_line_exits_2_with_one_line_and_starts_no_ray(folders, monkeypatch, capsys):
    monkeypatch.chdir(folders)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` would raise: the errors come before Ray is touched
    assert cli(["serve", "nowhere"]) == 2
    assert "hllm serve: error: no trained student at 'nowhere'" in capsys.readouterr().err
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    assert cli(["serve", "champion", "--api-key-env", "NO_SUCH_KEY_VAR"]) == 2
    assert "NO_SUCH_KEY_VAR: that environment variable is not set" in capsys.readouterr().err
    monkeypatch.setenv("A_KEY", "k")
    assert cli(["serve", "a=champion", "b=other", "--api-key-env", "A_KEY", "--address", "ray://elsewhere:10001"]) == 2
    assert "serves one student only" in capsys.readouterr().err


def test_the_printed_routes_name_the_default_model_in_the_curl_line():
    many = routes("http://127.0.0.1:8000", Plan(students={"main": "/m", "b": "/b"}))
    assert any("/v1/rollout" in line for line in many) and '"model": "main"' in many[-1]
    one = routes("http://127.0.0.1:8000", Plan(model="/m"))
    assert one[-1].startswith("  try: curl -s http://127.0.0.1:8000/v1/rerank") and '"model"' not in one[-1]


# ---- end to end: a real `hllm serve` process (its own Ray), tiny students


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], env: dict, timeout_s: float = 300.0) -> tuple[subprocess.Popen, list[str]]:
    """`hllm serve ARGS` until it prints 'Ctrl-C stops it.' -> (the process, the lines it printed)."""
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "serve", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("Ctrl-C stops it."):
            return proc, lines
    proc.kill()
    raise AssertionError("hllm serve did not come up:\n" + "\n".join(lines))


def stop(proc: subprocess.Popen, lines: list[str]) -> list[str]:
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) -> the lines printed after."""
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, "\n".join(lines) + out
    return out.splitlines()


@pytest.mark.slow
def test_hllm_serve_answers_the_cohere_sdk_behind_a_key_and_stops_on_ctrl_c(tmp_path_factory, small_splits):
    """Two tiny students behind one endpoint (the many-student app, the one that routes), a bearer key from an
    environment variable, the Cohere v2 SDK and plain HTTP, then Ctrl-C: exit 0, the port closed, Ray gone."""
    import cohere

    from test_students import build

    root = tmp_path_factory.mktemp("launch")
    main, other = build(root / "main", small_splits, steps=10), build(root / "other", small_splits, seed=1)
    port = free_port()
    # its own Ray beside the session's: HAProxy's stats and metrics ports (8404, 9101 by default) must differ too
    env = {**os.environ, "LAUNCH_TEST_KEY": "s3cret", "PYTHONUNBUFFERED": "1",
           "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port())}
    env.pop("RAY_ADDRESS", None)  # the session's Ray (when started) set it here: `hllm serve` would join that one
    proc, lines = start([f"main={main}", f"other={other}", "--port", str(port), "--api-key-env", "LAUNCH_TEST_KEY"], env)
    url = f"http://127.0.0.1:{port}"
    try:
        assert lines[0].startswith("hllm serve: 2 students (main, other; default main), 1 replica, ready in "), lines
        assert lines[0].endswith(f"at {url}  (bearer key required)") and any('"model": "main"' in l for l in lines)
        assert len(lines) <= 10, lines  # what it said, and nothing of Ray's
        docs = ["acme red leather boots", "zenith blue cotton shirt", "nordic red leather boots"]
        client = cohere.ClientV2(api_key="s3cret", base_url=url)
        answer = client.rerank(model="other", query="red leather boots", documents=docs, top_n=2)
        assert len(answer.results) == 2 and {r.index for r in answer.results} <= {0, 1, 2}
        assert answer.results[0].relevance_score >= answer.results[1].relevance_score
        from hllm import Reranker

        assert [r.index for r in answer.results] == [d.index for d in Reranker.load(other).rank(
            "red leather boots", docs, top_k=2)]
        assert answer.meta.first_stage_order is False  # the Cohere contract: documents are a set
        declared = client.rerank(model="other", query="red leather boots", documents=docs,
                                 request_options={"additional_body_parameters": {"first_stage_order": True}})
        assert declared.meta.first_stage_order is True  # the extension through the SDK's extra-body parameters
        assert requests.post(f"{url}/v1/rerank", json={"query": "q", "documents": docs}, timeout=30).status_code == 401
        listed = requests.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"}, timeout=30).json()
        assert [m["id"] for m in listed["data"]] == ["main", "other"]
    finally:
        after = stop(proc, lines) if proc.poll() is None else []
    assert after[-1] == "hllm serve: stopped", after
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/healthz", timeout=5)
