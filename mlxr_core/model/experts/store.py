"""Where a model's streamed experts come from: their places in the checkpoint files, reads on a
pool of threads (``os.preadv`` at each tensor's offset), the cache, reads ahead, and counts.

The pool's threads read and decode bytes with numpy only; MLX arrays are made on the thread that
calls :meth:`ExpertStore.fetch` (the engine's, which owns MLX). A failed read raises
:class:`~mlxr_core.errors.ExpertReadError` naming the file and tensor, logged once per file;
inside :meth:`ExpertStore.row_failures` a layer fails only the rows of the batch that routed to
the unreadable experts (the engine ends those requests and goes on with the others).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from mlxr_core.errors import ExpertReadError, MlxrError
from mlxr_core.model.checkpoint import HostPart, QuantSpec, StoredPart, StoredTensor
from mlxr_core.model.experts.cache import POLICIES, Entry, ExpertCache, ExpertKey

log = logging.getLogger(__name__)

#: Read latencies kept for the percentiles (the most recent reads).
LATENCY_WINDOW = 4096


@attrs.frozen
class ExpertSource:
    """Where one parameter of a layer's experts lies: row ``e`` of a stack of ``experts``
    (``stack``), or its own tensor per expert (``each``)."""

    experts: int
    stack: StoredPart | None = None
    each: tuple[StoredPart, ...] = ()

    def locate(self, expert: int) -> tuple[StoredTensor, int, int, tuple[int, ...], str]:
        """``(tensor, offset, nbytes, shape, part)`` of ``expert``'s bytes."""
        if self.stack is not None:
            offset, nbytes, shape = self.stack.source.row(expert, self.experts)
            return self.stack.source, offset, nbytes, shape, self.stack.part
        place = self.each[expert]
        return place.source, place.source.offset, place.source.nbytes, place.source.shape, place.part


@attrs.frozen(eq=False)
class LayerExperts:
    """One MoE layer's streamed experts: each parameter's source (``gate_proj.weight`` ...), the
    packing of each packed projection, and which of those are used dense (the
    ``models[].quantization`` policy dequantizes them), dequantized as they are read."""

    params: dict[str, ExpertSource]
    packing: dict[str, QuantSpec]
    dense: frozenset[str] = frozenset()


#: A read's result: the expert's host arrays by parameter, bytes read, seconds.
HostRead = tuple[dict[str, HostPart], int, float]


class ExpertStore:
    """A model's streamed experts (see the module). ``settings`` is ``models[].experts``;
    ``dtype`` the model's (float parts are cast to it)."""

    def __init__(self, settings: Any, dtype: mx.Dtype) -> None:
        self.settings, self.dtype = settings, dtype
        self.layers: list[LayerExperts] = []
        self.cache = ExpertCache(settings.cache_bytes, POLICIES[settings.policy]())
        self._pool = ThreadPoolExecutor(settings.read_threads, thread_name_prefix="mlxr-experts")
        self._pending: dict[ExpertKey, Future[HostRead]] = {}
        self._files: dict[Path, int] = {}
        self._files_lock = threading.Lock()
        self._bad_files: set[Path] = set()
        self._lost: dict[int, MlxrError] | None = None
        #: The experts each layer used at its last step (``prefetch: previous``).
        self.last: dict[int, list[int]] = {}
        self.counts = {"requests": 0, "hits": 0, "waits": 0, "misses": 0, "bytes_read": 0, "reads": 0,
                       "read_ahead": 0, "tokens": 0, "failed_reads": 0}  # fmt: skip
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def add_layer(self, layer: LayerExperts) -> int:
        """Register a layer's experts; its index in reads and cache keys."""
        self.layers.append(layer)
        return len(self.layers) - 1

    # -- on the MLX thread ----------------------------------------------------------------

    def fetch(self, layer: int, needed: list[int], ahead: list[int] | None = None) -> tuple[dict[int, Entry], dict[int, ExpertReadError]]:
        """The entries of experts ``needed`` of ``layer`` (cached, read ahead, or read now, all
        at once on the pool), and the read errors of those that could not be read. ``ahead``:
        experts of layer ``layer + 1`` to start reading meanwhile."""
        self._drain()
        self.counts["requests"] += len(needed)
        keys = [(layer, expert) for expert in needed]
        got: dict[int, Entry] = {}
        waiting: dict[int, Future[HostRead]] = {}
        for expert, key in zip(needed, keys, strict=True):
            entry = self.cache.get(key)
            if entry is not None:
                got[expert] = entry
                self.counts["hits"] += 1
                continue
            future = self._pending.pop(key, None)
            self.counts["waits" if future is not None else "misses"] += 1
            waiting[expert] = future if future is not None else self._pool.submit(self._read, key)
        if ahead and layer + 1 < len(self.layers):
            self.read_ahead(layer + 1, ahead)
        errors: dict[int, ExpertReadError] = {}
        for expert, future in waiting.items():
            try:
                host = self._done(future)
            except ExpertReadError as exc:
                errors[expert] = exc
                self._report(exc)
                continue
            entry = self._entry(layer, host)
            got[expert] = entry
            self.cache.put((layer, expert), entry, pinned=keys)
        self.last[layer] = needed
        return got, errors

    def read_ahead(self, layer: int, experts: list[int]) -> None:
        """Start reading ``experts`` of ``layer`` that are neither cached nor being read."""
        for expert in experts:
            key = (layer, expert)
            if key not in self.cache and key not in self._pending:
                self._pending[key] = self._pool.submit(self._read, key)
                self.counts["read_ahead"] += 1

    def count_tokens(self, tokens: int) -> None:
        """``tokens`` positions went through the model (bytes read per token)."""
        self.counts["tokens"] += tokens

    @contextlib.contextmanager
    def row_failures(self) -> Iterator[dict[int, MlxrError]]:
        """Within it, a layer whose unreadable experts only some rows of the batch routed to
        records those rows here (row -> error) and computes on; outside, it raises."""
        lost: dict[int, MlxrError] = {}
        self._lost = lost
        try:
            yield lost
        finally:
            self._lost = None

    def lose_rows(self, rows: list[int], error: MlxrError) -> bool:
        """Record ``rows`` as failed by ``error`` when inside :meth:`row_failures`; False outside."""
        if self._lost is None:
            return False
        for row in rows:
            self._lost.setdefault(row, error)
        return True

    def stats(self) -> dict[str, float]:
        """Counts since the load (``requests`` of experts by the layers: ``hits`` in the cache,
        ``waits`` on a read ahead, ``misses`` read then; ``bytes_read``, ``tokens``), the cache's
        bytes and evictions, and read latency percentiles in seconds."""
        recent = self._latencies.copy()  # atomic: the engine thread appends while /metrics reads
        latencies = np.array(recent) if recent else np.zeros(1)
        counts = dict(self.counts)
        return {
            **counts,
            "hit_rate": counts["hits"] / counts["requests"] if counts["requests"] else 0.0,
            "bytes_per_token": counts["bytes_read"] / counts["tokens"] if counts["tokens"] else 0.0,
            "cache_bytes": self.cache.nbytes,
            "cache_capacity": self.cache.capacity,
            "cached_experts": len(self.cache),
            "evictions": self.cache.evictions,
            "read_p50_seconds": float(np.percentile(latencies, 50)),
            "read_p99_seconds": float(np.percentile(latencies, 99)),
        }

    def close(self) -> None:
        """Stop the pool and close the files."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._files_lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()

    def _drain(self) -> None:
        """Reads ahead that finished go into the cache (a failed one is dropped: the read when
        needed reports it)."""
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            try:
                host = self._done(future)
            except ExpertReadError:
                continue
            if key not in self.cache:
                self.cache.put(key, self._entry(key[0], host))

    def _done(self, future: Future[HostRead]) -> dict[str, HostPart]:
        host, nbytes, seconds = future.result()
        self.counts["bytes_read"] += nbytes
        self.counts["reads"] += 1
        self._latencies.append(seconds)
        return host

    def _entry(self, layer: int, host: dict[str, HostPart]) -> Entry:
        """An expert's host arrays as MLX arrays (floats cast to the model dtype), projections
        the policy uses dense dequantized as the resident load does."""
        arrays: Entry = {}
        for param, (array, kind) in host.items():
            value = mx.array(array)
            if kind == "bf16":
                value = value.view(mx.bfloat16)
            arrays[param] = value if kind == "raw" else value.astype(self.dtype)
        experts = self.layers[layer]
        for projection in experts.dense:
            spec = experts.packing[projection]
            packed, scales, biases = (arrays.pop(f"{projection}.{part}", None) for part in ("weight", "scales", "biases"))
            arrays[f"{projection}.weight"] = mx.dequantize(
                packed, scales, biases, group_size=spec.group_size, bits=spec.bits, mode=spec.mode  # type: ignore[arg-type]
            ).astype(self.dtype)
        mx.eval(arrays)
        return arrays

    def _report(self, error: ExpertReadError) -> None:
        self.counts["failed_reads"] += 1
        path = Path(error.path or "")
        if path not in self._bad_files:
            self._bad_files.add(path)
            log.error("streamed experts: %s (requests that need experts of this file fail)", error)

    # -- on the pool ----------------------------------------------------------------------

    def _read(self, key: ExpertKey) -> HostRead:
        """Read and decode one expert (numpy only)."""
        started = time.perf_counter()
        layer, expert = key
        chunks: dict[tuple[Path, int], tuple[StoredTensor, int, tuple[int, ...]]] = {}
        wanted: dict[str, tuple[tuple[Path, int], str]] = {}
        for param, source in self.layers[layer].params.items():
            tensor, offset, nbytes, shape, part = source.locate(expert)
            chunks[(tensor.file, offset)] = (tensor, nbytes, shape)
            wanted[param] = ((tensor.file, offset), part)
        decoded: dict[tuple[Path, int], dict[str, HostPart]] = {}
        total = 0
        for (file, offset), (tensor, nbytes, shape) in chunks.items():
            raw = self._pread(tensor, offset, nbytes)
            total += nbytes
            try:
                decoded[(file, offset)] = tensor.decode(raw, shape)
            except Exception as exc:
                raise ExpertReadError(f"expert {expert}'s bytes do not decode: {type(exc).__name__}: {exc}",
                                      path=str(file), tensor=tensor.name) from exc  # fmt: skip
        host = {param: decoded[chunk][part] for param, (chunk, part) in wanted.items()}
        return host, total, time.perf_counter() - started

    def _pread(self, tensor: StoredTensor, offset: int, nbytes: int) -> np.ndarray:
        buffer = bytearray(nbytes)
        view, got = memoryview(buffer), 0
        try:
            fd = self._fd(tensor.file)
            while got < nbytes:
                count = os.preadv(fd, [view[got:]], offset + got)
                if count == 0:
                    break
                got += count
        except OSError as exc:
            raise ExpertReadError(f"unreadable: {exc}", path=str(tensor.file), tensor=tensor.name) from exc
        if got < nbytes:
            raise ExpertReadError(
                f"truncated: {nbytes} bytes wanted at offset {offset}, the file ends after {got}",
                path=str(tensor.file), tensor=tensor.name,
            )
        return np.frombuffer(buffer, dtype=np.uint8)

    def _fd(self, file: Path) -> int:
        with self._files_lock:
            fd = self._files.get(file)
            if fd is None:
                fd = self._files[file] = os.open(file, os.O_RDONLY)
            return fd
