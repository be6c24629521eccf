"""``localllm serve`` as users start it: a subprocess that prints its URL when ready, answers
the openai client, and stops cleanly on Ctrl+C; a busy or bad port fails at once, on one line.
The settings that fail before anything loads run ``main`` in this process (``cli_here``): a
fresh interpreter per case would add ~2 s of imports and test nothing more."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_cli import cli_here

SERVE = [sys.executable, "-m", "localllm.cli", "serve"]


def _ready_url(proc: subprocess.Popen[str], timeout: float) -> str:
    """Reads stdout until the one 'serving ... at URL' line arrives."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sel.select(timeout=0.5):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if " at http://" in line:
            return line.split(" at ", 1)[1].split()[0]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"serve never became ready: {proc.stderr.read() if proc.stderr else ''}")


def test_serve_subprocess_with_api_key(default_model_path: Path) -> None:
    env = {**os.environ, "LOCALLLM_API_KEY": "k-sub", "LOCALLLM_ALLOWED_ORIGINS": "http://localhost:3000"}
    proc = subprocess.Popen(
        [*SERVE, "--model", str(default_model_path), "--port", "0", "--max-model-len", "512", "--chats", "1",
         "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        url = _ready_url(proc, timeout=150)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        root = url.removesuffix("/v1")
        assert httpx.get(f"{root}/health").json() == {"status": "ok", "model": default_model_path.name, "optimizing": False}
        assert httpx.get(f"{url}/models").status_code == 401
        # issue 33: a foreign Host or Origin is refused; the origin from the environment is answered
        port = root.rsplit(":", 1)[1]
        assert httpx.get(f"{root}/health", headers={"Host": f"evil.example:{port}"}).status_code == 403
        assert httpx.get(f"{root}/health", headers={"Origin": "http://evil.example"}).status_code == 403
        preflight = httpx.options(f"{url}/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        client = openai.OpenAI(base_url=url, api_key="k-sub", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert r.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) in (0, 130)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("port", ["busy", "70000"])
def test_serve_bad_port_fails_fast_on_one_line(port: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        number = str(s.getsockname()[1]) if port == "busy" else port
        started = time.monotonic()
        r = cli_here("serve", "--port", number)
    assert r.returncode == 2
    assert r.stderr.startswith("localllm: error: cannot listen") or "--port" in r.stderr
    assert r.stderr.count("\n") == 1
    assert time.monotonic() - started < 30  # no model load before the bind


@pytest.mark.parametrize(("args", "env", "words"), [
    (["--api-key", ""], {}, "--api-key is empty"),
    (["--api-key", "   "], {}, "--api-key is empty"),
    ([], {"LOCALLLM_API_KEY": ""}, "LOCALLLM_API_KEY is empty"),
    (["--api-key", "two words here"], {}, "without spaces"),
    (["--max-waiting", "-1"], {}, "--max-waiting -1"),
    (["--request-timeout", "nan"], {}, "--request-timeout nan"),
    (["--request-timeout", "-5"], {}, "--request-timeout -5"),
    (["--allowed-origins", "localhost:3000"], {}, "--allowed-origins: 'localhost:3000' is not an origin"),
    ([], {"LOCALLLM_ALLOWED_HOSTS": "http://x"}, "LOCALLLM_ALLOWED_HOSTS: 'http://x'"),
])
def test_bad_serve_settings_fail_fast_on_one_line(args: list[str], env: dict[str, str], words: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty key used to turn authentication off without a word."""
    monkeypatch.delenv("LOCALLLM_API_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    r = cli_here("serve", "--port", "0", *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("localllm: error:") and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr


def test_a_short_api_key_gets_a_warning() -> None:
    with socket.socket() as s:  # a busy port ends the run right after the key is read
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = cli_here("serve", "--port", str(s.getsockname()[1]), "--api-key", "abc")
    lines = r.stderr.splitlines()
    assert lines[0] == "localllm: warning: --api-key is 3 characters long; a key under 8 is easy to guess"
    assert r.returncode == 2 and lines[1].startswith("localllm: error: cannot listen")
