from __future__ import annotations

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.quant.awq import (
    AWQLinear,
    awq_pack,
    awq_unpack,
    fake_quant_int4,
    quantize_int4,
)
from localllm.quant.groups import pick_group_size


def test_pack_matches_hand_computed_autoawq_word() -> None:
    # Columns 0..7 hold codes 1..8. AutoAWQ puts column AWQ_ORDER[i] = 0,2,4,6,1,3,5,7 in
    # nibble i, so from nibble 7 down to nibble 0 the word reads 8 6 4 2 7 5 3 1.
    codes = torch.arange(1, 9, dtype=torch.int32).reshape(1, 8)
    word = 0x86427531 - (1 << 32)  # as a signed int32
    assert awq_pack(codes).tolist() == [[word]]
    assert awq_unpack(torch.tensor([[word]], dtype=torch.int32)).tolist() == codes.tolist()


def test_pack_unpack_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (7, 40), generator=g, dtype=torch.int32)
    packed = awq_pack(codes)
    assert packed.shape == (7, 5) and packed.dtype == torch.int32
    assert torch.equal(awq_unpack(packed), codes)


def test_checkpoint_tensors_dequantize_to_the_fake_quant_values() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 128, generator=g)
    m = AWQLinear(128, 48, group_size=32)
    m.set_weight(w)
    m.mark_loaded()
    assert m.qweight.shape == (128, 6) and m.qzeros.shape == (4, 6) and m.scales.shape == (4, 48)
    assert m.scales.dtype == torch.float16
    # by hand from the AutoAWQ layout: w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]
    q = awq_unpack(m.qweight).float()
    z = awq_unpack(m.qzeros).float()
    s = m.scales.float()
    k = torch.arange(128)
    by_hand = ((q - z[k // 32]) * s[k // 32]).t()
    assert torch.equal(by_hand, m.dequantize())
    assert torch.equal(m.dequantize(), fake_quant_int4(w, 32))
    assert (m.dequantize() - w).abs().max() <= (w.abs().max() * 2 / 15)


def test_quantize_int4_codes_in_range_and_exact_on_grid() -> None:
    # weights already on a 4-bit grid survive quantization exactly
    scale = 0.125
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(2))
    codes[:, 0], codes[:, 1] = 0, 15  # each group spans the full range
    codes[:, 32], codes[:, 33] = 0, 15
    w = (codes.float() - 3) * scale
    q, _, _ = quantize_int4(w, 32)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    assert torch.equal(fake_quant_int4(w, 32), w)


def test_group_size_choice() -> None:
    dims = {"qkv": 576, "down": 1536}
    assert pick_group_size(dims, None) == 64
    assert pick_group_size({"a": 4096, "b": 11008}, None) == 128
    assert pick_group_size(dims, 32) == 32
    with pytest.raises(LocalLLMError) as e:
        pick_group_size(dims, 128)
    msg = str(e.value)
    assert "--group-size 128" in msg and "576" in msg and "use 64" in msg and "\n" not in msg
