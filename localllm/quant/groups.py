"""The int4 group size: one rule for the planner's sizing, the online quantizer, the
quantize and eval commands and checkpoint loading. Torch-free, so the planner can use it."""

from __future__ import annotations

from localllm.errors import LocalLLMError

GROUP_SIZES = (128, 64, 32)


def pick_group_size(in_dims: dict[str, int], requested: int | None) -> int:
    """The largest of 128/64/32 dividing every input dim, or ``requested`` when it divides them.
    ``in_dims`` maps a linear's name (for the error message) to its input width."""
    if requested is not None:
        if requested <= 0 or requested % 8:
            raise LocalLLMError(f"--group-size {requested}: use a positive multiple of 8 (128, 64 or 32)")
        bad = next(((n, d) for n, d in in_dims.items() if d % requested), None)
        if bad is not None:
            ok = [g for g in GROUP_SIZES if all(d % g == 0 for d in in_dims.values())]
            hint = f"use {ok[0]}" if ok else "no standard group size fits"
            raise LocalLLMError(
                f"--group-size {requested} does not divide the input dim {bad[1]} of {bad[0]}; {hint}"
            )
        return requested
    for g in GROUP_SIZES:
        if all(d % g == 0 for d in in_dims.values()):
            return g
    raise LocalLLMError(f"no int4 group size in {GROUP_SIZES} divides the input dims {sorted(set(in_dims.values()))}")
