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

The index is not trusted: a row must name a file this store writes (:data:`ENTRY_NAME`, directly
in the folder) with a plausible size, else it is dropped at start and its file never touched
outside the folder. A file is opened without following a symlink, and its size must be what its
header and its row's ``nbytes`` give before any of it is read; whatever goes wrong while an entry
loads quarantines it, and the request goes on without it.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import queue
import re
import sqlite3
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import attrs
import mlx.core as mx
import numpy as np
import safetensors

if TYPE_CHECKING:
    from mlxr_core.model.loader import LoadedModel

log = logging.getLogger(__name__)

INDEX = "index.sqlite3"
QUARANTINE = "quarantine"
#: The names :meth:`DiskPrefixStore._write` gives entry files; an index row naming anything else is
#: not ours.
ENTRY_NAME = re.compile(r"[0-9a-f]{32}\.safetensors")
#: safetensors' own bound on a file's header (ours are a few KB).
MAX_HEADER = 100 * 2**20
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


class UnfitEntry(Exception):
    """An entry file that disagrees with its index row (the message says how)."""


class DiskPrefixStore:
    """One model's entries in a prefix-cache folder (folders may be shared by models and
    processes; ``max_bytes`` bounds the whole folder)."""

    def __init__(self, folder: str | Path, max_bytes: int, identity: str, *, queue_size: int = 4):
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.identity = identity
        self.counters = DiskCounters()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._root = self.folder.resolve()
        self._lock = threading.Lock()
        self._entries: dict[str, DiskEntry] = {}
        with self._connect() as db:
            db.executescript(SCHEMA)
            self._scan(db)
        self.counters.nbytes = sum(entry.nbytes for entry in self._entries.values())
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(queue_size)
        self._writer = threading.Thread(target=self._run, name="mlxr-prefix-disk", daemon=True)
        self._writer.start()

    def _scan(self, db: sqlite3.Connection) -> None:
        """Take this model's entries from the index, dropping every row (any model's) that is not
        one this store could have written, and this model's rows whose file is gone or unfit."""
        dropped = 0
        rows = db.execute("SELECT rowid, file, identity, tokens, nbytes, sha256 FROM entries").fetchall()
        for rowid, file, identity, tokens, nbytes, sha256 in rows:
            entry = self._entry(file, tokens, nbytes, sha256)
            if entry is None:
                dropped += 1
                db.execute("DELETE FROM entries WHERE rowid = ?", (rowid,))
                if self._path(file) is not None:
                    self._set_aside(file)
                continue
            if identity != self.identity:
                continue
            try:
                with self._open(entry):
                    pass
            except FileNotFoundError:  # removed by hand, or quarantined before its row went
                db.execute("DELETE FROM entries WHERE rowid = ?", (rowid,))
                continue
            except Exception as exc:
                self.quarantine(entry, str(exc), forget=False)
                db.execute("DELETE FROM entries WHERE rowid = ?", (rowid,))
                continue
            self._entries[entry.file] = entry
        if dropped:
            log.warning("prefix cache: dropped %d index row(s) in %s that name no entry file of this cache "
                        "or give an impossible size", dropped, self.folder)  # fmt: skip

    def _entry(self, file: object, tokens: object, nbytes: object, sha256: object) -> DiskEntry | None:
        """The row as an entry, or None where it is not one this store writes: a name of
        :data:`ENTRY_NAME`, whole int64 token ids, a size within ``max_bytes`` and a hex digest."""
        path = self._path(file)
        if path is None or not isinstance(tokens, bytes) or len(tokens) % 8:
            return None
        if not isinstance(nbytes, int) or not 0 < nbytes <= self.max_bytes:
            return None
        if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
            return None
        return DiskEntry(path.name, np.frombuffer(tokens, dtype=np.int64), nbytes, sha256)

    def _path(self, file: object) -> Path | None:
        """``file``'s path in the folder, or None where it is no name this store writes. The path
        itself is not resolved: a symlink in its place is refused on reading, and moved or
        removed as the link it is, never followed."""
        if not isinstance(file, str) or not ENTRY_NAME.fullmatch(file):
            return None
        path = self._root / file
        return path if Path(os.path.normpath(path)).parent == self._root else None

    def _open(self, entry: DiskEntry) -> BinaryIO:
        """The entry's file, opened without following a symlink (nor waiting on a FIFO), checked
        to be a regular file of the size its safetensors header and ``nbytes`` give; raises
        :class:`UnfitEntry` (or the ``OSError``) otherwise. Positioned at its start."""
        path = self._path(entry.file)
        if path is None:
            raise UnfitEntry("is not an entry file name")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnfitEntry("is a symlink (never followed)") from exc
            raise
        handle = os.fdopen(fd, "rb")
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise UnfitEntry("is not a regular file")
            size = status.st_size
            header = int.from_bytes(handle.read(8), "little")
            if not 0 < header <= MAX_HEADER or size != 8 + header + entry.nbytes:
                raise UnfitEntry(f"has {size} bytes where its header and index row give "
                                 f"{8 + header + entry.nbytes} (its size disagrees with its index)")  # fmt: skip
            handle.seek(0)
        except BaseException:
            handle.close()
            raise
        return handle

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
        fails its check or fails to load for any reason (then quarantined)."""
        try:
            with self._open(entry) as handle:
                data = handle.read()
        except FileNotFoundError:
            self._forget(entry.file)
            return None
        except UnfitEntry as exc:
            self.quarantine(entry, str(exc))
            return None
        except Exception as exc:  # MemoryError included: never a failed request, never again
            self.quarantine(entry, f"cannot be read: {exc!r}")
            return None
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            self.quarantine(entry, "does not match its checksum (corrupt or truncated)")
            return None
        try:  # from the bytes checked, not the path again (which may have changed meanwhile)
            loaded: Any = mx.load(io.BytesIO(data), format="safetensors", return_metadata=True)
            arrays: dict[str, mx.array] = loaded[0]
            metadata: dict[str, str] = loaded[1]
            layers: list[list[mx.array]] = [[] for _ in range(int(metadata["layers"]))]
            for name in sorted(arrays, key=lambda name: tuple(map(int, name.split(".")))):
                layers[int(name.split(".")[0])].append(arrays[name])
            mx.eval(list(arrays.values()))
        except Exception as exc:  # passed the hash but is no entry of ours: never serve it
            self.quarantine(entry, f"cannot be loaded: {exc}")
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

    def quarantine(self, entry: DiskEntry, why: str, *, forget: bool = True) -> None:
        """Set ``entry`` aside (its file moved to ``quarantine/``; with ``forget``, its row dropped
        by the writer) and log ``why``: it is never served again."""
        log.warning("prefix cache: entry %s %s; moved to %s", entry.file, why, QUARANTINE)
        self.counters.quarantined += 1
        self._set_aside(entry.file)
        if forget:
            self._forget(entry.file)

    def _set_aside(self, file: str) -> None:
        """Move ``file`` (a symlink as itself) into ``quarantine/``, else remove it."""
        path = self._path(file)
        if path is None:
            return
        aside = self._root / QUARANTINE
        try:
            aside.mkdir(exist_ok=True)
            if aside.is_symlink() or not aside.is_dir():
                raise NotADirectoryError(aside)
            os.replace(path, aside / file)
        except OSError:
            with suppress(OSError):
                path.unlink(missing_ok=True)

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
        path = self._path(file)  # a row naming anything else loses only itself
        if path is not None:
            path.unlink(missing_ok=True)
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
