"""Qwen4-Exp's per-layer embeddings (PLE): hashed token n-grams read from a large table and mixed
into every hyper-connection stream of a few DeltaNet layers.

For each PLE layer (``ple_layer_ids``, one-indexed) and each position, the tokens before it are
taken back to the last end-of-sequence token (``eos_token_id``: a position never looks across
one; before the first token, and across one, it sees ``eos_token_id``). For every n-gram order
``n`` in ``2 .. ngram_size`` and each of its ``heads_per_ngram`` heads::

    mixed = xor(shifted[j] * multiplier[j] for j < n)        # int64; shifted[0] is the token
    row   = mixed % prime[head] + offset[head]                # one row of the layer's table

The primes are the first ones from ``ngram_vocab_size_base`` on, counted over every PLE layer's
heads in turn; the odd multipliers come from SplitMix64 of ``seed`` and the layer's index. The
rows of all heads, concatenated, are ``ple_embed_dim`` wide. The layer then gates a projection
of them by its streams (a per-stream key against the normed streams) and adds it, plus a
dilated depthwise convolution of it (``ple_conv_kernel_size`` taps, ``ngram_size`` apart), to
every stream.

A PLE layer's cache is a :class:`PLECache`: the DeltaNet's two states, this layer's convolution
inputs and the last ``ngram_size - 1`` tokens.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.cache import StateCache

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_PRIME_1 = 10007


def splitmix64(value: int) -> int:
    """SplitMix64's finalizer over ``value + gamma`` (64-bit wraparound)."""
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd multiplier of each shift (``ngram_size`` of them), small enough that a token id
    times one stays below ``2**63``."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (splitmix64((base + _GAMMA * (j + 1)) & _MASK64) % half_bound) + 1 for j in range(ngram_size)]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % divisor for divisor in range(3, math.isqrt(value) + 1, 2))


@lru_cache(maxsize=8)
def primes_from(start: int, count: int) -> list[int]:
    """The first ``count`` primes at or above ``start``."""
    primes: list[int] = []
    candidate = start
    while len(primes) < count:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes


class PLECache(StateCache):
    """A PLE layer's state for one sequence: ``[conv, recurrent]`` of its DeltaNet (as a
    :class:`~mlxr_core.model.cache.RecurrentCache` holds them), the PLE convolution's last inputs
    and the last ``ngram_size - 1`` tokens, stored less ``eos_token_id`` so that the zeros a
    batch gives a row that has seen nothing read as the end-of-sequence context."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...], nbytes_hint: int):
        super().__init__(4, nbytes_hint)
        self.shapes = shapes

    def empty_like(self) -> PLECache:
        return PLECache(self.shapes, self.nbytes_hint)


class DeltaNetSlots:
    """The DeltaNet's view of slots 0 and 1 of a :class:`PLECache` (or of its batch form): what
    :class:`~mlxr_core.model.layers.linear_attention.GatedDeltaNet` reads and writes."""

    keeps_positions = False

    def __init__(self, cache: Any):
        self.cache = cache

    @property
    def conv_state(self) -> mx.array | None:
        state: mx.array | None = self.cache[0]
        return state

    @property
    def recurrent_state(self) -> mx.array | None:
        state: mx.array | None = self.cache[1]
        return state

    def update(self, conv_state: mx.array, recurrent_state: mx.array, length: int) -> None:
        self.cache[0], self.cache[1] = conv_state, recurrent_state
        self.cache.advance(length)


class GroupRMSNorm(nn.Module):
    """RMS norm of each ``group``-wide slice of the last axis, scaled by ``1 + weight`` (one
    weight over the whole axis): Qwen4-Exp's norm over hyper-connection streams."""

    def __init__(self, dims: int, group: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.group, self.eps = group, eps

    def __call__(self, x: mx.array) -> mx.array:
        grouped = x.reshape(*x.shape[:-1], -1, self.group)
        normed = mx.fast.rms_norm(grouped, None, self.eps).reshape(x.shape)
        out: mx.array = normed * (1.0 + self.weight)
        return out


class NGramTable:
    """One PLE layer's table, out of the model's parameters: its shards memory-mapped where they
    lie in the checkpoint's files (only the rows a step hashes to are read, on the host, so the
    pages read stay the file's, not the process's), or arrays where the format read them."""

    def __init__(self, shards: list[tuple[np.ndarray, str]], dtype: mx.Dtype):
        self.shards = [array for array, _ in shards]
        self.kind = shards[0][1]
        self.starts = np.cumsum([0] + [len(array) for array in self.shards])[:-1].tolist()
        self.shape = (sum(len(array) for array in self.shards), *self.shards[0].shape[1:])
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.shards)

    def __call__(self, rows: mx.array) -> mx.array:
        """Rows ``[...]`` (int) -> ``[..., width]`` in :attr:`dtype`."""
        wanted = np.asarray(rows)
        out = np.empty((*wanted.shape, self.shape[1]), dtype=self.shards[0].dtype)
        for start, shard in zip(self.starts, self.shards, strict=True):
            inside = (wanted >= start) & (wanted < start + len(shard))
            out[inside] = shard[wanted[inside] - start]
        found = mx.array(out)
        return (found.view(mx.bfloat16) if self.kind == "bf16" else found).astype(self.dtype)


def host_rows(name: str, part: Any) -> tuple[np.ndarray, str]:
    """A table shard as a host array and how its values read (``float``, ``bf16``: raw bits):
    memory-mapped from its file for a :class:`~mlxr_core.model.checkpoint.StoredPart` (its
    format's decoder, given one row, says the type), copied for an ``mx.array``."""
    if isinstance(part, mx.array):
        return (np.array(part.view(mx.uint16)), "bf16") if part.dtype == mx.bfloat16 else (np.array(part), "float")
    source = part.source
    raw = np.memmap(source.file, dtype=np.uint8, mode="r", offset=source.offset, shape=(source.nbytes,))
    _, size, shape = source.row(0, source.shape[0])
    try:
        sample, kind = source.decode(np.array(raw[:size]), (1, *shape))["weight"]
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"the n-gram table cannot be read on demand: {exc}", tensor=name) from exc
    if kind not in ("float", "bf16"):
        raise ModelLoadError(f"the n-gram table is stored packed ({kind}); it is read as floats", tensor=name)
    return raw.view(sample.dtype).reshape(source.shape), kind


class NGramEmbedding(nn.Module):
    """The hashed n-gram rows of one PLE layer, from its :class:`NGramTable` (``rows`` of
    ``ple_embed_dim / heads``), which the architecture attaches after loading."""

    def __init__(self, args: Any, ple_index: int):
        super().__init__()
        self.ngram_size, self.per_order = args.ngram_size, args.heads_per_ngram
        heads = (args.ngram_size - 1) * args.heads_per_ngram
        self.eos = args.eos_id
        every = primes_from(args.ngram_vocab_size_base, len(args.ple_layer_ids) * heads)  # every PLE layer's, cached
        primes = every[ple_index * heads : (ple_index + 1) * heads]
        offsets = [sum(primes[:head]) for head in range(heads)]
        divisor = args.make_ngram_vocab_size_divisible_by
        #: The table's shape: rows padded to a multiple of ``make_ngram_vocab_size_divisible_by``.
        self.table_shape = (-(-sum(primes) // divisor) * divisor, args.ple_embed_dim // heads)
        self.table: NGramTable | None = None
        # Plain lists, not parameters: derived from the config, never loaded.
        self._multipliers = layer_multipliers(args.vocab_size, args.ngram_size, ple_index, args.seed)
        self._primes, self._offsets = primes, offsets

    def rows(self, tokens: mx.array, history: mx.array) -> mx.array:
        """Table rows ``[B, L, heads]`` of ``tokens`` ``[B, L]`` after ``history`` ``[B, n - 1]``."""
        L = tokens.shape[1]
        seen = mx.concatenate([history, tokens], axis=1).astype(mx.int64)  # [B, n - 1 + L]
        eos = mx.array(self.eos, dtype=mx.int64)
        # shifted[j][p]: the token j back from p, or eos where an eos lies at p-1 .. p-j+1
        shifted, cut = [seen[:, -L:]], mx.zeros(seen[:, -L:].shape, dtype=mx.bool_)
        for j in range(1, self.ngram_size):
            back = seen[:, seen.shape[1] - L - j : seen.shape[1] - j]
            shifted.append(mx.where(cut, eos, back))
            cut = cut | (back == eos)
        multipliers = [mx.array(m, dtype=mx.int64) for m in self._multipliers]  # past int32's range
        blocks = []
        for n in range(2, self.ngram_size + 1):
            mixed = shifted[0] * multipliers[0]
            for j in range(1, n):
                mixed = mx.bitwise_xor(mixed, shifted[j] * multipliers[j])
            heads = slice((n - 2) * self.per_order, (n - 1) * self.per_order)
            primes = mx.array(self._primes[heads], dtype=mx.int64)
            blocks.append(mx.remainder(mixed[..., None], primes) + mx.array(self._offsets[heads], dtype=mx.int64))
        return mx.concatenate(blocks, axis=-1).astype(mx.int32)

    def __call__(self, tokens: mx.array, history: mx.array) -> mx.array:
        """``[B, L]`` tokens -> ``[B, L, ple_embed_dim]``."""
        if self.table is None:
            raise RuntimeError("the n-gram table was never attached (Qwen4ExpArchitecture.attach_tables)")
        return self.table(self.rows(tokens, history)).reshape(*tokens.shape, -1)


class PLELayer(nn.Module):
    """One layer's per-layer embedding over ``[B, L, streams * hidden]``."""

    def __init__(self, args: Any, ple_index: int):
        super().__init__()
        H, S = args.hidden_size, args.hc_count
        self.hidden, self.streams = H, S
        self.kernel, self.dilation = args.ple_conv_kernel_size, args.ngram_size
        self.context = args.ngram_size - 1
        self.eos = args.eos_id
        self.ple_embedding = NGramEmbedding(args, ple_index)
        self.key_proj = nn.Linear(args.ple_embed_dim, S * H, bias=False)
        self.value_proj = nn.Linear(args.ple_embed_dim, H, bias=False)
        for name in ("norm_key", "norm_query", "norm_conv"):
            setattr(self, name, GroupRMSNorm(S * H, H, args.rms_norm_eps))
        # Depthwise, MLX's layout [channels, kernel, 1]; its taps are ``dilation`` apart.
        self.conv1d = nn.Conv1d(S * H, S * H, self.kernel, groups=S * H, bias=False)

    @property
    def conv_length(self) -> int:
        """Past inputs the dilated convolution reads."""
        return (self.kernel - 1) * self.dilation

    def __call__(self, x: mx.array, tokens: mx.array, cache: Any) -> mx.array:
        B, L, _ = x.shape
        S, H = self.streams, self.hidden
        stored = cache[3] if cache is not None else None
        history = (
            mx.full((B, self.context), self.eos, dtype=mx.int32) if stored is None else stored + self.eos
        )
        embedded = self.ple_embedding(tokens, history)
        key = self.norm_key(self.key_proj(embedded)).reshape(B, L, S, H)
        value = self.value_proj(embedded)
        query = self.norm_query(x).reshape(B, L, S, H)
        gate = (key * query).sum(axis=-1, keepdims=True) / math.sqrt(H)
        gate = mx.sqrt(mx.maximum(mx.abs(gate), 1e-6)) * mx.sign(gate)
        gated = (mx.sigmoid(gate) * value[:, :, None, :]).reshape(B, L, S * H)
        normed = self.norm_conv(gated)
        past = cache[2] if cache is not None else None
        if past is None:
            past = mx.zeros((B, self.conv_length, S * H), dtype=normed.dtype)
        window = mx.concatenate([past, normed], axis=1)  # [B, conv_length + L, C]
        weight = self.conv1d.weight[:, :, 0]  # [C, K]
        d = self.dilation
        conv = window[:, 0:L] * weight[:, 0]
        for k in range(1, self.kernel):
            conv = conv + window[:, k * d : k * d + L] * weight[:, k]
        if cache is not None:
            cache[2] = window[:, L:]
            cache[3] = (mx.concatenate([history, tokens.astype(mx.int32)], axis=1)[:, -self.context :]) - self.eos
        out: mx.array = gated + nn.silu(conv)
        return out


def derived_constants(args: Any) -> dict[str, dict[str, list[int]]]:
    """Layer stem (``model.layers.3``) -> the hashing constants of its PLE layer."""
    heads = (args.ngram_size - 1) * args.heads_per_ngram
    primes = primes_from(args.ngram_vocab_size_base, len(args.ple_layer_ids) * heads)
    out = {}
    for index, layer in enumerate(args.ple_layer_ids):
        mine = primes[index * heads : (index + 1) * heads]
        out[f"model.layers.{layer - 1}"] = {
            "layer_multipliers": layer_multipliers(args.vocab_size, args.ngram_size, index, args.seed),
            "ngram_heads_vocab_sizes": mine,
            "ngram_heads_offsets": [sum(mine[:h]) for h in range(heads)],
        }
    return out
