"""Structured output in the engine: grammars from SamplingParams (vLLM's names) on the real
default model, the bitmask the sampler applies (padded vocabularies included), constrained
and free requests in one batch, and ``localllm run --json-schema``."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.cli_common import read_json_schema
from localllm.engine.guided import GrammarCompiler, GrammarError, mask_logits
from localllm.errors import LocalLLMError
from tests.test_cli import assert_one_line_error, cli

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"enum": ["France", "Italy", "Japan"]},
        "sights": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 2},
    },
    "required": ["city", "country", "sights"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe a city you like."}]


def test_guided_json_regex_choice(llm: LLM) -> None:
    outs = llm.chat([CHAT] * 3, [SamplingParams(temperature=0.8, seed=s, max_tokens=100, guided_json=SCHEMA)
                                 for s in range(3)])
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
        # properties come in the schema's order
        assert list(json.loads(c.text)) == ["city", "country", "sights"]

    pattern = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])"
    out = llm.generate(["The treaty was signed on"], SamplingParams(temperature=0.9, seed=1, max_tokens=20,
                                                                    guided_regex=pattern))[0].outputs[0]
    assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop"

    out = llm.chat([{"role": "user", "content": "Is the sky green?"}],
                   SamplingParams(temperature=0, max_tokens=20, guided_choice=["yes", "no", "maybe"]))[0]
    assert out.outputs[0].text in ("yes", "no", "maybe")
    assert out.outputs[0].finish_reason == "stop"


def test_a_grammar_complete_on_the_last_allowed_token_is_a_stop(llm: LLM) -> None:
    """The grammar's end is the reply's end even when it lands on max_tokens: "stop", with
    all its text, not "length"; a stop string in that text still cuts it."""
    choice = SamplingParams(temperature=0, max_tokens=16, guided_choice=["Paris, of course"])
    full = llm.generate(["The capital of France is"], choice)[0].outputs[0]
    assert full.text == "Paris, of course" and full.finish_reason == "stop"
    assert full.token_ids[-1] not in llm.tokenizer.eos_token_ids  # the grammar ended it, not an EOS after it
    n = len(full.token_ids)
    exact = llm.generate(["The capital of France is"], dataclasses.replace(choice, max_tokens=n))[0].outputs[0]
    assert (exact.text, exact.finish_reason, list(exact.token_ids)) == (full.text, "stop", list(full.token_ids))
    cut = llm.generate(["The capital of France is"], dataclasses.replace(choice, stop=[", "]))[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("Paris", "stop", ", ")


def test_bad_grammars_are_one_line_errors(llm: LLM) -> None:
    with pytest.raises(GrammarError, match="JSON schema cannot be compiled"):
        llm.generate(["x"], SamplingParams(guided_json={"type": "object", "properties": {"a": {"type": "wat"}}}))
    with pytest.raises(GrammarError, match="regex cannot be compiled.*unclosed group"):
        llm.generate(["x"], SamplingParams(guided_regex="(ab"))
    with pytest.raises(LocalLLMError, match="exclude each other"):
        SamplingParams(guided_regex="a", guided_choice=["a"])
    with pytest.raises(LocalLLMError, match="not valid JSON"):
        SamplingParams(guided_json="{nope")
    with pytest.raises(LocalLLMError, match="non-empty list"):
        SamplingParams(guided_choice=[])
    assert not llm.engine.requests and not llm.engine.has_unfinished()


def test_constrained_and_free_share_a_batch(llm: LLM) -> None:
    free = [llm.tokenizer.encode(f"Once upon a time, {w}") for w in ("a fox", "the sea", "two kings")]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in free]
    engine = llm.engine
    guided = SamplingParams(temperature=0.7, seed=3, max_tokens=100, guided_json=SCHEMA)
    ids = [engine.add_request(p, greedy) for p in free] + [engine.add_request(CHAT, guided) for _ in range(2)]
    mixed_steps = 0
    finals = {}
    while engine.has_unfinished():
        running = list(engine.scheduler.running)
        outs = engine.step()
        if any(s.params.guided for s in running) and not all(s.params.guided for s in running):
            mixed_steps += 1
        finals.update({o.request_id: o for o in outs if o.finished})
    assert mixed_steps >= 5, "constrained and free requests never shared a step"
    assert [finals[r].outputs[0].token_ids for r in ids[:3]] == alone
    for r in ids[3:]:
        jsonschema.validate(json.loads(finals[r].outputs[0].text), SCHEMA)


def test_mask_keeps_exactly_what_the_grammar_allows_and_never_padding(llm: LLM) -> None:
    tok = llm.tokenizer
    padded = tok.vocab_size + 64  # a model whose embedding is padded past the tokenizer
    compiler = GrammarCompiler(tok, padded)
    digits = compiler.matcher(SamplingParams(guided_regex="[0-9]{1,6}"))
    free = compiler.matcher(SamplingParams())
    assert digits is not None and free is None
    logits = torch.randn(2, padded)
    logits[:, tok.vocab_size :] = 100.0  # the padding would win every argmax if it were allowed
    before = logits.clone()
    out = mask_logits(logits, [digits, free])
    assert torch.equal(out[1], before[1]), "a free row must be untouched"
    assert torch.equal(logits, before), "the logits themselves stay as they were"
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed and max(allowed) < tok.vocab_size
    for t in allowed:
        assert re.fullmatch(r"[0-9]+", tok.decode([t], skip_special_tokens=False)), t
    # every pure-digit token of up to 6 digits is allowed
    vocab = tok.backend.get_vocab()
    want = {i for s, i in vocab.items() if re.fullmatch(r"[0-9]{1,6}", s)}
    assert want <= set(allowed)
    # after six digits the grammar is complete: it reports so, and only EOS remains
    for t in tok.encode("123456"):
        done = digits.accept(t)
    assert done
    out = mask_logits(torch.randn(1, padded), [digits])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == list(tok.eos_token_ids)


def test_compiled_grammars_are_cached(llm: LLM) -> None:
    compiler = llm.engine.guided
    p = SamplingParams(guided_json=SCHEMA)
    assert compiler.compile(p) is compiler.compile(SamplingParams(guided_json=json.loads(json.dumps(SCHEMA))))
    assert compiler.compile(p) is compiler.compile(SamplingParams(guided_json=json.dumps(SCHEMA)))  # text form
    a, b = compiler.matcher(p), compiler.matcher(p)
    assert a.matcher is not b.matcher  # one state per request


def test_run_json_schema_cli(default_model_path: Path, tmp_path: Path) -> None:
    schema_file = tmp_path / "city.json"
    schema_file.write_text(json.dumps(SCHEMA))
    proc = cli("run", "--model", str(default_model_path), "--device", "cpu", "--json-schema", str(schema_file),
               "--temperature", "0", "--max-tokens", "100", "Describe a city you like.")
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), SCHEMA)

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "wat"}}}))
    assert_one_line_error(cli("run", "--model", str(default_model_path), "--device", "cpu", "--json-schema",
                              str(bad), "hi"), "JSON schema cannot be compiled")
    with pytest.raises(LocalLLMError, match="--json-schema .*missing.json: cannot be read"):
        read_json_schema(str(tmp_path / "missing.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(LocalLLMError, match="is an object"):
        read_json_schema(str(tmp_path / "list.json"))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(LocalLLMError, match="not valid JSON"):
        read_json_schema(str(tmp_path / "broken.json"))


def test_the_device_unpack_agrees_with_the_host_one() -> None:
    import numpy as np

    from localllm.engine.guided import unpack_bitmask, unpack_bitmask_torch

    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, size=(5, 7), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # all allowed: the sign bit is a token too
    bitmask[1] = 0
    for vocab in (7 * 32, 7 * 32 - 5, 7 * 32 + 9):  # exact, narrower, wider than the mask
        host = unpack_bitmask(bitmask, vocab)
        assert torch.equal(host, unpack_bitmask_torch(torch.from_numpy(bitmask), vocab))
        assert host.shape == (5, vocab) and bool(host[0, : 7 * 32].all()) and not bool(host[1].any())
        assert not bool(host[:, 7 * 32 :].any())
        token = 3 * 32 + 31  # bit 31 of word 3
        assert bool(host[2, token]) == bool((int(bitmask[2, 3]) >> 31) & 1)
