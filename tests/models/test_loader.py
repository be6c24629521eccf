"""The load pipeline (models/loader.py): what it decides beyond the plan rides on the
LoadedModel, and the plan stays as the planner made it."""

from __future__ import annotations

from pathlib import Path

from localllm.models.loader import load_model
from tests.models.test_random_models import tokenizer_folder, write_random_model  # noqa: F401 - a fixture


def test_a_departure_from_the_plan_is_a_note_on_the_loaded_model(tokenizer_folder: Path, tmp_path: Path) -> None:  # noqa: F811
    path = write_random_model(tmp_path / "tiny", "LlamaForCausalLM", tokenizer_folder)
    planned = load_model(str(path), dtype="float32", device="cpu", compile=False)
    assert planned.notes == () and planned.num_kv_blocks == planned.plan.num_kv_blocks

    asked = load_model(str(path), dtype="float32", device="cpu", compile=False, quant="rtn4",
                       num_kv_blocks=planned.plan.num_kv_blocks + 3)
    assert asked.num_kv_blocks == asked.plan.num_kv_blocks + 3 and asked.precision == "rtn4"
    assert asked.notes == (
        f"KV pool {asked.num_kv_blocks:,} blocks as asked, not the plan's {asked.plan.num_kv_blocks:,}",
        "rtn4 weights as asked, planned as awq (they store alike)",
    )
    assert not any("as asked, not" in r or "rtn4" in r for r in asked.plan.reasons)
