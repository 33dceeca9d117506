"""The Responses API's store: round trips, deletion, and its age, size and count bounds."""

from __future__ import annotations

import threading

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
