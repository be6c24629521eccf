"""localllm/reasoning.py: replies split into reasoning and content, whatever the chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.errors import LocalLLMError
from localllm.reasoning import (
    HARMONY_PARSER,
    HarmonyParser,
    ReasoningDelta,
    ReasoningFormat,
    ThinkParser,
    select_format,
)

QWEN3 = ReasoningFormat("qwen3")
R1 = ReasoningFormat("deepseek_r1")
HARMONY = ReasoningFormat(HARMONY_PARSER, skip_special_tokens=False)
QWEN3_GEN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
R1_GEN = "<｜User｜>hi<｜Assistant｜><think>\n"
QWEN3_NO_THINK = QWEN3_GEN + "<think>\n\n</think>\n\n"
GPT_OSS_GEN = "<|start|>user<|message|>hi<|end|><|start|>assistant"


def chunked(fmt: ReasoningFormat, tail: str, pieces: list[str]) -> tuple[str, str, list[ReasoningDelta]]:
    parser = fmt.parser(tail)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), deltas


def whole(fmt: ReasoningFormat, tail: str, text: str) -> tuple[str, str]:
    return fmt.parser(tail).split(text)


def cuts(text: str, points: list[int]) -> list[str]:
    marks = sorted({0, len(text), *(p % (len(text) + 1) for p in points)})
    return [text[a:b] for a, b in zip(marks, marks[1:])]


# ---- the whole reply: what each format means ----

@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nLet me add.\n2+2=4\n</think>\n\nThe answer is 4.", "Let me add.\n2+2=4", "The answer is 4."),
    ("\n<think>x</think>y", "x", "y"),
    ("<think>\n\n</think>\n\nHello", "", "Hello"),  # an empty block: no reasoning
    ("Hello <think>not reasoning</think>", "", "Hello <think>not reasoning</think>"),  # tags inside an answer
    ("  plain answer  ", "", "  plain answer  "),  # no block: verbatim
    ("<think>ran out while thinking", "ran out while thinking", ""),
    ("<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),  # one block per reply
    ("<thin", "", "<thin"),  # a partial tag at the end is text
    ("<think>a  <th", "a  <th", ""),
    ("<think>a < b </thinking> c</think>d", "a < b </thinking> c", "d"),
])
def test_think_whole_replies(text: str, reasoning: str, content: str) -> None:
    assert whole(QWEN3, QWEN3_GEN, text) == (reasoning, content)


def test_a_template_that_opens_the_block_starts_the_reply_inside_it() -> None:
    # DeepSeek-R1's template ends its prompt with "<think>\n": the reply has no opening tag
    text = "First, 9.11 < 9.8 since .11 < .80.\n</think>\n\n9.8 is greater."
    assert whole(QWEN3, R1_GEN, text) == ("First, 9.11 < 9.8 since .11 < .80.", "9.8 is greater.")
    assert whole(R1, R1_GEN, text) == ("First, 9.11 < 9.8 since .11 < .80.", "9.8 is greater.")
    # Qwen3 with enable_thinking=False closed an empty block in the prompt: the reply is answer
    assert whole(QWEN3, QWEN3_NO_THINK, "Hello! </think> is a tag.") == ("", "Hello! </think> is a tag.")


def test_deepseek_r1_starts_in_reasoning_without_an_opening_tag() -> None:
    # vLLM's deepseek_r1: R1 may leave out "<think>", so reasoning runs to "</think>"
    assert whole(R1, "<｜Assistant｜>", "thinking...</think>answer") == ("thinking...", "answer")
    assert whole(R1, "<｜Assistant｜>", "<think>thinking...</think>answer") == ("thinking...", "answer")
    assert whole(QWEN3, "<|im_start|>assistant\n", "thinking...</think>answer") == ("", "thinking...</think>answer")
    # a prompt that closed the block (thinking turned off) leaves R1's reply as answer
    assert whole(R1, "<｜Assistant｜><think>\n\n</think>\n\n", "answer") == ("", "answer")


HARMONY_REPLY = ("<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.")


@pytest.mark.parametrize("tail, text, reasoning, content", [
    (GPT_OSS_GEN, HARMONY_REPLY, "User asks 2+2. Answer 4.", "2 + 2 = 4."),
    (GPT_OSS_GEN, HARMONY_REPLY + "<|return|>", "User asks 2+2. Answer 4.", "2 + 2 = 4."),
    # a template (or reasoning_effort) that writes the header itself
    (GPT_OSS_GEN + "<|channel|>final<|message|>", "Just the answer.", "", "Just the answer."),
    (GPT_OSS_GEN + "<|channel|>analysis<|message|>", "hmm<|end|><|start|>assistant<|channel|>final<|message|>ok",
     "hmm", "ok"),
    # a model that skips the format: its text is the answer
    (GPT_OSS_GEN, "plain text", "", "plain text"),
    # commentary (a preamble to the user) is content; a header cut off at the end is dropped
    (GPT_OSS_GEN, "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>fin",
     "", "Checking."),
    (GPT_OSS_GEN, "<|channel|>analysis<|message|>a<b <|en", "a<b <|en", ""),
    (GPT_OSS_GEN, "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two",
     "onetwo", ""),
])
def test_harmony_whole_replies(tail: str, text: str, reasoning: str, content: str) -> None:
    assert whole(HARMONY, tail, text) == (reasoning, content)


def test_a_harmony_header_that_never_ends_is_text() -> None:
    text = "<|channel|>" + "x" * 600
    assert whole(HARMONY, GPT_OSS_GEN, text) == ("", text)


# ---- streaming: any split of the stream gives the same result ----

THINK_TEXTS = st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "think>", "\n", " ", "a", "b c",
                                        "</think", "<thinking>", "é"]), max_size=14).map("".join)
HARMONY_TEXTS = st.lists(st.sampled_from([
    "<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|start|>", "assistant",
    "<|return|>", "<|call|>", "<|", "|>", "<", "x", " to=functions.f", "<|constrain|>json",
]), max_size=14).map("".join)
TAILS_THINK = st.sampled_from([QWEN3_GEN, R1_GEN, QWEN3_NO_THINK, ""])
TAILS_HARMONY = st.sampled_from([GPT_OSS_GEN, GPT_OSS_GEN + "<|channel|>analysis<|message|>", "", "<|start|>assistant<|chan"])


@settings(max_examples=400, deadline=None)
@given(text=THINK_TEXTS, points=st.lists(st.integers(0, 400), max_size=8), tail=TAILS_THINK,
       fmt=st.sampled_from([QWEN3, R1]))
def test_think_any_split_gives_the_same_result(text: str, points: list[int], tail: str, fmt: ReasoningFormat) -> None:
    reasoning, content, _ = chunked(fmt, tail, cuts(text, points))
    assert (reasoning, content) == whole(fmt, tail, text)
    # and one character at a time, as a tokenizer of single bytes would send it
    assert chunked(fmt, tail, list(text))[:2] == (reasoning, content)


@settings(max_examples=400, deadline=None)
@given(text=HARMONY_TEXTS, points=st.lists(st.integers(0, 400), max_size=8), tail=TAILS_HARMONY)
def test_harmony_any_split_gives_the_same_result(text: str, points: list[int], tail: str) -> None:
    reasoning, content, _ = chunked(HARMONY, tail, cuts(text, points))
    assert (reasoning, content) == whole(HARMONY, tail, text)
    assert chunked(HARMONY, tail, list(text))[:2] == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60), points=st.lists(st.integers(0, 100), max_size=6))
def test_text_without_markers_is_all_content_for_harmony(text: str, points: list[int]) -> None:
    if "<|" in text or text.startswith("<"):
        return
    assert chunked(HARMONY, GPT_OSS_GEN, cuts(text, points))[:2] == ("", text)


def test_a_tag_split_across_chunks_is_held_then_released() -> None:
    parser = QWEN3.parser(QWEN3_GEN)
    assert parser.feed("<th") == ReasoningDelta()
    assert parser.feed("ink>\nStep") == ReasoningDelta(reasoning="Step")
    assert parser.feed(" one</th") == ReasoningDelta(reasoning=" one")
    assert parser.feed("ink>\n\nDone") == ReasoningDelta(content="Done")
    assert parser.finish() == ReasoningDelta()
    # a "<" that turns out not to start the tag is handed out with what follows it
    parser = QWEN3.parser(QWEN3_GEN)
    assert parser.feed("<") == ReasoningDelta()
    assert parser.feed("b>bold") == ReasoningDelta(content="<b>bold")


def test_reasoning_streams_before_the_block_ends() -> None:
    # a long thought is shown as it comes, not held until </think>
    parser = QWEN3.parser(R1_GEN)
    got = [parser.feed(w) for w in ["Let", " me", " think", ".\n"]]
    assert [d.reasoning for d in got] == ["Let", " me", " think", "."]


def test_harmony_streams_each_channel() -> None:
    parser = HARMONY.parser(GPT_OSS_GEN)
    pieces = ["<|channel|>", "analysis", "<|message|>", "Think", "ing", "<|end|>", "<|start|>", "assistant",
              "<|channel|>", "final", "<|message|>", "An", "swer"]
    deltas = [parser.feed(p) for p in pieces]
    assert [d.reasoning for d in deltas if d.reasoning] == ["Think", "ing"]
    assert [d.content for d in deltas if d.content] == ["An", "swer"]


# ---- which format a model gets ----

QWEN3_TEMPLATE = ("{%- if message.reasoning_content is string %}{%- endif %}"
                  "{{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
                  "{%- if enable_thinking is defined and enable_thinking is false %}"
                  "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
HARMONY_TEMPLATE = "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def test_the_format_comes_from_the_template_then_the_architecture() -> None:
    assert select_format(QWEN3_TEMPLATE) == ReasoningFormat("qwen3")
    assert select_format(HARMONY_TEMPLATE) == ReasoningFormat(HARMONY_PARSER, skip_special_tokens=False)
    assert select_format(None, "gpt-oss") == ReasoningFormat(HARMONY_PARSER, skip_special_tokens=False)
    assert select_format(None, "GptOssForCausalLM") is not None
    assert select_format(CHATML, "llama") is None
    assert select_format(None) is None


def test_the_override_wins_with_vllms_names() -> None:
    assert select_format(CHATML, override="deepseek_r1") == ReasoningFormat("deepseek_r1")
    assert select_format(QWEN3_TEMPLATE, override="none") is None
    assert select_format(CHATML, override="openai_gptoss").skip_special_tokens is False  # type: ignore[union-attr]
    assert select_format(QWEN3_TEMPLATE, override="auto") == ReasoningFormat("qwen3")
    with pytest.raises(LocalLLMError, match="unknown reasoning parser 'r1'; use one of auto, qwen3"):
        select_format(CHATML, override="r1")


def test_think_tags_that_are_special_tokens_are_kept_when_detokenizing() -> None:
    assert select_format(QWEN3_TEMPLATE, is_special=frozenset({"<think>", "</think>"})) == ReasoningFormat(
        "qwen3", skip_special_tokens=False)


def test_parsers_are_the_expected_kinds() -> None:
    assert isinstance(QWEN3.parser(), ThinkParser)
    assert isinstance(HARMONY.parser(), HarmonyParser)


# ---- what the parsers need from the rest: template variables, special tokens kept ----

def test_template_kwargs_and_reasoning_reach_the_template(default_checkpoint) -> None:
    from dataclasses import replace

    template = ("{{ 'think=' ~ (enable_thinking | default('unset')) }}|"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "[{{ m.reasoning_content | default('') }}/{{ m.thinking | default('') }}]{% endfor %}")
    tok = replace(default_checkpoint.tokenizer, chat_template=template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "r"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "think=unset|user:hi[/]assistant:yo[r/r]"
    rendered = tok.apply_chat_template(messages, False, template_kwargs={"enable_thinking": False})
    assert rendered.startswith("think=False|")
    with pytest.raises(LocalLLMError, match="chat template variable 'messages' is set by localllm itself"):
        tok.apply_chat_template(messages, template_kwargs={"messages": []})


def test_special_tokens_stay_in_the_text_when_asked(llm) -> None:
    """What harmony's parser reads: the engine detokenizes with special tokens kept when the
    request says so. The default model ends its answer with <|im_end|>; ignore_eos lets the
    reply run past it, so the token is in the reply either way, and only shows as text when kept."""
    from localllm import SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    im_end = llm.engine.tokenizer.backend.token_to_id("<|im_end|>")
    texts = []
    for skip in (True, False):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, skip_special_tokens=skip)
        out = llm.chat(messages, params)[0].outputs[0]
        assert im_end in out.token_ids
        texts.append(out.text)
    assert "<|im_end|>" not in texts[0] and "<|im_end|>" in texts[1]
    assert texts[1].replace("<|im_end|>", "").startswith(texts[0][:20])
