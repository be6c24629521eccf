"""History keeps a reply's reasoning in its own column; a version 3 file upgrades without loss."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from localllm import history
from localllm.history import SCHEMA_VERSION, History


def test_a_version_3_database_gets_a_reasoning_column_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "v3.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    for upgrade in (history._v1_tables, history._v2_fts, history._v3_branches):
        upgrade(db)
    db.execute("PRAGMA user_version = 3")
    db.execute("INSERT INTO conversations (title, created, updated) VALUES ('old', 0, 0)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created, parent_id) VALUES (1, 'user', 'hi', 0, NULL)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created, finish_reason, parent_id)"
               " VALUES (1, 'assistant', 'hello there', 0, 'stop', 1)")
    db.execute("UPDATE conversations SET head_id = 2")
    db.close()

    h = History(path)
    assert h.version == SCHEMA_VERSION >= 4
    old = h.messages(1)
    assert [(m.role, m.content, m.reasoning, m.finish_reason) for m in old] == [
        ("user", "hi", "", None), ("assistant", "hello there", "", "stop")]
    assert [hit.title for hit in h.search("hello")] == ["old"]  # the index survived the upgrade
    h.close()
    # the raw row too: an old reply reads back with an empty reasoning, not NULL
    db = sqlite3.connect(path)
    assert db.execute("SELECT reasoning FROM messages WHERE id = 2").fetchone() == ("",)
    db.close()


def test_reasoning_is_stored_apart_from_the_answer(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    c = h.create_conversation("t")
    h.add_message(c.id, "user", "What is 2+2?")
    reply = h.add_message(c.id, "assistant", "", reasoning="Adding")
    assert reply.reasoning == "Adding"
    h.update_message(reply.id, content="Four.", reasoning="Adding 2 and 2.", finish_reason="stop")
    h.update_message(reply.id, meta={"tokens": 9})  # an update without reasoning leaves it alone
    stored = h.messages(c.id)[-1]
    assert (stored.content, stored.reasoning, stored.meta) == ("Four.", "Adding 2 and 2.", {"tokens": 9})
    md = h.export_markdown(c.id)
    assert "## Assistant\n\n<details><summary>Thinking</summary>\n\nAdding 2 and 2.\n\n</details>\n\nFour." in md
    # search looks at answers, not at the reasoning behind them
    assert h.search("Adding") == []
    assert [hit.title for hit in h.search("four")] == ["t"]
