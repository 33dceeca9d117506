"""Kernel selection: (op, backend) implementations chosen per model, validated with reasons.

A kernel backend is an object with a ``supports(ctx)`` method returning the list of reasons it
cannot run in ``ctx`` (empty when it can) and an ``op`` callable with the op's signature:

- ``attention(q, k, v, *, scale, mask, sinks=None)``: q ``[B, Hq, L, D]``, k/v ``[B, Hkv, S, D]``,
  mask ``None | "causal" | mx.array`` (additive or boolean, broadcastable to ``[B, Hq, L, S]``); GQA
  when ``Hq`` is a multiple of ``Hkv``. ``sinks`` ``[Hq]`` (gpt-oss) is one learned logit per head
  that joins each softmax, never masked, and gets no value (its column is dropped after the
  softmax); it is passed only where the architecture's kernel context has ``"sinks": True``, and a
  backend that cannot take it refuses that context. Returns ``[B, Hq, L, D]``. Same contract as
  ``mx.fast.scaled_dot_product_attention``.
- ``rms_norm(x, weight, eps)``: as ``mx.fast.rms_norm``.
- ``add_rms_norm(x, residual, weight, eps) -> (h, normed)``: a residual add and the RMS norm
  after it, ``h = x + residual`` and ``rms_norm(h, weight, eps)`` (a decoder block's attention
  residual and its MLP's input norm: one kernel where a backend fuses them).
- ``rope(x, dims, *, traditional, base, scale, offset, freqs=None)``: as ``mx.fast.rope``.
- ``gated_activation(gate, up, *, activation) -> act(gate) * up``: a gated MLP's activation,
  ``activation`` ``"silu"`` (SwiGLU: ``gate * sigmoid(gate) * up``) or ``"gelu_tanh"`` (GeGLU:
  ``0.5 * gate * (1 + tanh(sqrt(2 / pi) * (gate + 0.044715 * gate**3))) * up``); ``gate`` and
  ``up`` share one shape and dtype and may be strided views (the two halves of one fused
  ``gate_up_proj`` output); returns their shape and dtype.
- ``quantized_matmul(x, w, scales, biases, *, transpose, group_size, bits, mode)``: as
  ``mx.quantized_matmul``; every quantized linear layer of a model (the decode step's weight
  reads) goes through it.
- ``gather_matmul(x, w, scales, biases, *, indices, transpose, group_size, bits, mode,
  sorted_indices)``: one matrix per row picked from a stack of experts, as ``mx.gather_qmm`` with
  ``rhs_indices=indices`` (``scales`` None: dense ``w``, as ``mx.gather_mm`` of ``w`` transposed
  when ``transpose``). ``w`` is ``[E, out, in]`` (packed on the last axis); ``x`` ``[..., 1, in]``
  broadcasts against ``indices`` ``[...]``; returns ``[..., 1, out]``. Every mixture-of-experts
  layer's expert matmuls go through it.
- ``route(logits, *, top_k, scoring, normalize, bias=None, groups=1, top_groups=1) -> (indices,
  weights)``: a mixture of experts' router: ``logits`` ``[..., E]`` scored by ``softmax`` (over
  all experts) or ``sigmoid``, in float32, the ``top_k`` best experts ``[..., k]`` (uint32, in
  any order) and their scores (float32), rescaled to sum to 1 when ``normalize``. DeepSeek-V3's
  choice: ``bias`` ``[E]`` added to the scores the experts are chosen on (not to their
  weights); ``groups`` > 1 equal groups of experts, ranked by the sum of their two best biased
  scores, of which only the ``top_groups`` best are chosen from. Those three are passed only by
  a layer that uses them (see :func:`mlxr_core.model.layers.moe.route`).
- ``gated_delta(q, k, v, g, beta, state) -> (out, state)``: the gated delta rule, the recurrence of
  Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5). ``q``, ``k`` ``[B, L, Hk, Dk]``, already
  L2-normalized per head by the caller, ``q`` also scaled by ``Dk**-0.5`` (the op normalizes
  nothing); ``v`` ``[B, L, Hv, Dv]`` with ``Hv`` a multiple of ``Hk``: key/query head ``j`` serves
  value heads ``j*r .. j*r + r - 1`` (``r = Hv // Hk``, torch's ``repeat_interleave``); ``g``
  ``[B, L, Hv]`` the log decay (<= 0, float32), ``beta`` ``[B, L, Hv]`` in (0, 1); ``state``
  ``[B, Hv, Dk, Dv]`` float32, or None for zeros. Per step ``t`` and value head:
  ``S = exp(g_t) S``, ``delta = beta_t (v_t - S^T k_t)``, ``S = S + outer(k_t, delta)``,
  ``out_t = S^T q_t``. Returns ``out`` ``[B, L, Hv, Dv]`` in ``v``'s dtype and the final state
  ``[B, Hv, Dk, Dv]`` (float32), computed in float32. An architecture with such layers puts
  ``linear_key_head_dim`` and ``linear_value_head_dim`` (its config's names) in the kernel context;
  backends written for some head dims only refuse the others there.
- ``kimi_delta(q, k, v, g, beta, state) -> (out, state)``: the Kimi delta rule (KDA: Kimi Linear,
  GLM-5-Next), the gated delta rule with a decay per key channel. ``q``, ``k`` ``[B, L, H, Dk]``
  (normalized and scaled as for ``gated_delta``), ``v`` ``[B, L, H, Dv]`` (one value head per key
  head), ``g`` ``[B, L, H, Dk]`` the log decay of each key channel (<= 0, float32), ``beta``
  ``[B, L, H]``, ``state`` ``[B, H, Dk, Dv]`` float32 or None. Per step ``t`` and head:
  ``S = diag(exp(g_t)) S``, then as ``gated_delta``. Returns ``out`` ``[B, L, H, Dv]`` in ``v``'s
  dtype and the final state (float32).
- ``ssd(q, k, v, g, beta, state) -> (out, state)``: Mamba-2's selective state space recurrence
  (SSD: Nemotron-H), ``gated_delta``'s signature: ``q`` (C) and ``k`` (B) ``[B, L, H, N]`` (the
  caller repeats a group's B and C over its heads), ``v`` (x) ``[B, L, H, P]``, ``g`` ``[B, L, H]``
  the log decay (``A * dt`` <= 0, float32), ``beta`` ``[B, L, H]`` the step size ``dt``, ``state``
  ``[B, H, P, N]`` float32 or None. Per step ``t`` and head: ``S = exp(g_t) S + beta_t v_t k_t^T``,
  ``out_t = S q_t`` (no ``D`` skip, no gate). Returns ``out`` ``[B, L, H, P]`` in ``v``'s dtype
  and the final state (float32).

A ``quantized_matmul`` or ``gather_matmul`` backend is also asked, once the model's weights are
packed, about each quantization mode they use: the context then carries ``quant_mode``
(``"affine"``, ``"mxfp4"``, ``"mxfp8"`` or ``"nvfp4"``, MLX's modes) in its ``shapes``, and a
backend that cannot multiply that packing here returns the reasons
(:meth:`KernelSet.packing_reasons`); the load is then refused naming ``quantization.mode``.

Selection happens once per model, never in the token loop: :func:`bind_kernels` resolves every op
to a plain callable and returns a :class:`KernelSet`. An explicit choice that cannot run is a
startup error listing the backend's reasons; ``auto`` takes the first backend by priority that can
run and logs which (and why the ones above it could not). :func:`kernel_report` is the same
decision for every backend at once, for ``mlxr kernels``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from mlxr_core.errors import KernelUnavailable, UnknownName

if TYPE_CHECKING:
    from mlxr_core.registry import Registry

log = logging.getLogger(__name__)

#: Every op an architecture may ask for, in the order ``mlxr kernels`` lists them.
OPS = (
    "attention", "rms_norm", "add_rms_norm", "rope", "gated_activation", "quantized_matmul",
    "gather_matmul", "route", "gated_delta", "kimi_delta", "ssd",
)


@attrs.frozen
class KernelContext:
    """What a backend needs to know to say whether it can run."""

    op: str
    device: str  # "cpu" or "gpu"
    platform: str  # "metal", "cuda" or "cpu"
    dtype: str  # activation dtype, e.g. "float32"
    shapes: Mapping[str, Any] = attrs.field(factory=dict)  # head_dim, n_heads, n_kv_heads, ...


class KernelBackend(Protocol):
    """A backend for one op. It may also carry a one-line ``summary`` (what it fuses, what it
    delegates), which ``mlxr kernels`` shows, and, for ``quantized_matmul``, ``keeps_packed``:
    True where it multiplies packed weights at least as fast as dense ones on a CPU, so
    ``quantization: auto`` keeps them packed there."""

    op: Callable[..., Any]

    def supports(self, ctx: KernelContext) -> list[str]:
        """Reasons this backend cannot run in ``ctx``; empty when it can."""
        ...


@attrs.frozen
class KernelSet:
    """The resolved kernels of one model: plain callables, looked up once."""

    attention: Callable[..., Any]
    rms_norm: Callable[..., Any]
    add_rms_norm: Callable[..., Any]
    rope: Callable[..., Any]
    gated_activation: Callable[..., Any]
    quantized_matmul: Callable[..., Any]
    gather_matmul: Callable[..., Any]
    route: Callable[..., Any]
    gated_delta: Callable[..., Any]
    kimi_delta: Callable[..., Any]
    ssd: Callable[..., Any]
    #: op -> backend name, for logs and ``mlxr info``.
    chosen: Mapping[str, str] = attrs.field(factory=dict)
    #: The chosen ``quantized_matmul`` backend's ``keeps_packed`` (see :class:`KernelBackend`).
    keeps_packed: bool = False
    #: ``(op, mode)`` -> why the backend chosen for ``op`` cannot run weights packed in ``mode``.
    packing_check: Callable[[str, str], list[str]] = attrs.field(default=lambda op, mode: [])

    def packing_reasons(self, op: str, mode: str) -> list[str]:
        """Why the backend bound for ``op`` (``quantized_matmul`` or ``gather_matmul``) cannot
        multiply weights packed in quantization ``mode`` here; empty when it can."""
        return self.packing_check(op, mode)


def current_platform() -> tuple[str, str]:
    """(device, platform) of MLX's default device: ("gpu", "metal"|"cuda") or ("cpu", "cpu")."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.gpu:
        if mx.metal.is_available():
            return "gpu", "metal"
        return "gpu", "cuda"
    return "cpu", "cpu"


def backends_for(registry: Registry, op: str) -> list[tuple[str, int]]:
    """(backend, priority) registered for ``op``, highest priority first."""
    found = []
    for name in registry.names():
        entry_op, _, backend = name.partition(":")
        if entry_op == op:
            found.append((backend, int(registry.entry(name).meta.get("priority", 0))))
    return sorted(found, key=lambda item: -item[1])


def kernel_preferences(choice: str) -> list[str]:
    """The backends a choice names, in order: ``"cpu_int8"``, ``"auto"``, or a preference list
    ``"cpu_int8, auto"`` (the first of them that can run here)."""
    return [name.strip() for name in choice.split(",")]


def select_kernel(registry: Registry, ctx: KernelContext, choice: str = "auto") -> tuple[str, Any]:
    """Pick the backend for ``ctx.op``: the named one (validated), the first of a preference list
    (``"cpu_int8, auto"``) that can run, or with ``auto`` the first supported by priority.

    :raises UnknownName: ``choice`` names no registered backend of the op.
    :raises KernelUnavailable: the named backend, every one of the list, or with ``auto`` every
        backend, cannot run in ``ctx``; the message lists each one's reasons.
    """
    candidates = backends_for(registry, ctx.op)
    known = [known_name for known_name, _ in candidates]
    preferences = kernel_preferences(choice)
    for name in preferences:
        if name != "auto" and name not in known:
            raise UnknownName(f"{ctx.op} kernel backend", name, known)
    passed: list[str] = []
    for name in preferences:
        if name == "auto":
            return _first_supported(registry, ctx, candidates, passed)
        backend = registry.get(f"{ctx.op}:{name}")
        reasons = backend.supports(ctx)
        if not reasons:
            if passed:
                log.info("kernel %s: chose %s (skipped %s)", ctx.op, name, " | ".join(passed))
            return name, backend
        if len(preferences) == 1:
            raise KernelUnavailable(
                f"kernels.{ctx.op}: backend {choice!r} cannot run here: " + "; ".join(reasons)
                + " (choose another backend or auto; `mlxr kernels` lists what runs here)"
            )
        passed.append(f"{name}: {'; '.join(reasons)}")
    raise KernelUnavailable(
        f"kernels.{ctx.op}: none of {choice!r} can run here: " + " | ".join(passed)
        + " (add auto to the list, or choose another backend; `mlxr kernels` lists what runs here)"
    )


def _first_supported(
    registry: Registry, ctx: KernelContext, candidates: list[tuple[str, int]], passed: list[str]
) -> tuple[str, Any]:
    """``auto``: the first backend by priority that can run in ``ctx`` (after the ``passed`` ones of
    a preference list)."""
    rejected = list(passed)
    for name, _ in candidates:
        backend = registry.get(f"{ctx.op}:{name}")
        reasons = backend.supports(ctx)
        if not reasons:
            # What it is and what was passed over: the load's record of why this backend runs.
            summary = f": {backend.summary}" if getattr(backend, "summary", "") else ""
            if rejected:
                log.info("kernel %s: auto chose %s%s (skipped %s)", ctx.op, name, summary, " | ".join(rejected))
            else:
                log.info("kernel %s: auto chose %s%s", ctx.op, name, summary)
            return name, backend
        rejected.append(f"{name}: {'; '.join(reasons)}")
    raise KernelUnavailable(
        f"no kernel backend for {ctx.op} can run here ({' | '.join(rejected) or 'none registered'})"
    )


def bind_kernels(
    registry: Registry,
    *,
    dtype: str,
    shapes: Mapping[str, Any],
    choices: Mapping[str, str] | None = None,
) -> KernelSet:
    """Resolve every op in :data:`OPS` for one model.

    ``choices`` maps an op to a backend name or ``auto`` (the merged global and per-model
    ``kernels:``); ops it leaves out are ``auto``. A choice for an op that is not in :data:`OPS`
    is an error rather than silently ignored.
    """
    device, platform = current_platform()
    choices = choices or {}
    unknown = sorted(set(choices) - set(OPS))
    if unknown:
        raise UnknownName("kernel op", unknown[0], OPS)
    chosen: dict[str, str] = {}
    ops: dict[str, Callable[..., Any]] = {}
    bound: dict[str, tuple[KernelContext, KernelBackend]] = {}
    keeps_packed = False
    for op in OPS:
        ctx = KernelContext(op=op, device=device, platform=platform, dtype=dtype, shapes=shapes)
        name, backend = select_kernel(registry, ctx, choices.get(op, "auto"))
        chosen[op] = name
        ops[op] = backend.op
        bound[op] = (ctx, backend)
        if op == "quantized_matmul":
            keeps_packed = bool(getattr(backend, "keeps_packed", False))  # optional, see KernelBackend

    def packing_check(op: str, mode: str) -> list[str]:
        ctx, backend = bound[op]
        return list(backend.supports(attrs.evolve(ctx, shapes={**ctx.shapes, "quant_mode": mode})))

    return KernelSet(chosen=chosen, keeps_packed=keeps_packed, packing_check=packing_check, **ops)


def kernel_report(
    registry: Registry,
    *,
    dtype: str,
    shapes: Mapping[str, Any],
    device: str | None = None,
    platform: str | None = None,
) -> list[dict[str, Any]]:
    """Every registered backend of every op, asked whether it can run in one context.

    One JSON-ready row per (op, backend), ops in :data:`OPS` order (then any other registered op)
    and backends by priority: ``supported`` with the ``reasons`` when not, ``auto`` on the backend
    ``auto`` would choose, the providing ``plugin`` and the backend's ``summary``. A backend that
    fails to import is reported as unsupported with the error, not raised.
    """
    if device is None or platform is None:
        device, platform = current_platform()
    registered = {name.partition(":")[0] for name in registry.names()}
    rows = []
    for op in [*OPS, *sorted(registered - set(OPS))]:
        ctx = KernelContext(op=op, device=device, platform=platform, dtype=dtype, shapes=shapes)
        auto_taken = False
        for name, priority in backends_for(registry, op):
            entry = registry.entry(f"{op}:{name}")
            summary = ""
            try:
                backend = entry.load()
                reasons = list(backend.supports(ctx))
                summary = str(getattr(backend, "summary", ""))  # optional, see KernelBackend
            except Exception as exc:  # a broken backend must not hide the others
                reasons = [f"failed to load: {type(exc).__name__}: {exc}"]
            auto = not reasons and not auto_taken
            auto_taken = auto_taken or auto
            rows.append(
                {
                    "op": op,
                    "backend": name,
                    "priority": priority,
                    "plugin": entry.plugin,
                    "supported": not reasons,
                    "reasons": reasons,
                    "auto": auto,
                    "summary": summary,
                }
            )
    return rows
