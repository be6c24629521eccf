"""Per-layer scales of an FP8 (e4m3) KV cache: 1.0 by default, as in vLLM, or calibrated.

The cache stores ``(K R - k_offset) / k_scale`` and ``V / v_scale`` saturated to e4m3's +-448,
one scale for K and one for V per layer, where R is the model's key rotation (``key_rotation``
in models/llama.py: the keys after RoPE, rotated by a normalised Hadamard matrix, as the
queries are) and k_offset a per-layer [kv_heads, head_dim] vector (zeros unless calibrated;
softmax ignores it); the attention kernels fold the scales back in. With 1.0 the cache holds the values as
they are: e4m3 keeps 3 mantissa bits from 2^-6 to 448, and the default model's rotated keys
reach ~12 and its values ~18, so nothing saturates, but the few values under 2^-6 lose
precision.

Calibration (``calculate_kv_scales``) runs one prefill of ``calibration_prompt`` over a
private full-precision pool, sets each layer's k_offset to the mean of its K R there (the
large channels of RoPE'd keys are mostly a steady offset), reads the largest |K R - k_offset|
(what an FP8 cache stores) and |V| from that pool, and sets ``scale = max / (448 / HEADROOM)``: the calibration prompt's largest value lands at
448 / HEADROOM, so a later prompt may run HEADROOM times larger before it saturates, and
small values move out of the subnormal range.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from localllm.models.llama import LlamaForCausalLM
    from localllm.tokenizer import Tokenizer

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
HEADROOM = 2.0

# A short chat through the model's own template: the system and role tokens every chat starts
# with (where attention sinks put the largest keys) and some ordinary prose.
CALIBRATION_CHAT = (
    {"role": "user", "content": "Explain in a few sentences how a bicycle stays upright, and why riding "
                                "slowly is harder than riding fast."},
    {"role": "assistant", "content": "A moving bicycle stays upright mostly because the rider steers: when it "
                                     "starts to lean, turning the front wheel into the lean brings the wheels "
                                     "back under the rider's weight. The fork's geometry helps, since a leaning "
                                     "bike turns its front wheel the same way on its own. At low speed every "
                                     "correction has to be larger, so balancing takes more effort."},
    {"role": "user", "content": "Now list three things to check before a long ride, with numbers where they "
                                "matter, such as tyre pressure in bar or psi."},
)


def calibration_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode_chat(list(CALIBRATION_CHAT))


@torch.inference_mode()
def calibrate_kv_scales(model: LlamaForCausalLM, token_ids: Sequence[int]) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per layer from one prefill of ``token_ids`` (cut to the positions the
    model's rotary table covers). Also sets each attention layer's ``k_offset`` to the mean of
    its rotated keys there, which an FP8 cache subtracts before it stores them; the scales are
    those of the keys so centred.

    The prefill writes into a private pool (fp32 on CPU, the model dtype elsewhere) that this
    function attaches to the model; the caller attaches the engine's pool afterwards.
    """
    from localllm.engine.kv_cache import KVCache
    from localllm.quant.forward import BLOCK_SIZE, blocks_for, device_of, prefill_batch

    token_ids = list(token_ids)[: model.cos_sin.shape[0]]
    dev = device_of(model)
    n = len(token_ids)
    dtype = torch.float32 if dev.type == "cpu" else model.lm_head.weight.dtype
    cache = KVCache.for_model(model, blocks_for([n]), BLOCK_SIZE, dtype)
    batch = prefill_batch([list(token_ids)], dev)
    model(batch.input_ids, batch.positions, batch.meta)
    peaks = []
    for attn, (k_pool, v_pool) in zip(model.attention_layers(), cache.layers):
        # contiguous slots 0..n-1; this pool holds the keys unrotated, an FP8 one rotated
        k = k_pool.flatten(0, 1)[:n].float() @ attn.k_rotation
        v = v_pool.flatten(0, 1)[:n].float()
        offset = k.mean(dim=0)  # [KVH, D]
        attn.k_offset = offset.contiguous()
        peaks.append(torch.stack([(k - offset).abs().amax(), v.abs().amax()]))
    amax = torch.stack(peaks).t().clamp(min=1e-6)  # [2, layers]
    scales = (amax * HEADROOM / FP8_MAX).t().tolist()
    return [(k, v) for k, v in scales]
