"""The CPU prediction is honest: a forward pass built from the plan stays within 10% of it.

This is a stand-in for the engine (random weights of the planned dtype, the planned KV pool,
a prefill of max_num_batched_tokens through the blocks) run in a fresh process, so that
RSS growth is not blurred by whatever earlier tests allocated.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch, torch.nn.functional as F
    from localllm.catalog import load_catalog
    from localllm.hardware.planner import compare_memory, plan
    from localllm.hardware.probe import CPUInfo, GiB, Hardware, MemoryMeter

    flags = frozenset({"avx2", "avx512_bf16"} if sys.argv[1] == "bf16" else {"avx2"})
    hw = Hardware(cpu=CPUInfo("test", 2, 2, flags, "x86_64"), ram_total_bytes=16 * GiB,
                  ram_available_bytes=8 * GiB)
    m = load_catalog()["smollm2-135m-instruct"]
    p = plan(m, hw, cpu_compile=False)  # the synthetic forward runs eagerly
    wd = getattr(torch, p.weight_dtype)
    H, nh, nkv, hd, I, V = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.intermediate_size, m.vocab_size
    T = p.max_num_batched_tokens
    with MemoryMeter("cpu") as meter:
        # Values do not matter here, only resident bytes; full() is much faster than randn().
        emb = torch.full((V, H), 0.02, dtype=wd)
        layers = [[torch.full((o, i), 0.02, dtype=wd) for o, i in
                   ((nh * hd, H), (nkv * hd, H), (nkv * hd, H), (H, nh * hd), (I, H), (I, H), (H, I))]
                  for _ in range(m.num_layers)]
        kv = torch.empty(p.num_kv_blocks, 2, m.num_layers, p.block_size, nkv, hd, dtype=torch.float32)
        kv.fill_(0.0)  # an engine must touch its pool for RSS to show it
        with torch.inference_mode():
            x = emb[torch.arange(T) % V].float()
            # Blocks run one at a time, so two of them reach the same activation peak as thirty.
            for wq, wk, wv, wo, wg, wu, wdn in layers[:2]:
                h = F.rms_norm(x, (H,)).to(wd)
                q = F.linear(h, wq).float().view(T, nh, hd).transpose(0, 1)
                k = F.linear(h, wk).float().view(T, nkv, hd).transpose(0, 1)
                v = F.linear(h, wv).float().view(T, nkv, hd).transpose(0, 1)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                x = x + F.linear(a.transpose(0, 1).reshape(T, nh * hd).to(wd), wo).float()
                h = F.rms_norm(x, (H,)).to(wd)
                x = x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wdn).float()
            logits = F.linear(F.rms_norm(x[-p.max_num_seqs:], (H,)).to(wd), emb).float().softmax(-1)
    print(json.dumps(compare_memory(p, meter.actual_bytes).to_dict()))
''')


def test_cpu_prediction_within_ten_percent_of_a_synthetic_forward() -> None:
    # fp32 and bf16 weights, in two processes at once: each measures only its own RSS.
    procs = {
        precision: subprocess.Popen([sys.executable, "-c", SCRIPT, precision], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        for precision in ("fp32", "bf16")
    }
    for precision, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        check = json.loads(out.strip().splitlines()[-1])
        assert check["ok"], (precision, check)
