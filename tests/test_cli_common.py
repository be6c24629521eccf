"""The start-up progress on stderr: plain lines where stderr is no terminal (`serve` under a
service manager or into a log), one when a stage starts and one when it ends."""

from __future__ import annotations

import pytest

from localllm.cli_common import progress_printer


def test_progress_off_a_terminal_is_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    report = progress_printer()
    for done in range(11):  # once per tensor: two lines, not eleven
        report("loading", done, 10)
    report("optimizing for this CPU in the background (first run only)", 0, 2)
    report("optimizing for this CPU in the background (first run only)", 1, 2)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "localllm: loading…" and lines[1].startswith("localllm: loading: done in ")
    assert lines[2:] == ["localllm: optimizing for this CPU in the background (first run only)…"]  # not done yet
    report("optimizing for this CPU in the background (first run only)", 2, 2)
    assert capsys.readouterr().err.startswith("localllm: optimizing for this CPU in the background (first run only): done")
