"""The prefix cache's disk tier (``engine.prefix_cache.disk``): entries survive eviction and restarts.

An entry the memory tier evicts (or still holds at shutdown) becomes one safetensors file under
``path`` (``{layer}.{index}`` -> that layer's snapshot arrays), listed in a SQLite index
(``index.sqlite3``) with its token ids, size, SHA-256 and last use. A later process with the same
model finds it by token prefix. Rows carry the model's identity (:func:`model_identity`: its
weights files, dtype, quantization and KV cache setting), so another model never reads them.

Only the engine thread runs MLX: it copies an evicted entry's arrays to host memory and puts them
on a bounded queue (an entry that finds the queue full is dropped and counted, the engine never
waits on the disk); a writer thread writes the file (to a temporary name, then renamed, so a
crash leaves no half file under an indexed name), records the row and evicts the least recently
used entries past ``max_bytes``. Reading happens on the engine thread at lookup: the file's hash
is checked before ``mx.load``; a corrupt, truncated or unreadable file is moved to
``quarantine/``, its row removed, and logged, never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import numpy as np
import safetensors

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel

log = logging.getLogger(__name__)

INDEX = "index.sqlite3"
QUARANTINE = "quarantine"
#: Bytes read from each end of a weights file for :func:`model_identity` (a full hash of GBs of
#: weights would cost seconds at every start).
SAMPLE_BYTES = 2**20
SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    file TEXT PRIMARY KEY,
    identity TEXT NOT NULL,
    tokens BLOB NOT NULL,
    nbytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_used ON entries (used);
CREATE INDEX IF NOT EXISTS entries_identity ON entries (identity);
"""


@attrs.define
class DiskEntry:
    file: str
    tokens: np.ndarray
    nbytes: int
    sha256: str


@attrs.define
class DiskCounters:
    """The disk tier's tallies, copied into :class:`~mlxr_core.engine.prefix_cache.PrefixStats`."""

    writes: int = 0
    #: Entries not written: the queue was full, or the entry alone exceeds ``max_bytes``.
    drops: int = 0
    quarantined: int = 0
    evictions: int = 0
    #: Bytes of this model's entries on disk.
    nbytes: int = 0


@attrs.define
class _Write:
    tokens: np.ndarray
    #: Per layer, per array: (safetensors dtype name, host copy).
    layers: list[list[tuple[str, np.ndarray]]]
    nbytes: int


def model_identity(model: LoadedModel) -> str:
    """A hash of what makes one model's KV state differ from another's: its weights files (name,
    size, modification time and a hash of each file's first and last MiB), format, architecture,
    the dtype and shape of every parameter as loaded (which quantization and the dtype decide) and
    the KV cache setting."""
    path = Path(model.path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(SAMPLE_BYTES))
            if stat.st_size > 2 * SAMPLE_BYTES:
                handle.seek(-SAMPLE_BYTES, os.SEEK_END)
                digest.update(handle.read(SAMPLE_BYTES))
    from mlx.utils import tree_flatten

    flat: list[tuple[str, mx.array]] = tree_flatten(model.model.parameters())  # type: ignore[assignment]
    parameters = [(name, tuple(array.shape), str(array.dtype)) for name, array in flat]
    kv_cache = attrs.asdict(model.kv_cache) if model.kv_cache is not None else None
    described = [model.format, type(model.arch).__name__, model.dtype, parameters, kv_cache]
    digest.update(json.dumps(described, default=str).encode())
    return digest.hexdigest()


class DiskPrefixStore:
    """One model's entries in a prefix-cache folder (folders may be shared by models and
    processes; ``max_bytes`` bounds the whole folder)."""

    def __init__(self, folder: str | Path, max_bytes: int, identity: str, *, queue_size: int = 4):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.identity = identity
        self.counters = DiskCounters()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: dict[str, DiskEntry] = {}
        with self._connect() as db:
            db.executescript(SCHEMA)
            rows = db.execute(
                "SELECT file, tokens, nbytes, sha256 FROM entries WHERE identity = ?", (identity,)
            ).fetchall()
            for file, tokens, nbytes, sha256 in rows:
                if not (self.folder / file).is_file():  # removed by hand, or quarantined before its row went
                    db.execute("DELETE FROM entries WHERE file = ?", (file,))
                    continue
                self._entries[file] = DiskEntry(file, np.frombuffer(tokens, dtype=np.int64), nbytes, sha256)
        self.counters.nbytes = sum(entry.nbytes for entry in self._entries.values())
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(queue_size)
        self._writer = threading.Thread(target=self._run, name="mlxr-prefix-disk", daemon=True)
        self._writer.start()

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.folder / INDEX, timeout=30.0)) as db, db:
            yield db

    def entries(self) -> list[DiskEntry]:
        with self._lock:
            return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    # -- engine thread ------------------------------------------------------------------------

    def put(self, tokens: np.ndarray, layers: list[tuple[mx.array, ...]], *, block: bool = False) -> bool:
        """Queue an entry for writing (host copies of its arrays are made here, on the MLX thread);
        False, counted in ``drops``, where the queue is full (``block``: wait instead) or the
        entry alone exceeds ``max_bytes``."""
        nbytes = sum(array.nbytes for layer in layers for array in layer)
        if nbytes > self.max_bytes:
            self.counters.drops += 1
            return False
        write = _Write(np.array(tokens, dtype=np.int64), [[_host(a) for a in layer] for layer in layers], nbytes)
        try:
            self._queue.put(("write", write), block=block)
        except queue.Full:
            self.counters.drops += 1
            return False
        return True

    def touch(self, file: str) -> None:
        """Mark an entry used (for the LRU order); skipped where the queue is full."""
        with suppress(queue.Full):
            self._queue.put_nowait(("touch", (file, time.time())))

    def load(self, entry: DiskEntry) -> list[tuple[mx.array, ...]] | None:
        """The entry's per-layer arrays, or None where its file is gone (evicted meanwhile) or
        fails its check (then quarantined)."""
        path = self.folder / entry.file
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(entry.file)
            return None
        except OSError as exc:
            self._quarantine(entry, f"cannot be read: {exc}")
            return None
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            self._quarantine(entry, "does not match its checksum (corrupt or truncated)")
            return None
        try:
            loaded: Any = mx.load(str(path), format="safetensors", return_metadata=True)
            arrays: dict[str, mx.array] = loaded[0]
            metadata: dict[str, str] = loaded[1]
            layers: list[list[mx.array]] = [[] for _ in range(int(metadata["layers"]))]
            for name in sorted(arrays, key=lambda name: tuple(map(int, name.split(".")))):
                layers[int(name.split(".")[0])].append(arrays[name])
            mx.eval(list(arrays.values()))
        except Exception as exc:  # passed the hash but is no entry of ours: never serve it
            self._quarantine(entry, f"cannot be loaded: {exc}")
            return None
        self.touch(entry.file)
        return [tuple(layer) for layer in layers]

    def _forget(self, file: str) -> None:
        with self._lock:
            entry = self._entries.pop(file, None)
            if entry is not None:
                self.counters.nbytes -= entry.nbytes
        with suppress(queue.Full):  # else the row of a missing file is dropped at the next start
            self._queue.put_nowait(("forget", file))

    def _quarantine(self, entry: DiskEntry, why: str) -> None:
        log.warning("prefix cache: entry %s %s; moved to %s", entry.file, why, QUARANTINE)
        self.counters.quarantined += 1
        aside = self.folder / QUARANTINE
        try:
            aside.mkdir(exist_ok=True)
            os.replace(self.folder / entry.file, aside / entry.file)
        except OSError:
            (self.folder / entry.file).unlink(missing_ok=True)
        self._forget(entry.file)

    def flush(self) -> None:
        """Wait until everything queued is written (tests, benchmarks; not the engine's path)."""
        self._queue.join()

    def close(self, timeout: float = 60.0) -> None:
        """Write what is queued, then stop the writer."""
        self._queue.put(None)
        self._writer.join(timeout)

    # -- writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        with self._connect() as db:
            while (item := self._queue.get()) is not None:
                kind, payload = item
                try:
                    if kind == "write":
                        self._write(db, payload)
                    elif kind == "touch":
                        db.execute("UPDATE entries SET used = ? WHERE file = ?", (payload[1], payload[0]))
                    else:
                        db.execute("DELETE FROM entries WHERE file = ?", (payload,))
                    db.commit()
                except Exception:  # a full disk, say: the memory tier goes on serving
                    log.exception("prefix cache: the disk tier failed to %s an entry", kind)
                    db.rollback()
                finally:
                    self._queue.task_done()

    def _write(self, db: sqlite3.Connection, write: _Write) -> None:
        file = f"{uuid.uuid4().hex}.safetensors"
        temporary = self.folder / f".{file}.partial"
        specs = {
            f"{i}.{j}": safetensors.TensorSpec(
                dtype=dtype, shape=list(host.shape), data_ptr=host.ctypes.data, data_len=host.nbytes
            )
            for i, layer in enumerate(write.layers)
            for j, (dtype, host) in enumerate(layer)
        }
        try:
            safetensors.serialize_file(specs, temporary, {"layers": str(len(write.layers))})
            digest = hashlib.sha256()
            with temporary.open("rb") as handle:
                while chunk := handle.read(2**24):
                    digest.update(chunk)
                os.fsync(handle.fileno())
            sha256 = digest.hexdigest()
            os.replace(temporary, self.folder / file)
        finally:
            temporary.unlink(missing_ok=True)
        tokens = write.tokens
        # A stored prefix of this entry is redundant, as in the memory tier.
        redundant = [
            entry.file for entry in self.entries()
            if len(entry.tokens) <= len(tokens) and np.array_equal(entry.tokens, tokens[: len(entry.tokens)])
        ]
        for old in redundant:
            self._delete(db, old)
        db.execute(
            "INSERT INTO entries (file, identity, tokens, nbytes, sha256, used) VALUES (?, ?, ?, ?, ?, ?)",
            (file, self.identity, tokens.tobytes(), write.nbytes, sha256, time.time()),
        )
        with self._lock:
            self._entries[file] = DiskEntry(file, tokens, write.nbytes, sha256)
            self.counters.nbytes += write.nbytes
        self.counters.writes += 1
        total = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0]
        while total > self.max_bytes:
            oldest, nbytes = db.execute("SELECT file, nbytes FROM entries ORDER BY used LIMIT 1").fetchone()
            self._delete(db, oldest)
            self.counters.evictions += 1
            total -= nbytes

    def _delete(self, db: sqlite3.Connection, file: str) -> None:
        db.execute("DELETE FROM entries WHERE file = ?", (file,))
        (self.folder / file).unlink(missing_ok=True)
        with self._lock:
            entry = self._entries.pop(file, None)
            if entry is not None:
                self.counters.nbytes -= entry.nbytes


def _host(array: mx.array) -> tuple[str, np.ndarray]:
    """A host copy of an evaluated array and its safetensors dtype (numpy has no bfloat16: its bits
    travel as uint16)."""
    dtype = str(array.dtype).removeprefix("mlx.core.")
    if array.dtype == mx.bfloat16:
        return dtype, np.array(array.view(mx.uint16))
    return dtype, np.array(array)
