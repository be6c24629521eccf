"""The real default model against the plain reference pass, and GGUF against its HF export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.errors import LocalLLMError
from localllm.models.llama import AttentionMetadata
from localllm.models.export import save_hf_folder
from localllm.models.formats import open_checkpoint
from localllm.models.loader import load_model
from tests.reference import hf_state_dict, reference_greedy_choices, reference_logits

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_weights(default_checkpoint):
    return hf_state_dict(default_checkpoint)


@pytest.fixture(scope="module")
def greedy_outputs(llm: LLM) -> list:
    """The session engine's greedy replies to PROMPTS, generated once for the tests that read them."""
    return llm.generate(PROMPTS, GREEDY)


def test_greedy_tokens_match_reference(greedy_outputs: list, default_checkpoint, reference_weights) -> None:
    cfg, tok = default_checkpoint.config, default_checkpoint.tokenizer
    outs = greedy_outputs
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        got = out.outputs[0].token_ids
        assert len(got) == 32
        # == reference_greedy(cfg, reference_weights, ids, 32), in one reference pass, not 32
        assert reference_greedy_choices(cfg, reference_weights, ids, got) == got, prompt


@torch.inference_mode()
def test_logits_match_reference_within_tolerance(llm: LLM, default_checkpoint, reference_weights) -> None:
    """The engine's paged prefill logits equal the reference's to 1e-3 (fp32, both paths)."""
    engine = llm.engine
    ids = default_checkpoint.tokenizer.encode(PROMPTS[0] + " red, yellow and blue. Mixing them")
    T = len(ids)
    bs = engine.block_manager.block_size
    blocks = list(range(-(-T // bs)))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(T),
        query_start_loc=torch.tensor([0, T], dtype=torch.int32),
        seq_lens=torch.tensor([T], dtype=torch.int32),
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        num_decodes=0,
    )
    model = engine.runner.model
    assert not engine.has_unfinished()  # the pool's first blocks are free scratch space here
    got = model.compute_logits(model(torch.tensor(ids), torch.arange(T), meta))
    want = reference_logits(default_checkpoint.config, reference_weights, ids)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4), (got - want).abs().max()


def test_chat_answers_paris(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>, not max_tokens


def test_gguf_and_hf_export_give_identical_tokens(default_checkpoint, llm: LLM, greedy_outputs: list,
                                                  tmp_path: Path) -> None:
    save_hf_folder(default_checkpoint, tmp_path / "hf")
    exported = open_checkpoint(tmp_path / "hf")
    assert exported.config.num_layers == default_checkpoint.config.num_layers
    text = "Hello! How are you today? 1234 ünïcödé"
    assert exported.tokenizer.encode(text) == default_checkpoint.tokenizer.encode(text)
    hf_llm = LLM(str(tmp_path / "hf"), dtype="float32", device="cpu")
    a = greedy_outputs
    b = hf_llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    chat = [{"role": "user", "content": "Name a fruit."}]
    assert hf_llm.tokenizer.encode_chat(chat) == llm.tokenizer.encode_chat(chat)


def test_stop_string_truncates_and_ends(llm: LLM) -> None:
    out = llm.generate(["1, 2, 3, 4, 5,"], SamplingParams(temperature=0, max_tokens=40, stop=[" 8"]))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == " 8"
    assert out.outputs[0].text.endswith("7,")
    assert " 8" not in out.outputs[0].text


def test_prompt_longer_than_context_is_an_error(llm: LLM) -> None:
    with pytest.raises(LocalLLMError, match="context limit"):
        llm.generate([[1] * (llm.engine.max_model_len + 5)], GREEDY)


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_device_cuda_on_a_cpu_only_torch_says_why(default_model_path: Path) -> None:
    with pytest.raises(LocalLLMError) as e:
        load_model(str(default_model_path), device="cuda")
    message = str(e.value)
    assert message.startswith("--device cuda: ") and message.endswith("; use --device cpu")
    assert f"torch {torch.__version__} is a CPU-only build" in message and "\n" not in message
