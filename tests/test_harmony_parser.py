"""localllm/reasoning.py's HarmonyParser on gpt-oss replies that call tools: a message
addressed to a tool is never answer nor reasoning, its header reads the same with the
recipient before or after the channel (or going on from the prompt's ``<|start|>assistant``),
and every reading (the pieces of each message, the reasoning/content split, the calls, the
server's ``HarmonyCallsKept``) is the same however the reply is cut into chunks: at every
character boundary, and one character at a time.

(tests/test_reasoning.py covers the reasoning/answer split; tests/server/test_harmony_tools.py
checks the server's reading against openai-harmony's on the real vocabulary.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.reasoning import (
    OUTSIDE,
    HarmonyCall,
    HarmonyHeader,
    HarmonyParser,
    HarmonyPiece,
    read_header,
)
from localllm.server.reasoning_fields import HarmonyCallsKept

GEN = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"  # the generation prompt's end
ARGS = '{"location":"Paris","days":2}'
THOUGHT = "<|channel|>analysis<|message|>Need the forecast.<|end|>"

# the same call, as each header form harmony allows writes it (the reply after GEN)
CALL_FORMS = {
    "recipient after the channel": f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}",
    "recipient first, going on from the prompt's role":
        f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}",
    "recipient first, constrained":
        f" to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{ARGS}",
    "a message of its own, recipient first":
        f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>",
    "a message of its own, recipient after the channel":
        f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}",
}

# (prompt tail, reply, reasoning, content, calls): what the plain reading must give
REPLIES: dict[str, tuple[str, str, str, list[HarmonyCall]]] = {
    "thought then a recipient-first call": (
        GEN, f"{THOUGHT}<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>",
        "Need the forecast.", "", [HarmonyCall("functions.get_weather", ARGS, "json")]),
    "recipient-first call right after the prompt": (
        GEN, CALL_FORMS["recipient first, going on from the prompt's role"], "", "",
        [HarmonyCall("functions.get_weather", ARGS, "json")]),
    "preamble, call, and a second call": (
        GEN, "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant to=functions.now"
             "<|channel|>commentary json<|message|>{}<|call|><|start|>assistant<|channel|>commentary "
             f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}",
        "", "Let me look.",
        [HarmonyCall("functions.now", "{}", "json"), HarmonyCall("functions.get_weather", ARGS, "json")]),
    "a built-in tool on the analysis channel": (
        GEN, "<|channel|>analysis to=python code<|message|>print(2+2)<|call|>", "", "",
        [HarmonyCall("python", "print(2+2)", "code")]),
    "an answer, no call": (
        GEN, f"{THOUGHT}<|start|>assistant<|channel|>final<|message|>It is sunny, to=all.<|return|>",
        "Need the forecast.", "It is sunny, to=all.", []),
    "text outside the format that starts like a recipient": (GEN, " tomorrow it rains", "", " tomorrow it rains", []),
    "a reply cut inside a call's arguments": (
        GEN + "<|channel|>analysis<|message|>",
        'hmm<|end|><|start|>assistant to=functions.now<|channel|>commentary json<|message|>{"zo',
        "hmm", "", [HarmonyCall("functions.now", '{"zo', "json")]),
}


def split_points(text: str) -> list[list[str]]:
    """The reply cut in two at every character boundary, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def read_plain(tail: str, pieces: list[str]) -> tuple[str, str, list[HarmonyCall]]:
    parser = HarmonyParser(tail)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), parser.calls


def read_messages(tail: str, pieces: list[str]) -> list[tuple[HarmonyHeader, str, str | None]]:
    """Each message as (header, body, end), joined from its pieces; checks the pieces' order."""
    parser = HarmonyParser(tail)
    got: list[HarmonyPiece] = [p for chunk in pieces for p in parser.messages(chunk)] + parser.finish_messages()
    out: list[tuple[HarmonyHeader, str, str | None]] = []
    for p in got:
        if p.first:
            assert not out or out[-1][2] is not None, "a message began before the one before it ended"
            out.append((p.header, "", None))
        header, body, end = out[-1]
        assert p.header == header and end is None, "a piece after its message's end"
        out[-1] = (header, body + p.text, p.end)
    assert not out or out[-1][2] is not None, "the reply's last message never ended"
    return out


@pytest.mark.parametrize("form", list(CALL_FORMS))
def test_every_header_form_reads_as_the_same_call(form: str) -> None:
    """Recipient before or after the channel, ``json`` bare or after ``<|constrain|>``, the
    header going on from the prompt's role or a message of its own: one call, its arguments
    as written, nothing in the answer or the reasoning."""
    for pieces in split_points(CALL_FORMS[form]):
        assert read_plain(GEN, pieces) == ("", "", [HarmonyCall("functions.get_weather", ARGS, "json")])
    (header, body, end), = read_messages(GEN, [CALL_FORMS[form]])
    assert (header.role, header.channel, header.recipient, header.content_type, body) == (
        "assistant", "commentary", "functions.get_weather", "json", ARGS)
    assert header.is_call and not header.is_reasoning
    assert end == ("<|call|>" if form == "a message of its own, recipient first" else "")
    # the server keeps the call whole in the answer as one message, for its tool-call reader
    assert HarmonyCallsKept(GEN).split(CALL_FORMS[form]) == ("", header.opening() + ARGS + "<|call|>")
    assert header.opening().startswith("<|start|>assistant")


def test_header_fields() -> None:
    def fields(h: HarmonyHeader) -> tuple[str | None, ...]:
        return h.role, h.channel, h.recipient, h.content_type

    assert fields(read_header("<|channel|>analysis<|message|>")) == (None, "analysis", None, None)
    after = read_header("<|channel|>commentary to=functions.f <|constrain|>json<|message|>", "assistant")
    first = read_header(" to=functions.f<|channel|>commentary <|constrain|>json<|message|>", "assistant")
    own = read_header("<|start|>assistant to=functions.f<|channel|>commentary json<|message|>")
    assert fields(after) == fields(first) == fields(own) == ("assistant", "commentary", "functions.f", "json")
    assert first.opening() == "<|start|>assistant to=functions.f<|channel|>commentary <|constrain|>json<|message|>"
    assert own.opening() == own.text
    # a tool's result is addressed to the assistant: no call
    result = read_header("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>")
    assert (result.role, result.recipient, result.is_call) == ("functions.get_weather", "assistant", False)
    assert not OUTSIDE.is_call and OUTSIDE.opening() == ""


@pytest.mark.parametrize("case", list(REPLIES))
def test_a_reply_reads_the_same_at_every_split(case: str) -> None:
    """The split, the calls, each message's pieces and the server's kept-calls reading, for
    the reply fed whole, cut at every character boundary, and one character at a time."""
    tail, text, reasoning, content, calls = REPLIES[case]
    assert read_plain(tail, [text]) == (reasoning, content, calls)
    messages = read_messages(tail, [text])
    kept = HarmonyCallsKept(tail).split(text)
    assert kept[0] == reasoning
    for pieces in split_points(text):
        assert read_plain(tail, pieces) == (reasoning, content, calls), pieces
        assert read_messages(tail, pieces) == messages, pieces
        calls_kept = HarmonyCallsKept(tail)
        deltas = [calls_kept.feed(p) for p in pieces] + [calls_kept.finish()]
        assert ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)) == kept, pieces
    # no call's text reaches the answer or the reasoning
    assert "to=functions" not in reasoning + content and all(c.arguments not in content for c in calls if c.arguments)


HARMONY_TEXTS = st.lists(st.sampled_from([
    "<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|start|>", "assistant",
    "<|return|>", "<|call|>", "<|", "|>", "x", " to=functions.f", " to=python", " to", "=", "<|constrain|>json",
    " json", " ",
]), max_size=16).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=HARMONY_TEXTS, tail=st.sampled_from([GEN, GEN + "<|channel|>analysis<|message|>", ""]))
def test_messages_and_calls_do_not_depend_on_the_chunking(text: str, tail: str) -> None:
    whole = read_plain(tail, [text]), read_messages(tail, [text])
    for pieces in split_points(text):
        assert (read_plain(tail, pieces), read_messages(tail, pieces)) == whole
    # what the plain reading leaves out is exactly the bodies of messages addressed to a tool
    bodies = [body for header, body, _ in whole[1] if header.is_call]
    assert [c.arguments for c in whole[0][2]] == bodies
