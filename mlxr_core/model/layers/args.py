"""Config dataclasses: the Hugging Face keys a graph reads, built from a tolerant config dict.

Tolerant of keys a graph does not read, strict about the values it does: every declared field is
checked against its annotation (an ``int`` field takes an integer or an integral float, a ``float``
field a finite number, ...) and against :attr:`ConfigArgs.limits`, before anything is built from
it, so an absurd checkpoint (``num_hidden_layers: 1e9``, a head count of 0, a NaN rope base) is a
:class:`~mlxr_core.errors.ModelLoadError` naming the key and value, not a crash in the graph.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from typing import Any, ClassVar, TypeVar

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers.config_eras import FULL, SLIDING, current_config

ArgsT = TypeVar("ArgsT", bound="ConfigArgs")

#: MLX dimensions are 32-bit signed integers.
MAX_DIM = 2**31 - 1
#: The smallest positive float: a lower bound that reads "greater than zero".
POSITIVE = sys.float_info.min


@dataclasses.dataclass
class ConfigArgs:
    """Base of every architecture's config class: :meth:`from_config` keeps the keys the class
    declares, ignores the rest, names the required ones that are missing and checks each value."""

    #: The family's name in error messages (``"the llama config lacks ..."``).
    family = "model"
    #: field -> other config keys that mean it, read when the field's own key is absent (e.g.
    #: transformers 5 saves Qwen3-MoE's ``num_experts`` as ``num_local_experts``).
    aliases: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: field -> (lowest, highest) value a checkpoint may give a numeric field (inclusive); fields
    #: not listed only need the right type (and, for floats, to be finite).
    limits: ClassVar[dict[str, tuple[float, float]]] = {}
    #: Keys that change the math, for a class that does not declare them: key -> the values under
    #: which this graph computes what the checkpoint means (every entry of a list). Another value
    #: is refused, naming the key: never served as if it were one of these.
    computes: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @classmethod
    def from_config(cls: type[ArgsT], config: dict[str, Any]) -> ArgsT:
        """Build from a checkpoint config of either transformers era
        (:func:`~mlxr_core.model.layers.config_eras.current_config`), ignoring keys this graph does
        not use unless they would change its math (:meth:`check_unread`). A ``null`` for a field
        that cannot be None counts as absent (the field's default); a value of the wrong type or
        outside :attr:`limits` raises ModelLoadError naming the key (``exc.key``) and the value."""
        fields = dataclasses.fields(cls)
        config = current_config(config, {field.name for field in fields})
        for name, others in cls.aliases.items():
            for other in others:
                if name not in config and other in config:
                    config[name] = config[other]
        hints = field_types(cls)
        known = {
            field.name: check_value(
                field.name, config[field.name], hints[field.name], cls.limits.get(field.name)
            )
            for field in fields
            if field.name in config
            # A null where the graph needs a value means the default (an optional field keeps it).
            and (config[field.name] is not None or type(None) in typing.get_args(hints[field.name]))
        }
        missing = [
            field.name
            for field in fields
            if field.default is dataclasses.MISSING
            and field.default_factory is dataclasses.MISSING
            and field.name not in known
        ]
        if missing:
            raise ModelLoadError(f"the {cls.family} config lacks {', '.join(missing)}", key=missing[0])
        args = cls(**known)
        args.check_unread(config)
        return args

    def layer_pattern(self, key: str) -> list[str] | None:
        """What this graph computes per layer for a per-layer key it does not declare
        (``layer_types``, ``mlp_layer_types``), or None where it has no layers to say it of."""
        return None

    def check_unread(self, config: dict[str, Any]) -> None:
        """Refuse, naming the key, a config key this class does not declare that asks for other
        math than the graph computes: a value outside :attr:`computes`, or a per-layer pattern
        other than :meth:`layer_pattern`'s."""
        declared = {field.name for field in dataclasses.fields(self)}
        for key, allowed in self.computes.items():
            value = config.get(key)
            if key in declared or value is None:
                continue
            wrong = [item for item in (value if isinstance(value, list) else [value]) if item not in allowed]
            if wrong:
                shown = ", ".join(map(repr, allowed))
                raise ModelLoadError(f"{wrong[0]!r}: the {self.family} graph computes only {shown}", key=key)
        for key in ("layer_types", "mlp_layer_types"):
            value, pattern = config.get(key), self.layer_pattern(key)
            if key in declared or value is None or pattern is None:
                continue
            if value != pattern:
                raise ModelLoadError(
                    f"{_short(value)} is not what the {self.family} graph computes ({_short(pattern)})", key=key
                )


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """Each field's annotation, resolved (once per class)."""
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return _FIELD_TYPES[cls]


def check_value(key: str, value: Any, hint: Any, limits: tuple[float, float] | None = None) -> Any:
    """``value`` as a field annotated ``hint`` holds it (an integral float becomes an int), or
    ModelLoadError naming ``key``. Annotations other than ``int``, ``float``, ``bool``, ``str``,
    lists and dicts of them, and their optional forms pass through unchecked."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        others = [arg for arg in args if arg is not type(None)]
        return check_value(key, value, others[0], limits) if len(others) == 1 else value
    if hint is bool:
        if type(value) is int and value in (0, 1):
            return bool(value)
        if not isinstance(value, bool):
            raise _wrong(key, value, "true or false")
        return value
    if hint is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)  # JSON writers that print 4096.0
        if not isinstance(value, int) or isinstance(value, bool):
            raise _wrong(key, value, "an integer")
        low, high = limits or (-MAX_DIM, MAX_DIM)
        if not low <= value <= high:
            raise _wrong(key, value, f"an integer in [{int(low)}, {int(high)}]")
        return value
    if hint is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise _wrong(key, value, "a finite number")
        if limits is not None and not limits[0] <= value <= limits[1]:
            raise _wrong(key, value, _number_in(*limits))
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise _wrong(key, value, "a string")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _wrong(key, value, "a list")
        item = args[0] if args else Any
        return [check_value(f"{key}[{i}]", v, item, limits) for i, v in enumerate(value)]
    if origin is dict and not isinstance(value, dict):
        raise _wrong(key, value, "an object")
    return value


def _wrong(key: str, value: Any, expected: str) -> ModelLoadError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ModelLoadError(f"{shown} is not {expected}", key=key)


def _short(pattern: Any) -> str:
    """A per-layer list, runs of one value counted: ``['dense', 3 x 'sparse']``."""
    if not isinstance(pattern, list):
        return repr(pattern)
    runs: list[list[Any]] = []
    for item in pattern:
        if runs and runs[-1][0] == item:
            runs[-1][1] += 1
        else:
            runs.append([item, 1])
    shown = ", ".join(repr(item) if n == 1 else f"{n} x {item!r}" for item, n in runs)
    return f"[{shown}]" if len(shown) <= 120 else f"[{shown[:117]}...]"


def _number_in(low: float, high: float) -> str:
    above = "a positive number" if low == POSITIVE else f"a number >= {low:g}"
    return above if high == math.inf else f"{above} and <= {high:g}"


#: Numeric keys of ``rope_scaling`` that must be finite and positive when present.
ROPE_SCALING_POSITIVE = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
)
#: Numeric keys of ``rope_scaling`` that must be finite when present.
ROPE_SCALING_FINITE = ("attention_factor", "mscale", "mscale_all_dim")


@dataclasses.dataclass
class TransformerArgs(ConfigArgs):
    """The keys most decoder-only transformers share (Hugging Face names and defaults)."""

    #: Far above any released model, far below what would exhaust memory building the graph.
    limits = {
        "hidden_size": (1, 1 << 20),
        "num_hidden_layers": (1, 1 << 12),
        "intermediate_size": (1, 1 << 22),
        "num_attention_heads": (1, 1 << 12),
        "num_key_value_heads": (1, 1 << 12),
        "head_dim": (1, 1 << 14),
        "vocab_size": (1, 1 << 24),
        "rms_norm_eps": (POSITIVE, 1.0),
        "rope_theta": (1.0, 1e15),
        "rope_freq_factors": (POSITIVE, math.inf),
        "partial_rotary_factor": (POSITIVE, 1.0),
        "max_position_embeddings": (1, MAX_DIM),
        "sliding_window": (0, MAX_DIM),
        # Keys of the families built on this class, checked where a family declares them.
        "rope_local_base_freq": (1.0, 1e15),
        "original_max_position_embeddings": (1, MAX_DIM),
        "query_pre_attn_scalar": (POSITIVE, math.inf),
        "final_logit_softcapping": (0.0, math.inf),
        "global_head_dim": (1, 1 << 14),
        "num_global_key_value_heads": (1, 1 << 12),
        "num_experts": (0, 1 << 14),
        "num_local_experts": (1, 1 << 14),
        "num_experts_per_tok": (1, 1 << 14),
        "moe_intermediate_size": (1, 1 << 22),
        "shared_expert_intermediate_size": (0, 1 << 22),
        "decoder_sparse_step": (1, 1 << 12),
        "mlp_only_layers": (0, 1 << 12),
    }

    #: The gated MLP's activation these graphs compute (SwiGLU), and attention as a causal LM's.
    computes = {"hidden_act": ("silu", "swish"), "use_bidirectional_attention": (False,)}
    #: Every layer's feed-forward kind (``mlp_layer_types``' words), where it is one for all.
    mlp_kind: ClassVar[str] = "dense"

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    #: llama.cpp's per-frequency divisors (GGUF ``rope_freqs.weight``), the stored form of llama3 scaling.
    rope_freq_factors: list[float] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None and self.hidden_size < self.num_attention_heads:
            raise ModelLoadError(
                f"hidden_size = {self.hidden_size} is smaller than num_attention_heads = "
                f"{self.num_attention_heads}: no head_dim follows from them",
                key="hidden_size",
            )
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_key_value_heads = {self.num_key_value_heads} does not divide "
                f"num_attention_heads = {self.num_attention_heads}",
                key="num_key_value_heads",
            )
        rope_dims = self.rope_dims
        if rope_dims < 2 or rope_dims % 2:
            raise ModelLoadError(
                f"partial_rotary_factor = {self.partial_rotary_factor} of head_dim {self.head_dim} "
                f"gives {rope_dims} rotary dimensions; RoPE needs a positive even number",
                key="partial_rotary_factor",
            )
        factors = self.rope_freq_factors
        if factors is not None and len(factors) != rope_dims // 2:
            raise ModelLoadError(
                f"rope_freq_factors holds {len(factors)} values; the {rope_dims} rotary "
                f"dimensions need {rope_dims // 2}",
                key="rope_freq_factors",
            )
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)

    def layer_pattern(self, key: str) -> list[str] | None:
        """Every layer alike: attending within ``sliding_window`` where one is set (Mistral's
        rule; families with other rules declare ``layer_types``), its MLP :attr:`mlp_kind`."""
        kind = (SLIDING if self.sliding_window else FULL) if key == "layer_types" else self.mlp_kind
        return [kind] * self.num_hidden_layers

    @property
    def kv_heads(self) -> int:
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @property
    def dims(self) -> int:
        """The per-head size (``head_dim``, defaulted in ``__post_init__``)."""
        assert self.head_dim is not None
        return self.head_dim

    @property
    def rope_dims(self) -> int:
        return int(self.dims * self.partial_rotary_factor)

    def kernel_shapes(self) -> dict[str, Any]:
        """Shapes kernels check: head dim, head counts, rotary dims and the mask kinds used."""
        return {
            "head_dim": self.head_dim,
            "n_heads": self.num_attention_heads,
            "n_kv_heads": self.num_key_value_heads,
            "rope_dims": self.rope_dims,
            "rope_traditional": self.rope_traditional,
            "masks": ("causal", "array"),
        }


def check_rope_scaling(scaling: dict[str, Any], key: str = "rope_scaling") -> None:
    """Refuse a ``rope_scaling`` whose numbers would divide by zero or give NaN frequencies: each
    factor finite (and positive where it divides), the factor lists finite and positive, and
    llama3's two frequency factors distinct."""
    for name in (*ROPE_SCALING_POSITIVE, *ROPE_SCALING_FINITE):
        value = scaling.get(name)
        if value is None:
            continue
        lowest = POSITIVE if name in ROPE_SCALING_POSITIVE else -math.inf
        check_value(f"{key}.{name}", value, float, (lowest, math.inf))
    for name in ("short_factor", "long_factor"):
        if scaling.get(name) is not None:
            check_value(f"{key}.{name}", scaling[name], list[float], (POSITIVE, math.inf))
    low, high = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
    if low is not None and low == high:
        raise ModelLoadError(
            f"{key}.low_freq_factor and high_freq_factor are both {low}: llama3 scaling divides "
            "by their difference",
            key=key,
        )
