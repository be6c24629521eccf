"""Chat history in SQLite: conversations, their messages, full-text search and export.

No Textual here: the TUI drives it, but it is plain storage that a script or test can use.

Durability rules the TUI relies on:
- the connection runs in autocommit mode, so every ``add_message`` and ``update_message`` is
  one transaction, on disk when it returns (WAL keeps that cheap and lets a killed process
  leave a database the next start opens as is);
- a reply being streamed is a row with ``finish_reason`` NULL, rewritten as it grows; a row
  still NULL when its chat is next opened was cut short by a crash (``mark_interrupted``);
- the schema version lives in ``PRAGMA user_version`` and each version has one upgrade
  function, run in order inside a transaction, so an old file is upgraded on open.

Messages form a tree: each has a ``parent_id`` (None for a first message), and a conversation's
``head_id`` names the leaf of the branch on screen. Editing a message or regenerating a reply
adds a sibling and moves the head; the old branch stays, reachable with ``switch_branch``.
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
    head_id: int | None = None  # the last message of the branch shown
    dropped_until: int | None = None  # this message and those before it on the branch are not sent


@dataclass(slots=True)
class StoredMessage:
    id: int
    conversation_id: int
    role: str  # "user" | "assistant"
    content: str
    created: float
    # "stop" | "length" | "abort" | "error" | "interrupted" for replies; None while one streams
    finish_reason: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # tok/s, token counts, cached tokens...
    parent_id: int | None = None
    sibling_index: int = 0  # place among the messages that share this one's parent, by age
    num_siblings: int = 1
    # a thinking model's reasoning, kept apart from ``content`` (the answer): shown folded, never
    # sent back as part of the reply ("" for user messages and for models that do not think)
    reasoning: str = ""


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


def _v3_branches(db: sqlite3.Connection) -> None:
    # Until v2 a conversation was a list: each message's parent is the one before it.
    db.execute("ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE")
    db.execute("ALTER TABLE conversations ADD COLUMN head_id INTEGER")
    db.execute("ALTER TABLE conversations ADD COLUMN dropped_until INTEGER")
    db.execute("CREATE INDEX messages_by_parent ON messages(parent_id)")
    db.execute(
        """UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p
               WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id)"""
    )
    db.execute("UPDATE conversations SET head_id = (SELECT MAX(m.id) FROM messages m WHERE m.conversation_id = conversations.id)")
    # UI state that outlives a session (theme, active tab): one row per key.
    db.execute("CREATE TABLE app_state (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


def _v4_reasoning(db: sqlite3.Connection) -> None:
    # Replies stored before this version have no separate reasoning: "" keeps them as they were.
    db.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")


_MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_v1_tables, _v2_fts, _v3_branches, _v4_reasoning]
HEAD = -1  # add_message's default parent: the conversation's current head
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
        allowed = {"title", "system_prompt", "params", "model", "tab_position", "dropped_until"}
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
        meta: dict[str, Any] | None = None, parent_id: int | None = HEAD, reasoning: str = "",
    ) -> StoredMessage:
        """Appends under ``parent_id`` (default: the head; None: a new first message) and makes
        the new message the head, in one transaction."""
        now = time.time()
        with self._tx() as db:
            if parent_id == HEAD:
                row = db.execute("SELECT head_id FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
                parent_id = row[0] if row else None
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, created, finish_reason, meta, parent_id,"
                " reasoning) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, now, finish_reason, json.dumps(meta or {}), parent_id, reasoning),
            )
            message_id = int(cur.lastrowid or 0)
            db.execute("UPDATE conversations SET updated = ?, head_id = ? WHERE id = ?",
                       (now, message_id, conversation_id))
            siblings = self._sibling_ids(conversation_id, parent_id)
        return StoredMessage(message_id, conversation_id, role, content, now, finish_reason, dict(meta or {}),
                             parent_id, siblings.index(message_id), len(siblings), reasoning)

    def update_message(
        self, message_id: int, *, content: str | None = None, finish_reason: str | None = None,
        meta: dict[str, Any] | None = None, reasoning: str | None = None,
    ) -> None:
        """Rewrites the given fields (None: unchanged) in one transaction: a streaming reply
        calls this about once a second, so a crash loses at most that much of it."""
        sets, values = [], []
        if content is not None:
            sets.append("content = ?")
            values.append(content)
        if finish_reason is not None:
            sets.append("finish_reason = ?")
            values.append(finish_reason)
        if meta is not None:
            sets.append("meta = ?")
            values.append(json.dumps(meta))
        if reasoning is not None:
            sets.append("reasoning = ?")
            values.append(reasoning)
        if not sets:
            return
        with self._tx() as db:
            db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*values, message_id))
            db.execute("UPDATE conversations SET updated = ? WHERE id = (SELECT conversation_id FROM messages"
                       " WHERE id = ?)", (time.time(), message_id))

    def delete_message(self, message_id: int) -> None:
        """Deletes a message and everything under it. A head inside that subtree moves to the
        message's parent, or for a first message to the newest other branch."""
        with self._tx() as db:
            row = db.execute("SELECT conversation_id, parent_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                return
            cid, parent = row["conversation_id"], row["parent_id"]
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
            head = db.execute("SELECT head_id FROM conversations WHERE id = ?", (cid,)).fetchone()[0]
            if head is not None and db.execute("SELECT 1 FROM messages WHERE id = ?", (head,)).fetchone():
                return
            if parent is None:
                root = db.execute("SELECT MAX(id) FROM messages WHERE conversation_id = ? AND parent_id IS NULL",
                                  (cid,)).fetchone()[0]
                parent = None if root is None else _newest_leaf(db, int(root))
            db.execute("UPDATE conversations SET head_id = ? WHERE id = ?", (parent, cid))

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        """The branch on screen: from the first message down to the head."""
        rows = self.db.execute(
            """WITH RECURSIVE path(id, depth) AS (
                   SELECT head_id, 0 FROM conversations WHERE id = ? AND head_id IS NOT NULL
                   UNION ALL
                   SELECT m.parent_id, path.depth + 1 FROM messages m JOIN path ON m.id = path.id
                   WHERE m.parent_id IS NOT NULL
               )
               SELECT m.*,
                   (SELECT COUNT(*) FROM messages s WHERE s.conversation_id = m.conversation_id
                        AND s.parent_id IS m.parent_id AND s.id < m.id) AS sibling_index,
                   (SELECT COUNT(*) FROM messages s WHERE s.conversation_id = m.conversation_id
                        AND s.parent_id IS m.parent_id) AS num_siblings
               FROM path JOIN messages m ON m.id = path.id ORDER BY path.depth DESC""",
            (conversation_id,),
        ).fetchall()
        return [_message(r) for r in rows]

    def siblings(self, message_id: int) -> list[int]:
        """Ids of the message and its alternatives (same parent), oldest first."""
        row = self.db.execute("SELECT conversation_id, parent_id FROM messages WHERE id = ?", (message_id,)).fetchone()
        return self._sibling_ids(row["conversation_id"], row["parent_id"]) if row else []

    def _sibling_ids(self, conversation_id: int, parent_id: int | None) -> list[int]:
        rows = self.db.execute(
            "SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id",
            (conversation_id, parent_id),
        ).fetchall()
        return [int(r[0]) for r in rows]

    def switch_branch(self, conversation_id: int, message_id: int) -> list[StoredMessage]:
        """Shows the branch through ``message_id``: the head becomes its newest descendant
        (newest child at each step). Returns the new branch."""
        with self._tx() as db:
            head = _newest_leaf(db, message_id)
            db.execute("UPDATE conversations SET head_id = ?, updated = ? WHERE id = ?",
                       (head, time.time(), conversation_id))
        return self.messages(conversation_id)

    def clear_conversation(self, conversation_id: int) -> None:
        """Deletes every message, every branch; the conversation and its settings stay."""
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            db.execute("UPDATE conversations SET head_id = NULL, dropped_until = NULL, updated = ? WHERE id = ?",
                       (time.time(), conversation_id))

    def mark_interrupted(self, conversation_id: int) -> int:
        """Replies left streaming (finish_reason NULL) by a process that died become
        "interrupted". Call only for a chat no reply of this process is writing to."""
        cur = self.db.execute(
            "UPDATE messages SET finish_reason = 'interrupted'"
            " WHERE conversation_id = ? AND role = 'assistant' AND finish_reason IS NULL",
            (conversation_id,),
        )
        return cur.rowcount

    def recent_prompts(self, limit: int = 200) -> list[str]:
        """What the user sent lately, in every chat, oldest first, without repeats in a row."""
        rows = self.db.execute(
            "SELECT content FROM messages WHERE role = 'user' ORDER BY id DESC LIMIT ?", (limit,)
        ).fetchall()
        out: list[str] = []
        for (content,) in reversed(rows):
            if not out or out[-1] != content:
                out.append(content)
        return out

    # ---- state of the app between sessions ----

    def get_state(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM app_state WHERE key = ?", (key,)).fetchone()
        return str(row[0]) if row else None

    def set_state(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO app_state (key, value) VALUES (?, ?)"
                        " ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))

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
            suffix = {"abort": " *(stopped)*", "interrupted": " *(interrupted)*", None: " *(interrupted)*"}.get(
                m.finish_reason, "") if m.role == "assistant" else ""
            lines += [f"## {who}{suffix}", ""]
            if m.reasoning:  # folded, as the chat shows it
                lines += ["<details><summary>Thinking</summary>", "", m.reasoning, "", "</details>", ""]
            lines += [m.content, ""]
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


def _newest_leaf(db: sqlite3.Connection, message_id: int) -> int:
    """Follows the newest child down from ``message_id`` to a leaf."""
    head = message_id
    while (child := db.execute("SELECT MAX(id) FROM messages WHERE parent_id = ?", (head,)).fetchone()[0]) is not None:
        head = int(child)
    return head


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
        head_id=row["head_id"], dropped_until=row["dropped_until"],
    )


def _message(row: sqlite3.Row) -> StoredMessage:
    try:
        meta = json.loads(row["meta"] or "{}")
    except json.JSONDecodeError:
        meta = {}
    keys = row.keys()
    return StoredMessage(row["id"], row["conversation_id"], row["role"], row["content"], row["created"],
                         row["finish_reason"], meta, row["parent_id"],
                         row["sibling_index"] if "sibling_index" in keys else 0,
                         row["num_siblings"] if "num_siblings" in keys else 1,
                         row["reasoning"] if "reasoning" in keys else "")
