"""config.json as both transformers generations write it. transformers >= 5 writes
``rope_parameters`` (theta and scaling together) and ``dtype``; older releases ``rope_theta``,
``rope_scaling`` and ``torch_dtype``. Multimodal wrappers hold the text model's config in
``text_config`` and its weights under a prefix. Every shape here is what transformers 5.24's
``save_pretrained`` wrote for the same settings (checked once by hand, with logits equal to
transformers' own to 1e-6); the logits are checked against tests/reference.py's plain pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from localllm import LLM, SamplingParams
from localllm.errors import LocalLLMError
from localllm.models.llama import ModelConfig
from localllm.models.formats import open_checkpoint
from localllm.models.gguf_file import gguf_rope_scaling
from tests.models.test_random_models import tokenizer_folder, write_random_model  # noqa: F401 - a fixture
from tests.reference import hf_state_dict, reference_logits

IDS = list(range(200, 330))  # long enough for the low rope frequencies to matter


def _logprobs(path: Path, ids: list[int] = IDS) -> dict[int, float]:
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=256)
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=10))[0].outputs[0].logprobs[0]


def _assert_reference(path: Path, got: dict[int, float], ids: list[int] = IDS) -> None:
    ckpt = open_checkpoint(path)
    want = torch.log_softmax(reference_logits(ckpt.config, hf_state_dict(ckpt), ids)[-1], -1)
    assert max(abs(lp - float(want[t])) for t, lp in got.items()) < 1e-3
    assert next(iter(got)) == int(want.argmax())


def _far(a: dict[int, float], b: dict[int, float]) -> bool:
    return list(a) != list(b) or max(abs(a[t] - b[t]) for t in a) > 1e-2


def _base(**over: Any) -> dict[str, Any]:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 512, "model_type": "llama"}
    cfg.update(over)
    return cfg


# ---- rope_parameters: the same model either way, and not the one rope_theta 10000 would give ----

V5_DEFAULT = {"rope_theta": None, "rope_scaling": None, "torch_dtype": None, "dtype": "float32",
              "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
V4_DEFAULT = {"rope_theta": 100000.0, "torch_dtype": "float32"}
V5_LLAMA3 = {"rope_theta": None, "rope_scaling": None, "dtype": "bfloat16", "rope_parameters": {
    "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64,
    "rope_theta": 500000.0, "rope_type": "llama3"}}
V4_LLAMA3 = {"rope_theta": 500000.0, "torch_dtype": "bfloat16", "rope_scaling": {
    "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64,
    "rope_type": "llama3"}}


@pytest.mark.parametrize(("v5", "v4"), [(V5_DEFAULT, V4_DEFAULT), (V5_LLAMA3, V4_LLAMA3)], ids=["default", "llama3"])
def test_transformers5_config_loads_the_same_model(v5: dict[str, Any], v4: dict[str, Any], tokenizer_folder: Path,
                                                   tmp_path: Path) -> None:
    new = write_random_model(tmp_path / "v5", "LlamaForCausalLM", tokenizer_folder, tied=False, config=v5)
    old = write_random_model(tmp_path / "v4", "LlamaForCausalLM", tokenizer_folder, tied=False, config=v4)
    assert ModelConfig.from_hf(json.loads((new / "config.json").read_text())) == \
        ModelConfig.from_hf(json.loads((old / "config.json").read_text()))
    got = _logprobs(new)
    assert got == _logprobs(old)
    _assert_reference(new, got)
    # what the loader did before: rope_parameters unread, so theta 10000 and no scaling
    ignored = write_random_model(tmp_path / "ignored", "LlamaForCausalLM", tokenizer_folder, tied=False,
                                 config={"rope_theta": None, "rope_scaling": None})
    assert _far(got, _logprobs(ignored))


YARN_CASES = {
    "yarn": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "truncate": False,
                              "original_max_position_embeddings": 256, "attention_factor": 1.3},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_scaled_rope_matches_the_reference(case: str, tokenizer_folder: Path, tmp_path: Path) -> None:
    params = YARN_CASES[case]
    path = write_random_model(tmp_path / case, "Qwen2ForCausalLM", tokenizer_folder,
                              config={"rope_theta": None, "rope_scaling": None, "rope_parameters": params})
    got = _logprobs(path)
    _assert_reference(path, got)
    plain = write_random_model(tmp_path / "plain", "Qwen2ForCausalLM", tokenizer_folder,
                               config={"rope_theta": params["rope_theta"], "rope_scaling": None})
    assert _far(got, _logprobs(plain))  # the scaling did something


def test_reading_follows_transformers_precedence() -> None:
    # theta inside rope_parameters wins over a top-level one; a legacy rope_scaling replaces rope_parameters
    cfg = ModelConfig.from_hf(_base(rope_theta=1.0e4, rope_parameters={"rope_theta": 5.0e5, "rope_type": "default"}))
    assert cfg.rope_theta == 5.0e5 and cfg.rope_scaling is None
    cfg = ModelConfig.from_hf(_base(rope_theta=7.0e4, rope_scaling={"type": "linear", "factor": 2.0},
                                    rope_parameters={"rope_type": "default", "rope_theta": 1.0}))
    assert cfg.rope_theta == 7.0e4 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # yarn and llama3 default their pretraining length to max_position_embeddings; a top-level one wins
    cfg = ModelConfig.from_hf(_base(rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    assert cfg.rope_scaling["original_max_position_embeddings"] == 512
    cfg = ModelConfig.from_hf(_base(original_max_position_embeddings=100,
                                    rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64}))
    assert cfg.rope_scaling["original_max_position_embeddings"] == 100
    # transformers' defaults for keys left out
    assert ModelConfig.from_hf(_base()).rms_norm_eps == 1e-6
    qwen3 = _base(architectures=["Qwen3ForCausalLM"])
    del qwen3["head_dim"], qwen3["max_position_embeddings"]
    cfg = ModelConfig.from_hf(qwen3)
    assert cfg.head_dim == 128 and cfg.max_position_embeddings == 32768


@pytest.mark.parametrize(("over", "words"), [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "head_dim / 2 = 8"),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}, "'mrope'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}},
     "per layer type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "'low_freq_factor'"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "'factor'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": -2}}, "positive"),
    ({"rope_theta": "big"}, "rope_theta"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"architectures": ["PaliGemmaForConditionalGeneration"], "text_config": {"model_type": "gemma2"}},
     "PaliGemmaForConditionalGeneration holds a 'gemma2' text model"),
])
def test_math_changing_keys_are_refused_on_one_line(over: dict[str, Any], words: str) -> None:
    with pytest.raises(LocalLLMError) as e:
        ModelConfig.from_hf(_base(**over), "config.json")
    message = str(e.value)
    assert words in message and message.startswith("config.json:") and "\n" not in message


def test_sliding_windows_as_transformers_reads_them() -> None:
    mistral = _base(architectures=["MistralForCausalLM"])
    assert ModelConfig.from_hf(mistral).sliding_window == 4096  # MistralConfig's default
    assert ModelConfig.from_hf({**mistral, "sliding_window": None}).sliding_window is None  # v0.2+
    assert ModelConfig.from_hf({**mistral, "sliding_window": 128}).layer_window(1) == 128
    qwen = _base(architectures=["Qwen2ForCausalLM"], sliding_window=128, max_window_layers=1)
    assert ModelConfig.from_hf(qwen).sliding_window is None  # use_sliding_window is false by default
    qwen_swa = ModelConfig.from_hf({**qwen, "use_sliding_window": True})
    assert [qwen_swa.layer_window(i) for i in range(2)] == [None, 128]  # layer 1 slides
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 2}).sliding_window is None
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True,
                                "layer_types": ["full_attention", "full_attention"]}).sliding_window is None
    assert ModelConfig.from_hf(_base(sliding_window=16)).sliding_window is None  # Llama has none


def test_a_sliding_window_does_not_cap_the_context(tokenizer_folder: Path, tmp_path: Path) -> None:
    """Every attention path applies the window, so the context is the model's, not the
    window's (tests/models/test_families.py checks tokens past the window against transformers)."""
    path = write_random_model(tmp_path / "swa", "MistralForCausalLM", tokenizer_folder, heads=4, kv_heads=4,
                              config={"sliding_window": 96})
    llm = LLM(str(path), dtype="float32", device="cpu")
    assert llm.engine.max_model_len == 512
    ids = list(range(300, 380))
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=10))[0].outputs[0].logprobs[0]
    _assert_reference(path, out, ids)
    assert len(llm.generate([list(range(300, 400))], SamplingParams(max_tokens=1))[0].outputs[0].token_ids) == 1


# ---- multimodal wrappers ----

@pytest.mark.parametrize("layout", ["legacy", "v5"])
def test_text_model_of_a_multimodal_wrapper(layout: str, tokenizer_folder: Path, tmp_path: Path) -> None:
    """A LLaVA checkpoint: its text model is loaded (the prefix stripped, the vision tower left
    out) and gives the logits of the same weights saved as a plain text model."""
    text = write_random_model(tmp_path / "text", "LlamaForCausalLM", tokenizer_folder, tied=False,
                              config={"rope_theta": None, "rope_parameters": {"rope_theta": 50000.0,
                                                                              "rope_type": "default"}})
    wrapped = tmp_path / "llava"
    wrapped.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (wrapped / f).write_bytes((text / f).read_bytes())
    text_cfg = json.loads((text / "config.json").read_text())
    del text_cfg["architectures"]
    (wrapped / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "dtype": "float32",
        "image_token_index": 49151, "text_config": {**text_cfg, "model_type": "llama"},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32},
    }))
    prefix, head = ("language_model.model.", "language_model.lm_head.") if layout == "legacy" else (
        "model.language_model.", "lm_head.")
    tensors = {(head + k[len("lm_head."):] if k.startswith("lm_head.") else prefix + k[len("model."):]): v
               for k, v in load_file(str(text / "model.safetensors")).items()}
    vision_prefix = "" if layout == "legacy" else "model."
    tensors[f"{vision_prefix}vision_tower.embeddings.patch_embedding.weight"] = torch.randn(32, 3, 16, 16)
    tensors[f"{vision_prefix}multi_modal_projector.linear_1.weight"] = torch.randn(64, 32)
    save_file(tensors, str(wrapped / "model.safetensors"))

    cfg = open_checkpoint(wrapped).config
    assert cfg.architecture == "LlamaForCausalLM" and cfg.wrapper == "LlavaForConditionalGeneration"
    assert cfg.rope_theta == 50000.0
    assert _logprobs(wrapped) == _logprobs(text)


# ---- GGUF's rope keys ----

def test_gguf_rope_scaling_keys() -> None:
    def read(**rope: Any) -> dict[str, Any]:
        fields = {f"llama.rope.{k.replace('__', '.')}": v for k, v in rope.items()}
        cfg: dict[str, Any] = {"head_dim": 64, "max_position_embeddings": 8192}
        gguf_rope_scaling(fields, "llama", cfg, Path("m.gguf"))
        return cfg

    assert "rope_scaling" not in read(freq_base=1e5, dimension_count=64)
    assert read(scaling__type="linear", scaling__factor=4.0)["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert read(scaling__type="yarn", scaling__factor=4.0, scaling__original_context_length=2048)["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    # RoPE on part of the head: the config reader takes it for Phi-3 and refuses it for llama (above)
    assert read(dimension_count=32)["partial_rotary_factor"] == 0.5  # noqa: PLR2004
    for rope, words in (({"scaling__type": "longrope"}, "'longrope'"),
                        ({"scaling__type": "yarn", "scaling__factor": 4.0, "scaling__yarn_log_multiplier": 0.1},
                         "yarn_log_multiplier"),
                        ({"dimension_sections": [16, 24, 24, 0]}, "dimension_sections")):
        with pytest.raises(LocalLLMError, match=words):
            read(**rope)
