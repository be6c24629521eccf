"""The SQLite history on its own: migrations, durability, search, delete and export."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from localllm.history import SCHEMA_VERSION, History, HistoryError, fts_query


def test_a_new_database_is_at_the_latest_version_in_wal_mode(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    assert h.version == SCHEMA_VERSION
    assert h.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_version_1_database_is_upgraded_and_indexed(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    from localllm import history

    db = sqlite3.connect(path, isolation_level=None)
    history._v1_tables(db)
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO conversations (title, created, updated) VALUES ('old chat', 0, 0)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'zebra crossing', 0)")
    db.close()
    h = History(path)
    assert h.version == SCHEMA_VERSION
    assert [hit.title for hit in h.search("zebra")] == ["old chat"]  # the rebuild indexed old rows


def test_a_newer_database_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(HistoryError, match="newer"):
        History(path)


def test_messages_are_on_disk_when_add_returns(tmp_path: Path) -> None:
    """A process killed right after add_message loses nothing: another process sees it."""
    path = tmp_path / "h.sqlite3"
    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from localllm.history import History
        h = History(Path({str(path)!r}))
        c = h.create_conversation("killed", tab_position=0)
        h.add_message(c.id, "user", "saved before the kill")
        os._exit(9)  # no close, no cleanup
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False)
    assert proc.returncode == 9
    h = History(path)
    [conv] = h.open_tabs()
    assert [m.content for m in h.messages(conv.id)] == ["saved before the kill"]


def test_search_delete_and_export(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    a = h.create_conversation("Python", system_prompt="Be brief.", model="m")
    h.add_message(a.id, "user", "How do I reverse a list?")
    h.add_message(a.id, "assistant", "Use `reversed()`:\n\n```python\nxs[::-1]\n```", "stop")
    b = h.create_conversation("Cooking")
    h.add_message(b.id, "user", "How long do I boil an egg?")
    h.add_message(b.id, "assistant", "About nine minu", "abort")

    assert [x.title for x in h.search("revers")] == ["Python"]  # prefix match while typing
    assert [x.title for x in h.search("boil egg")] == ["Cooking"]
    assert h.search('"; DROP TABLE messages; --') == []  # user text is never FTS syntax

    md = h.export_markdown(a.id)
    assert md.startswith("# Python\n") and "**System:**" in md and "```python\nxs[::-1]\n```" in md
    assert "## Assistant *(stopped)*" in h.export_markdown(b.id)
    path = h.export_to_file(a.id, tmp_path / "out")
    assert path.read_text(encoding="utf-8") == md

    h.delete_conversation(b.id)
    assert [c.title for c in h.list_conversations()] == ["Python"]
    assert h.search("boil") == []  # the index follows deletes
    assert h.db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (b.id,)).fetchone()[0] == 0


def test_branches_keep_every_alternative(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    c = h.create_conversation("t")
    q = h.add_message(c.id, "user", "q")
    a1 = h.add_message(c.id, "assistant", "a1", "stop")
    a2 = h.add_message(c.id, "assistant", "a2", "stop", parent_id=q.id)  # regenerated
    assert (a2.sibling_index, a2.num_siblings) == (1, 2)
    assert [(m.content, m.sibling_index, m.num_siblings) for m in h.messages(c.id)] == [("q", 0, 1), ("a2", 1, 2)]
    follow = h.add_message(c.id, "user", "more")
    assert follow.parent_id == a2.id  # the default parent is the head
    assert [m.content for m in h.switch_branch(c.id, a1.id)] == ["q", "a1"]
    # Back to a2: its newest descendant becomes the head again.
    assert [m.content for m in h.switch_branch(c.id, a2.id)] == ["q", "a2", "more"]
    q2 = h.add_message(c.id, "user", "q, edited", parent_id=None)  # the first message edited
    assert [m.content for m in h.messages(c.id)] == ["q, edited"] and h.siblings(q2.id) == [q.id, q2.id]
    h.delete_message(q2.id)  # the head goes back to the newest other branch
    assert [m.content for m in h.messages(c.id)] == ["q", "a2", "more"]
    h.clear_conversation(c.id)
    assert h.messages(c.id) == [] and h.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0


def test_a_streaming_reply_is_rewritten_in_place_and_a_dead_one_is_marked(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    c = h.create_conversation("t")
    h.add_message(c.id, "user", "q")
    r = h.add_message(c.id, "assistant", "")  # finish_reason NULL: streaming
    h.update_message(r.id, content="The capital")
    h.update_message(r.id, content="The capital of France")
    assert h.search("capital")[0].conversation_id == c.id  # the index follows the rewrites
    assert h.mark_interrupted(c.id) == 1
    [_, m] = h.messages(c.id)
    assert (m.content, m.finish_reason) == ("The capital of France", "interrupted")
    h.update_message(m.id, content="The capital of France is Paris.", finish_reason="stop", meta={"tokens": 8})
    [_, m] = h.messages(c.id)
    assert (m.finish_reason, m.meta) == ("stop", {"tokens": 8}) and h.mark_interrupted(c.id) == 0
    assert "*(interrupted)*" not in h.export_markdown(c.id)


def test_a_version_2_database_gets_branches(tmp_path: Path) -> None:
    from localllm import history

    path = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    history._v1_tables(db)
    history._v2_fts(db)
    db.execute("PRAGMA user_version = 2")
    db.execute("INSERT INTO conversations (title, created, updated) VALUES ('old', 0, 0)")
    for role, text in [("user", "1"), ("assistant", "2"), ("user", "3")]:
        db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, ?, ?, 0)", (role, text))
    db.close()
    h = History(path)
    assert [m.content for m in h.messages(1)] == ["1", "2", "3"]  # the list became a branch
    assert h.add_message(1, "assistant", "4").parent_id == h.messages(1)[-2].id


def test_recent_prompts_and_app_state(tmp_path: Path) -> None:
    h = History(tmp_path / "h.sqlite3")
    c = h.create_conversation("t")
    for text in ["a", "b", "b", "c"]:
        h.add_message(c.id, "user", text)
        h.add_message(c.id, "assistant", "ok", "stop")
    assert h.recent_prompts() == ["a", "b", "c"]
    assert h.get_state("theme") is None
    h.set_state("theme", "nord")
    h.set_state("theme", "gruvbox")
    assert h.get_state("theme") == "gruvbox"


def test_fts_query_quotes_words() -> None:
    assert fts_query("") == ""
    assert fts_query("a OR b") == '"a" "OR" "b"*'
