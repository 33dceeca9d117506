"""Sparse mixtures of experts: a router (the ``route`` kernel) picks ``top_k`` experts per token,
the experts' gated MLPs run through the ``gather_matmul`` kernel (one matmul per projection over a stack of experts, never
a loop), and their outputs are summed with the router's weights; shared experts, where a family
has them, run on every token.

Expert weights are stacked ``[experts, out, in]`` per projection (:class:`SwitchLinear`), as
mlx-lm stores them (``switch_mlp.gate_proj.weight``); architectures' ``sanitize`` stacks the
per-expert tensors of Hugging Face checkpoints. Packed experts stay packed
(:class:`QuantizedSwitchLinear`, built by ``nn.quantize`` through :meth:`SwitchLinear.to_quantized`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.fuse import swiglu

#: From this many (token, expert) pairs on, rows are sorted by expert before the gathered
#: matmuls, so each expert's weights are read once for all its rows (a prompt chunk); below it
#: (decode steps) sorting costs more than it saves.
SORT_FROM = 64


def route(
    logits: mx.array,
    top_k: int,
    *,
    scoring: str = "softmax",
    normalize: bool = True,
    bias: mx.array | None = None,
    groups: int = 1,
    top_groups: int = 1,
) -> tuple[mx.array, mx.array]:
    """The ``top_k`` experts of each token and their weights, from router logits ``[..., E]``.

    ``scoring`` is ``softmax`` (over all experts) or ``sigmoid`` (each expert alone), in float32;
    ``normalize`` rescales the chosen experts' scores to sum to 1 (softmax-then-renormalize is
    softmax over the top-k logits: Mixtral's and gpt-oss's rule; Qwen's with ``norm_topk_prob``).

    DeepSeek-V3's router (``noaux_tc``) adds two rules that only change which experts are chosen,
    never their weights: ``bias`` ``[E]`` (``e_score_correction_bias``) is added to the scores
    the choice is made on, and with ``groups`` > 1 the experts are split into that many equal
    groups, each group ranked by the sum of its two best biased scores, and only the experts of
    the ``top_groups`` best groups can be chosen.
    Returns ``(indices [..., k] uint32, weights [..., k] float32)``."""
    logits = logits.astype(mx.float32)
    if scoring == "softmax":
        scores = mx.softmax(logits, axis=-1, precise=True)
    elif scoring == "sigmoid":
        scores = mx.sigmoid(logits)
    else:
        raise ValueError(f"unknown router scoring {scoring!r} (softmax, sigmoid)")
    choice = scores if bias is None else scores + bias.astype(mx.float32)
    if groups > 1 and top_groups < groups:
        experts = choice.shape[-1]
        grouped = choice.reshape(*choice.shape[:-1], groups, experts // groups)
        ranks = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)  # [..., groups, 1]
        dropped = mx.argpartition(ranks, kth=groups - top_groups - 1, axis=-2)[..., : groups - top_groups, :]
        grouped = mx.put_along_axis(grouped, dropped, mx.array(-math.inf, dtype=mx.float32), axis=-2)
        choice = grouped.reshape(choice.shape)
    indices = mx.argpartition(-choice, kth=top_k - 1, axis=-1)[..., :top_k]
    weights = mx.take_along_axis(scores, indices, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices.astype(mx.uint32), weights


def weighted_sum(outputs: mx.array, weights: mx.array) -> mx.array:
    """The chosen experts' outputs ``[..., k, hidden]`` summed with their router weights ``[..., k]``."""
    return (outputs * weights[..., None].astype(outputs.dtype)).sum(axis=-2)


class SwitchLinear(nn.Module):
    """``experts`` linear layers stacked: ``weight [experts, out, in]`` (and ``bias [experts,
    out]``); called with rows ``x [..., 1, in]`` and the expert of each ``indices [...]``."""

    def __init__(self, in_dims: int, out_dims: int, experts: int, *, kernels: KernelSet, bias: bool = False):
        super().__init__()
        scale = math.sqrt(1.0 / in_dims)
        self.weight = mx.random.uniform(-scale, scale, (experts, out_dims, in_dims))
        if bias:
            self.bias = mx.zeros((experts, out_dims))
        self._gather_matmul = kernels.gather_matmul

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        out: mx.array = self._gather_matmul(
            x, self["weight"], None, None, indices=indices, transpose=True, sorted_indices=sorted_indices
        )
        if "bias" in self:
            out = out + mx.expand_dims(self["bias"][indices], -2)
        return out

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> QuantizedSwitchLinear:
        """The packed form (``nn.quantize`` calls it): same outputs to quantization error."""
        experts, out_dims, in_dims = self["weight"].shape
        layer = QuantizedSwitchLinear(
            in_dims, out_dims, experts, gather_matmul=self._gather_matmul, bias="bias" in self,
            group_size=group_size, bits=bits, mode=mode,
        )
        layer.weight, layer.scales, *biases = mx.quantize(self["weight"], group_size, bits, mode=mode)
        layer.biases = biases[0] if biases else None
        if "bias" in self:
            layer.bias = self["bias"]
        return layer


class QuantizedSwitchLinear(nn.Module):
    """:class:`SwitchLinear` with packed weights (``weight``, ``scales``, ``biases``, as
    ``mx.quantize`` lays out each expert), multiplied packed by the ``gather_matmul`` kernel."""

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        experts: int,
        *,
        gather_matmul: Callable[..., mx.array],
        bias: bool = False,
        group_size: int = 64,
        bits: int = 4,
        mode: str = "affine",
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(
            mx.zeros((experts, out_dims, in_dims)), group_size, bits, mode=mode
        )
        self.biases = biases[0] if biases else None
        if bias:
            self.bias = mx.zeros((experts, out_dims))
        self._gather_matmul = gather_matmul
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        out = self._gather_matmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=sorted_indices,
        )
        if "bias" in self:
            out = out + mx.expand_dims(self["bias"][indices], -2)
        return out


class SwitchGLU(nn.Module):
    """Every expert's gated MLP, ``down(act(gate(x)) * up(x))``, stacked: ``gate_proj``,
    ``up_proj`` and ``down_proj`` are :class:`SwitchLinear`. ``activation`` takes ``(gate, up)``;
    ``top_k`` (the experts a token runs) is what ``mlxr info`` counts as active."""

    def __init__(
        self,
        hidden: int,
        inner: int,
        experts: int,
        *,
        kernels: KernelSet,
        activation: Callable[[mx.array, mx.array], mx.array] = swiglu,
        bias: bool = False,
        top_k: int | None = None,
    ):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.gate_proj = SwitchLinear(hidden, inner, experts, kernels=kernels, bias=bias)
        self.up_proj = SwitchLinear(hidden, inner, experts, kernels=kernels, bias=bias)
        self.down_proj = SwitchLinear(inner, hidden, experts, kernels=kernels, bias=bias)
        self._activation = activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """``x [..., hidden]`` and each token's experts ``indices [..., k]`` -> every chosen
        expert's output, ``[..., k, hidden]``."""
        return gated_experts(x, indices, self.gate_proj, self.up_proj, self.down_proj, self._activation)


#: A stack of experts' projection: ``(rows, picks, sorted_indices) -> outputs`` (:class:`SwitchLinear`).
Projection = Callable[[mx.array, mx.array, bool], mx.array]


def gated_experts(
    x: mx.array,
    indices: mx.array,
    gate: Projection,
    up: Projection,
    down: Projection,
    activation: Callable[[mx.array, mx.array], mx.array],
) -> mx.array:
    """:class:`SwitchGLU`'s computation over any three stacked projections: ``x [..., hidden]``
    and each token's experts ``indices [..., k]`` (rows of the stacks) -> ``[..., k, hidden]``."""
    hidden, k = x.shape[-1], indices.shape[-1]
    lead = indices.shape[:-1]
    rows = x.reshape(-1, 1, 1, hidden)  # [N, 1, 1, H]: broadcasts against [N, k]
    picks = indices.reshape(-1, k)
    order = None
    if picks.size >= SORT_FROM:
        flat = picks.flatten()
        order = mx.argsort(flat)
        rows = rows.reshape(-1, 1, hidden)[order // k]  # [N * k, 1, H], grouped by expert
        picks = flat[order]
    sort = order is not None
    out = down(activation(gate(rows, picks, sort), up(rows, picks, sort)), picks, sort)
    if order is not None:
        out = out[mx.argsort(order)]
    return out.reshape(*lead, k, hidden)


class CorrectedRouter(nn.Module):
    """DeepSeek-V3's router ``gate``: ``weight [experts, hidden]`` and the choice's bias
    ``e_score_correction_bias [experts]`` (see :func:`route`), logits computed in float32. Not a
    linear layer, so no quantization policy packs it (transformers keeps it in float32 too)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = mx.zeros((experts, hidden))
        self.e_score_correction_bias = mx.zeros((experts,))

    def __call__(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32) @ self.weight.astype(mx.float32).T


class SparseMoE(nn.Module):
    """A mixture-of-experts feed-forward layer: router ``gate`` (``[hidden] -> [experts]``),
    stacked experts ``switch_mlp``, and optionally a shared expert run on every token (named
    ``shared_name``: Qwen's ``shared_expert``, DeepSeek's ``shared_experts``), scaled by
    ``sigmoid(shared_expert_gate(x))`` when ``shared_gate`` (Qwen2-MoE).

    DeepSeek-V3's routing: ``corrected`` makes ``gate`` a :class:`CorrectedRouter`, whose bias
    and ``groups`` / ``top_groups`` decide the choice (:func:`route`); ``scale`` multiplies the
    chosen experts' weights (``routed_scaling_factor``)."""

    def __init__(
        self,
        hidden: int,
        inner: int,
        experts: int,
        top_k: int,
        *,
        kernels: KernelSet,
        scoring: str = "softmax",
        normalize: bool = True,
        router_bias: bool = False,
        shared_expert: nn.Module | None = None,
        shared_gate: bool = False,
        shared_name: str = "shared_expert",
        activation: Callable[[mx.array, mx.array], mx.array] = swiglu,
        expert_bias: bool = False,
        corrected: bool = False,
        groups: int = 1,
        top_groups: int = 1,
        scale: float = 1.0,
    ):
        super().__init__()
        self.top_k, self.scoring, self.normalize = top_k, scoring, normalize
        self.groups, self.top_groups, self.scale = groups, top_groups, scale
        self._route = kernels.route
        self.gate = (
            CorrectedRouter(hidden, experts) if corrected else nn.Linear(hidden, experts, bias=router_bias)
        )
        self.switch_mlp = SwitchGLU(
            hidden, inner, experts, kernels=kernels, activation=activation, bias=expert_bias, top_k=top_k
        )
        self.shared_name = shared_name
        if shared_expert is not None:
            setattr(self, shared_name, shared_expert)
            if shared_gate:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def choose(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """The experts of each token of ``x [..., hidden]`` and their weights (:func:`route`)."""
        # DeepSeek's options only where set: a route backend written before them still serves the rest.
        extra: dict[str, Any] = {}
        if isinstance(self.gate, CorrectedRouter):
            extra["bias"] = self.gate.e_score_correction_bias
        if self.groups > 1:
            extra.update(groups=self.groups, top_groups=self.top_groups)
        indices, weights = self._route(
            self.gate(x), top_k=self.top_k, scoring=self.scoring, normalize=self.normalize, **extra
        )
        if self.scale != 1.0:
            weights = weights * self.scale
        return indices, weights

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = self.choose(x)
        out = weighted_sum(self.switch_mlp(x, indices), weights)
        if self.shared_name in self:
            shared = self[self.shared_name](x)
            if "shared_expert_gate" in self:
                shared = mx.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


def active_share(model: nn.Module) -> dict[str, float]:
    """Parameter path prefix -> the share of it one token runs: ``top_k / experts`` for every
    :class:`SwitchGLU` that knows its ``top_k`` (``mlxr info``'s active parameters)."""
    return {
        f"{name}.": module.top_k / module.experts
        for name, module in model.named_modules()
        if isinstance(module, SwitchGLU) and module.top_k
    }


def stack_experts(
    weights: dict[str, mx.array], experts: str, target: str, names: dict[str, str], count: int
) -> dict[str, mx.array]:
    """Hugging Face's per-expert tensors stacked as :class:`SwitchGLU` holds them.

    Every ``{layer}.{experts}.{e}.{name}.{kind}`` (``experts`` such as ``mlp.experts``, ``name`` a
    key of ``names``) becomes row ``e`` of ``{layer}.{target}.{names[name]}.{kind}`` (``target``
    such as ``mlp.switch_mlp``). Tensors of folders that already stack them (mlx-lm's) and every
    other tensor pass through unchanged.

    :raises ModelLoadError: some of the ``count`` experts' tensors are missing (named)."""
    marker = f".{experts}."
    groups: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        layer, found, rest = name.partition(marker)
        parts = rest.split(".")
        if found and len(parts) == 3 and parts[0].isdigit() and parts[1] in names:
            groups.setdefault((layer, parts[1], parts[2]), {})[int(parts[0])] = array
        else:
            out[name] = array
    missing = [
        f"{layer}.{experts}.{e}.{name}.{kind}"
        for (layer, name, kind), rows in groups.items()
        for e in range(count)
        if e not in rows
    ]
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} expert tensor(s) of {count} experts: "
            + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        )
    for (layer, name, kind), rows in groups.items():
        out[f"{layer}.{target}.{names[name]}.{kind}"] = mx.stack([rows[e] for e in range(count)])
    return out


def split_fused_experts(weights: dict[str, mx.array], experts: str, target: str) -> dict[str, mx.array]:
    """transformers 5's fused expert tensors (families it saves without a conversion back) as
    :class:`SwitchGLU` holds them: every ``{layer}.{experts}.gate_up_proj`` (``[E, 2I, H]``, the
    gate's rows first) as ``{layer}.{target}.gate_proj.weight`` and ``up_proj.weight``, every
    ``{layer}.{experts}.down_proj`` (``[E, H, I]``) as ``{layer}.{target}.down_proj.weight``.
    Every other tensor passes through.

    :raises ModelLoadError: a ``gate_up_proj`` that is not ``[experts, 2 * width, hidden]`` (named)."""
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        layer, found, part = name.rpartition(f".{experts}.")
        if not found or part not in ("gate_up_proj", "down_proj"):
            out[name] = array
        elif part == "down_proj":
            out[f"{layer}.{target}.down_proj.weight"] = array
        elif array.ndim != 3 or array.shape[1] % 2:
            raise ModelLoadError(f"shape {list(array.shape)}: expected [experts, 2 * width, hidden]", tensor=name)
        else:
            gate, up = mx.split(array, 2, axis=1)
            out[f"{layer}.{target}.gate_proj.weight"], out[f"{layer}.{target}.up_proj.weight"] = gate, up
    return out
