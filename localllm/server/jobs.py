"""What engine jobs an API request becomes: its prompts tokenized (or its token ids checked),
its n choices fanned out with their seeds, its grammar compiled. Everything a request can get
wrong is found here, as a 4xx, before anything is generated.
"""

from __future__ import annotations

import asyncio
from typing import Any

from localllm.engine.guided import GrammarError
from localllm.engine.sequence import SamplingParams, choice_seed
from localllm.errors import InvalidParameterError, LocalLLMError
from localllm.server.admission import Job, ServerState
from localllm.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    context_length_error,
    parse_chat,
    parse_completion,
)
from localllm.server.reasoning_fields import needs_special_tokens
from localllm.server.structured import parse_guided
from localllm.server.tools import ToolCalling, parse_tools, tool_messages

async def prompt_ids(
    state: ServerState, prompt: str | list[int] | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, object] | None = None,
) -> list[int]:
    tokenizer = state.engine.tokenizer
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        vocab = tokenizer.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)  # type: ignore[operator]
        if bad is not None:
            raise APIError(400, f"'prompt': token id {bad} is outside the vocabulary (size {vocab})",
                           param="prompt", code="invalid_value")
        return list(prompt)  # type: ignore[arg-type]
    try:
        # a long prompt takes milliseconds to tokenize: keep it off the event loop that streams
        if isinstance(prompt, str):
            return await asyncio.to_thread(tokenizer.encode, prompt)
        return await asyncio.to_thread(tokenizer.encode_chat, prompt, True, tools,  # type: ignore[arg-type]
                                       template_kwargs)
    except LocalLLMError as e:
        raise APIError(400, str(e), param="messages" if isinstance(prompt, list) else "prompt") from None


def make_jobs(
    state: ServerState, req: GenerationRequest, prompts: list[list[int]], param: str, base_id: str,
) -> list[Job]:
    """``req.n`` jobs per prompt, ids ``{base_id}-{choice index}``; a prompt that is empty or does
    not fit the context, or sampling the model cannot do, is refused before any job runs."""
    jobs: list[Job] = []
    for p, ids in enumerate(prompts):
        if not ids:
            raise APIError(400, f"'{param}': the prompt is empty", param=param, code="invalid_value")
        if len(ids) >= state.context_limit or (
            req.max_tokens is not None and len(ids) + req.max_tokens > state.context_limit
        ):
            raise context_length_error(state.context_limit, len(ids), req.max_tokens, param)
        for i in range(req.n):
            # choice i gets seed + i, so choices differ reproducibly
            kw = {**req.sampling, "seed": choice_seed(req.sampling["seed"], i)}
            try:
                params = SamplingParams(**kw)
                # against the model here, before a stream starts: the engine checks it again
                params.validate(state.vocab_size)
            except InvalidParameterError as e:
                raise APIError(422, f"'{e.param}': {e.problem}", param=e.param, code="invalid_value") from None
            jobs.append((ids, params, f"{base_id}-{p * req.n + i}"))
    return jobs


async def chat_inputs(
    state: ServerState, body: Any,
) -> tuple[ChatRequest, list[int], ToolCalling | None, str | None]:
    """The chat request with its structured-output and tool fields read, and its prompt
    rendered with the tools; the last item names the field that asked for a grammar."""
    req = parse_chat(body, state.sampling_defaults)
    guided = parse_guided(body)
    calling = parse_tools(body, state.engine.tokenizer)
    tool_messages(body["messages"], req.messages)
    if calling is not None and calling.grammar is not None:
        if guided.param is not None:
            raise APIError(400, f"'{guided.param}' and a forced 'tool_choice' both constrain the output; send one",
                           param=guided.param, code="invalid_value")
        guided.sampling, guided.param = {"guided_grammar": calling.grammar}, "tools"
    req.sampling.update(guided.sampling)
    if needs_special_tokens(state.reasoning):  # the reasoning markers are special tokens (harmony)
        req.sampling["skip_special_tokens"] = False
    ids = await prompt_ids(state, req.messages, calling.tools if calling is not None else None, req.template_kwargs)
    return req, ids, calling, guided.param


async def compile_grammar(state: ServerState, jobs: list[Job], param: str | None) -> None:
    """Compiles the request's grammar on a worker thread before anything is generated, so
    that a bad schema is a 400 (the engine thread then finds it cached)."""
    if param is None:
        return
    try:
        await asyncio.to_thread(state.engine.engine.guided.compile, jobs[0][1])
    except GrammarError as e:
        raise APIError(400, f"'{param}': {e}", param=param, code="invalid_value") from None


async def completion_inputs(state: ServerState, body: Any) -> tuple[CompletionRequest, list[list[int]], str | None]:
    """The completion request with its structured-output fields read and every prompt
    tokenized; the last item names the field that asked for a grammar."""
    req = parse_completion(body, state.sampling_defaults)
    guided = parse_guided(body)
    req.sampling.update(guided.sampling)
    prompts = [await prompt_ids(state, p) for p in req.prompts]
    return req, prompts, guided.param
