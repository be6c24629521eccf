"""bench/gguf_agreement.py without llama.cpp or a model: how a model's held bytes are counted
and how issue 28's table reads a report (the 10% rule, a prompt that never parted)."""

from __future__ import annotations

import torch

from tests.bench.scripts import load_bench


load_bench("peers")  # the package bench/peers, as the bench scripts import it
bench = load_bench("gguf_agreement")


def test_a_tied_head_is_counted_once() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    model.register_buffer("d", torch.zeros(3, dtype=torch.float16))
    assert bench.held_bytes(model) == 10 * 4 * 4 + 3 * 2


def _report(held: int, rss: int, first: int | None) -> dict[str, object]:
    mib = 2**20
    return {"model": "/x/m.Q4_K_M.gguf", "file_bytes": 100 * mib, "planned_weight_bytes": 99 * mib,
            "held_bytes": held * mib, "kv_bytes": 400 * mib, "rss_peak": rss * mib, "anon_peak": rss * mib,
            "reason": "gguf blocks as stored (int8-dot CPU kernels): Q4_K x2 (sized from the tensors of m)",
            "agreement": 0.5, "per_prompt": [{"agreement": 1.0, "first_difference": first},
                                             {"agreement": 0.0, "first_difference": 0}]}


def test_the_table_row_says_within_only_when_weights_tensors_and_rss_are() -> None:
    good = bench.markdown([_report(101, 520, None)]).splitlines()[-1]
    assert "| yes |" in good and "| -, 0 |" in good and "(int8-dot CPU kernels): Q4_K x2 |" in good
    assert "**50.0%** (100.0%, 0.0%)" in good and good.endswith("| - | - |")  # no reference: no Q4_1 columns
    assert "| no |" in bench.markdown([_report(115, 520, 3)])  # tensors 15% over the file
    assert "| no |" in bench.markdown([_report(101, 600, 3)])  # RSS 20% over file + KV
