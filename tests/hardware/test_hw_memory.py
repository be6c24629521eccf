"""The CPU prediction is honest: the real engine, loaded as planned and run through its
largest step, grows RSS by what the plan predicts, within 10%.

Each precision runs in a fresh process, so that RSS growth is not blurred by whatever
earlier tests allocated. The step is the plan's worst case: a full token budget of prompts
in one forward pass, every one of ``max_num_seqs`` rows sampling at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, sys
    import gguf, jinja2, safetensors, tokenizers, torch  # the libraries are the baseline, not the model
    from localllm.engine.engine import EngineConfig, LLMEngine
    from localllm.engine.sequence import SamplingParams
    from localllm.hardware.planner import compare_memory
    from localllm.hardware.probe import MemoryMeter

    with MemoryMeter("cpu") as meter:
        # eager decode: compiling costs a minute per engine, and the plan adds its own allowance for it
        llm = LLMEngine(EngineConfig(dtype=sys.argv[1], device="cpu", chats=1, compile=False))
        p = llm.plan
        n = p.max_num_seqs
        per = p.max_num_batched_tokens // n
        for i in range(n):
            llm.add_request([1000 + (7 * i + j) % 40000 for j in range(per)],
                            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        sizes = []
        while llm.has_unfinished():
            llm.step()
            sizes.append(llm.stats().batch_tokens)
        # the KV pool's pages are faulted in on a background thread (kv_cache.reserve_in_background):
        # measured before it ends, the pool counted anywhere from nothing to all of it
        assert llm.runner.kv_cache.wait_reserved(timeout=120)
    assert sizes[0] == per * n, sizes  # the first step is the whole budget, all rows sampling
    print(json.dumps({**compare_memory(p, meter.actual_bytes).to_dict(), "plan": p.precision}))
''')


def test_cpu_prediction_within_ten_percent_of_the_real_engine() -> None:
    # fp32 and bf16 weights, in two processes at once: each measures only its own RSS.
    procs = {
        dtype: subprocess.Popen([sys.executable, "-c", SCRIPT, dtype], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        for dtype in ("float32", "bfloat16")
    }
    for dtype, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        check = json.loads(out.strip().splitlines()[-1])
        assert check["ok"], (dtype, check)
