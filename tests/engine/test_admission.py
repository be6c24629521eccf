"""Sampling parameters checked against the model at admission: a bad one is refused with
an error naming the field, before anything reaches a tensor, and leaves nothing behind."""

from __future__ import annotations

import pytest

from localllm.engine.sequence import SamplingParams
from localllm.errors import InvalidParameterError, LocalLLMError

VOCAB = 49152


@pytest.mark.parametrize(("change", "param"), [
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"top_k": 100000}, "top_k"),
    ({"stop_token_ids": [5, VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"n": 2.5}, "n"),
    ({"stop": "x"}, "stop"),  # only the constructor turns a string into a list
    ({"logprobs": 21}, "logprobs"),
    ({"seed": 2**64}, "seed"),
])
def test_a_bad_field_is_refused_by_name_and_leaves_nothing(llm, change: dict, param: str) -> None:
    engine = llm.engine
    good = SamplingParams(temperature=0, max_tokens=2)
    bad = SamplingParams(temperature=0, max_tokens=2)
    for name, value in change.items():
        setattr(bad, name, value)  # changed after construction: admission checks again
    with pytest.raises(InvalidParameterError) as e:
        llm.generate(["The sky is", "Hello"], [good, bad])
    assert e.value.param == param and param in str(e.value) and "\n" not in str(e.value)
    # the good prompt before it was taken back: nothing runs later with someone else's call
    assert not engine.requests and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_vocabulary_is_the_bound(llm) -> None:
    out = llm.generate(["The sky is"], SamplingParams(temperature=1.0, top_k=VOCAB, seed=0, max_tokens=2,
                                                      stop_token_ids=[VOCAB - 1]))
    assert len(out[0].outputs[0].token_ids) == 2


def test_tiny_temperatures_are_greedy(llm) -> None:
    """vLLM's rule: below 1e-5 is greedy, where logits / T would overflow the softmax."""
    greedy = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=6))
    tiny = llm.generate(["The capital of France is"], SamplingParams(temperature=1e-30, max_tokens=6, seed=3))
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_prompt_problems_are_local_llm_errors(llm) -> None:
    for prompt, words in (([1, True, 3], "token ids"), ([1, VOCAB], "token ids"), ("a\ud800b", "lone surrogate")):
        with pytest.raises(LocalLLMError, match=words):
            llm.generate([prompt], SamplingParams(max_tokens=1))
    with pytest.raises(LocalLLMError, match="2 prompts but 3 sampling params"):
        llm.generate(["a", "b"], [SamplingParams()] * 3)
    assert not llm.engine.requests
