"""Rotary position embeddings and their scaled variants, applied through the bound ``rope`` kernel.

Every variant is the kernel's RoPE with some per-frequency ``freqs`` (``mx.fast.rope``'s form:
the inverse of Hugging Face's ``inv_freq``), and optionally a factor on the rotated features
(Hugging Face scales ``cos`` and ``sin`` by an "attention factor" for LongRoPE and YaRN):

==============  ===============================================================================
``rope_type``   frequencies
==============  ===============================================================================
``default``     ``base ** (2i / dims)``
``linear``      positions divided by ``factor`` (the kernel's ``scale``)
``llama3``      long wavelengths stretched by ``factor``, short ones kept, the band between blended
``yarn``        interpolated below the ``beta_slow`` rotations, kept above ``beta_fast``, a linear
                ramp between; rotated features scaled by ``0.1 ln(factor) + 1`` (or as configured)
``longrope``    the ``short_factor`` divisors (the context within ``original_max_position_embeddings``);
                rotated features scaled by ``sqrt(1 + ln(factor) / ln(original))``
``proportional`` the first ``partial_rotary_factor`` of the pairs ``(i, i + D/2)`` rotated at the
                frequencies of the whole head size ``D`` (divided by ``factor``), the rest never
                (an infinite period): Gemma 4's global layers
==============  ===============================================================================

llama.cpp stores llama3 scaling as per-frequency divisors (GGUF ``rope_freqs.weight``): a config's
``rope_freq_factors`` multiplies whatever frequencies the type gives.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import mlx.core as mx

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.layers.config_eras import rope_type

#: Every ``rope_type`` :func:`make_rotary` builds (``su`` is LongRoPE's older name).
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "su", "proportional")


def base_freqs(dims: int, base: float) -> mx.array:
    """Unscaled RoPE ``freqs``: ``base ** (2i / dims)``."""
    return base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def llama3_rope_freqs(dims: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """Llama 3.1 frequency scaling: long wavelengths stretched by ``factor``, short ones kept,
    the band between interpolated. Returns ``freqs`` as ``mx.fast.rope`` takes them (periods / 2pi)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))

    freqs = base_freqs(dims, base)
    wavelengths = 2 * math.pi * freqs
    low_freq_wavelength = original / low_freq_factor
    high_freq_wavelength = original / high_freq_factor
    smooth = (original / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = freqs / ((1 - smooth) / factor + smooth)
    freqs = mx.where(wavelengths > low_freq_wavelength, freqs * factor, freqs)
    in_band = (wavelengths > high_freq_wavelength) & (wavelengths < low_freq_wavelength)
    return mx.where(in_band, interpolated, freqs)


def yarn_rope(
    dims: int, base: float, scaling: dict[str, Any], max_positions: int
) -> tuple[mx.array, float]:
    """YaRN's ``freqs`` and attention factor (transformers' ``_compute_yarn_parameters``)."""
    original = int(scaling.get("original_max_position_embeddings") or max_positions)
    factor = float(scaling.get("factor") or max_positions / original)

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(
                factor, scaling["mscale_all_dim"]
            )
        else:
            attention_factor = mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1: keep the frequency, 0: interpolate it
    inv_freq = 1.0 / base_freqs(dims, base)
    inv_freq = inv_freq / factor * (1.0 - extrapolate) + inv_freq * extrapolate
    return 1.0 / inv_freq, float(attention_factor)


def longrope(
    dims: int, base: float, scaling: dict[str, Any], max_positions: int, original: int
) -> tuple[mx.array, float]:
    """LongRoPE's short-context ``freqs`` and attention factor. A KV cache cannot follow
    transformers' switch of the whole sequence to the long factors past ``original`` positions,
    so the short ones serve (and ``original`` is the context the graph reports)."""
    short = scaling.get("short_factor")
    if not isinstance(short, list) or len(short) != dims // 2:
        raise ModelLoadError(
            f"longrope short_factor must list {dims // 2} numbers "
            f"(rotary dims / 2), got {short!r:.80}"
        )
    freqs = mx.array(short, dtype=mx.float32) * base_freqs(dims, base)
    factor = scaling.get("factor") or max_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return freqs, float(attention_factor)


class Rotary:
    """One RoPE setting, applied through the bound rope kernel (holds no weights): either a
    ``base`` or per-frequency ``freqs``, a position ``scale``, and a ``factor`` on the rotated
    features (1 for most)."""

    def __init__(
        self,
        kernels: KernelSet,
        dims: int,
        *,
        base: float | None = None,
        freqs: mx.array | None = None,
        scale: float = 1.0,
        traditional: bool = False,
        factor: float = 1.0,
    ):
        self.rope = kernels.rope
        self.dims = dims
        self.base = None if freqs is not None else base
        self.freqs = freqs
        self.scale = scale
        self.traditional = traditional
        self.factor = factor

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        rotated: mx.array = self.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )
        if self.factor == 1.0:
            return rotated
        factor = mx.array(self.factor, dtype=x.dtype)
        if self.dims == x.shape[-1]:
            return rotated * factor
        head, tail = rotated[..., : self.dims], rotated[..., self.dims :]
        return mx.concatenate([head * factor, tail], axis=-1)


class PositionScale:
    """Llama 4's query scaling by position (transformers' ``get_llama_4_attn_scale``, configured in
    Ministral 3's and Mistral 4's ``rope_parameters``): the queries at position ``p`` multiplied by
    ``1 + beta * ln(1 + floor(p / original))``, a step up every ``original`` positions, so that
    attention stays sharp past the context the model was trained on. Holds no weights."""

    def __init__(self, beta: float, original: int):
        self.beta, self.original = beta, original

    def __call__(self, queries: mx.array, offset: int | mx.array) -> mx.array:
        """``queries [B, H, L, D]`` whose first position is ``offset`` (an int, or one per row)."""
        L = queries.shape[2]
        positions = mx.arange(L, dtype=mx.float32)
        if isinstance(offset, mx.array) and offset.ndim == 1:
            positions = (positions[None] + offset[:, None].astype(mx.float32))[:, None]  # [B, 1, L]
        else:
            positions = positions + offset  # [L]
        # A left-padded row's padding sits at negative positions: kept finite (it is masked out).
        steps = mx.floor(mx.maximum(positions, 0.0) / self.original)
        scale = 1.0 + self.beta * mx.log1p(steps)
        return queries * scale[..., None].astype(queries.dtype)


def make_rotary(
    kernels: KernelSet,
    dims: int,
    base: float,
    scaling: dict[str, Any] | None = None,
    *,
    traditional: bool = False,
    freq_factors: list[float] | None = None,
    max_positions: int = 2048,
    original_max_positions: int | None = None,
    types: Collection[str] = ROPE_TYPES,
    family: str = "this",
) -> Rotary:
    """The rotary embedding a config's ``rope_scaling`` asks for; a ModelLoadError names a
    ``rope_type`` outside ``types`` (those the family's checkpoints use and are tested)."""
    scaling = dict(scaling or {})
    kind = rope_type(scaling)
    if kind not in types:
        raise ModelLoadError(
            f"rope_scaling type {kind!r} is not supported by the {family} graph ({', '.join(types)})",
            key="rope_scaling",
        )
    freqs: mx.array | None = None
    scale, factor = 1.0, 1.0
    if kind == "linear":
        scale = 1.0 / float(scaling["factor"])
    elif kind == "llama3":
        freqs = llama3_rope_freqs(dims, base, scaling)
    elif kind == "yarn":
        freqs, factor = yarn_rope(dims, base, scaling, max_positions)
    elif kind in ("longrope", "su"):
        original = int(
            scaling.get("original_max_position_embeddings") or original_max_positions or max_positions
        )
        freqs, factor = longrope(dims, base, scaling, max_positions, original)
    elif kind == "proportional":
        rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * dims // 2)
        still = mx.full((dims // 2 - rotated,), math.inf)  # an infinite period: never rotated
        freqs = mx.concatenate([base_freqs(dims, base)[:rotated], still])
        freqs = freqs * float(scaling.get("factor", 1.0))
    if freq_factors is not None:
        own = freqs if freqs is not None else base_freqs(dims, base)
        freqs = own * mx.array(freq_factors, dtype=mx.float32)
    return Rotary(
        kernels, dims, base=base, freqs=freqs, scale=scale, traditional=traditional, factor=factor
    )


def args_rotary(args: Any, kernels: KernelSet, **overrides: Any) -> Rotary:
    """:func:`make_rotary` from a :class:`~mlxr_core.model.layers.args.TransformerArgs`."""
    settings: dict[str, Any] = {
        "base": args.rope_theta,
        "scaling": args.rope_scaling,
        "traditional": args.rope_traditional,
        "freq_factors": args.rope_freq_factors,
        "max_positions": args.max_position_embeddings,
        "family": args.family,
        **overrides,
    }
    return make_rotary(kernels, args.rope_dims, **settings)
