"""Each quantized linear's fast path against its dequantized reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localllm.quant.fp8 import FP8_DTYPE, FP8Linear, quantize_fp8_per_channel
from localllm.quant.int8 import PACKED_MAX_ROWS, quantize_per_token_int8
from localllm.quant.methods import make_quant_linear

METHODS = ["int8", "int8-w8a8", "fp8", "rtn4"]


def _module(method: str, w: torch.Tensor, sizes: list[int] | None = None, bias: torch.Tensor | None = None):
    m = make_quant_linear(method, w.shape[1], w.shape[0], sizes, bias is not None, group_size=32)
    m.set_weight(w)
    if bias is not None:
        m.bias.data.copy_(bias)
    m.mark_loaded()
    return m


@pytest.fixture()
def weight() -> torch.Tensor:
    return torch.randn(96, 128, generator=torch.Generator().manual_seed(0)) * 0.05


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 5, PACKED_MAX_ROWS + 8])
def test_fast_path_matches_dequantized_reference(method: str, rows: int, weight: torch.Tensor) -> None:
    m = _module(method, weight)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    if method == "int8-w8a8":  # the reference sees the per-token int8 activations too
        xq, xs = quantize_per_token_int8(x)
        ref = F.linear(xq.float() * xs, m.dequantize())
        tol = 1e-4
    else:
        ref = F.linear(x, m.dequantize())
        # bf16 activations on the packed CPU paths: ~2^-8 relative per element
        tol = 2e-2 if method in ("int8", "rtn4") else 1e-4
    y = m(x)
    assert y.shape == (rows, 96) and y.dtype == x.dtype
    assert (y - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("method", METHODS)
def test_quantization_error_is_bounded(method: str, weight: torch.Tensor) -> None:
    m = _module(method, weight)
    rel = ((m.dequantize() - weight).norm() / weight.norm()).item()
    assert rel < {"int8": 0.01, "int8-w8a8": 0.01, "fp8": 0.05, "rtn4": 0.15}[method]


@pytest.mark.parametrize("method", METHODS)
def test_fused_with_bias_and_3d_input(method: str, weight: torch.Tensor) -> None:
    bias = torch.randn(96) * 0.1
    m = _module(method, weight, sizes=[64, 16, 16], bias=bias)
    x = torch.randn(2, 3, 128)
    ref = F.linear(x, m.dequantize(), bias)
    y = m(x)
    assert y.shape == (2, 3, 96)
    assert torch.allclose(y, ref, atol=0.05 * ref.abs().max().item())
    shards = dict(m.export())
    assert sorted(shards) == [0, 1, 2] and shards[1]["bias"].shape == (16,)


@pytest.mark.parametrize("kind,method", [("int8", "int8"), ("int4", "rtn4")])
def test_forced_dequant_path_equals_reference(kind: str, method: str, weight: torch.Tensor,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"LOCALLLM_QUANT_CPU_{kind.upper()}", "dequant")
    m = _module(method, weight)
    x = torch.randn(3, 128)
    assert torch.allclose(m(x), F.linear(x, m.dequantize()), atol=1e-5)


def test_fp8_table_upcast_matches_torch_cast(weight: torch.Tensor) -> None:
    m = _module("fp8", weight)
    assert isinstance(m, FP8Linear) and m.weight.dtype == FP8_DTYPE
    assert torch.equal(m._upcast(torch.float32), m.weight.float())
    q, _ = quantize_fp8_per_channel(torch.tensor([[1000.0, -3.0], [0.0, 0.0]]))
    assert not torch.isnan(q.float()).any() and q.float()[0, 0] == 448.0


def test_online_module_quantizes_each_shard_as_it_arrives(weight: torch.Tensor) -> None:
    m = make_quant_linear("int8", 128, 96, [64, 32], False, online=True)
    ref = _module("int8", weight)
    assert sorted(m.expected_weight_names()) == ["weight#0", "weight#1"]
    m.load_weight("weight", weight[64:], 1)
    # per-row scales: the shard's rows are final at once, and no float copy is kept
    assert m.expected_weight_names() == ["weight#0"] and m._staging is None
    assert torch.equal(m.weight[64:], ref.weight[64:])
    m.load_weight("weight", weight[:64], 0)
    assert m.expected_weight_names() == [] and m._staging is None
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.weight_scale, ref.weight_scale)
