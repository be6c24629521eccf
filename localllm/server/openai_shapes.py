"""What OpenAI's response bodies look like, built from the engine's outputs: the final chat and
completion objects, a chunk's choice fields, usage, logprobs in the two endpoints' shapes, and
an engine failure as an API error.

Pure functions of finished or partial ``RequestOutput`` objects: nothing here awaits or holds
state, so the streaming and the final answer cannot drift apart.
"""

from __future__ import annotations

import time
from typing import Any

from localllm.engine.engine import RequestOutput
from localllm.errors import LocalLLMError
from localllm.server.admission import ServerState
from localllm.server.protocol import APIError, ChatRequest, CompletionRequest
from localllm.server.reasoning_fields import split_reply
from localllm.server.tools import ToolCalling, ToolCallParser, assistant_message


def usage(prompts: list[list[int]], n: int, finals: list[RequestOutput | None]) -> dict[str, Any]:
    completion = sum(len(o.outputs[0].token_ids) for o in finals if o is not None)
    # a prompt counts once however many choices it has, as OpenAI bills it
    prompt = sum(len(ids) for ids in prompts)
    cached = sum((finals[p * n].num_cached_tokens if finals[p * n] is not None else 0)  # type: ignore[union-attr]
                 for p in range(len(prompts)))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, LocalLLMError):
        return APIError(400, str(e))
    return APIError(500, f"engine error: {type(e).__name__}: {e}", type_="server_error", code="engine_error")


# ---- logprobs in OpenAI's two shapes ----

def chat_logprobs(state: ServerState, out: RequestOutput, start: int, end: int, top: int) -> dict[str, Any] | None:
    c = out.outputs[0]
    if c.logprobs is None:
        return None
    content = []
    for token_id, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
        text = state.token_text(token_id)
        ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:top]
        content.append({
            "token": text, "logprob": lps[token_id], "bytes": list(text.encode()),
            "top_logprobs": [{"token": state.token_text(t), "logprob": lp,
                              "bytes": list(state.token_text(t).encode())} for t, lp in ranked],
        })
    return {"content": content}


def completion_logprobs(
    state: ServerState, out: RequestOutput, start: int, end: int, top: int, offset: int,
) -> dict[str, Any] | None:
    c = out.outputs[0]
    if c.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
        text = state.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(lps[token_id])
        tops.append({state.token_text(t): lp for t, lp in sorted(lps.items(), key=lambda kv: -kv[1])[:top]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


# ---- the final objects ----

def chat_completion(
    state: ServerState, req: ChatRequest, rid: str, prompts: list[list[int]], finals: list[RequestOutput | None],
    calling: ToolCalling | None,
) -> dict[str, Any]:
    """The ``chat.completion`` object; ``finals`` holds every job's finished output."""
    choices = []
    for k, out in enumerate(finals):
        assert out is not None
        c = out.outputs[0]
        reasoning, answer = split_reply(state, prompts[0], c.text)
        message, finish_reason = assistant_message(calling, answer, c.finish_reason)
        if state.reasoning is not None:
            message["reasoning_content"] = reasoning
        choices.append({
            "index": k, "message": message,
            "logprobs": chat_logprobs(state, out, 0, len(c.token_ids), req.top_logprobs) if req.logprobs else None,
            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
        })
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": state.model, "choices": choices, "usage": usage(prompts, req.n, finals)}


def text_completion(
    state: ServerState, req: CompletionRequest, rid: str, prompts: list[list[int]],
    finals: list[RequestOutput | None],
) -> dict[str, Any]:
    """The ``text_completion`` object; ``finals`` holds every job's finished output."""
    choices = []
    for k, out in enumerate(finals):
        assert out is not None
        c = out.outputs[0]
        lp = None if req.logprobs is None else completion_logprobs(state, out, 0, len(c.token_ids),
                                                                     req.logprobs, 0)
        choices.append({"index": k, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason})
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": state.model, "choices": choices, "usage": usage(prompts, req.n, finals)}


# ---- a chunk's choice fields ----

def tool_fields(parser: ToolCallParser, out: RequestOutput, text: str) -> dict[str, Any] | None:
    """A chat chunk's fields with the reply read for tool calls; None while text is held."""
    delta = parser.read(text, out.finished)
    if not out.finished and not delta.content and not delta.calls:
        return None
    fields: dict[str, Any] = {"delta": delta.to_openai(), "logprobs": None}
    if out.finished and parser.calls and out.outputs[0].finish_reason == "stop":
        fields["finish_reason"] = "tool_calls"
    return fields
