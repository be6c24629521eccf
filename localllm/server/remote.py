"""A remote OpenAI-compatible server behind ``AsyncEngine``'s interface.

``RemoteEngine`` streams ``/v1/chat/completions`` (or ``/v1/completions`` for raw text and
token-id prompts) from vLLM, SGLang, llama-server, Ollama or ``localllm serve``, and yields
the engine's own ``RequestOutput`` objects, so the TUI, ``run`` and ``bench`` need not know
which engine they talk to (``localllm run`` streams through either with one loop).

What a server does not send, it cannot report: token ids are unknown, so ``token_ids`` and
``prompt_token_ids`` hold ``-1`` placeholders whose lengths are the server's token counts
(one per streamed chunk until the final ``usage`` corrects it); logprobs are not mapped.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from localllm.engine.engine import CompletionOutput, EngineStats, Prompt, RequestOutput
from localllm.engine.outputs import Prefix, RequestMetrics
from localllm.engine.sequence import GUIDED_FIELDS, SamplingParams
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.reasoning import ReasoningFormat
    from localllm.tokenizer import Tokenizer

UNKNOWN_TOKEN = -1
_CONNECT_TIMEOUT_S = 10.0
# Between two chunks: a long prompt queued behind other users' prefills on a busy server can
# take minutes before its first token.
_READ_TIMEOUT_S = 600.0
_BUSY_WAIT_S = 60.0  # how long 503s with Retry-After are waited out before the error reaches the user
_MAX_RETRY_AFTER_S = 30.0


def normalize_endpoint(endpoint: str) -> str:
    """``host:8000``, ``http://host:8000``, ``http://host:8000/v1/`` and a pasted
    ``.../v1/chat/completions`` all become ``http://host:8000/v1``."""
    url = endpoint.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions", "/models"):
        url = url.removesuffix(suffix)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LocalLLMError(f"--endpoint {endpoint!r}: expected a URL like http://host:8000/v1")
    if parts.path in ("", "/"):
        url += "/v1"  # every server we target mounts the OpenAI API there
    return url


def _error_message(status: int, body: bytes) -> str:
    try:
        data = json.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        message = err.get("message") if isinstance(err, dict) else err
        if message is None and isinstance(data, dict):
            message = data.get("detail") or data.get("message")
        text = str(message if message is not None else data)
    except (ValueError, AttributeError):
        text = body.decode(errors="replace")
    text = " ".join(text.split())[:300]
    return f"HTTP {status}: {text}" if text else f"HTTP {status}"


@dataclass(slots=True)
class _Flight:
    loop: asyncio.AbstractEventLoop
    task: asyncio.Task[None]


@dataclass(slots=True)
class _Tally:
    """Engine-wide numbers, as seen from this client."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    max_batch: int = 0
    chunk_times: deque[float] = field(default_factory=lambda: deque(maxlen=8192))  # for a recent rate


class RemoteEngine:
    """Same interface as ``AsyncEngine``: ``generate``, ``stats``, ``abort``, ``shutdown``,
    ``sampling_defaults`` (as the server reports them; empty if it does not) and ``tokenizer``
    (None: the server tokenizes). Construction asks ``/v1/models`` for the model
    (the first one listed unless ``model`` is given) and fails with a one-line
    ``LocalLLMError`` if the server cannot be reached or refuses the key."""

    tokenizer: Tokenizer | None = None  # the server tokenizes
    reasoning: ReasoningFormat | None = None  # a server splits reasoning off itself (reasoning_content)

    def __init__(self, endpoint: str, api_key: str | None = None, model: str | None = None) -> None:
        self.endpoint = normalize_endpoint(endpoint)
        self.api_key = api_key
        self.max_model_len: int | None = None
        self.served_models: list[str] = []  # what /v1/models listed
        self.sampling_defaults: dict[str, float | int] = {}  # the server applies its own
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._ssl = ssl.create_default_context()  # built once: it costs ~10 ms per client
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._flights: dict[str, _Flight] = {}
        self._ids = itertools.count()
        self._tally = _Tally()
        self._stopped = False
        self._placeholders: list[int] = []  # only grows: see _unknown
        self.model = self._discover_model(model)

    # ---- setup ----

    def _discover_model(self, wanted: str | None) -> str:
        try:
            r = httpx.get(f"{self.endpoint}/models", headers=self._headers, timeout=_CONNECT_TIMEOUT_S,
                          verify=self._ssl)
        except httpx.HTTPError as e:
            raise LocalLLMError(f"cannot reach {self.endpoint}: {_describe(e)}") from None
        if r.status_code in (401, 403):
            raise LocalLLMError(f"{self.endpoint} refused the request ({_error_message(r.status_code, r.content)}); "
                                "check --api-key")
        models: list[dict[str, Any]] = []
        if r.status_code == 200:
            try:
                data = r.json().get("data", [])
                models = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
            except (ValueError, AttributeError):
                models = []
        self.served_models = [m["id"] for m in models]
        if wanted is not None:
            # not checked against the list: Ollama, for one, also answers to aliases it does not list
            entry = next((m for m in models if m["id"] == wanted), None)
        elif models:
            entry = models[0]
        else:
            raise LocalLLMError(f"{self.endpoint}/models listed no model ({_error_message(r.status_code, r.content)})"
                                "; name one with --model")
        if entry is not None and isinstance(entry.get("max_model_len"), int):
            self.max_model_len = entry["max_model_len"]  # vLLM and localllm serve report it
        if entry is not None and isinstance(entry.get("sampling_defaults"), dict):
            self.sampling_defaults = _sampling_defaults(entry["sampling_defaults"])
        return wanted or entry["id"]  # type: ignore[index]

    def _client(self) -> httpx.AsyncClient:
        # httpx clients belong to one event loop; the TUI has one, tests may have several
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            for old in [lp for lp in self._clients if lp.is_closed()]:
                del self._clients[old]
            client = httpx.AsyncClient(
                headers=self._headers, verify=self._ssl,
                timeout=httpx.Timeout(_READ_TIMEOUT_S, connect=_CONNECT_TIMEOUT_S),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
            self._clients[loop] = client
        return client

    # ---- the AsyncEngine interface ----

    def stats(self) -> EngineStats:
        t = self._tally
        now = time.monotonic()
        recent = sum(1 for x in t.chunk_times if now - x < 2.0)
        running = len(self._flights)
        return EngineStats(
            model=self.model, precision="unknown", device="remote", num_running=running, num_waiting=0,
            batch_size=running, batch_tokens=running, kv_blocks_total=0, kv_blocks_used=0, kv_blocks_cached=0,
            step_time_s=0.0, generation_tokens_per_s=recent / 2.0 if running else 0.0, num_preemptions=0,
            prefix_cache_hit_tokens=t.cached_tokens, prompt_tokens=t.prompt_tokens, max_batch_size_seen=t.max_batch,
        )

    def abort(self, request_id: str) -> None:
        """Ends the request's stream (its last output has finish_reason "abort"); closing the
        connection makes the server abort it too. Safe from any thread."""
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.loop.call_soon_threadsafe(flight.task.cancel)

    def shutdown(self) -> None:
        self._stopped = True
        for request_id in list(self._flights):
            self.abort(request_id)
        for loop, client in list(self._clients.items()):
            if not loop.is_closed() and loop.is_running():
                loop.call_soon_threadsafe(lambda c=client: asyncio.ensure_future(c.aclose()))
        self._clients.clear()

    async def aclose(self) -> None:
        """Closes this event loop's connections (``shutdown`` cannot await them)."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields one output per streamed chunk with text; the last has ``finished`` set.
        Breaking out of the loop or cancelling the task closes the connection."""
        if self._stopped:
            raise LocalLLMError("the remote engine was shut down")
        params = params or SamplingParams()
        request_id = request_id or f"remote-{next(self._ids)}"
        if request_id in self._flights:
            raise LocalLLMError(f"request id {request_id!r} is already running")
        chat = bool(prompt) and isinstance(prompt, list) and isinstance(prompt[0], dict)
        body = self._body(prompt, params, chat)
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        metrics = RequestMetrics(time.monotonic())
        task = asyncio.create_task(self._pump(chat, body, queue))
        self._flights[request_id] = _Flight(asyncio.get_running_loop(), task)
        self._tally.max_batch = max(self._tally.max_batch, len(self._flights))
        text_parts: list[str] = []
        n_chunks = 0
        finish: str | None = None
        stop_reason: str | int | None = None
        usage: dict[str, Any] = {}
        try:
            while True:
                kind, payload = await queue.get()
                if kind == "error":
                    raise payload
                if kind == "chunk":
                    delta, fin, stop, chunk_usage = payload
                    if chunk_usage:
                        usage = chunk_usage
                    if fin:
                        finish, stop_reason = fin, stop
                    if not delta:
                        continue
                    now = time.monotonic()
                    if metrics.first_token_time is None:
                        metrics.first_scheduled_time = metrics.arrival_time
                        metrics.first_token_time = now
                    elif metrics.last_token_time is not None:
                        metrics.inter_token_latencies.append(now - metrics.last_token_time)
                    metrics.last_token_time = now
                    self._tally.chunk_times.append(now)
                    text_parts.append(delta)
                    n_chunks += 1
                    yield self._output(request_id, metrics, Prefix(text_parts), delta, [UNKNOWN_TOKEN], n_chunks,
                                       {}, None, None, False)
                    continue
                # "end" (the stream finished) or "aborted" (abort() or our own cancellation)
                metrics.finished_time = time.monotonic()
                if kind == "aborted":
                    finish = "abort"
                self._count(usage)
                yield self._output(request_id, metrics, ("".join(text_parts),), "", [], n_chunks, usage,
                                   finish or "stop", stop_reason, True)
                return
        finally:
            self._flights.pop(request_id, None)
            if not task.done():
                task.cancel()

    # ---- internals ----

    def _body(self, prompt: Prompt, p: SamplingParams, chat: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                                "temperature": p.temperature, "top_p": p.top_p}
        if chat:
            body["messages"] = prompt
        elif isinstance(prompt, str):
            body["prompt"] = prompt
        else:
            body["prompt"] = list(prompt)  # token ids: vLLM, SGLang and localllm serve take them
        if p.max_tokens is not None:
            body["max_tokens"] = p.max_tokens
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = p.stop
        # Extensions only when asked for: OpenAI itself rejects parameters it does not know.
        optional = {
            "top_k": (p.top_k, -1), "min_p": (p.min_p, 0.0), "repetition_penalty": (p.repetition_penalty, 1.0),
            "presence_penalty": (p.presence_penalty, 0.0), "frequency_penalty": (p.frequency_penalty, 0.0),
            "ignore_eos": (p.ignore_eos, False),
        }
        for name, (value, default) in optional.items():
            if value != default and not (name == "top_k" and value == 0):
                body[name] = value
        if p.stop_token_ids:
            body["stop_token_ids"] = p.stop_token_ids
        if p.guided_json is not None:  # OpenAI's form, which every server here takes
            schema = json.loads(p.guided_json) if isinstance(p.guided_json, str) else p.guided_json
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
        for name in GUIDED_FIELDS[1:]:  # vLLM's names, which localllm serve takes too
            if getattr(p, name) is not None:
                body[name] = getattr(p, name)
        return body

    async def _pump(self, chat: bool, body: dict[str, Any], queue: asyncio.Queue[tuple[str, Any]]) -> None:
        """Reads the SSE stream into ``queue``: ("chunk", (delta, finish, stop, usage)) items,
        then ("end", None); ("error", LocalLLMError) or ("aborted", None) instead on failure."""
        url = f"{self.endpoint}/{'chat/completions' if chat else 'completions'}"
        try:
            waited = 0.0
            while True:
                async with self._client().stream("POST", url, json=body) as r:
                    # a busy server (localllm's --max-waiting) says when to come back, as OpenAI's clients heed
                    wait = _retry_after(r) if r.status_code == 503 else None
                    if wait is None or waited + wait > _BUSY_WAIT_S:
                        await self._read_events(r, url, chat, queue)
                        break
                    await r.aread()
                await asyncio.sleep(wait)
                waited += wait
            queue.put_nowait(("end", None))
        except asyncio.CancelledError:
            queue.put_nowait(("aborted", None))
            raise
        except LocalLLMError as e:
            queue.put_nowait(("error", e))
        except httpx.HTTPError as e:
            queue.put_nowait(("error", LocalLLMError(f"{url}: {_describe(e)}")))

    @staticmethod
    async def _read_events(r: httpx.Response, url: str, chat: bool, queue: asyncio.Queue[tuple[str, Any]]) -> None:
        if r.status_code >= 400:
            raise LocalLLMError(f"{url}: {_error_message(r.status_code, await r.aread())}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, "event:" lines
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                raise LocalLLMError(f"{url}: the server sent a malformed event: {data[:120]!r}") from None
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                raise LocalLLMError(f"{url}: {_error_message(r.status_code, data.encode())}")
            queue.put_nowait(("chunk", _parse_chunk(chunk, chat)))

    def _count(self, usage: dict[str, Any]) -> None:
        self._tally.prompt_tokens += _int(usage.get("prompt_tokens"))
        self._tally.cached_tokens += _cached(usage)

    def _output(
        self, request_id: str, metrics: RequestMetrics, text: Seq[str], delta: str, delta_ids: list[int],
        n_chunks: int, usage: dict[str, Any], finish: str | None, stop_reason: str | int | None, finished: bool,
    ) -> RequestOutput:
        """Placeholder ids cost O(1) per chunk: one shared run of ``UNKNOWN_TOKEN`` viewed at the
        right length (the final output, counted once, gets plain lists)."""
        n_out = _int(usage.get("completion_tokens")) or n_chunks
        n_prompt = _int(usage.get("prompt_tokens"))
        if finished:
            token_ids: Seq[int] = [UNKNOWN_TOKEN] * n_out
            prompt_ids: Seq[int] = [UNKNOWN_TOKEN] * n_prompt
        else:
            token_ids, prompt_ids = self._unknown(n_out), ()
        completion = CompletionOutput(
            index=0, text_pieces=text, token_ids=token_ids, cumulative_logprob=None, logprobs=None,
            finish_reason=finish, stop_reason=stop_reason, delta_text=delta, delta_token_ids=delta_ids,
        )
        return RequestOutput(request_id, None, prompt_ids, [completion], finished, _cached(usage), metrics)

    def _unknown(self, n: int) -> Prefix[int]:
        if len(self._placeholders) < n:
            self._placeholders.extend([UNKNOWN_TOKEN] * max(n - len(self._placeholders), 1024))
        return Prefix(self._placeholders, 0, n)


def _parse_chunk(chunk: dict[str, Any], chat: bool) -> tuple[str, str | None, str | int | None, dict[str, Any]]:
    delta = ""
    finish = stop = None
    choices = chunk.get("choices") or []
    if choices and isinstance(choices[0], dict):
        c = choices[0]
        if chat:
            d = c.get("delta") or {}
            delta = (d.get("content") or "") if isinstance(d, dict) else ""
        else:
            delta = c.get("text") or ""
        finish = c.get("finish_reason")
        stop = c.get("stop_reason")
    usage = chunk.get("usage")
    return str(delta), finish, stop, usage if isinstance(usage, dict) else {}


def _sampling_defaults(reported: dict[str, Any]) -> dict[str, float | int]:
    """The keys of a server's reported defaults that SamplingParams knows, with numeric values."""
    from localllm.catalog import SAMPLING_KEYS

    return {k: kind(v) for k, kind in SAMPLING_KEYS.items()
            if isinstance(v := reported.get(k), (int, float)) and not isinstance(v, bool)}


def _retry_after(r: httpx.Response) -> float | None:
    """Retry-After in seconds when it is a small number (not an HTTP date), else None."""
    try:
        wait = float(r.headers.get("retry-after", ""))
    except ValueError:
        return None
    return wait if 0 <= wait <= _MAX_RETRY_AFTER_S else None


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _cached(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details")
    return _int(details.get("cached_tokens")) if isinstance(details, dict) else 0


def _describe(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.ConnectError):
        return "connection refused or host unreachable"
    if isinstance(e, httpx.TimeoutException):
        return "timed out"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
