"""Per-model sampling defaults: generation_config.json, the catalog's ``sampling`` table, which
catalog entry a path is, and the engine and ``LLM`` using them when the caller sets nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localllm import LLM, SamplingParams
from localllm.catalog import DEFAULT_MODEL
from localllm.errors import LocalLLMError
from localllm.engine.sampling_defaults import catalog_entry_for, read_generation_config, sampling_defaults
from tests.models.test_random_models import tokenizer_folder, write_random_model  # noqa: F401 - a fixture

QWEN25_GENERATION_CONFIG = {  # Qwen/Qwen2.5-7B-Instruct's generation_config.json
    "bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
    "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0",
}


def _write(folder: Path, config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "generation_config.json"
    path.write_text(json.dumps(config))
    return path


def test_generation_config_gives_the_sampling_keys_only(tmp_path: Path) -> None:
    got = read_generation_config(_write(tmp_path, QWEN25_GENERATION_CONFIG))
    assert got == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert isinstance(got["top_k"], int) and isinstance(got["temperature"], float)


def test_do_sample_false_is_greedy(tmp_path: Path) -> None:
    config = {**QWEN25_GENERATION_CONFIG, "do_sample": False}
    assert read_generation_config(_write(tmp_path, config)) == {"temperature": 0.0, "repetition_penalty": 1.05}


def test_top_k_zero_means_off(tmp_path: Path) -> None:
    assert read_generation_config(_write(tmp_path, {"top_k": 0, "temperature": 1})) == {"top_k": -1, "temperature": 1.0}


@pytest.mark.parametrize("config, fragment", [
    ({"temperature": "hot"}, "'temperature' must be a number"),
    ({"top_k": 2.5}, "'top_k' must be an integer"),
    ({"top_p": True}, "'top_p' must be a number"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_generation_config_is_one_line_naming_the_file(tmp_path: Path, config: object, fragment: str) -> None:
    path = _write(tmp_path, config)
    with pytest.raises(LocalLLMError, match=fragment) as info:
        read_generation_config(path)
    assert str(path) in str(info.value)


def test_out_of_range_default_names_its_source(tmp_path: Path) -> None:
    path = _write(tmp_path / "model", {"temperature": -1})
    with pytest.raises(LocalLLMError) as info:
        sampling_defaults(tmp_path / "model", str(tmp_path / "model"))
    assert str(path) in str(info.value) and "temperature" in str(info.value) and "got -1" in str(info.value)


def test_which_catalog_entry_a_model_is(tmp_path: Path, default_model_path: Path) -> None:
    assert catalog_entry_for(default_model_path, None).id == DEFAULT_MODEL  # type: ignore[union-attr]
    # pulled into the store: the folder is the catalog id, whatever the user typed
    assert catalog_entry_for(default_model_path, str(default_model_path)).id == DEFAULT_MODEL  # type: ignore[union-attr]
    # the same GGUF file downloaded elsewhere: its file name is the catalog source's
    elsewhere = tmp_path / default_model_path.name
    assert catalog_entry_for(elsewhere, str(elsewhere)).id == DEFAULT_MODEL  # type: ignore[union-attr]
    assert catalog_entry_for(tmp_path / "other.gguf", str(tmp_path / "other.gguf")) is None
    assert catalog_entry_for(tmp_path, "Qwen/Qwen2.5-7B-Instruct").id == "qwen2.5-7b-instruct"  # type: ignore[union-attr]


def test_the_file_wins_over_the_catalog_for_the_keys_it_sets(tmp_path: Path) -> None:
    folder = tmp_path / "smollm2"
    _write(folder, {"top_p": 0.95, "min_p": 0.05, "bos_token_id": 1})
    assert sampling_defaults(folder, DEFAULT_MODEL) == {"temperature": 0.2, "top_p": 0.95, "min_p": 0.05}
    assert sampling_defaults(tmp_path / "other.gguf", str(tmp_path / "other.gguf")) == {}


def test_the_default_model_engine_reports_its_defaults(llm: LLM) -> None:
    assert llm.engine.sampling_defaults == {"temperature": 0.2, "top_p": 0.5}
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.5, -1)


def test_generate_without_params_uses_the_models_defaults(tmp_path: Path, tokenizer_folder: Path) -> None:  # noqa: F811
    greedy = write_random_model(tmp_path / "greedy", "Qwen2ForCausalLM", tokenizer_folder)
    config = json.loads((greedy / "generation_config.json").read_text())
    _write(greedy, {**config, "do_sample": False, "temperature": 0.9})
    llm = LLM(str(greedy), dtype="float32", device="cpu", max_model_len=256)
    assert llm.engine.sampling_defaults == {"temperature": 0.0}
    prompt = [5, 17, 300, 42]
    first, again = llm.generate([prompt])[0], llm.generate([prompt])[0]
    explicit = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == explicit.outputs[0].token_ids
    # the same weights without the file's say: SamplingParams' temperature 1 samples (random
    # weights spread over 49k tokens, so two 16-token samples agreeing is out of the question)
    plain = write_random_model(tmp_path / "plain", "Qwen2ForCausalLM", tokenizer_folder)
    llm = LLM(str(plain), dtype="float32", device="cpu", max_model_len=256)
    assert llm.engine.sampling_defaults == {} and llm.get_default_sampling_params().temperature == 1.0
    assert llm.generate([prompt])[0].outputs[0].token_ids != llm.generate([prompt])[0].outputs[0].token_ids
