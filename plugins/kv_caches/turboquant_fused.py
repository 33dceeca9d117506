"""The Python side of the fused TurboQuant kernels, shared by their two sources: CUDA
(:mod:`mlxr_plugins.kv_caches.turboquant_cuda`) and Metal
(:mod:`mlxr_plugins.kv_caches.turboquant_metal`). Both backends' kernels take the same inputs,
template arguments and grid (in threads), and make the same outputs; this module decides which
calls they take (shapes), builds the kernels, plans the launches and shapes the results
(:class:`Kernels`). A backend module holds its kernel sources (:class:`Sources`) and exports its
:class:`Kernels`' methods as its functions.

:mod:`~mlxr_plugins.kv_caches.turboquant` picks the module for the machine
(:func:`~mlxr_plugins.kv_caches.turboquant.fused_backend`) and calls it as a :class:`FusedBackend`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import mlx.core as mx

#: Threads per threadgroup (block) of the scores kernel (one position each).
SCORE_THREADS = 128
#: Fewest positions one threadgroup of the values kernel sums.
MIN_CHUNK = 64


class FusedBackend(Protocol):
    """What a backend module offers: the reference's :class:`~mlxr_plugins.kv_caches.codebooks.Codec`
    calls (encode, scores, weighted values) for the calls its ``reasons`` accept."""

    def reasons(self, queries: mx.array) -> list[str]:
        """Why :meth:`scores` and :meth:`weighted_values` cannot take this attention call (empty:
        they can)."""
        ...

    def encode_reasons(self, keys: mx.array) -> list[str]:
        """Why :meth:`encode` cannot take these keys (empty: it can)."""
        ...

    def encode(self, codec: Any, keys: mx.array, values: mx.array) -> list[mx.array]: ...

    def scores(self, codec: Any, queries: mx.array, *keys: mx.array) -> mx.array: ...

    def weighted_values(self, codec: Any, probs: mx.array, codes: mx.array, norms: mx.array) -> mx.array: ...


def call_reasons(queries: mx.array) -> list[str]:
    """The shapes the attention kernels refuse, whatever the backend."""
    return ["more than one query position (a prompt)"] if queries.shape[-2] != 1 else []


def encode_shape_reasons(keys: mx.array) -> list[str]:
    """The shapes the encoding kernel refuses (a threadgroup of ``D`` threads, whole SIMD-groups)."""
    found = []
    if keys.size == 0:
        found.append("no positions")
    if keys.shape[-1] % 32 or keys.shape[-1] > 1024:
        found.append(f"head size {keys.shape[-1]} is not a multiple of 32 up to 1024")
    return found


def planes(bits: int) -> tuple[int, int]:
    """The widths of the bit planes ``bits``-bit codes are stored in (the second 0 if one)."""
    from mlxr_plugins.kv_caches.codebooks import PLANES

    widths = PLANES[bits]
    return widths[0], widths[1] if len(widths) > 1 else 0


@attrs.frozen
class Sources:
    """One backend's kernel sources (bodies; MLX writes the signatures): the encoding kernel's
    (``SKETCH_ON`` defined 1 or 0 before it) with its header, and the attention kernels' with
    theirs."""

    encode: str
    encode_header: str
    scores: str
    values: str
    header: str


class Kernels:
    """One backend's fused kernels, built on first use by its ``mx.fast`` maker
    (``cuda_kernel`` or ``metal_kernel``: both take and run kernels alike), and the reference's
    calls through them. A backend module exports these bound methods as its functions."""

    def __init__(
        self, platform: str, available: Callable[[], bool], make: Callable[..., Any], sources: Sources, target_blocks: int
    ) -> None:
        self.platform, self.available, self.make, self.sources = platform, available, make, sources
        #: Threadgroups to aim for in the values kernel (enough to fill the GPU).
        self.target_blocks = target_blocks
        self._built: dict[str, Any] = {}

    def reasons(self, queries: mx.array) -> list[str]:
        """Why the fused kernels cannot take this attention call (empty: they can)."""
        return self._device_reasons() + call_reasons(queries)

    def encode_reasons(self, keys: mx.array) -> list[str]:
        """Why :meth:`encode` cannot take these keys (empty: it can)."""
        return self._device_reasons() + encode_shape_reasons(keys)

    def _device_reasons(self) -> list[str]:
        if mx.default_device() != mx.gpu or not self.available():
            return [f"MLX's {self.platform} backend is not the default device"]
        return []

    def _kernel(
        self, name: str, inputs: list[str], outputs: list[str], source: str, header: str, *, views: bool
    ) -> Any:
        """A kernel, built once (MLX compiles it once per template instantiation). ``views``: it
        reads its inputs through their strides (the cache's views), so MLX copies none."""
        if name not in self._built:
            self._built[name] = self.make(
                name=name, input_names=inputs, output_names=outputs, source=source, header=header,
                ensure_row_contiguous=not views,
            )  # fmt: skip
        return self._built[name]

    def _encode_kernel(self, sketch: bool) -> Any:
        return self._kernel(
            "mlxr_tq_encode" + ("_sketch" if sketch else ""),
            ["x", "rotation", "sketch", "edges", "levels"],
            ["codes", "signs", "norms"] if sketch else ["codes", "norms"],
            f"#define SKETCH_ON {int(sketch)}\n" + self.sources.encode,
            self.sources.encode_header,
            views=False,
        )

    def _scores_kernel(self) -> Any:
        inputs = ["q", "qs", "codes", "signs", "norms", "levels"]
        return self._kernel("mlxr_tq_scores", inputs, ["out"], self.sources.scores, self.sources.header, views=True)

    def _values_kernel(self) -> Any:
        inputs = ["probs", "codes", "norms", "levels"]
        return self._kernel("mlxr_tq_values", inputs, ["out"], self.sources.values, self.sources.header, views=True)

    def encode(self, codec: Any, keys: mx.array, values: mx.array) -> list[mx.array]:
        """:meth:`Codec.encode_keys` and :meth:`Codec.encode_values` of ``[B, H, L, D]`` keys and
        values, one kernel each: a threadgroup of ``D`` threads per (row, head, position)
        normalizes, rotates, finds each coordinate's level, sketches the keys' residual and packs
        the bytes (the reference spends some 40 small ops on it, which on a GPU cost more than the
        attention itself)."""
        *lead, D = keys.shape
        arrays = []
        for x, levels, sketch in ((keys, codec.keys, codec.sketch_keys), (values, codec.values, False)):
            N = x.size // D
            W0, W1 = planes(levels.bits)
            shapes = [(N, D * levels.bits // 8)] + ([(N, D // 8), (N, 2)] if sketch else [(N, 1)])
            dtypes = [mx.uint8] + ([mx.uint8, mx.float16] if sketch else [mx.float16])
            outputs = self._encode_kernel(sketch)(
                inputs=[x.reshape(N, D), codec.rotation, codec.sketch, levels.edges, levels.levels],
                template=[("T", x.dtype), ("D", D), ("W0", W0), ("W1", W1)],
                grid=(N * D, 1, 1),
                threadgroup=(D, 1, 1),
                output_shapes=shapes,
                output_dtypes=dtypes,
            )
            arrays += [out.reshape(*lead, out.shape[-1]) for out in outputs]
        return arrays

    def scores(self, codec: Any, queries: mx.array, *keys: mx.array) -> mx.array:
        """:meth:`Codec.scores` for one query position: ``queries`` ``[B, Hkv, R, 1, D]``, the stored
        keys ``[B, Hkv, S, *]`` -> ``[B, Hkv, R, 1, S]`` float32."""
        B, Hkv, R, _, D = queries.shape
        if codec.sketch_keys:
            codes, signs, norms = keys
            rotated, sketched = codec.query_terms(queries.astype(mx.float32))
            kbits = codec.bits - 1
        else:
            codes, norms = keys
            rotated = queries.astype(mx.float32) @ codec.rotation
            sketched, signs = rotated, codes  # unread
            kbits = codec.bits
        S = codes.shape[2]
        W0, W1 = planes(kbits)
        weight = math.sqrt(math.pi / 2) / D
        (out,) = self._scores_kernel()(
            inputs=[mx.contiguous(rotated), mx.contiguous(sketched), codes, signs, norms, codec.keys.levels],
            template=[
                ("R", R), ("D", D), ("W0", W0), ("W1", W1), ("SKETCH", int(codec.sketch_keys)),
                ("SKETCH_SCALE_BITS", float_bits(weight)),
            ],
            grid=(-(-S // SCORE_THREADS) * SCORE_THREADS, B * Hkv, 1),
            threadgroup=(SCORE_THREADS, 1, 1),
            output_shapes=[(B, Hkv, R, 1, S)],
            output_dtypes=[mx.float32],
        )
        return out

    def weighted_values(self, codec: Any, probs: mx.array, codes: mx.array, norms: mx.array) -> mx.array:
        """:meth:`Codec.weighted_values` for one query position: ``probs`` ``[B, Hkv, R, 1, S]``
        -> ``[B, Hkv, R, 1, D]``, rotated back: a threadgroup per chunk of positions, their partial
        sums added here."""
        B, Hkv, R, _, S = probs.shape
        D = codec.dim
        W0, W1 = planes(codec.bits)
        chunks = max(1, min(-(-S // MIN_CHUNK), -(-self.target_blocks // (B * Hkv))))
        (partial,) = self._values_kernel()(
            inputs=[mx.contiguous(probs.astype(mx.float32)), codes, norms, codec.values.levels],
            template=[("R", R), ("D", D), ("W0", W0), ("W1", W1)],
            grid=(chunks * D, B * Hkv, 1),
            threadgroup=(D, 1, 1),
            output_shapes=[(chunks, B, Hkv, R, 1, D)],
            output_dtypes=[mx.float32],
        )
        return partial.sum(axis=0) @ codec.rotation.T


def float_bits(value: float) -> int:
    """``value`` as float32, its bits read as an int (a template argument can only be an int)."""
    return int(struct.unpack("<i", struct.pack("<f", value))[0])
