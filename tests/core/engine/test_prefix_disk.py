"""The prefix cache's disk tier (``engine.prefix_cache.disk``): evicted entries are found again
by a new process, a damaged file is quarantined and never served, another model never reads the
entries, the folder stays under its bound (least recently used out first), and the engine never
waits for the writer."""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
import threading
from contextlib import closing

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import (
    Config,
    EngineConfig,
    KVCacheConfig,
    ModelConfig,
    PrefixCacheConfig,
    PrefixDiskConfig,
)
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.prefix_cache import PrefixCache
from mlxr_core.engine.prefix_disk import INDEX, QUARANTINE, DiskPrefixStore
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
from mlxr_core.model.cache import KVCache
from mlxr_core.plugins import load_plugins

LAYERS, HEADS, HEAD_DIM = 2, 2, 8
#: One entry of 40 positions: 2 layers x (keys + values) x 2 heads x 40 x 8 float32.
ENTRY_BYTES = LAYERS * 2 * HEADS * 40 * HEAD_DIM * 4


def tokens(seed: int, n: int = 40) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 3 for i in range(n)]


def caches_for(seed: int, n: int = 40) -> list[KVCache]:
    shape = (1, HEADS, n, HEAD_DIM)
    return [
        KVCache.from_arrays(mx.full(shape, seed + layer, dtype=mx.float32), mx.full(shape, -seed - layer, dtype=mx.float32))
        for layer in range(LAYERS)
    ]


def make_cache() -> list[KVCache]:
    return [KVCache() for _ in range(LAYERS)]


def lookup(cache: PrefixCache, prompt: list[int]) -> tuple[int, list[KVCache] | None]:
    return cache.lookup(prompt, limit=len(prompt), make_cache=make_cache)


def open_store(folder, max_bytes=10 * ENTRY_BYTES, identity="model-a", **kwargs) -> DiskPrefixStore:
    return DiskPrefixStore(folder, max_bytes, identity, **kwargs)


def test_an_evicted_entry_is_found_by_a_new_instance(tmp_path):
    first = PrefixCache(ENTRY_BYTES, open_store(tmp_path))
    assert first.store(tokens(1), caches_for(1))
    assert first.store(tokens(2), caches_for(2))  # evicts (spills) the first
    assert first.disk is not None
    first.disk.flush()
    assert first.stats.disk_writes == 1 and first.stats.disk_bytes == ENTRY_BYTES
    first.close()  # writes the second too

    restarted = PrefixCache(ENTRY_BYTES, open_store(tmp_path))
    reused, caches = lookup(restarted, [*tokens(1), 9, 9, 9])
    assert reused == 40 and caches is not None
    assert restarted.stats.disk_hits == 1
    assert mx.array_equal(caches[1].keys[..., :40, :], mx.full((1, HEADS, 40, HEAD_DIM), 2.0))
    reused, _ = lookup(restarted, tokens(2)[:30] + [1] * 10)
    assert reused == 30 and restarted.stats.disk_hits == 2
    reused, _ = lookup(restarted, tokens(2)[:30] + [1] * 10)  # now in memory
    assert reused == 30 and restarted.stats.disk_hits == 2 and restarted.stats.hits == 3
    restarted.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_entry_is_quarantined_and_never_served(tmp_path, caplog, damage):
    cache = PrefixCache(ENTRY_BYTES, open_store(tmp_path))
    cache.store(tokens(1), caches_for(1))
    cache.close()
    [file] = tmp_path.glob("*.safetensors")
    data = bytearray(file.read_bytes())
    if damage == "flip":
        data[-100:-90] = bytes(b ^ 0xFF for b in data[-100:-90])
    else:
        data = data[: len(data) // 2]
    file.write_bytes(bytes(data))

    restarted = PrefixCache(ENTRY_BYTES, open_store(tmp_path))
    with caplog.at_level(logging.WARNING, logger="mlxr_core.engine.prefix_disk"):
        assert lookup(restarted, [*tokens(1), 5]) == (0, None)
    assert file.name in caplog.text
    assert ("checksum" if damage == "flip" else "size disagrees with its index") in caplog.text
    assert not file.exists() and (tmp_path / QUARANTINE / file.name).exists()
    assert restarted.stats.disk_quarantined == 1 and restarted.stats.disk_hits == 0
    restarted.close()
    assert len(open_store(tmp_path)) == 0  # its index row is gone


def test_a_row_whose_file_is_gone_is_dropped_and_a_hand_written_file_is_ignored(tmp_path):
    cache = PrefixCache(ENTRY_BYTES, open_store(tmp_path))
    cache.store(tokens(1), caches_for(1))
    cache.close()
    [file] = tmp_path.glob("*.safetensors")
    file.unlink()
    (tmp_path / "stray.safetensors").write_bytes(b"not ours")
    store = open_store(tmp_path)
    assert len(store) == 0
    assert lookup(PrefixCache(ENTRY_BYTES, store), [*tokens(1), 5]) == (0, None)
    store.close()


def test_another_identity_never_reads_the_entries(tmp_path):
    cache = PrefixCache(ENTRY_BYTES, open_store(tmp_path, identity="model-a"))
    cache.store(tokens(1), caches_for(1))
    cache.close()
    other = PrefixCache(ENTRY_BYTES, open_store(tmp_path, identity="model-b"))
    assert lookup(other, [*tokens(1), 5]) == (0, None)
    assert other.disk is not None and len(other.disk) == 0
    other.close()
    assert (tmp_path / INDEX).exists() and len(open_store(tmp_path, identity="model-a")) == 1


def test_the_folder_stays_under_its_bound_least_recently_used_out_first(tmp_path):
    store = open_store(tmp_path, max_bytes=2 * ENTRY_BYTES + 100)
    first, second, third = (np.array(tokens(seed), dtype=np.int64) for seed in (1, 2, 3))
    assert store.put(first, [c.snapshot() for c in caches_for(1)], block=True)
    assert store.put(second, [c.snapshot() for c in caches_for(2)], block=True)
    store.flush()
    by_tokens = {tuple(entry.tokens): entry for entry in store.entries()}
    assert store.load(by_tokens[tuple(first)]) is not None  # the first is now the more recent
    store.flush()
    assert store.put(third, [c.snapshot() for c in caches_for(3)], block=True)
    store.flush()
    kept = {tuple(entry.tokens) for entry in store.entries()}
    assert kept == {tuple(first), tuple(third)}
    assert store.counters.evictions == 1 and store.counters.nbytes == 2 * ENTRY_BYTES
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    store.close()


def test_an_entry_larger_than_the_folder_is_dropped(tmp_path):
    store = open_store(tmp_path, max_bytes=ENTRY_BYTES - 1)
    assert not store.put(np.array(tokens(1)), [c.snapshot() for c in caches_for(1)])
    assert store.counters.drops == 1
    store.close()


def test_a_full_queue_drops_and_counts_instead_of_waiting(tmp_path, monkeypatch):
    store = open_store(tmp_path, queue_size=1)
    writing, release = threading.Event(), threading.Event()
    write = store._write

    def slow_write(db, entry):
        writing.set()
        release.wait(10)
        write(db, entry)

    monkeypatch.setattr(store, "_write", slow_write)
    cache = PrefixCache(ENTRY_BYTES, store)
    cache.store(tokens(1), caches_for(1))
    cache.store(tokens(2), caches_for(2))  # spills the first, which the writer takes
    assert writing.wait(10)
    for seed in (3, 4, 5):  # three more spills: one waits in the queue, two find it full
        assert cache.store(tokens(seed), caches_for(seed))
    assert cache.stats.disk_drops == 2 and cache.stats.disk_writes == 0
    release.set()
    cache.close()
    assert cache.stats.disk_writes == 3  # the two queued, and the one memory held at close


# -- an index and files that cannot be trusted ------------------------------------------------


def written_entry(folder) -> str:
    """The file name of one entry (tokens(1)) written to ``folder``."""
    cache = PrefixCache(ENTRY_BYTES, open_store(folder))
    cache.store(tokens(1), caches_for(1))
    cache.close()
    [file] = folder.glob("*.safetensors")
    return file.name


def update_index(folder, sql: str, *params) -> None:
    with closing(sqlite3.connect(folder / INDEX)) as db, db:
        db.execute(sql, params)


def test_a_row_naming_a_file_outside_the_folder_never_deletes_it(tmp_path):
    folder = tmp_path / "cache"
    victim = tmp_path / "victim.txt"
    victim.write_text("not the cache's")
    file = written_entry(folder)
    # the row points outside and claims a size that forces an eviction at the next write
    update_index(folder, "UPDATE entries SET file = ?, nbytes = ? WHERE file = ?", "../victim.txt", 10**12, file)
    store = open_store(folder)
    assert len(store) == 0
    assert store.put(np.array(tokens(2), dtype=np.int64), [c.snapshot() for c in caches_for(2)], block=True)
    store.flush()
    assert store.counters.writes == 1 and store.counters.evictions == 0
    store.close()
    assert victim.read_text() == "not the cache's"
    with closing(sqlite3.connect(folder / INDEX)) as db:
        assert [row[0] for row in db.execute("SELECT file FROM entries")] != ["../victim.txt"]
        assert db.execute("SELECT COUNT(*) FROM entries WHERE file LIKE '%/%'").fetchone()[0] == 0


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("file", "/etc/hostname"),
        ("file", "../x.safetensors"),
        ("file", "ABCDEF0123456789ABCDEF0123456789.safetensors"),
        ("nbytes", -1),
        ("nbytes", 10**15),
        ("nbytes", "many"),
        ("tokens", b"\x01\x02\x03"),
        ("sha256", None),
    ],
)
def test_rows_that_are_no_entry_of_ours_are_dropped_at_start(tmp_path, column, value):
    file = written_entry(tmp_path)
    second = PrefixCache(ENTRY_BYTES, open_store(tmp_path))  # a good entry beside the bad one
    second.store(tokens(2), caches_for(2))
    second.close()
    if column == "sha256":  # NOT NULL in the schema: a row of another shape
        update_index(tmp_path, "UPDATE entries SET sha256 = 'zz' WHERE file = ?", file)
    else:
        update_index(tmp_path, f"UPDATE entries SET {column} = ? WHERE file = ?", value, file)
    store = open_store(tmp_path)
    assert [tuple(entry.tokens) for entry in store.entries()] == [tuple(tokens(2))]
    store.close()
    with closing(sqlite3.connect(tmp_path / INDEX)) as db:
        assert db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 1


def test_rows_of_another_model_that_are_no_entry_of_ours_are_dropped_too(tmp_path):
    file = written_entry(tmp_path)
    update_index(tmp_path, "UPDATE entries SET identity = 'model-b', file = '../victim.txt' WHERE file = ?", file)
    open_store(tmp_path).close()
    with closing(sqlite3.connect(tmp_path / INDEX)) as db:
        assert db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == 0


@pytest.fixture
def address_space_cap():
    """Cap this process's address space a little above its use, as a memory-capped server is."""
    resource = pytest.importorskip("resource")
    with open("/proc/self/status") as status:
        used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (used + 2 * 2**30, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.skipif(sys.platform != "linux", reason="caps the address space through /proc")
def test_a_huge_sparse_entry_is_quarantined_and_the_lookup_goes_on(tmp_path, caplog, address_space_cap):
    file = tmp_path / written_entry(tmp_path)
    with file.open("r+b") as handle:
        handle.truncate(20 * 2**30)  # 20 GB, sparse
    cache = PrefixCache(ENTRY_BYTES, open_store(tmp_path, max_bytes=2**40))
    with caplog.at_level(logging.WARNING, logger="mlxr_core.engine.prefix_disk"):
        assert lookup(cache, [*tokens(1), 5]) == (0, None)
    assert "size disagrees with its index" in caplog.text
    assert not file.exists() and (tmp_path / QUARANTINE / file.name).exists()
    assert cache.stats.disk_quarantined == 1
    cache.close()
    assert len(open_store(tmp_path)) == 0  # and after a restart it is not tried again


@pytest.mark.parametrize("when", ["at start", "after start"])
def test_a_symlinked_entry_is_never_followed(tmp_path, when):
    folder = tmp_path / "cache"
    file = folder / written_entry(folder)
    genuine = tmp_path / "elsewhere.safetensors"  # a copy whose hash matches its row
    genuine.write_bytes(file.read_bytes())

    def swap() -> None:
        file.unlink()
        file.symlink_to(genuine)

    if when == "at start":
        swap()
    cache = PrefixCache(ENTRY_BYTES, open_store(folder))
    if when == "after start":
        swap()
    assert lookup(cache, [*tokens(1), 5]) == (0, None)
    assert cache.stats.disk_hits == 0 and cache.stats.disk_quarantined == 1
    assert genuine.exists() and (folder / QUARANTINE / file.name).is_symlink()
    cache.close()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_in_an_entrys_place_does_not_hold_the_lookup(tmp_path):
    file = tmp_path / written_entry(tmp_path)
    cache = PrefixCache(ENTRY_BYTES, open_store(tmp_path))
    file.unlink()
    os.mkfifo(file)
    result: list[object] = []
    looking = threading.Thread(target=lambda: result.append(lookup(cache, [*tokens(1), 5])), daemon=True)
    looking.start()
    looking.join(10)
    if looking.is_alive():  # let the blocked reader go before failing
        os.close(os.open(file, os.O_WRONLY | os.O_NONBLOCK))
        looking.join(10)
        pytest.fail("the lookup waited on a FIFO")
    assert result == [(0, None)] and cache.stats.disk_quarantined == 1
    cache.close()


def test_an_entry_that_does_not_fit_the_models_caches_is_quarantined(tmp_path):
    store = open_store(tmp_path)
    three_layers = [*caches_for(1), *caches_for(1)[:1]]
    assert store.put(np.array(tokens(1), dtype=np.int64), [c.snapshot() for c in three_layers], block=True)
    store.close()
    cache = PrefixCache(ENTRY_BYTES, open_store(tmp_path, max_bytes=20 * ENTRY_BYTES))
    assert cache.store(tokens(1)[:30], caches_for(7, 30))  # a shorter match in memory still serves
    reused, caches = lookup(cache, [*tokens(1), 5])
    assert reused == 30 and caches is not None
    assert mx.array_equal(caches[0].keys[..., :30, :], mx.full((1, HEADS, 30, HEAD_DIM), 7.0))
    assert cache.stats.disk_quarantined == 1 and cache.stats.disk_hits == 0
    cache.close()


# -- the engine, restarted ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", hidden=128, heads=4, kv_heads=2)


PREFIX = [(i * 13) % 250 + 3 for i in range(60)]


def run_engine(tiny_path, folder, prompt, *, dtype="float32", kv_cache=None, enabled=True):
    """(greedy tokens of ``prompt``, the prefix cache's stats) from a fresh engine."""
    prefix_cache = PrefixCacheConfig(
        enabled=enabled, disk=PrefixDiskConfig(path=str(folder), max_bytes=2**26) if enabled else None
    )
    model = ModelConfig(path=str(tiny_path), name="tiny", context_length=256, dtype=dtype, kv_cache=kv_cache)
    eng = Engine(Config(models=[model], engine=EngineConfig(prefix_cache=prefix_cache)), load_plugins())
    eng.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, extra={"ignore_eos": True})
        events = list(eng.submit(GenerationRequest(model="tiny", prompt_ids=prompt, params=params)))
        assert isinstance(events[-1], Finished), events[-1]
        stats = eng.stats()["prefix_cache"].get("tiny", {})
    finally:
        eng.stop()
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids], stats


@pytest.mark.parametrize(
    "kv_cache", [None, KVCacheConfig(method="turboquant", bits=3, window=4)], ids=["full", "turboquant"]
)
def test_a_restarted_engine_answers_from_the_disk_tier_as_a_cold_one_does(tiny_path, tmp_path, kv_cache):
    run_engine(tiny_path, tmp_path, [*PREFIX, 7, 8, 9], kv_cache=kv_cache)  # its entry reaches disk at shutdown
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    prompt = [*PREFIX, 200, 201]
    warm, stats = run_engine(tiny_path, tmp_path, prompt, kv_cache=kv_cache)
    assert stats["disk_hits"] == 1 and stats["reused_tokens"] == len(PREFIX)
    cold, _ = run_engine(tiny_path, tmp_path, prompt, enabled=False, kv_cache=kv_cache)
    assert warm == cold


@pytest.mark.parametrize(
    ("dtype", "kv_cache"), [("float16", None), ("float32", KVCacheConfig(bits=8, group_size=32))], ids=["dtype", "kv_cache"]
)
def test_a_model_loaded_otherwise_never_reads_the_entries(tiny_path, tmp_path, dtype, kv_cache):
    run_engine(tiny_path, tmp_path, [*PREFIX, 7, 8, 9])
    _, stats = run_engine(tiny_path, tmp_path, [*PREFIX, 200, 201], dtype=dtype, kv_cache=kv_cache)
    assert stats["disk_hits"] == 0 and stats["hits"] == 0 and stats["disk_quarantined"] == 0
    # Both models' entries share the folder; the first model still finds its own.
    _, stats = run_engine(tiny_path, tmp_path, [*PREFIX, 200, 201])
    assert stats["disk_hits"] == 1
