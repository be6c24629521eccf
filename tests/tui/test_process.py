"""``localllm chat`` as a real process on a pseudo-terminal: its exit code on bad input, and a
SIGKILL in the middle of a reply, after which the partial reply is in the history, marked
interrupted on the next start, and can be continued or regenerated; nothing else is lost."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

from localllm.history import History
from localllm.tui.app import ChatApp
from tests.tui.conftest import wait_until
from tests.tui.fakes import FakeEngine

LOCALLLM = str(Path(sys.executable).with_name("localllm"))


class Terminal:
    """A child process on a pty of a fixed size; its output is drained all the time (a full
    pty buffer would block the app) and kept for assertions."""

    def __init__(self, args: list[str], env: dict[str, str], size: tuple[int, int] = (100, 30)) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self.master = master
        self.output = bytearray()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # the child closed its end
                return
            if not chunk:
                return
            self.output += chunk

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait_for_output(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle.encode() not in self.output:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = bytes(self.output[-2000:]).decode(errors="replace")
                raise AssertionError(f"{needle!r} never appeared (exit {self.proc.poll()}); output ends: {tail!r}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=5)
        os.close(self.master)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(LOCALLLM_HOME=str(home), TERM="xterm-256color", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    return env


def test_a_model_that_does_not_exist_exits_2_with_the_reason(home: Path) -> None:
    term = Terminal([LOCALLLM, "chat", "--model", "/nonexistent"], _env(home))
    try:
        term.wait_for_output("no such file", timeout=180)  # shown in the app first
        term.type("\x11")  # ctrl+q
        assert term.proc.wait(timeout=60) == 2
        term.wait_for_output("localllm: error: the model failed to load: /nonexistent: no such file or folder",
                             timeout=10)
    finally:
        term.close()


def _rows(db_path: Path, conversation_id: int) -> list[tuple]:
    db = sqlite3.connect(db_path)
    try:
        return db.execute("SELECT id, parent_id, role, content, finish_reason, meta FROM messages"
                          " WHERE conversation_id = ? ORDER BY id", (conversation_id,)).fetchall()
    finally:
        db.close()


async def test_sigkill_mid_reply_keeps_the_partial_reply(home: Path, default_model_path: Path) -> None:
    db_path = home / "data" / "history.sqlite3"
    h = History(db_path)
    other = h.create_conversation("Older chat", system_prompt="Be brief.")
    for role, text in [("user", "Hello"), ("assistant", "Hi! How can I help?"), ("user", "Name a colour."),
                       ("assistant", "Blue.")]:
        h.add_message(other.id, role, text, "stop" if role == "assistant" else None)
    h.close()
    before = _rows(db_path, other.id)
    # Greedy and long, so the reply is still streaming when the kill comes.
    (home / "config.toml").write_text("[chat]\ntemperature = 0.0\nmax_tokens = 1000\n")

    term = Terminal([LOCALLLM, "chat", "--model", str(default_model_path)], _env(home))
    try:
        # As soon as the window is up: the reply starts when the model has loaded.
        term.wait_for_output("Newline", timeout=120)
        term.type("Write a long story about a dragon who learns to bake bread.\r")
        deadline = time.monotonic() + 240
        partial = None
        while partial is None:
            assert term.proc.poll() is None and time.monotonic() < deadline, "no partial reply reached the history"
            time.sleep(0.2)
            db = sqlite3.connect(db_path)
            row = db.execute("SELECT id, content FROM messages WHERE role = 'assistant' AND finish_reason IS NULL"
                             " AND length(content) > 40").fetchone()
            db.close()
            partial = row
        os.killpg(term.proc.pid, signal.SIGKILL)
        term.proc.wait(timeout=30)
    finally:
        term.close()

    db = sqlite3.connect(db_path)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    assert _rows(db_path, other.id) == before  # the other chat is exactly as it was
    h = History(db_path)
    [conv] = h.open_tabs()
    [user, reply] = h.messages(conv.id)
    assert user.content == "Write a long story about a dragon who learns to bake bread."
    assert reply.id == partial[0] and reply.content.startswith(partial[1]) and reply.finish_reason is None
    h.close()

    # The next start shows it as interrupted; ctrl+g goes on from where it stopped.
    engine = FakeEngine("and they lived happily ever after.")
    app = ChatApp(engine, probe=False)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = app.active_chat
        assert chat.turns[-1].finish_reason == "interrupted"
        assert "interrupted" in str(chat.views[-1].query_one(".header").render())
        await pilot.press("ctrl+g")
        await wait_until(pilot, lambda: not chat.generating and chat.turns[-1].finish_reason == "stop")
        # No tokenizer here (a server would be the same): the partial reply goes as the last message.
        assert engine.prompts[-1][-1] == {"role": "assistant", "content": reply.content}
        assert chat.turns[-1].content == reply.content + "and they lived happily ever after."
        # Or regenerate: the interrupted reply stays as a branch.
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: not chat.generating and chat.turns[-1].branch == (1, 2))
    h = History(db_path)
    assert [m.content for m in h.messages(conv.id)][-1] == "and they lived happily ever after."
    assert h.siblings(reply.id) == [reply.id, h.messages(conv.id)[-1].id]
    assert h.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
