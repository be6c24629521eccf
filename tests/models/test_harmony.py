"""gpt-oss's harmony chat format against OpenAI's own renderer and parser (``openai-harmony``,
a test-only dependency), on the real o200k_harmony vocabulary.

The vocabulary is tiktoken's o200k_base (the file ``openai-harmony`` loads; it cannot download
it here: the npm ``tiktoken`` package ships the same ranks, rebuilt once into
~/.cache/localllm-fixtures and checked against the file's published sha256) plus harmony's
special tokens. It is written as a GGUF file's tokenizer fields as llama.cpp's converter
writes gpt-oss (byte-level BPE, pre-tokenizer ``gpt-4o``) and read by ``Tokenizer.from_gguf_fields``,
so the ids compared are the ones a real gpt-oss GGUF gives. gpt-oss's shipped chat template
(llama.cpp's copy, from the sources bench/peers.py --build unpacks) is the model's template.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from localllm.reasoning import format_for, prompt_tail
from localllm.tokenizer import IncrementalDetokenizer, Tokenizer

FIXTURES = Path.home() / ".cache" / "localllm-fixtures"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # o200k_base.tiktoken
NPM_TIKTOKEN = "tiktoken@1.0.22"
GPT_OSS_TEMPLATE = next(iter(sorted((Path.home() / ".cache" / "localllm-peers").glob(
    "llama_cpp_python-*/vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja"))), None)
# harmony's special tokens as o200k_harmony numbers them; the rest of 199998..201087 is reserved
SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
            200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
            200012: "<|call|>", 200018: "<|endofprompt|>"}
VOCAB_SIZE = 201088


def _o200k_file() -> Path:
    """o200k_base.tiktoken (base64 token, rank per line), rebuilt from the npm package's ranks."""
    path = FIXTURES / "o200k_base.tiktoken"
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256:
        return path
    if shutil.which("npm") is None:
        pytest.skip("needs npm to fetch the o200k_base ranks (the tiktoken npm package)")
    work = FIXTURES / "npm-tiktoken"
    work.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["npm", "pack", NPM_TIKTOKEN], cwd=work, capture_output=True, text=True, timeout=300)
    tgz = next(work.glob("tiktoken-*.tgz"), None)
    if done.returncode or tgz is None:
        pytest.skip(f"npm pack {NPM_TIKTOKEN} failed: {done.stderr.strip()[-200:]}")
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/encoders/o200k_base.json")
        assert member is not None
        ranks = json.load(member)["bpe_ranks"]
    lines = []
    for line in ranks.split("\n"):  # "<prefix> <first rank> tok tok ...": consecutive ranks
        if line:
            _, first, *tokens = line.split(" ")
            lines += [f"{t} {int(first) + i}\n" for i, t in enumerate(tokens)]
    data = "".join(lines).encode()
    assert hashlib.sha256(data).hexdigest() == VOCAB_SHA256
    path.write_bytes(data)
    return path


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a byte-level BPE vocabulary is written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _gguf_fields(vocab: Path) -> dict[str, Any]:
    """The tokenizer fields of a gpt-oss GGUF: byte-level tokens, merges ranked as tiktoken
    ranks the pieces (each token formed from its best-ranked split), control specials."""
    ranks = {}
    for line in vocab.read_bytes().splitlines():
        b64, rank = line.split()
        ranks[base64.b64decode(b64)] = int(rank)
    chars = _byte_chars()
    text = {tok: "".join(chars[b] for b in tok) for tok in ranks}
    merges = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        splits = [(max(ranks[tok[:k]], ranks[tok[k:]]), k) for k in range(1, len(tok))
                  if tok[:k] in ranks and tok[k:] in ranks]
        _, k = min(splits)
        merges.append((rank, f"{text[tok[:k]]} {text[tok[k:]]}"))
    tokens = [""] * VOCAB_SIZE
    types = [1] * VOCAB_SIZE
    for tok, rank in ranks.items():
        tokens[rank] = text[tok]
    for i in range(len(ranks), VOCAB_SIZE):
        tokens[i], types[i] = SPECIALS.get(i, f"<|reserved_{i}|>"), 3
    fields: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [m for _, m in sorted(merges)],
        "tokenizer.ggml.bos_token_id": 199998, "tokenizer.ggml.eos_token_id": 200002,
        "tokenizer.ggml.add_bos_token": False,
    }
    if GPT_OSS_TEMPLATE is not None:
        fields["tokenizer.chat_template"] = GPT_OSS_TEMPLATE.read_text()
    return fields


@pytest.fixture(scope="session")
def harmony() -> Any:
    """openai-harmony's gpt-oss encoding, its vocabulary from the local file."""
    oh = pytest.importorskip("openai_harmony", reason="needs openai-harmony (pip install openai-harmony)")
    vocab = _o200k_file()
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab.parent)
    return oh, oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS), vocab


@pytest.fixture(scope="session")
def tokenizer(harmony: Any) -> Tokenizer:
    return Tokenizer.from_gguf_fields(_gguf_fields(harmony[2]), "gpt-oss.gguf")


TODAY = datetime.date.today().isoformat()
# (OpenAI messages, template kwargs): as a chat client sends them
CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, str]]] = [
    ([{"role": "user", "content": "What is 2 + 2?"}], {}),
    ([{"role": "system", "content": "Answer in French.\nBe brief."}, {"role": "user", "content": "Hello, world!"}],
     {"reasoning_effort": "high"}),
    ([{"role": "developer", "content": "Use metric units."}, {"role": "user", "content": "How far is the moon?"},
      {"role": "assistant", "content": "About 384,400 km.", "reasoning_content": "Mean distance, km."},
      {"role": "user", "content": "And the sun? 日本語 ok 🙂"}], {"reasoning_effort": "low"}),
    ([{"role": "user", "content": "  spaces  \n\ttabs "}, {"role": "assistant", "content": "Noted."},
      {"role": "user", "content": [{"type": "text", "text": "parts"}, {"type": "text", "text": " too"}]}], {}),
]


def _reference(oh: Any, messages: list[dict[str, Any]], kwargs: dict[str, str]) -> list[Any]:
    """The same conversation as openai-harmony's messages (the system and developer roles as
    vLLM maps them: the renderer's system message, the caller's text as instructions)."""
    effort = {"low": oh.ReasoningEffort.LOW, "medium": oh.ReasoningEffort.MEDIUM, "high": oh.ReasoningEffort.HIGH}
    system = oh.SystemContent.new().with_conversation_start_date(TODAY).with_reasoning_effort(
        effort[kwargs.get("reasoning_effort", "medium")])
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    for m in messages:
        text = m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
        if m["role"] in ("system", "developer"):
            out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, oh.DeveloperContent.new().with_instructions(text)))
        elif m["role"] == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, text))
        else:
            if "reasoning_content" in m:
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, m["reasoning_content"]).with_channel("analysis"))
            out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel("final"))
    return out


@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_chat_prompt_ids_equal_openai_harmony(harmony: Any, tokenizer: Tokenizer, case: int) -> None:
    """The prompt a gpt-oss chat sends is openai-harmony's rendering for a completion, id for
    id: its system message, the caller's system text as developer instructions, earlier answers
    on the final channel with their reasoning dropped, and ``<|start|>assistant`` to answer."""
    oh, enc, _ = harmony
    messages, kwargs = CONVERSATIONS[case]
    want = enc.render_conversation_for_completion(oh.Conversation.from_messages(_reference(oh, messages, kwargs)),
                                                  oh.Role.ASSISTANT)
    assert tokenizer.speaks_harmony
    assert tokenizer.encode_chat(messages, template_kwargs=kwargs) == list(want)


def test_a_conversation_without_generation_prompt_is_openai_harmonys_rendering(harmony: Any,
                                                                             tokenizer: Tokenizer) -> None:
    """Ending on an answer (no generation prompt): every message as openai-harmony's
    ``render_conversation`` writes it, the answer's reasoning dropped and ``<|end|>`` closing it."""
    oh, enc, _ = harmony
    messages = [*CONVERSATIONS[2][0][:3]]
    want = enc.render_conversation(oh.Conversation.from_messages(_reference(oh, messages, {})))
    assert tokenizer.encode_chat(messages, add_generation_prompt=False) == list(want)


@pytest.mark.skipif(GPT_OSS_TEMPLATE is None, reason="needs llama.cpp's sources (bench/peers.py --build)")
def test_shipped_template_differs_only_by_the_instructions_blank_line(tokenizer: Tokenizer) -> None:
    """gpt-oss's own jinja template, run in our sandbox, writes the same prompt as the
    renderer but for a blank line after the developer's instructions (which openai-harmony
    and so vLLM do not write): why chats are rendered by localllm/harmony.py."""
    messages, kwargs = CONVERSATIONS[2]
    ours = tokenizer.apply_chat_template(messages, template_kwargs=kwargs)
    jinja = tokenizer._render([{**m, "thinking": m.get("reasoning_content")} if m["role"] == "assistant" else m
                               for m in messages], True, None, dict(kwargs))
    assert jinja != ours
    assert jinja.replace("Use metric units.\n\n<|end|>", "Use metric units.<|end|>") == ours


REPLY = ("<|channel|>analysis<|message|>The user asks 2+2. Simple: 4.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.\n\nAnything else?<|return|>")


def test_reply_stream_splits_as_openai_harmony_parses(harmony: Any, tokenizer: Tokenizer) -> None:
    """A generated reply, fed token by token as the engine streams it (detokenized with the
    special tokens kept, as the harmony format asks), gives openai-harmony's parse: the
    analysis channel as reasoning, the final channel as the answer; the reply stops at
    ``<|return|>``, while ``<|end|>`` (which closes the reasoning) is no stop."""
    oh, enc, _ = harmony
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    assert ids == list(enc.encode(REPLY, allowed_special="all"))
    parsed = enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT)
    want = {m.channel: "".join(c.text for c in m.content) for m in parsed}
    assert set(want) == {"analysis", "final"}

    fmt = format_for(tokenizer, "gpt-oss")
    assert fmt is not None and not fmt.skip_special_tokens
    assert ids[-1] in tokenizer.eos_token_ids and tokenizer.backend.token_to_id("<|call|>") in tokenizer.eos_token_ids
    assert tokenizer.backend.token_to_id("<|end|>") not in tokenizer.eos_token_ids
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    parser = fmt.parser(prompt_tail(tokenizer, prompt))
    detok = IncrementalDetokenizer(tokenizer, fmt.skip_special_tokens)
    reasoning, content, deltas = [], [], 0
    for i, tid in enumerate(ids):
        delta = parser.read(detok.add([tid]), finished=i == len(ids) - 1)
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        deltas += bool(delta.content)
    assert ("".join(reasoning), "".join(content)) == (want["analysis"], want["final"])
    assert deltas > 3  # the answer streamed in pieces, not at the end


def test_gguf_pre_tokenizer_gpt_4o_equals_tiktoken(harmony: Any, tokenizer: Tokenizer) -> None:
    """gpt-oss GGUFs name their split ``gpt-4o``: text (contractions, digits, CJK, code,
    emoji, runs of spaces and newlines) encodes to o200k's ids and decodes back."""
    _, enc, _ = harmony
    text = ("I'm sure they'll PAY $1234567.89 for naïve café's CamelCase\n\n\n  x = f(a,b)//2;  \t"
            "日本語のテキスト 🙂🙂 DON'T-stop\r\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(enc.encode(text, allowed_special=set()))
    assert tokenizer.decode(ids) == text


def test_run_prints_the_answer_and_keeps_the_reasoning_apart(tokenizer: Tokenizer,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`localllm run`'s display of a streamed gpt-oss reply (commands.ReplySplit, fed the
    engine's outputs as it streams them): the answer alone on stdout, the reasoning on stderr,
    and both in the --json report's fields."""
    from localllm.commands import ReplySplit
    from localllm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

    fmt = format_for(tokenizer, "gpt-oss")
    assert fmt is not None
    split = ReplySplit(fmt, tokenizer)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    detok = IncrementalDetokenizer(tokenizer, fmt.skip_special_tokens)
    ids = tokenizer.encode(REPLY, add_special_tokens=False)
    for i, tid in enumerate(ids):
        piece = detok.add([tid])
        out = CompletionOutput(0, [piece], ids[:i + 1], None, None, "stop" if i == len(ids) - 1 else None,
                               delta_text=piece, delta_token_ids=[tid])
        split.add(RequestOutput("r", None, prompt, [out], i == len(ids) - 1, 0, RequestMetrics(0.0)), echo=True)
    shown = capsys.readouterr()
    assert shown.out == "2 + 2 = **4**.\n\nAnything else?"
    assert shown.err == "The user asks 2+2. Simple: 4.\n"
    assert "".join(split.content) == shown.out and "".join(split.reasoning) == "The user asks 2+2. Simple: 4."


# ---- tools ----

WEATHER = {"type": "object", "properties": {
    "location": {"type": "string", "description": "City name"},
    "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "tags": {"type": "array", "items": {"type": "string"}, "description": "labels"},
    "when": {"type": ["string", "null"]},
    "hourly": {"type": "boolean", "default": False},
    "options": {"type": "object", "description": "extras", "properties": {
        "lang": {"type": "string", "default": "en"}, "at": {"type": "object", "properties": {"z": {"type": "number"}},
                                                                 "required": ["z"]}}, "required": ["lang"]},
    "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}}},
    "mode": {"oneOf": [{"type": "string"}, {"type": "integer"}], "description": "how"},
    "any": {"anyOf": [{"type": "string"}, {"type": "number"}]},
    "free": {}, "raw": {"type": "array"},
}, "required": ["location", "days"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast.\nDaily.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "The time.",
                                      "parameters": {"type": "object", "description": "none", "properties": {}}}},
    {"type": "function", "function": {"name": "ping", "description": "Ping."}},
    {"type": "function", "function": {"name": "lookup", "description": "", "parameters": {
        "type": "object", "$defs": {"id": {"type": "string"}}, "required": ["grid"], "properties": {
            "level": {"type": "integer", "enum": [1, 2]}, "opts": {"type": "object", "default": {"a": 1, "b": "é"},
                                                                    "properties": {}},
            "ref": {"$ref": "#/$defs/id"}, "grid": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
            "maybe": {"type": ["string", "null"], "enum": ["a", None]}, "fixed": {"const": "x"},
            "deep": {"type": "object", "properties": {"inner": {"type": "object", "description": "in",
                                                                "properties": {"q": {"type": "string"}}}}},
            "either": {"type": "object", "properties": {"v": {"oneOf": [
                {"type": "object", "properties": {"a": {"type": "object", "properties": {"c": {"type": "string"}}}}},
                {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
                {"type": "string", "description": "S"}, {"type": "null"}]}}}}}}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"location":"Paris","days":2}'}}
TOOL_CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "reasoning_content": "Need the forecast.", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
    [{"role": "user", "content": "Paris, and the time?"},
     {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two calls.", "tool_calls": [
         CALL, {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
     {"role": "tool", "tool_call_id": "call_2", "content": "10:00"},
     {"role": "assistant", "content": "21C at 10:00.", "reasoning_content": "Got both."},
     {"role": "user", "content": "Thanks!"}],
]


def _tool_reference(oh: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[Any]:
    """The conversation as vLLM hands gpt-oss's to openai-harmony: the tools in the developer
    message, every reasoning as an analysis message (the renderer drops what it drops), calls
    as ``json`` commentary messages to ``functions.NAME``, results from ``functions.NAME``."""
    described = [oh.ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                        parameters=t["function"].get("parameters")) for t in tools]
    dev = oh.DeveloperContent.new().with_function_tools(described)
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new().with_conversation_start_date(TODAY))]
    names: dict[str, str] = {}
    if not any(m["role"] == "system" for m in messages):
        out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
    for m in messages:
        if m["role"] == "system":
            out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev.with_instructions(m["content"])))
        elif m["role"] == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, m["content"]))
        elif m["role"] == "tool":
            author = oh.Author.new(oh.Role.TOOL, f"functions.{names[m['tool_call_id']]}")
            out.append(oh.Message.from_author_and_content(author, m["content"]).with_recipient("assistant")
                       .with_channel("commentary"))
        else:
            if m.get("reasoning_content"):
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, m["reasoning_content"])
                           .with_channel("analysis"))
            if not m.get("tool_calls"):
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, m["content"]).with_channel("final"))
                continue
            if m["content"]:
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, m["content"]).with_channel("commentary"))
            for call in m["tool_calls"]:
                names[call["id"]] = call["function"]["name"]
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, call["function"]["arguments"])
                           .with_channel("commentary").with_recipient(f"functions.{call['function']['name']}")
                           .with_content_type("json"))
    return out


@pytest.mark.parametrize("case", range(len(TOOL_CONVERSATIONS)))
def test_tool_conversations_equal_openai_harmony(harmony: Any, tokenizer: Tokenizer, case: int) -> None:
    """Tools as harmony's TypeScript namespace (descriptions, optional fields, defaults, enums,
    unions, arrays, nested objects, a tool without parameters), calls ending in ``<|call|>``
    to ``functions.NAME``, results from ``functions.NAME`` to the assistant, and the reasoning
    of a turn still calling tools kept (dropped once a final answer ends the turn): id for id."""
    oh, enc, _ = harmony
    messages = TOOL_CONVERSATIONS[case]
    want = enc.render_conversation_for_completion(oh.Conversation.from_messages(_tool_reference(oh, messages, TOOLS)),
                                                  oh.Role.ASSISTANT)
    assert tokenizer.encode_chat(messages, tools=TOOLS) == list(want)


def test_tool_calls_as_the_server_reads_them_render_the_same(harmony: Any, tokenizer: Tokenizer) -> None:
    """The server turns a call's arguments into an object for jinja templates
    (server/tools.py's tool_messages) and names each tool result; harmony writes them back
    as compact JSON (the text gpt-oss wrote, here the text sent) and the function's name."""
    from localllm.server.tools import tool_messages

    raw = TOOL_CONVERSATIONS[1]
    parsed = [{k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")} for m in raw]
    tool_messages(raw, parsed)
    assert isinstance(parsed[2]["tool_calls"][0]["function"]["arguments"], dict)
    got = tokenizer.decode(tokenizer.encode_chat(parsed, tools=TOOLS), skip_special_tokens=False)
    assert 'to=functions.get_weather<|channel|>commentary json<|message|>{"location":"Paris","days":2}<|call|>' in got
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 21}<|end|>' in got


def test_a_tool_result_without_its_call_is_one_clear_error(tokenizer: Tokenizer) -> None:
    from localllm.errors import LocalLLMError

    with pytest.raises(LocalLLMError, match="tool message needs the 'tool_call_id'"):
        tokenizer.encode_chat([{"role": "user", "content": "x"}, {"role": "tool", "content": "1", "tool_call_id": "z"}])


# ---- the TUI's continuation of a reply cut short ----

@pytest.mark.parametrize("answer, reasoning", [("The capital is", "Paris is the capital."), ("Par", ""),
                                               ("", "The user asks about Fra"),
                                               # cut deep in a long analysis: the parser's tail
                                               # must still reach its header (prompt_tail)
                                               ("", "The user asks about France, " * 12 + "so")])
def test_continuing_a_cut_reply_goes_on_inside_its_harmony_message(harmony: Any, tokenizer: Tokenizer,
                                                                   answer: str, reasoning: str) -> None:
    """The TUI's continue: the prompt the reply was generated from (earlier reasoning dropped
    as openai-harmony drops it), then the reply as the model wrote it, left open: its analysis
    message, then the final message's header and the partial answer's ids; a reply cut
    while thinking goes on inside its analysis message."""
    from localllm.tui.backend import continuation_prompt

    oh, enc, _ = harmony
    messages, _ = CONVERSATIONS[2]
    prompt = list(enc.render_conversation_for_completion(
        oh.Conversation.from_messages(_reference(oh, messages, {})), oh.Role.ASSISTANT))
    if answer:
        written = (f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" if reasoning else "")
        written += f"<|channel|>final<|message|>{answer}"
    else:
        written = f"<|channel|>analysis<|message|>{reasoning}"
    want = prompt + list(enc.encode(written, allowed_special="all"))
    assert continuation_prompt(tokenizer, messages, answer, reasoning) == want
    # the reply's parser, started from this prompt's tail, takes the next tokens to the same side
    fmt = format_for(tokenizer, "gpt-oss")
    assert fmt is not None
    split = fmt.parser(prompt_tail(tokenizer, want)).split(" more")
    assert split == (("", " more") if answer else (" more", ""))
