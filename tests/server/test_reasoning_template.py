"""A thinking model's own chat template, end to end through the server: the reasoning parser
chosen from the template (no --reasoning-parser), ``enable_thinking`` and earlier turns'
``reasoning_content`` reaching the template, and a template that opens the reasoning block in
the prompt, so that the reply starts inside it.

The model is a tiny random Qwen3 (written by the test, SmolLM2's tokenizer) whose
tokenizer_config.json carries a template written here the way Qwen3's behaves: ChatML turns;
an assistant turn after the last user message shows its reasoning in a <think> block, earlier
ones drop it; ``enable_thinking=false`` writes an empty closed block into the prompt; and
``open_thinking=true`` opens the block in the prompt, as Qwen3's thinking-only releases and
DeepSeek-R1's template do. Its replies are noise, so where a test needs a block in the reply a
``guided_regex`` has the model write one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from localllm.engine.async_engine import AsyncEngine
from localllm.engine.engine import EngineConfig, LLMEngine
from localllm.server.app import create_app
from localllm.server.serving import start_server_thread
from tests.models.test_random_models import write_random_model

TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content is string and loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- m.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if open_thinking is defined and open_thinking %}{{- '<think>\\n' }}"
    "{%- elif enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
USER = {"role": "user", "content": "What is the capital of France?"}


@pytest.fixture(scope="module")
def base(default_checkpoint, tmp_path_factory) -> Iterator[str]:
    from localllm.models.export import save_hf_folder

    tok = tmp_path_factory.mktemp("tok")
    save_hf_folder(default_checkpoint, tok, tensors=iter([]))
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    path: Path = write_random_model(tmp_path_factory.mktemp("m") / "qwen3-thinking", "Qwen3ForCausalLM", tok,
                                    heads=4, kv_heads=2)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=512, chats=1,
                                                compile=False)))
    server = start_server_thread(create_app(engine))  # no reasoning_parser: the template decides
    try:
        yield f"{server.url}/v1"
    finally:
        server.stop()
        engine.shutdown()


def _chat(base: str, messages: list[dict], **kw: object):
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def test_the_template_picks_the_parser_and_enable_thinking_reaches_it(base: str) -> None:
    thinking = _chat(base, [USER], max_tokens=1)
    plain = _chat(base, [USER], max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the closed empty block the template wrote: <think>, \n\n, </think>, \n\n in this vocabulary
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens
    # a reasoning parser is on although the server was given none: the field is there
    assert "reasoning_content" in thinking.choices[0].message.model_extra


def test_the_template_drops_earlier_reasoning_and_keeps_the_current_turns(base: str) -> None:
    answer = {"role": "assistant", "content": "Paris."}
    thought = {**answer, "reasoning_content": "France's capital is Paris."}
    later = {"role": "user", "content": "And Spain?"}
    past = [_chat(base, [USER, m, later], max_tokens=1).usage.prompt_tokens for m in (answer, thought)]
    assert past[0] == past[1]  # a past turn's reasoning stays out of the prompt
    current = [_chat(base, [USER, m], max_tokens=1).usage.prompt_tokens for m in (answer, thought)]
    assert current[1] > current[0]  # the turn after the last user message keeps it


def test_a_prompt_that_opens_the_block_starts_the_reply_inside_it(base: str) -> None:
    regex = r"[a-z]{3,8}( [a-z]{2,8}){2,4}\n</think>\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}\."
    raw = _chat(base, [USER], max_tokens=60, extra_body={"guided_regex": regex,
                                                          "chat_template_kwargs": {"open_thinking": True}})
    message = raw.choices[0].message
    reasoning, content = message.model_extra["reasoning_content"], message.content
    # no opening tag in the reply: the parser knew from the prompt that it starts inside
    assert reasoning and content and "think>" not in reasoning + content
    assert reasoning[0].islower() and content[0].isupper() and content.endswith(".")
    streamed = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300).chat.completions.create(
        model="m", messages=[USER], temperature=0, max_tokens=60, stream=True,
        extra_body={"guided_regex": regex, "chat_template_kwargs": {"open_thinking": True}})
    parts = {"reasoning_content": "", "content": ""}
    for chunk in streamed:
        for choice in chunk.choices:
            parts["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            parts["content"] += choice.delta.content or ""
    assert parts == {"reasoning_content": reasoning, "content": content}
