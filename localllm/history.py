"""Chat history in SQLite: conversations, their messages, full-text search and export.

No Textual here: the TUI drives it, but it is plain storage that a script or test can use.

Durability rules the TUI relies on:
- the connection runs in autocommit mode, so every ``add_message`` is on disk when it returns
  (WAL keeps that cheap and lets a killed process leave a database the next start opens as is);
- the schema version lives in ``PRAGMA user_version`` and each version has one upgrade
  function, run in order inside a transaction, so an old file is upgraded on open.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localllm.paths import data_dir

DB_NAME = "history.sqlite3"


@dataclass(slots=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    params: dict[str, Any]
    model: str
    created: float
    updated: float
    tab_position: int | None = None  # open as a tab at this position when the app last ran
    num_messages: int = 0


@dataclass(slots=True)
class StoredMessage:
    id: int
    conversation_id: int
    role: str  # "user" | "assistant"
    content: str
    created: float
    finish_reason: str | None = None  # "stop" | "length" | "abort" for replies
    meta: dict[str, Any] = field(default_factory=dict)  # tok/s, cached tokens, model...


@dataclass(slots=True)
class SearchHit:
    conversation_id: int
    title: str
    snippet: str
    updated: float


# ---- migrations: version N is reached by _MIGRATIONS[N - 1] ----


def _v1_tables(db: sqlite3.Connection) -> None:
    db.execute(
        """CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            system_prompt TEXT NOT NULL DEFAULT '',
            params TEXT NOT NULL DEFAULT '{}',
            model TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL,
            updated REAL NOT NULL,
            tab_position INTEGER
        )"""
    )
    db.execute(
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            created REAL NOT NULL,
            finish_reason TEXT,
            meta TEXT NOT NULL DEFAULT '{}'
        )"""
    )
    db.execute("CREATE INDEX messages_by_conversation ON messages(conversation_id, id)")


def _v2_fts(db: sqlite3.Connection) -> None:
    # An external-content index: the text lives once, in messages; triggers keep the index in step.
    db.execute("CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='id')")
    db.execute(
        """CREATE TRIGGER messages_ai AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END"""
    )
    db.execute(
        """CREATE TRIGGER messages_ad AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        END"""
    )
    db.execute(
        """CREATE TRIGGER messages_au AFTER UPDATE OF content ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
        END"""
    )
    db.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")


_MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_v1_tables, _v2_fts]
SCHEMA_VERSION = len(_MIGRATIONS)


class HistoryError(Exception):
    pass


class History:
    """One connection, used from one thread (the UI's)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or data_dir() / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, timeout=5.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL under WAL can lose the last commits on power loss but never corrupts; a killed
        # process (the case that matters for a TUI) loses nothing.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise HistoryError(
                f"{self.path} has schema version {version}, newer than this localllm's {SCHEMA_VERSION}; upgrade localllm"
            )
        for target in range(version + 1, SCHEMA_VERSION + 1):
            with self._tx() as db:
                _MIGRATIONS[target - 1](db)
                db.execute(f"PRAGMA user_version = {target}")

    @property
    def version(self) -> int:
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    # ---- conversations ----

    def create_conversation(
        self, title: str, system_prompt: str = "", params: dict[str, Any] | None = None, model: str = "",
        tab_position: int | None = None,
    ) -> Conversation:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations (title, system_prompt, params, model, created, updated, tab_position)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (title, system_prompt, json.dumps(params or {}), model, now, now, tab_position),
        )
        return Conversation(int(cur.lastrowid or 0), title, system_prompt, dict(params or {}), model, now, now,
                            tab_position)

    def update_conversation(self, conversation_id: int, **fields: Any) -> None:
        allowed = {"title", "system_prompt", "params", "model", "tab_position"}
        unknown = set(fields) - allowed
        if unknown:
            raise HistoryError(f"unknown conversation fields {sorted(unknown)}")
        if "params" in fields:
            fields["params"] = json.dumps(fields["params"])
        if not fields:
            return
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(
            f"UPDATE conversations SET {sets}, updated = ? WHERE id = ?",
            (*fields.values(), time.time(), conversation_id),
        )

    def get_conversation(self, conversation_id: int) -> Conversation | None:
        row = self.db.execute(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n"
            " FROM conversations c WHERE c.id = ?",
            (conversation_id,),
        ).fetchone()
        return _conversation(row) if row else None

    def list_conversations(self, limit: int = 500) -> list[Conversation]:
        rows = self.db.execute(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n"
            " FROM conversations c ORDER BY c.updated DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [_conversation(r) for r in rows]

    def open_tabs(self) -> list[Conversation]:
        rows = self.db.execute(
            "SELECT c.*, 0 AS n FROM conversations c WHERE tab_position IS NOT NULL ORDER BY tab_position"
        ).fetchall()
        return [_conversation(r) for r in rows]

    def set_open_tabs(self, conversation_ids: list[int]) -> None:
        with self._tx() as db:
            db.execute("UPDATE conversations SET tab_position = NULL WHERE tab_position IS NOT NULL")
            db.executemany(
                "UPDATE conversations SET tab_position = ? WHERE id = ?",
                [(i, cid) for i, cid in enumerate(conversation_ids)],
            )

    def delete_conversation(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ---- messages ----

    def add_message(
        self, conversation_id: int, role: str, content: str, finish_reason: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> StoredMessage:
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, created, finish_reason, meta)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, now, finish_reason, json.dumps(meta or {})),
            )
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return StoredMessage(int(cur.lastrowid or 0), conversation_id, role, content, now, finish_reason,
                             dict(meta or {}))

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self.db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        ).fetchall()
        return [_message(r) for r in rows]

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Deletes ``message_id`` and everything after it (regenerate, edit)."""
        self.db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id))

    # ---- search and export ----

    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        query = fts_query(text)
        if not query:
            return []
        rows = self.db.execute(
            """SELECT c.id AS cid, c.title AS title, c.updated AS updated,
                      snippet(messages_fts, 0, '[', ']', '…', 10) AS snip
               FROM messages_fts
               JOIN messages m ON m.id = messages_fts.rowid
               JOIN conversations c ON c.id = m.conversation_id
               WHERE messages_fts MATCH ?
               ORDER BY rank LIMIT ?""",
            (query, limit * 4),
        ).fetchall()
        hits: dict[int, SearchHit] = {}
        for r in rows:  # best-ranked message per conversation
            if r["cid"] not in hits:
                hits[r["cid"]] = SearchHit(r["cid"], r["title"], " ".join(r["snip"].split()), r["updated"])
        return list(hits.values())[:limit]

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.get_conversation(conversation_id)
        if conv is None:
            raise HistoryError(f"no conversation {conversation_id}")
        lines = [f"# {conv.title}", ""]
        if conv.model:
            lines += [f"*Model: {conv.model}*", ""]
        if conv.system_prompt:
            lines += ["**System:**", "", conv.system_prompt, ""]
        for m in self.messages(conversation_id):
            who = "User" if m.role == "user" else "Assistant"
            suffix = " *(stopped)*" if m.finish_reason == "abort" else ""
            lines += [f"## {who}{suffix}", "", m.content, ""]
        return "\n".join(lines).rstrip() + "\n"

    def export_to_file(self, conversation_id: int, folder: Path | None = None) -> Path:
        conv = self.get_conversation(conversation_id)
        if conv is None:
            raise HistoryError(f"no conversation {conversation_id}")
        folder = folder or data_dir() / "exports"
        folder.mkdir(parents=True, exist_ok=True)
        stem = re.sub(r"[^\w.-]+", "-", conv.title).strip("-")[:60] or "chat"
        path = folder / f"{stem}-{conversation_id}.md"
        path.write_text(self.export_markdown(conversation_id), encoding="utf-8")
        return path


def fts_query(text: str) -> str:
    """User text -> an FTS5 query: every word must match, the last one as a prefix (search as
    you type). Words are quoted, so FTS5 operators and punctuation in the text are literal."""
    words = re.findall(r"\w+", text)
    if not words:
        return ""
    quoted = ['"' + w.replace('"', '""') + '"' for w in words]
    quoted[-1] += "*"
    return " ".join(quoted)


def _conversation(row: sqlite3.Row) -> Conversation:
    try:
        params = json.loads(row["params"] or "{}")
    except json.JSONDecodeError:  # a hand-edited row must not stop the app from opening
        params = {}
    return Conversation(
        id=row["id"], title=row["title"], system_prompt=row["system_prompt"], params=params,
        model=row["model"], created=row["created"], updated=row["updated"], tab_position=row["tab_position"],
        num_messages=row["n"] if "n" in row.keys() else 0,  # noqa: SIM118 - sqlite3.Row has no __contains__ for keys
    )


def _message(row: sqlite3.Row) -> StoredMessage:
    try:
        meta = json.loads(row["meta"] or "{}")
    except json.JSONDecodeError:
        meta = {}
    return StoredMessage(row["id"], row["conversation_id"], row["role"], row["content"], row["created"],
                         row["finish_reason"], meta)
