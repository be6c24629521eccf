"""The report of a peers run: rows of trials with their medians and speed ratios against the
targets, and the table printed at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.bench import percentile


# The targets, as speed ratios (localllm over llama.cpp).
TARGETS = {"single": 1.0, "prefill": 1.5, "server16": 2.0, "prefix_hit": 1.0,
           # issue 31: speculation on, over llama.cpp's n-gram speculation and over ours off
           "spec_code": 1.5, "spec_code_self": 1.6, "spec_prose_self": 0.97}


@dataclass(slots=True)
class Row:
    key: str
    label: str
    unit: str  # "tok/s" (higher is faster) or "s" (a TTFT: lower is faster)
    peer: str = "llama.cpp"
    ours: list[float] = field(default_factory=list)
    theirs: list[float] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        ours, theirs = percentile(self.ours, 50), percentile(self.theirs, 50)
        ratio = speed_ratio(ours, theirs, self.unit)
        target = TARGETS.get(self.key)
        return {
            "key": self.key, "label": self.label, "unit": self.unit, "peer": self.peer,
            "ours": ours, "theirs": theirs, "speed_ratio": ratio, "target": target,
            "met": None if target is None or ratio is None else ratio >= target,
            "ours_trials": [round(x, 4) for x in self.ours], "theirs_trials": [round(x, 4) for x in self.theirs],
            "details": self.details,
        }


def speed_ratio(ours: float | None, theirs: float | None, unit: str) -> float | None:
    """Above 1: localllm is faster. tok/s over tok/s; for a time, theirs over ours."""
    if ours is None or theirs is None or ours <= 0 or theirs <= 0:
        return None
    return round(ours / theirs if unit != "s" else theirs / ours, 3)


def _num(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:.3f} s" if unit == "s" else f"{x:.1f}"


def format_report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"localllm against llama.cpp on {Path(r['model']).name}, {m['date']}",
        f"CPU: {m['cpu']}; {', '.join(m['isa']) or 'no AVX2'}; {m['threads']} threads of {m['cpus']}",
        f"load average {' '.join(map(str, m['load_average']))} at the start, "
        f"{' '.join(map(str, m['load_average_end']))} at the end",
        f"localllm: {r['localllm'].get('precision') or 'the plan (--dtype ' + r['localllm']['dtype'] + ')'}"
        + (f", quant {r['localllm']['quant']}" if r["localllm"].get("quant") else "")
        + f"; llama.cpp {r['llama_cpp']['version'] or '(not found)'}",
        f"{r['trials']} trial(s) each, interleaved (localllm, then the peer), medians; "
        "speed = localllm / peer (TTFT: peer / localllm), above 1 means localllm is faster",
        "",
        f"{'measure':<52} {'localllm':>10} {'peer':>10} {'speed':>7}  target",
    ]
    for row in r["rows"]:
        target = "" if row["target"] is None else f">= {row['target']}x: " + ("met" if row["met"] else "not met")
        if row["target"] is not None and row["met"] is None:
            target = f">= {row['target']}x: -"
        ratio = "-" if row["speed_ratio"] is None else f"{row['speed_ratio']:.2f}x"
        unit = " (tok/s)" if row["unit"] == "tok/s" else ""
        lines.append(f"{row['label'] + unit:<52} {_num(row['ours'], row['unit']):>10} "
                     f"{_num(row['theirs'], row['unit']):>10} {ratio:>7}  {target}")
    if r["commands"]:
        lines += ["", "commands:"]
        for measure, cmds in r["commands"].items():
            for side, cmd in cmds.items():
                lines.append(f"  {measure} / {side}: {cmd}")
    if r["notes"]:
        lines += ["", "notes:"] + [f"  {n}" for n in r["notes"]]
    lines.append(f"\n(wall time {r['wall_s']:.0f} s)")
    return "\n".join(lines)
