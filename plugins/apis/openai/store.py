"""Stored responses for the Responses API (``store: true``, ``previous_response_id``,
``GET``/``DELETE /v1/responses/{id}``, ``input_items``): one SQLite file, bounded.

Each row keeps a response's JSON, its input items and the whole conversation it continued (the
chat messages a follow-up turn renders before its own input), and its owner: the
:func:`~mlxr_core.http.access.owner_id` of the API key that made it (NULL on a server without
keys). A row is found only by its owner, as if absent to any other; rows from before owners were
kept have none, so on a server with keys no key finds them. Writes evict the oldest rows past
``max_age_s`` and, oldest first, past ``max_bytes`` of stored JSON or ``max_items`` rows, so the
file cannot grow without bound. A connection serves one thread at a time (a lock); handlers call
it from worker threads.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import attrs

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    model TEXT NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    messages TEXT NOT NULL,
    size INTEGER NOT NULL,
    owner TEXT
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


@attrs.frozen
class Stored:
    """A stored response: its JSON object, its input items, and the chat messages of the whole
    conversation up to and including its own output (what a follow-up turn continues)."""

    id: str
    model: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    #: The API key's owner id it belongs to; None on a server without keys.
    owner: str | None = None


class ResponseStore:
    """Responses by id in the SQLite file ``path`` (``":memory:"`` for none on disk)."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_bytes: int = 256 * 2**20,
        max_age_s: float = 30 * 86400,
        max_items: int = 10_000,
    ) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self.max_bytes, self.max_age_s, self.max_items = max_bytes, max_age_s, max_items
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        self._add_owner_column()

    def _add_owner_column(self) -> None:
        """Give a store written before owners were kept its ``owner`` column (its rows: none)."""
        with self._lock:
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
            if "owner" in columns:
                return
            try:
                self._db.execute("ALTER TABLE responses ADD COLUMN owner TEXT")
            except sqlite3.OperationalError as exc:  # another process added it meanwhile
                if "duplicate column" not in str(exc):
                    raise

    def put(self, item: Stored) -> None:
        """Store ``item`` (replacing one of its id), then evict past the limits. An item larger
        than ``max_bytes`` by itself is not kept."""
        row = [json.dumps(value, ensure_ascii=False) for value in (item.response, item.input_items, item.messages)]
        size = sum(len(text.encode()) for text in row)
        if size > self.max_bytes:
            return
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses (id, created, model, response, input_items, messages, size, owner)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (item.id, time.time(), item.model, *row, size, item.owner),
            )
            self._evict()

    def get(self, response_id: str, owner: str | None = None) -> Stored | None:
        """The stored response ``response_id`` of ``owner``, or None (never stored, deleted,
        evicted, or another owner's)."""
        with self._lock:
            self._expire()
            found = self._db.execute(
                "SELECT id, model, response, input_items, messages FROM responses WHERE id = ? AND owner IS ?",
                (response_id, owner),
            ).fetchone()
        if found is None:
            return None
        rid, model, response, items, messages = found
        return Stored(rid, model, json.loads(response), json.loads(items), json.loads(messages), owner)

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Forget ``response_id`` of ``owner``; whether it was there (another owner's is not)."""
        with self._lock:
            deleted = self._db.execute("DELETE FROM responses WHERE id = ? AND owner IS ?", (response_id, owner))
            return deleted.rowcount > 0

    def stats(self) -> tuple[int, int]:
        """``(rows, bytes of stored JSON)``."""
        with self._lock:
            rows, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        return int(rows), int(size)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _expire(self) -> None:
        self._db.execute("DELETE FROM responses WHERE created < ?", (time.time() - self.max_age_s,))

    def _evict(self) -> None:
        self._expire()
        rows, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        if rows <= self.max_items and size <= self.max_bytes:
            return
        drop_rows, drop_bytes = max(0, rows - self.max_items), max(0, size - self.max_bytes)
        dropped: list[str] = []
        for rid, row_size in self._db.execute("SELECT id, size FROM responses ORDER BY created, rowid"):
            if drop_rows <= 0 and drop_bytes <= 0:
                break
            dropped.append(rid)
            drop_rows, drop_bytes = drop_rows - 1, drop_bytes - row_size
        self._db.executemany("DELETE FROM responses WHERE id = ?", [(rid,) for rid in dropped])
