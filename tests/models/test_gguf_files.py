"""GGUF files as users download them: a SentencePiece llama model, one split into shards by the
gguf package, and architectures localllm does not run. Each is written by the test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.errors import LocalLLMError
from localllm.models.formats import open_checkpoint
from localllm.models.gguf_file import gguf_shards
from tests.models.gguf_files import random_llama_weights, spm_vocab, train_sentencepiece, write_llama_gguf
from tests.reference import reference_greedy, reference_logits
from tests.test_cli import assert_one_line_error, cli

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[float], list[int]]:
    return spm_vocab(train_sentencepiece("bpe"))


@pytest.fixture(scope="module")
def weights(vocab) -> dict[str, torch.Tensor]:
    return random_llama_weights(len(vocab[0]))


@pytest.fixture(scope="module")
def single(vocab, weights, tmp_path_factory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("single") / "tiny.gguf", *vocab, weights)[0]


def split(vocab, weights, folder: Path) -> list[Path]:  # noqa: ANN001
    shards = write_llama_gguf(folder / "tiny.gguf", *vocab, weights, split_max_tensors=8)
    assert [p.name for p in shards] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(p.is_file() for p in shards)
    return shards


def test_spm_model_generates_what_the_reference_pass_does(single: Path, weights) -> None:
    ckpt = open_checkpoint(single)
    llm = LLM(str(single), dtype="float32", device="cpu", max_model_len=128)
    prompt = ckpt.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    out = llm.generate([prompt], GREEDY)[0]
    assert out.outputs[0].token_ids == reference_greedy(ckpt.config, weights, prompt, 12)
    # logprobs too: they see Q/K rows in the wrong rotary order, where greedy tokens may not
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0].outputs[0].logprobs[0]
    want = torch.log_softmax(reference_logits(ckpt.config, weights, prompt)[-1], -1)
    assert all(abs(lp - float(want[t])) < 1e-4 for t, lp in got.items())


def test_shards_load_as_one_model_from_any_shard(single: Path, vocab, weights, tmp_path: Path) -> None:
    shards = split(vocab, weights, tmp_path)
    whole = open_checkpoint(single)
    want = dict(whole.weights())
    for shard in shards:
        assert gguf_shards(shard) == shards
        ckpt = open_checkpoint(shard)
        assert ckpt.config == whole.config and ckpt.num_tensors == whole.num_tensors == len(want)
        assert ckpt.tokenizer.encode("Hello world") == whole.tokenizer.encode("Hello world")
        got = dict(ckpt.weights())
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    llm = LLM(str(shards[1]), dtype="float32", device="cpu", max_model_len=128)
    prompt = whole.tokenizer.encode("The quick brown fox")
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == reference_greedy(whole.config, weights, prompt, 12)


def test_a_missing_shard_is_named(vocab, weights, tmp_path: Path) -> None:
    shards = split(vocab, weights, tmp_path)
    shards[1].unlink()
    with pytest.raises(LocalLLMError, match="tiny-00002-of-00003.gguf: missing"):
        open_checkpoint(shards[0])
    assert_one_line_error(cli("run", "--model", str(shards[2]), "hi"), "tiny-00002-of-00003.gguf", "missing")


def test_shards_of_different_splits_are_refused(vocab, weights, tmp_path: Path) -> None:
    shards = split(vocab, weights, tmp_path / "a")
    other = write_llama_gguf(tmp_path / "b" / "tiny.gguf", *vocab, weights, split_max_tensors=11)  # 2 shards
    os.replace(other[1], shards[1])  # shard 2 of 2 where shard 2 of 3 belongs
    with pytest.raises(LocalLLMError, match="different splits"):
        open_checkpoint(shards[0])


def test_pull_of_a_shard_copies_every_shard(vocab, weights, tmp_path: Path, monkeypatch) -> None:
    from localllm import store

    shards = split(vocab, weights, tmp_path / "download")
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    path = store.pull(str(shards[2]))
    assert sorted(p.name for p in path.parent.glob("*.gguf")) == [p.name for p in shards]
    assert path.name == shards[0].name
    assert open_checkpoint(path).num_tensors == 21


def test_unsupported_architecture_is_one_line(vocab, weights, tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "gemma.gguf", *vocab, weights, arch="gemma2")[0]
    with pytest.raises(LocalLLMError, match="'gemma2' is not supported; localllm runs llama, qwen2, qwen3"):
        open_checkpoint(path)
    assert_one_line_error(cli("run", "--model", str(path), "hi"), "gemma.gguf", "'gemma2'", "llama, qwen2, qwen3")


def test_run_on_a_gguf_without_chat_template_notes_the_fallback(single: Path) -> None:
    proc = cli("run", "--model", str(single), "--temperature", "0", "--max-tokens", "4", "--dtype", "float32", "Hi")
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("localllm: note:")]
    assert len(notes) == 1 and "no chat template" in notes[0], proc.stderr
    assert "Traceback" not in proc.stderr
