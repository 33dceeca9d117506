"""The conformance check every architecture plugin passes, on tiny random weights.

An architecture is a contract with the engine (:class:`~mlxr_core.model.arch.Architecture`): the
module maps ``[B, L]`` ids to ``[B, L, vocab]`` logits; decoding through :meth:`make_cache` one token
at a time gives the logits of one full forward pass; and the engine's batch flow (each prompt
prefilled alone, its caches joined into the batch's (each layer's ``to_batch``: keys and values
right-aligned, recurrent states stacked), every row decoded together under the batch's padding
mask, rows leaving) gives each row what it would get alone;
``hidden_states`` (pooled for embeddings) is padding- and chunking-invariant; where the module
offers the cut points of a compiled decode step (:mod:`mlxr_core.model.compiled`), decoding
through :class:`~mlxr_core.model.compiled.CompiledDecode` gives the same logits in the same batch
flow; and where the module's layers fuse (:func:`mlxr_core.model.fuse.fuse_model`), the fused
module passes the same checks with the same logits.
Third-party architectures run the same check::

    from mlxr_core.testing.conformance import TINY_CONFIG, check_architecture
    check_architecture(MyArchitecture(), {**TINY_CONFIG, "model_type": "mine"}, kernels)

The checks of the other plugin kinds are importable from here too, one line each:
:func:`check_format`, :func:`check_kernel_parity`, :func:`check_api`, :func:`check_sampler` and
:func:`check_decoder`, each raising AssertionError naming the first broken property.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlxr_core.model.cache import batch_mask
from mlxr_core.model.compiled import CompiledDecode, eager_step, unsupported
from mlxr_core.model.fuse import fuse_model
from mlxr_core.testing.api_check import check_api
from mlxr_core.testing.decoding_check import check_decoder, check_sampler
from mlxr_core.testing.format_check import check_format
from mlxr_core.testing.kernel_check import ParityReport, check_kernel_parity

if TYPE_CHECKING:
    import mlx.nn as nn

    from mlxr_core.kernels import KernelSet
    from mlxr_core.model.arch import Architecture

__all__ = [
    "LENGTHS",
    "TINY_CONFIG",
    "ParityReport",
    "check_api",
    "check_architecture",
    "check_decoder",
    "check_format",
    "check_kernel_parity",
    "check_sampler",
    "random_model",
]

#: A config every built-in architecture accepts: Hugging Face keys, tiny shapes, a sliding window
#: shorter than the test sequences (for architectures that use one) and a global layer.
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 97,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "sliding_window": 4,
    "sliding_window_pattern": 2,
    "tie_word_embeddings": False,
    # Mixtures of experts: 4 experts, 2 per token, a shared expert where the family has one.
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    # Gemma 4's per-layer inputs: by default a 262144-row table of 256 features per layer.
    "vocab_size_per_layer_input": 97,
    "hidden_size_per_layer_input": 4,
    # Hybrids (Qwen3-Next, Qwen3.5): a Gated DeltaNet layer, then an attention layer.
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "full_attention_interval": 2,
    # M-RoPE (Qwen2.5-VL): how many of a head's 4 frequencies read the temporal, height and width positions.
    "mrope_section": [1, 1, 2],
    # Multi-head latent attention (DeepSeek-V3): latent, query bottleneck and per-head widths; its
    # experts in 2 groups of 2, one group chosen; the first layer dense.
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 6,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # Qwen4-Exp's indexed attention: 2 blocks of 2 tokens picked per query (fewer than the prompts').
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 8,
    "indexer_budget": 4,
    "indexer_compress_ratio": 2,
}
#: Gemma 3n: its second layer shares the first's keys and values (15 shared by default), the
#: first's MLP sparse, a LAuReL rank below the hidden size.
_GEMMA3N = {"num_kv_shared_layers": 1, "activation_sparsity_pattern": [0.95, 0.0], "laurel_rank": 4}
#: What a family needs beside :data:`TINY_CONFIG`: GLM-5-Next's latent attention rotates nothing;
#: Mistral 4 computes only YaRN (as transformers' graph does).
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3n": _GEMMA3N,
    "gemma3n_text": _GEMMA3N,
    "kimi_linear": {"linear_num_heads": 2, "linear_head_dim": 16},
    # GLM-5-Next's linear-attention layers default to 64 heads of 128 (18 s a conformance run).
    "glm5_next": {"qk_rope_head_dim": 0, "linear_num_heads": 2, "linear_head_dim": 16},
    "glm5_next_text": {"qk_rope_head_dim": 0, "linear_num_heads": 2, "linear_head_dim": 16},
    "mistral4": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                  "beta_fast": 32.0, "beta_slow": 1.0}},
}


def tiny_config(model_type: str) -> dict[str, Any]:
    """:data:`TINY_CONFIG` for ``model_type``, with what its family needs (:data:`TINY_OVERRIDES`)."""
    return {**TINY_CONFIG, **TINY_OVERRIDES.get(model_type, {}), "model_type": model_type}
#: Prompt lengths of the two batch rows: different, and longer than the sliding window.
LENGTHS = (11, 6)
DECODE_STEPS = 3


def random_model(
    arch: Architecture, config: dict[str, Any], kernels: KernelSet, seed: int = 0
) -> nn.Module:
    """The module with O(1) logits: matrices scaled by ``1/sqrt(fan_in)``, vectors near 1 (norms)
    or near 0 (biases); integer tables are kept. MLX's default initialization gives near-zero
    logits, which prove little."""
    model = arch.build(config, kernels)
    rng = np.random.default_rng(seed)
    params = []
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, array in flat:
        if not mx.issubdtype(array.dtype, mx.floating):
            continue  # tables of ids (DeepSeek-V4's token -> experts) stay as built: noise is no id
        noise = rng.standard_normal(array.shape).astype(np.float32)
        if array.ndim == 1:
            value = 0.1 * noise + (0.0 if name.endswith("bias") else 1.0)
        else:
            value = noise / np.sqrt(array.shape[-1])
        params.append((name, mx.array(value)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def check_architecture(
    arch: Architecture,
    config: dict[str, Any],
    kernels: KernelSet,
    *,
    seed: int = 0,
    atol: float | None = None,
) -> None:
    """Raise AssertionError naming the first broken property of ``arch`` on ``config``.

    ``atol`` defaults to 1e-4 on CPU and 2e-2 on a GPU: MLX's CUDA float32 matmuls round like
    TF32 (cached vs one-pass logits differ by 3-7e-3 for every architecture on an H100)."""
    if atol is None:
        atol = 2e-2 if mx.default_device() == mx.gpu else 1e-4
    vocab = int(config["vocab_size"])
    rng = np.random.default_rng(seed + 1)
    # Each prompt: n - 1 prefilled tokens, DECODE_STEPS + 1 decoded in the batch, one more alone.
    prompts = [rng.integers(0, vocab, n + DECODE_STEPS + 1).tolist() for n in LENGTHS]
    model = random_model(arch, config, kernels, seed)
    full = _check_model(arch, model, prompts, vocab, atol)
    fused = random_model(arch, config, kernels, seed)
    if fuse_model(fused):
        fused_full = _check_model(arch, fused, prompts, vocab, atol)
        for row, (mine, expected) in enumerate(zip(fused_full, full, strict=True)):
            _close(mine, expected, atol, f"prompt {row} with the projections fused")


def _check_model(
    arch: Architecture, model: nn.Module, prompts: list[list[int]], vocab: int, atol: float
) -> list[np.ndarray]:
    """Every property of :func:`check_architecture` for one module; its one-pass logits."""
    # Shapes: a batch of equal-length rows, logits over the vocabulary, float.
    length = min(LENGTHS)
    logits = model(mx.array([p[:length] for p in prompts]))
    assert logits.shape == (2, length, vocab), f"forward shape {logits.shape}"
    assert bool(mx.all(mx.isfinite(logits))), "non-finite logits"
    full = [np.array(model(mx.array([p]))[0]) for p in prompts]

    # Cache: prefill half, then one token at a time == one full pass.
    for prompt, expected in zip(prompts, full, strict=True):
        cache = arch.make_cache(model)
        half = len(prompt) // 2
        steps = [model(mx.array([prompt[:half]]), cache=cache)]
        steps += [model(mx.array([[token]]), cache=cache) for token in prompt[half:]]
        cached = np.array(mx.concatenate(steps, axis=1)[0])
        _close(cached, expected, atol, f"cached decoding of a {len(prompt)}-token sequence")

    _check_batch(arch, model, prompts, full, atol, partial(eager_step, model), "")
    if unsupported(model) is None:
        _check_batch(arch, model, prompts, full, atol, CompiledDecode(model), " (compiled decode step)")

    check_hidden_states(arch, model, prompts, atol)
    return full


def _check_batch(
    arch: Architecture,
    model: nn.Module,
    prompts: list[list[int]],
    full: list[np.ndarray],
    atol: float,
    decode: Callable[[mx.array, list[Any], mx.array | None], mx.array],
    how: str,
) -> None:
    """Rows prefilled alone, joined (left padding), decoded together through ``decode``, one
    leaves and the other decodes on alone: each step's logits equal the one-pass ``full``."""
    rows = []
    for n, prompt in zip(LENGTHS, prompts, strict=True):
        cache = arch.make_cache(model)
        model(mx.array([prompt[: n - 1]]), cache=cache)
        rows.append([layer.to_batch() for layer in cache])
    batch = rows[0]
    for layer, other in zip(batch, rows[1], strict=True):
        layer.extend(other)
    for step in range(DECODE_STEPS + 1):
        tokens = mx.array([p[n - 1 + step] for n, p in zip(LENGTHS, prompts, strict=True)])
        out = np.array(decode(tokens, batch, batch_mask(batch)))
        for row, (n, expected) in enumerate(zip(LENGTHS, full, strict=True)):
            _close(out[row], expected[n - 1 + step], atol, f"batch row {row}, decode step {step}{how}")
    for layer in batch:
        layer.filter([1])
    position = LENGTHS[1] + DECODE_STEPS  # the survivor decodes on alone, without a mask
    alone = np.array(decode(mx.array([prompts[1][position]]), batch, None)[0])
    _close(alone, full[1][position], atol, f"the remaining row after the other left{how}")
    # One sequence in its own per-layer caches, as the drafting decoders keep it.
    prompt, expected = prompts[0], full[0]
    cache = arch.make_cache(model)
    model(mx.array([prompt[:-2]]), cache=cache)
    for position in (len(prompt) - 2, len(prompt) - 1):
        single = np.array(decode(mx.array([prompt[position]]), cache, None)[0])
        _close(single, expected[position], atol, f"decoding one sequence, position {position}{how}")


def check_hidden_states(
    arch: Architecture, model: nn.Module, prompts: list[list[int]], atol: float
) -> None:
    """``hidden_states`` (what embeddings pool): ``[B, L, D]``; a right-padded row's real
    positions equal the row alone; chunks through a cache equal one pass."""
    alone = [np.array(arch.hidden_states(model, mx.array([p]))[0]) for p in prompts]
    width = alone[0].shape[-1]
    for states, prompt in zip(alone, prompts, strict=True):
        assert states.shape == (len(prompt), width), f"hidden states shape {states.shape}"
        assert np.isfinite(states).all(), "non-finite hidden states"
    width = max(len(p) for p in prompts)
    padded = mx.array([p + [0] * (width - len(p)) for p in prompts])
    batched = np.array(arch.hidden_states(model, padded))
    for row, (prompt, expected) in enumerate(zip(prompts, alone, strict=True)):
        _close(batched[row, : len(prompt)], expected, atol, f"hidden states of right-padded row {row}")
    prompt, expected = prompts[0], alone[0]
    cache = arch.make_cache(model)
    third = len(prompt) // 3
    pieces = [prompt[:third], prompt[third : 2 * third], prompt[2 * third :]]
    chunked = [np.array(arch.hidden_states(model, mx.array([piece]), cache)[0]) for piece in pieces]
    _close(np.concatenate(chunked), expected, atol, "hidden states computed in chunks through a cache")


def _close(actual: np.ndarray, expected: np.ndarray, atol: float, what: str) -> None:
    worst = float(np.abs(actual - expected).max())
    assert worst <= atol, f"{what}: logits differ by {worst:.2e} (> {atol:g})"
