"""The Responses API's store: round trips, deletion, its age, size and count bounds, rows found
only by their owner, and a store from before owners were kept."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import closing

import attrs
import pytest

from mlxr_plugins.apis.openai.store import ResponseStore, Stored


def item(n: int, text: str = "hi") -> Stored:
    return Stored(
        f"resp_{n}", "tiny", {"id": f"resp_{n}", "output_text": text},
        [{"type": "message", "role": "user", "content": text}],
        [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}],
    )  # fmt: skip


def test_a_response_round_trips_and_survives_reopening(tmp_path):
    path = tmp_path / "data" / "responses.sqlite3"
    store = ResponseStore(path)
    store.put(item(1, "héllo 👋"))
    store.close()
    again = ResponseStore(path)
    assert again.get("resp_1") == item(1, "héllo 👋")
    assert again.get("resp_2") is None
    assert again.delete("resp_1") and not again.delete("resp_1")
    assert again.get("resp_1") is None


def test_the_oldest_go_first_past_the_count_and_size_bounds(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3", max_items=3)
    for n in range(5):
        store.put(item(n))
    assert [n for n in range(5) if store.get(f"resp_{n}")] == [2, 3, 4]
    one = store.stats()[1] // 3
    small = ResponseStore(":memory:", max_bytes=one * 2 + one // 2)
    for n in range(4):
        small.put(item(n))
    rows, size = small.stats()
    assert rows == 2 and size <= small.max_bytes
    assert small.get("resp_3") and small.get("resp_2") and not small.get("resp_1")
    small.put(item(9, "x" * (small.max_bytes + 1)))  # larger than the whole store: not kept
    assert small.get("resp_9") is None and small.stats()[0] == 2


def test_expired_responses_are_gone(monkeypatch: pytest.MonkeyPatch):
    import mlxr_plugins.apis.openai.store as module

    now = [1000.0]
    monkeypatch.setattr(module.time, "time", lambda: now[0])
    store = ResponseStore(":memory:", max_age_s=60)
    store.put(item(1))
    now[0] += 59
    assert store.get("resp_1")
    now[0] += 2
    assert store.get("resp_1") is None


def test_threads_share_one_store(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3")

    def work(base: int) -> None:
        for n in range(base, base + 50):
            store.put(item(n))
            assert store.get(f"resp_{n}") is not None

    threads = [threading.Thread(target=work, args=(i * 100,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.stats()[0] == 200


def test_a_response_is_found_only_by_its_owner(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3")
    mine = attrs.evolve(item(1), owner="alice")
    store.put(mine)
    store.put(item(2))  # made on a server without keys
    assert store.get("resp_1", "alice") == mine
    assert store.get("resp_1", "bob") is None and store.get("resp_1") is None
    assert store.get("resp_2") == item(2) and store.get("resp_2", "alice") is None
    assert not store.delete("resp_1", "bob") and not store.delete("resp_1")
    assert store.delete("resp_1", "alice") and store.get("resp_1", "alice") is None


def test_a_store_written_before_owners_gains_the_column_and_keeps_its_rows(tmp_path):
    path = tmp_path / "r.sqlite3"
    with closing(sqlite3.connect(path)) as db, db:  # the schema as it was
        db.executescript("""
            CREATE TABLE responses (id TEXT PRIMARY KEY, created REAL NOT NULL, model TEXT NOT NULL,
                response TEXT NOT NULL, input_items TEXT NOT NULL, messages TEXT NOT NULL, size INTEGER NOT NULL);
            CREATE INDEX responses_created ON responses (created);
        """)
        old = item(1)
        row = [json.dumps(value) for value in (old.response, old.input_items, old.messages)]
        db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)", ("resp_1", time.time(), "tiny", *row, 10))
    store = ResponseStore(path)
    assert store.get("resp_1") == old  # as before, on a server without keys
    assert store.get("resp_1", "alice") is None  # no key owns what was kept before owners
    store.put(attrs.evolve(item(2), owner="alice"))
    store.close()
    again = ResponseStore(path)  # opening it again finds the column there
    assert again.get("resp_2", "alice") is not None and again.get("resp_1") == old
