"""Config dataclasses: the Hugging Face keys a graph reads, built from a tolerant config dict."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

from mlxr_core.errors import ModelLoadError

ArgsT = TypeVar("ArgsT", bound="ConfigArgs")


@dataclasses.dataclass
class ConfigArgs:
    """Base of every architecture's config class: :meth:`from_config` keeps the keys the class
    declares, ignores the rest and names the required ones that are missing."""

    #: The family's name in error messages (``"the llama config lacks ..."``).
    family = "model"
    #: field -> other config keys that mean it, read when the field's own key is absent (e.g.
    #: transformers 5 saves Qwen3-MoE's ``num_experts`` as ``num_local_experts``).
    aliases: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def from_config(cls: type[ArgsT], config: dict[str, Any]) -> ArgsT:
        """Build from a checkpoint config, ignoring keys this graph does not use."""
        fields = dataclasses.fields(cls)
        config = dict(config)
        for name, others in cls.aliases.items():
            for other in others:
                if name not in config and other in config:
                    config[name] = config[other]
        known = {field.name: config[field.name] for field in fields if field.name in config}
        missing = [
            field.name
            for field in fields
            if field.default is dataclasses.MISSING
            and field.default_factory is dataclasses.MISSING
            and field.name not in known
        ]
        if missing:
            raise ModelLoadError(f"the {cls.family} config lacks {', '.join(missing)}")
        return cls(**known)


@dataclasses.dataclass
class TransformerArgs(ConfigArgs):
    """The keys most decoder-only transformers share (Hugging Face names and defaults)."""

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
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

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
