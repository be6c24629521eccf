"""The staged first build (kernels/cpu_build.py): a model that said what it runs gets a library
whose other files are compiled unoptimised, then the whole library is built in the background
at the lowest priority and is what later starts load; the table of which file serves which
model agrees with the sources. The compiler is a stand-in that records its command lines and
writes this session's real library as its output: what is under test is which files are
compiled how, and which library each start takes, not the compile."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from localllm.kernels import cpu_build, cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="CPU kernels could not be built here")

SMOLLM = cpu_build.Needs(frozenset({64}), frozenset({3, 8}))  # head_dim 64, Q4_1 and Q8_0 blocks


def _ids() -> dict[str, int]:
    """GGML type ids by kernel name (kQ4_0 = 2, ...) from gguf/formats.h."""
    text = (cpu_build.SOURCE_DIR / "gguf" / "formats.h").read_text()
    return {name: int(v) for name, v in re.findall(r"\b(k[A-Z0-9_]+) = (\d+)", text)}


def test_the_table_of_optional_files_matches_their_sources() -> None:
    """Each GGUF kernel file serves exactly the types its `case` labels name, each fixed-size
    attention file its head dim: a type added to a file without the table would compile it
    unoptimised for the models that run it."""
    ids = _ids()
    names = {str(tu.relative_to(cpu_build.SOURCE_DIR)) for tu in cpu_build.translation_units()}
    assert set(cpu_build.OPTIONAL) <= names
    files = [n for n in cpu_build.OPTIONAL if n.startswith("gguf/linear_")]
    served = {n: {ids[c] for c in re.findall(r"case (k\w+):", (cpu_build.SOURCE_DIR / n).read_text())} for n in files}
    for name, types in served.items():
        assert types
        for t in types:
            needs = cpu_build.Needs(frozenset(), frozenset({t}))
            assert [n for n in files if cpu_build.OPTIONAL[n](needs)] == [name]
    for d in (64, 128, 256, 80):
        needs = cpu_build.Needs(frozenset({d}))
        unused = {str(p.relative_to(cpu_build.SOURCE_DIR)) for p in cpu_build.unused_units(needs)}
        attention = {n for n in cpu_build.OPTIONAL if n.startswith("attention_")}
        assert attention - unused == {f"attention_d{d}.cpp" if d != 80 else "attention_generic.cpp"}
    assert cpu_build.unused_units(None) == []  # nothing said: the whole library at once


def test_the_generic_gguf_kernels_are_built_first_where_they_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an x86-64-v3 CPU the generic GGUF file serves only LOCALLLM_CPU_ISA=generic; off it,
    every GGUF model."""
    generic = cpu_build.SOURCE_DIR / "gguf" / "generic.cpp"
    if not generic.exists():
        pytest.skip("no generic GGUF kernels in this tree")
    monkeypatch.delenv(cpu_build.ISA_ENV, raising=False)
    monkeypatch.setattr(cpu_build, "_x86_v3", lambda: True)
    assert generic in cpu_build.unused_units(SMOLLM)
    monkeypatch.setenv(cpu_build.ISA_ENV, "generic")
    assert generic not in cpu_build.unused_units(SMOLLM)
    monkeypatch.delenv(cpu_build.ISA_ENV)
    monkeypatch.setattr(cpu_build, "_x86_v3", lambda: False)
    assert generic not in cpu_build.unused_units(SMOLLM)
    assert generic in cpu_build.unused_units(cpu_build.Needs(frozenset({64})))  # no GGUF: never


def _stand_in(tmp_path: Path) -> tuple[Path, Path]:
    """A compiler that appends its command line, its niceness and its scheduling group to a
    log, then writes this session's library to its -o."""
    log = tmp_path / "calls"
    script = tmp_path / "cxx"
    script.write_text(f'#!/bin/sh\necho "$(nice) $(cat /proc/self/autogroup 2>/dev/null) | $*" >> "{log}"\n'
                      f'for a; do out=$a; done\ncp "{cpu_build._library_path()}" "$out"\n')
    script.chmod(0o755)
    return script, log


def test_a_first_build_stages_what_the_model_runs_then_the_whole_library_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cxx, log = _stand_in(tmp_path)
    monkeypatch.setenv("LOCALLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setattr(cpu_build, "_expected", None)
    monkeypatch.setattr(cpu_build, "_progress", None)
    monkeypatch.setattr(cpu_build, "background_build", None)
    told: list[tuple[str, int, int]] = []
    cpu_build.expect(SMOLLM, lambda stage, done, total: told.append((stage, done, total)))
    cpu_build.expect(cpu_build.Needs(frozenset({128})))  # a second model: the first one decides
    unused = cpu_build.unused_units(SMOLLM)
    assert {str(p.relative_to(cpu_build.SOURCE_DIR)) for p in unused} >= {
        "attention_d128.cpp", "attention_d256.cpp", "gguf/linear_kquant.cpp", "gguf/linear_table.cpp"}

    staged = cpu_build.library()
    whole = cpu_build._library_path()
    assert staged is not None and staged.is_file() and staged != whole
    # the staged build's progress moves from 0 to all its files and the link, in order
    n = len(cpu_build.translation_units()) + 1
    assert {stage for stage, _, _ in told} == {cpu_build.STAGE} and {t for _, _, t in told} == {n}
    assert [d for _, d, _ in told] == sorted(d for _, d, _ in told) and told[0][1] == 0 and told[-1][1] == n
    thread = cpu_build.background_build
    assert thread is not None
    thread.join(120)
    assert not thread.is_alive() and whole.is_file()

    calls = [line.split(" | ", 1) for line in log.read_text().splitlines()]
    compiles = [(how, args.split()) for how, args in calls if " -c " in f" {args} "]
    first = compiles[: len(cpu_build.translation_units())]
    later = compiles[len(first):]
    level = {args[args.index("-c") + 1]: next(a for a in args if a.startswith("-O")) for _, args in first}
    assert {Path(s) for s, o in level.items() if o == "-O0"} == set(unused)
    assert all(o == "-O3" for s, o in level.items() if Path(s) not in unused)
    # the background compiles each unused file optimised (the others are cached), at nice 19
    assert sorted(args[args.index("-c") + 1] for _, args in later) == sorted(map(str, unused))
    assert all("-O3" in args for _, args in later)
    background = [how for how, _ in calls[len(first) + 1:]]  # after the staged link
    assert background and all(how.split()[0] == "19" for how in background)
    if Path("/proc/self/autogroup").exists():
        assert all("nice 19" in how for how in background)

    # the next start loads the whole library, compiles nothing and starts no background build
    before = len(log.read_text().splitlines())
    monkeypatch.setattr(cpu_build, "background_build", None)
    assert cpu_build.library() == whole
    assert cpu_build.background_build is None
    assert len(log.read_text().splitlines()) == before


def test_the_needs_of_the_default_model(default_model_path: Path) -> None:
    """What the loader tells the build for the default model: head dim 64, its GGUF types."""
    from localllm.models.formats import open_checkpoint
    from localllm.models.loader import kernel_needs

    needs = kernel_needs(open_checkpoint(default_model_path))
    assert needs.head_dims == frozenset({64})
    assert 3 in needs.gguf_types and not needs.experts  # Q4_1 blocks, no experts
    kept = {str(p.relative_to(cpu_build.SOURCE_DIR)) for p in cpu_build.translation_units()} - {
        str(p.relative_to(cpu_build.SOURCE_DIR)) for p in cpu_build.unused_units(needs)}
    assert {"attention_d64.cpp", "gguf/linear_legacy.cpp", "ops.cpp"} <= kept
