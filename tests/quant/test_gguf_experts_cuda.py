"""A GGUF MoE's experts kept as stored on the GPU's code path (quant/gguf_experts_cuda.py), run
in a rehearsal (``LOCALLLM_TRITON_ON_CPU``: the CUDA code path on CPU tensors, the Triton
kernels under the interpreter) against the CPU's own GGUF experts path on the same file.

The files are tests/models/test_moe.py's tiny MoEs with quantized experts (gpt-oss in MXFP4
with its biases; Qwen3-MoE in Q8_0, Q5_0, Q4_K and Q6_K, one layer's gate and up of two types).
Nothing here ran on a GPU: the kernels' compiles for sm80/89/90 are bench/aot_check.py's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from localllm.quant import gguf_formats as gf
from localllm.quant.forward import prefill_logits
from tests.models.test_families import family_tokenizer  # noqa: F401
from tests.models.test_moe import EXPERT_TYPES, QuantizedMoE, _make, _quantized_files
from tests.quant.test_gguf_cuda import rehearse  # noqa: F401
from tests.tiers import matrix

gguf_linear_mod = pytest.importorskip("localllm.kernels.gguf_linear")


# A byte-level vocabulary of 320 tokens: the interpreter runs the head's GEMV too, and the
# families' 49k-row head would cost it minutes a step.
SMALL_VOCAB = 320
PROMPTS = [list(range(40, 60)), [5, 6, 7]]


def _byte_vocab() -> dict[str, Any]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
    tokens = [*chars, "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [f"<unused{i}>" for i in range(SMALL_VOCAB - len(tokens))]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * 257 + [3] * (SMALL_VOCAB - 257), "tokenizer.ggml.merges": ["Ġ t"]}


@pytest.fixture(scope="module", params=matrix(["gpt_oss", "qwen3_moe"], ci=["gpt_oss"]))
def quantized(request: pytest.FixtureRequest, family_tokenizer: tuple[Path, dict],  # noqa: F811
              tmp_path_factory: pytest.TempPathFactory) -> QuantizedMoE:
    """tests/models/test_moe.py's tiny MoE of this family with quantized experts, on a small vocabulary."""
    from tests.models import test_moe

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_moe, "VOCAB", SMALL_VOCAB)
        fields = _byte_vocab()
        m = _make(request.param, (family_tokenizer[0], fields), tmp_path_factory.mktemp(f"moe-gpu-{request.param}"))
        return _quantized_files(m, fields, tmp_path_factory.mktemp(f"moe-gpu-q-{request.param}"))


class GroupedLaunches:
    """Counts the grouped kernel's launches by path (FMA tiles for a few rows per expert, dot above)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        kernel = gguf_linear_mod._gguf_grouped_kernel
        original = kernel.run

        def run(*args: Any, **kw: Any) -> Any:
            self.counts["dot" if kw["USE_DOT"] else "fma"] += 1
            self.counts[gf.type_name(kw["FORMAT"])] += 1
            return original(*args, **kw)

        monkeypatch.setattr(kernel, "run", run)


def _engine(path: Path) -> Any:
    from localllm.engine.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(path), device="cpu", max_model_len=128, compile=False, max_num_seqs=4))


def _greedy(engine: Any) -> list[list[int]]:
    from localllm.engine.sequence import SamplingParams

    prompts = [PROMPTS[0][:20], PROMPTS[1]]  # a 20-token prefill (dot tiles), then a decode of 2 (FMA tiles)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def test_gpu_plan_keeps_the_experts_as_stored_and_matches_the_cpu_path(
    quantized: QuantizedMoE, rehearse: Callable[[bool], None], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    """On the GPU's plan every layer's experts are the file's blocks (no float expert matrix,
    exactly the file's expert bytes, sized so by the planner), each projection one grouped
    launch over the routed experts' rows; logits and greedy tokens are the CPU GGUF path's."""
    from localllm.models.loader import load_model
    from localllm.quant.gguf_experts import GGUFExperts
    from localllm.quant.gguf_experts_cuda import GGUFExpertsCUDA

    cpu = load_model(str(quantized.quantized), device="cpu", compile=False)
    assert isinstance(cpu.model.model.layers[0].mlp.experts, GGUFExperts)
    want_logits = prefill_logits(cpu.model, PROMPTS[0][:20])
    want_tokens = _greedy(_engine(quantized.quantized))
    del cpu

    rehearse(True)
    launches = GroupedLaunches(monkeypatch)
    loaded = load_model(str(quantized.quantized), device="cpu", compile=False)
    assert "Triton kernels" in loaded.plan.precision_reason and "stacked experts as stored" in loaded.plan.precision_reason
    layers = loaded.model.model.layers
    assert all(isinstance(layer.mlp.experts, GGUFExpertsCUDA) and layer.mlp.w13 is None for layer in layers)
    assert not [n for n, _ in loaded.model.named_parameters() if ".mlp.w" in n]
    for layer, (gate, up, down) in zip(layers, EXPERT_TYPES[quantized.name]):
        ex = layer.mlp.experts
        assert (ex.w13.fmt, (ex.w3 or ex.w13).fmt, ex.w2.fmt) == (gate, up, down) and (ex.w3 is None) == (gate == up)
    held = sum(t.numel() * t.element_size() for layer in layers for n, t in layer.mlp.experts.named_buffers()
               if not n.endswith("lut"))
    assert held == quantized.expert_bytes  # the file's bytes, repacked by kind, nothing expanded
    assert abs(loaded.plan.weight_bytes - quantized.tensor_bytes) <= 0.01 * quantized.tensor_bytes

    got = prefill_logits(loaded.model, PROMPTS[0][:20])
    assert (got - want_logits).abs().max() < 0.02 * want_logits.abs().max()  # noqa: PLR2004
    assert launches.counts["dot"] and not launches.counts["fma"], dict(launches.counts)
    engine = _engine(quantized.quantized)
    assert _greedy(engine) == want_tokens
    assert launches.counts["fma"], dict(launches.counts)  # the decode steps' few rows per expert
    kinds = {t for layer in EXPERT_TYPES[quantized.name] for t in layer}
    assert all(launches.counts[k] for k in kinds), dict(launches.counts)

    # what a decode bucket's CUDA graph needs: routing and grouped launches read nothing back
    from tests.engine.test_rehearsal import NoHostSync

    runner = engine.runner
    runner._capture_graphs(1)
    launches.counts.clear()
    with NoHostSync() as mode:
        out = runner._decode_call(1).clone()
    assert mode.ops and torch.isfinite(out).all()
    assert launches.counts["fma"] >= 2 * len(layers) and not launches.counts["dot"], dict(launches.counts)
