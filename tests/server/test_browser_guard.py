"""Issue 33: no web page can drive the server. A foreign ``Host`` (DNS rebinding), a foreign
``Origin``, a cross-site request and a body not declared JSON are refused (403, 415) before
the engine sees them; the official client, httpx and curl keep working; an origin the user
allows gets CORS headers and its preflights answered."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from localllm.errors import LocalLLMError
from localllm.server.allow_lists import AllowLists, allow_lists, origin_key, split_host
from localllm.server.app import create_app
from localllm.server.serving import start_server_thread
from tests.server.conftest import API_KEY, Served

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"messages": QUESTION, "max_tokens": 2, "temperature": 0}
UI = "http://localhost:3000"  # the web UI the user allows on the second server


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


def _prompt_tokens(served: Served) -> int:
    return served.engine.stats().prompt_tokens


def _error(r: httpx.Response, status: int, code: str, *words: str) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert "\n" not in error["message"] and all(w in error["message"] for w in words), error["message"]
    assert "access-control-allow-origin" not in r.headers
    return str(error["message"])


@pytest.fixture(scope="module")
def ui_server(served: Served) -> Iterator[str]:
    """The same engine behind a key, answering the name myhost.lan and the origin ``UI``."""
    running = start_server_thread(create_app(served.engine, api_key=API_KEY,
                                             allow=allow_lists("127.0.0.1", "myhost.lan", UI)))
    try:
        yield running.url
    finally:
        running.stop()


# ---- the default: loopback names, no origin ----

def test_a_foreign_host_is_refused_on_every_route(served: Served) -> None:
    host = f"evil.example:{_port(served.url)}"
    before = _prompt_tokens(served)
    for method, path in (("GET", "/v1/models"), ("GET", "/health"), ("GET", "/metrics"),
                         ("POST", "/v1/chat/completions")):
        r = httpx.request(method, f"{served.url}{path}", headers={"Host": host}, json=CHAT, timeout=30)
        _error(r, 403, "host_not_allowed", "evil.example", "--allowed-hosts evil.example", "LOCALLLM_ALLOWED_HOSTS")
    assert _prompt_tokens(served) == before  # nothing reached the engine
    # a loopback address hidden in a foreign name, and a malformed port, are foreign too
    for bad in ("127.0.0.1.evil.example", f"localhost:{_port(served.url)}x", "localhost.evil.example:80"):
        assert httpx.get(f"{served.url}/health", headers={"Host": bad}).status_code == 403, bad


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:{port}", "127.0.0.1:{port}", "127.1.2.3", "[::1]:{port}",
                                  "app.localhost:{port}", "localhost."])
def test_loopback_names_are_answered(served: Served, host: str) -> None:
    r = httpx.get(f"{served.url}/health", headers={"Host": host.format(port=_port(served.url))})
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_a_foreign_origin_cannot_generate_with_a_simple_request(served: Served) -> None:
    """A page's fetch with a text/plain body needs no preflight: it ran before issue 33."""
    before = _prompt_tokens(served)
    origin = "http://evil.example"
    r = httpx.post(f"{served.base}/chat/completions", content=json.dumps(CHAT),
                   headers={"Origin": origin, "Content-Type": "text/plain;charset=UTF-8"}, timeout=30)
    _error(r, 403, "origin_not_allowed", origin, f"--allowed-origins {origin}", "LOCALLLM_ALLOWED_ORIGINS")
    for headers in ({"Origin": origin}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
        _error(httpx.get(f"{served.base}/models", headers=headers), 403, "origin_not_allowed")
        _error(httpx.post(f"{served.base}/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=headers),
               403, "origin_not_allowed")
    assert _prompt_tokens(served) == before


def test_a_foreign_preflight_is_refused(served: Served) -> None:
    r = httpx.options(f"{served.base}/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    _error(r, 403, "origin_not_allowed")
    assert not any(h.startswith("access-control-") for h in r.headers)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp"])
def test_a_body_not_declared_json_is_415(served: Served, content_type: str | None) -> None:
    before = _prompt_tokens(served)
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(f"{served.base}/chat/completions", content=json.dumps(CHAT).encode(), headers=headers)
    _error(r, 415, "unsupported_media_type", "Content-Type: application/json", "curl")
    assert _prompt_tokens(served) == before


def test_clients_keep_working(served: Served) -> None:
    client = openai.OpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=60)
    assert client.chat.completions.create(model="any", **CHAT).usage.completion_tokens >= 1  # type: ignore[arg-type]
    r = httpx.post(f"{served.base}/chat/completions", content=json.dumps(CHAT),
                   headers={"Content-Type": "Application/JSON; charset=utf-8"}, timeout=60)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl_keeps_working(served: Served) -> None:
    """curl as the docs show it; curl's default form type gets a 415 that says what to add."""
    curl = ["curl", "-s", "-w", "\n%{http_code}", f"{served.base}/chat/completions", "-d", json.dumps(CHAT)]
    ok = subprocess.run([*curl, "-H", "Content-Type: application/json"], capture_output=True, text=True, timeout=60)
    body, status = ok.stdout.rsplit("\n", 1)
    assert status == "200" and json.loads(body)["choices"][0]["message"]["content"]
    plain = subprocess.run(curl, capture_output=True, text=True, timeout=60)
    body, status = plain.stdout.rsplit("\n", 1)
    assert status == "415" and "-H 'Content-Type: application/json'" in json.loads(body)["error"]["message"]


# ---- what the user allows ----

def test_an_allowed_origin_gets_its_preflight_and_cors_headers(ui_server: str) -> None:
    wanted = "authorization, content-type, x-stainless-lang"
    r = httpx.options(f"{ui_server}/v1/chat/completions", headers={
        "Origin": UI, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": wanted,
        "Access-Control-Request-Private-Network": "true"})  # no key: a preflight never carries one
    assert r.status_code == 204, r.text
    assert r.headers["access-control-allow-origin"] == UI
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == wanted
    assert r.headers["access-control-allow-private-network"] == "true"
    # the request itself, as the official client would send it from that page
    client = openai.OpenAI(base_url=f"{ui_server}/v1", api_key=API_KEY, max_retries=0, timeout=60,
                           default_headers={"Origin": UI})
    raw = client.chat.completions.with_raw_response.create(model="any", **CHAT)  # type: ignore[arg-type]
    assert raw.headers["access-control-allow-origin"] == UI and "Origin" in raw.headers["vary"]
    assert raw.parse().usage.completion_tokens >= 1
    # errors reach the page too, so that it can tell the user what is wrong
    r = httpx.get(f"{ui_server}/v1/models", headers={"Origin": UI})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == UI
    # another origin, and a text/plain body from the allowed one, are still refused
    _error(httpx.get(f"{ui_server}/health", headers={"Origin": "http://localhost:3001"}), 403, "origin_not_allowed")
    r = httpx.post(f"{ui_server}/v1/chat/completions", content=json.dumps(CHAT),
                   headers={"Origin": UI, "Content-Type": "text/plain", "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 415 and r.headers["access-control-allow-origin"] == UI  # the UI can show why


def test_an_allowed_host_is_answered(ui_server: str) -> None:
    port = _port(ui_server)
    assert httpx.get(f"{ui_server}/health", headers={"Host": f"MyHost.lan:{port}"}).status_code == 200
    assert httpx.get(f"{ui_server}/health", headers={"Host": f"other.lan:{port}"}).status_code == 403


# ---- the lists themselves ----

def test_the_bound_address_and_wildcards() -> None:
    lan = allow_lists("192.168.1.20")  # --host 192.168.1.20: its own address is its name
    assert lan.host_allowed("192.168.1.20:8000") and lan.host_allowed("localhost:8000")
    assert not lan.host_allowed("10.0.0.1:8000") and not lan.host_allowed("evil.example")
    every = allow_lists("0.0.0.0")  # every interface: any IP address, but no name
    assert every.host_allowed("10.0.0.1:8000") and every.host_allowed("[fe80::1]:8000")
    assert not every.host_allowed("evil.example:8000")
    assert allow_lists("::").any_ip_host and not allow_lists("localhost").any_ip_host
    anything = allow_lists("127.0.0.1", "*", "*")
    assert anything.host_allowed("evil.example") and anything.origin_allowed("https://anything.example")
    assert AllowLists().host_allowed(None)  # HTTP/1.0 without Host: a program, never a browser


def test_origins_compare_as_browsers_send_them() -> None:
    lists = allow_lists("127.0.0.1", None, "HTTP://LocalHost:3000/, https://ui.example:443")
    assert lists.allowed_origins == {"http://localhost:3000", "https://ui.example"}
    assert lists.origin_allowed("http://localhost:3000") and lists.origin_allowed("https://ui.example")
    assert not lists.origin_allowed("http://localhost:3001") and not lists.origin_allowed("null")
    assert not lists.origin_allowed("https://localhost:3000") and not lists.origin_allowed("garbage")
    assert origin_key("http://[::1]:8080") == "http://[::1]:8080" and split_host("[::1]:8080") == ("::1", "8080")


@pytest.mark.parametrize(("hosts", "origins", "env", "words"), [
    (None, "localhost:3000", {}, "--allowed-origins: 'localhost:3000' is not an origin"),
    (None, "http://ui.example/app", {}, "without a path"),
    (None, None, {"LOCALLLM_ALLOWED_ORIGINS": "ui.example"}, "LOCALLLM_ALLOWED_ORIGINS: 'ui.example'"),
    ("http://myhost.lan", None, {}, "--allowed-hosts: 'http://myhost.lan' is not a host name"),
    (None, None, {"LOCALLLM_ALLOWED_HOSTS": "a.lan, host:port"}, "LOCALLLM_ALLOWED_HOSTS: 'host:port'"),
])
def test_bad_entries_are_one_line_errors(monkeypatch: pytest.MonkeyPatch, hosts: str | None, origins: str | None,
                                         env: dict[str, Any], words: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LocalLLMError) as e:
        allow_lists("127.0.0.1", hosts, origins)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_flags_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_ALLOWED_ORIGINS", "http://from-env.example")
    monkeypatch.setenv("LOCALLLM_ALLOWED_HOSTS", "env.lan")
    assert allow_lists("127.0.0.1").allowed_origins == {"http://from-env.example"}
    assert allow_lists("127.0.0.1").allowed_hosts == {"env.lan"}
    assert allow_lists("127.0.0.1", "", "").allowed_origins == frozenset()  # an empty flag: none
