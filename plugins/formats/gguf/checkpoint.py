"""Read a GGUF file into a :class:`~mlxr_core.model.checkpoint.Checkpoint`.

The ``gguf`` package parses the file (memory-mapped) and dequantizes what MLX cannot hold exactly.
This module maps llama.cpp's metadata keys and tensor names to Hugging Face ones, undoes llama.cpp's
rotary row permutation, and repacks Q4_0/Q4_1/Q8_0 blocks bit-exactly into MLX affine quantization
(see :mod:`mlxr_plugins.formats.gguf.quants`), and Q5_0/Q5_1/Q4_K/Q5_K through their exact
32-element groups, and MXFP4 into MLX's ``mxfp4`` mode. Other block types are dequantized with
``gguf`` (exact) and come with the MLX format nearest to them, for the loader's quantization policy.
"""

from __future__ import annotations

import logging
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QType

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.checkpoint import Checkpoint, QuantSpec, Shard, ShardPlan, TokenizerSpec
from mlxr_core.model.layers.args import TransformerArgs, check_value, field_types
from mlxr_core.model.progress import track
from mlxr_plugins.formats.gguf.quants import (
    EXACT_BITS,
    GROUP_SIZE,
    NEAREST_BITS,
    repack,
    repack_mxfp4,
    unpermute_rows,
)

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
#: Stored as plain floats: read as they are, cast to the model dtype.
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

#: llama.cpp block tensor names -> Hugging Face module names under ``model.layers.N``.
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # Mixtures of experts: the router, the experts stacked ``[experts, out, in]``, a shared expert.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
#: Mixtral files older than llama.cpp's stacked experts hold one tensor per expert
#: (``blk.N.ffn_gate.E.weight``); the architecture stacks them.
PER_EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: Per-architecture overrides of :data:`BLOCK_NAMES`. Gemma's blocks have four norms: llama.cpp's
#: ``ffn_norm`` is the norm before the feed-forward, ``post_*`` the ones after each sub-layer.
ARCH_BLOCK_NAMES = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
    # Phi-3 keeps Hugging Face's fused projections: q, k, v in one matrix, gate and up in ``ffn_up``.
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # gpt-oss: the norm before the experts, the attention sinks (``.weight`` appended; the
    # architecture drops it), and newer files' gate and up experts in one tensor.
    "gpt-oss": {
        "post_attention_norm": "post_attention_layernorm",
        "attn_sinks": "self_attn.sinks",
        "ffn_gate_up_exps": "mlp.switch_mlp.gate_up_proj",
    },
}
#: Gemma 4: Gemma 3's four norms, the experts' own norms, the per-layer input's gate, projection
#: and norm, the router (its ``.scale`` and the down experts' ``.scale`` are the router's scales:
#: :data:`ARCH_PARAMETER_NAMES`), and the experts with gate and up in one tensor.
ARCH_BLOCK_NAMES["gemma4"] = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_gate_exps": "experts.gate_proj",
    "ffn_up_exps": "experts.up_proj",
    "ffn_down_exps": "experts.down_proj",
}
#: Per-architecture block tensors (``blk.N.<name>``) that are a module's parameter other than
#: ``weight`` in Hugging Face naming: llama.cpp appended ``.weight`` or renamed the parameter.
ARCH_PARAMETER_NAMES = {
    "gemma4": {
        "layer_output_scale.weight": "layer_scalar",
        "ffn_gate_inp.scale": "router.scale",
        "ffn_down_exps.scale": "router.per_expert_scale",
    },
}
#: Per-architecture top-level tensors beside :data:`TOP_NAMES` (Gemma 4's per-layer inputs).
ARCH_TOP_NAMES = {
    "gemma4": {
        "per_layer_token_embd": "model.embed_tokens_per_layer",
        "per_layer_model_proj": "model.per_layer_model_projection",
        "per_layer_proj_norm": "model.per_layer_projection_norm",
    },
}
#: The Qwen hybrids (Gated DeltaNet and gated attention): ``attn_qkv``/``attn_gate`` are DeltaNet's
#: q|k|v and z projections, ``ssm_*`` the rest of it; ``ssm_ba`` is Qwen3-Next's b|a projection
#: (grouped by key head, split by :func:`hybrid_weights`), ``ssm_beta``/``ssm_alpha`` Qwen3.5's.
HYBRID_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
#: llama.cpp architecture -> Hugging Face model_type of the Qwen hybrids.
HYBRID_ARCHS = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
ARCH_BLOCK_NAMES.update(dict.fromkeys(HYBRID_ARCHS, HYBRID_BLOCK_NAMES))
#: Architectures whose RMS norms scale by ``1 + w``: llama.cpp's converter stores ``w + 1`` in the
#: file (so ggml multiplies by it directly); we subtract it back to the Hugging Face form. (Not the
#: hybrids' DeltaNet output norm, which scales by ``w``: see :func:`shifted_norm`.)
NORM_PLUS_ONE_ARCHS = frozenset({"gemma3", *HYBRID_ARCHS})

#: Architectures whose Q/K rows llama.cpp permuted for its adjacent-pair ("NORM") RoPE. We restore
#: the Hugging Face row order rather than switching the graph to traditional RoPE, so the arch never
#: depends on which file format its weights came from (the same graph serves safetensors folders).
PERMUTED_ARCHS = frozenset({"llama"})

#: Tensors that are not module weights: llama3 and LongRoPE factors go to the config, the rest is
#: derived.
NOT_WEIGHTS = (
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
    "attn_rot_embd",
)


def shifted_norm(name: str, arch: str) -> bool:
    """Whether tensor ``name`` of an ``arch`` file holds a norm's ``1 + w``."""
    return arch in NORM_PLUS_ONE_ARCHS and name.endswith("norm.weight") and ".ssm_norm." not in name


def hf_name(name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name to its Hugging Face name; unknown names pass through."""
    if name.startswith("blk.") and name.count(".") == 2:  # a parameter without a suffix (ssm_a)
        _, index, rest = name.split(".")
        mapped = ARCH_BLOCK_NAMES.get(arch, {}).get(rest)
        return f"model.layers.{index}.{mapped}" if mapped else name
    module, _, kind = name.rpartition(".")
    if module.startswith("blk."):
        _, index, rest = module.split(".", 2)
        parameter = ARCH_PARAMETER_NAMES.get(arch, {}).get(f"{rest}.{kind}")
        if parameter:
            return f"model.layers.{index}.{parameter}"
        base, _, expert = rest.partition(".")
        if expert.isdigit() and base in PER_EXPERT_NAMES:
            return f"model.layers.{index}.mlp.experts.{expert}.{PER_EXPERT_NAMES[base]}.{kind}"
        mapped = ARCH_BLOCK_NAMES.get(arch, {}).get(rest) or BLOCK_NAMES.get(rest)
        return f"model.layers.{index}.{mapped}.{kind}" if mapped else name
    mapped = TOP_NAMES.get(module) or ARCH_TOP_NAMES.get(arch, {}).get(module)
    return f"{mapped}.{kind}" if mapped else name


class _Reader(gguf.GGUFReader):
    """``GGUFReader``, faster, and naming the tensor whose data does not fit in the file."""

    # The reader slices its np.memmap once per metadata item (~250k times for a 49k-token vocab);
    # every memmap slice pays for memmap.__array_finalize__. A plain ndarray view of the same
    # mapping reads the same bytes, still lazily, about 3.5x faster.
    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._mapped = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[Any], list[int], list[Any]]:
        """Arrays of scalars in one read, arrays of strings in a tight loop: the base class walks
        every element through several numpy views (8 s for Gemma's 262k-token vocabulary).
        ``contents()`` reads the same values either way."""
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_raw = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        item_type = gguf.GGUFValueType(int(item_raw[0]))
        start, n = orig_offs + 12, int(count[0])
        types = [gguf.GGUFValueType.ARRAY, item_type]
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is not None:
            values = self._get(start, scalar, n)
            if values.size != n:
                raise ValueError(f"an array of {n} values at offset {orig_offs} runs past the end")
            return 12 + int(values.nbytes), [item_raw, count, values], [2], types
        if item_type == gguf.GGUFValueType.STRING and n * 8 > len(self.data) - start:
            raise ValueError(f"an array of {n} strings at offset {orig_offs} runs past the end")
        if item_type != gguf.GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        data, offs = self.data, start
        buffer = memoryview(data.data)  # the raw bytes, for struct
        parts: list[Any] = [item_raw, count]
        for _ in range(int(count[0])):
            (length,) = struct.unpack_from("<Q", buffer, offs)
            parts.append(data[offs + 8 : offs + 8 + length])
            offs += 8 + length
        if offs > len(data):
            raise ValueError(f"a string array at offset {orig_offs} runs past the end of the file")
        return offs - orig_offs, parts, list(range(2, len(parts))), types

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        try:
            super()._build_tensors(start_offs, fields)
        except Exception:
            for field in fields:  # only on failure: find the culprit
                try:
                    super()._build_tensors(start_offs, [field])
                except Exception as exc:
                    raise _TensorError(bytes(field.parts[1]).decode(errors="replace"), exc) from exc
            raise


class _TensorError(Exception):
    def __init__(self, tensor: str, cause: Exception):
        super().__init__(f"{tensor}: {cause}")
        self.tensor, self.cause = tensor, cause


def open_reader(path: Path) -> gguf.GGUFReader:
    """Parse ``path``'s header and tensor index (memory-mapped); raise ModelLoadError if corrupt."""
    if not detect(path):
        raise ModelLoadError(
            "not a GGUF file (it does not start with the magic bytes 'GGUF')", path=str(path)
        )
    try:
        return _Reader(path)
    except _TensorError as exc:
        raise ModelLoadError(
            f"truncated or corrupt GGUF: the tensor's data does not fit in the file "
            f"({path.stat().st_size} bytes): {exc.cause}",
            path=str(path),
            tensor=exc.tensor,
        ) from exc.cause
    except Exception as exc:
        raise ModelLoadError(
            f"corrupt GGUF header: {type(exc).__name__}: {exc}", path=str(path)
        ) from exc


def detect(path: Path) -> bool:
    """True when ``path`` is a file starting with the GGUF magic."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == MAGIC
    except OSError:
        return False


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The decoded value of a metadata key, or ``default`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except Exception as exc:
        raise ValueError(f"metadata key {key!r} is unreadable: {type(exc).__name__}: {exc}") from exc
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        # The shortest decimal of the stored float32 (1e-05, not 9.999999747378752e-06).
        value = float(str(np.float32(value)))
    return value


#: Config keys read from ``{arch}.*`` metadata -> the key each is stored under (without the
#: ``{arch}.`` prefix), each checked as :class:`TransformerArgs` types it as soon as it is read.
METADATA_KEYS = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "sliding_window": "attention.sliding_window",
}
#: Other config keys and where they come from; errors about their values (raised when an
#: architecture reads them) name the metadata key.
OTHER_METADATA_KEYS = {
    "partial_rotary_factor": "rope.dimension_count",
    "rope_scaling": "rope.scaling",
    "rope_scaling.factor": "rope.scaling.factor",
    "rope_scaling.original_max_position_embeddings": "rope.scaling.original_context_length",
    "num_experts": "expert_count",
    "num_local_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    "original_max_position_embeddings": "rope.scaling.original_context_length",
}


def config_keys(arch: str) -> dict[str, str]:
    """Config key -> the GGUF metadata key (or tensor) it comes from, for error messages."""
    keys = {name: f"{arch}.{key}" for name, key in {**METADATA_KEYS, **OTHER_METADATA_KEYS}.items()}
    keys["vocab_size"] = "token_embd.weight"
    keys["rope_freq_factors"] = "rope_freqs.weight"
    if arch == "gemma4":
        keys.update({name: f"{arch}.{key}" for name, key in GEMMA4_KEYS.items()})
        keys["vocab_size_per_layer_input"] = "per_layer_token_embd.weight"
    return keys


def read_config(reader: gguf.GGUFReader, tensors: dict[str, Any]) -> dict[str, Any]:
    """The model config in Hugging Face naming, from ``{arch}.*`` metadata and tensor shapes.

    Every value it computes with is checked first (type and range, as the architectures' config
    classes check them): a ModelLoadError names the metadata key and value."""
    arch = field_value(reader, "general.architecture")
    if not arch:
        raise ModelLoadError("general.architecture is missing", key="general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{arch!r} is not a string", key="general.architecture")

    def get(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    types, limits = field_types(TransformerArgs), TransformerArgs.limits
    # Per-layer arrays (Gemma 4's key/value heads and MLP widths) are read by the arch's settings.
    per_layer = PER_LAYER_KEYS.get(arch, ())
    values = {
        name: check_value(f"{arch}.{key}", get(key), types[name], limits.get(name))
        for name, key in METADATA_KEYS.items()
        if get(key) is not None and not (name in per_layer and isinstance(get(key), list))
    }
    heads = values.get("num_attention_heads")
    config: dict[str, Any] = {
        "model_type": arch,
        **values,
        "num_key_value_heads": values.get("num_key_value_heads", heads),
        "rms_norm_eps": values.get("rms_norm_eps", 1e-6),
        "rope_theta": values.get("rope_theta", 10000.0),
        "max_position_embeddings": values.get("max_position_embeddings", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }
    if not config.get("sliding_window"):
        config.pop("sliding_window", None)
    kv_heads = config["num_key_value_heads"]
    if heads and kv_heads and heads % kv_heads:  # llama's rows are unpermuted per head below
        raise ModelLoadError(
            f"{kv_heads} key/value heads do not divide the {heads} attention heads",
            key=f"{arch}.{METADATA_KEYS['num_key_value_heads']}",
        )
    embedding = tensors.get("token_embd.weight")
    if embedding is not None:
        config["vocab_size"] = int(embedding.shape[-1])  # ggml shape: [hidden, vocab]
    elif get("vocab_size") is not None:
        config["vocab_size"] = get("vocab_size")
    head_dim = values.get("head_dim")
    if head_dim is None and heads and config.get("hidden_size"):
        head_dim = config["hidden_size"] // heads
    if head_dim:
        config["head_dim"] = head_dim
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and head_dim and rope_dims != head_dim:
        if type(rope_dims) is not int or not 2 <= rope_dims <= head_dim or rope_dims % 2:
            raise ModelLoadError(
                f"{rope_dims!r} rotary dimensions: expected an even number in [2, {head_dim}] "
                "(the head size)",
                key=f"{arch}.rope.dimension_count",
            )
        config["partial_rotary_factor"] = rope_dims / head_dim

    kind = get("rope.scaling.type")
    if kind and kind != "none":
        scaling: dict[str, Any] = {"rope_type": kind, "factor": get("rope.scaling.factor", 1.0)}
        original = get("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = original
        config["rope_scaling"] = scaling
    elif get("rope.scale_linear"):  # older files
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scale_linear")}
    factors = tensors.get("rope_freqs.weight")
    if factors is not None:
        stored = np.asarray(factors.data, dtype=np.float32)
        if not (np.isfinite(stored) & (stored > 0)).all():
            raise ModelLoadError(
                "rope frequency factors must be finite and positive", tensor="rope_freqs.weight"
            )
        config["rope_freq_factors"] = [float(f) for f in stored]
    if arch == "gemma3":
        config.update(gemma3_settings(config))
    if arch == "phi3":
        config.update(phi3_settings(config, tensors, get))
    if get("expert_count"):
        config.update(moe_settings(arch, config, tensors, get))
    if arch == "gpt-oss":
        config.update(gpt_oss_settings(config, get))
    if arch in HYBRID_ARCHS:
        config.update(hybrid_settings(arch, config, get))
    if arch == "qwen2vl":
        config.update(qwen2vl_settings(get))
    if arch == "qwen3vl":
        config.update(qwen3vl_settings(get))
    if arch == "gemma4":
        config.update(gemma4_settings(config, tensors, get))
        config.pop("rope_freq_factors", None)  # read into rope_parameters
    return {key: value for key, value in config.items() if value is not None}


def qwen2vl_settings(get: Callable[..., Any]) -> dict[str, Any]:
    """llama.cpp's ``qwen2vl``, the language model of Qwen2-VL and Qwen2.5-VL alike (the same
    graph; their projectors differ): Qwen2 with M-RoPE over ``rope.dimension_sections``, served as
    ``qwen2_5_vl``."""
    return {"model_type": "qwen2_5_vl", "rope_scaling": mrope_scaling(get, "qwen2vl")}


def mrope_scaling(get: Callable[..., Any], arch: str) -> dict[str, Any]:
    """M-RoPE's (time, height, width) sections from ``rope.dimension_sections`` (llama.cpp pads
    them to four), as transformers' ``rope_scaling``."""
    sections = get("rope.dimension_sections")
    if not isinstance(sections, list) or len(sections) < 3 or not all(type(s) is int and s >= 0 for s in sections):
        raise ModelLoadError(f"{sections!r}: expected the M-RoPE sections (time, height, width, ...)",
                             key=f"{arch}.rope.dimension_sections")
    return {"type": "mrope", "mrope_section": sections[:3]}


def qwen3vl_settings(get: Callable[..., Any]) -> dict[str, Any]:
    """llama.cpp's ``qwen3vl``: Qwen3 with interleaved M-RoPE over ``rope.dimension_sections``,
    served as ``qwen3_vl`` (always interleaved). ``n_deepstack_layers``, where the file has it, is
    kept to check the mmproj's DeepStack layers against."""
    settings: dict[str, Any] = {"model_type": "qwen3_vl", "rope_scaling": mrope_scaling(get, "qwen3vl")}
    deepstack = get("n_deepstack_layers")
    if deepstack is not None:
        if type(deepstack) is not int or deepstack < 0:
            raise ModelLoadError(f"{deepstack!r}: expected a count of layers", key="qwen3vl.n_deepstack_layers")
        settings["num_deepstack_layers"] = deepstack
    return settings


def hybrid_settings(arch: str, config: dict[str, Any], get: Callable[..., Any]) -> dict[str, Any]:
    """The Qwen hybrids' keys from llama.cpp's ``ssm.*`` metadata (``state_size`` is a key head's
    size, ``group_count`` the key heads, ``time_step_rank`` the value heads, ``inner_size`` all
    value heads' width), the layer pattern, and the file's layout of DeltaNet's projections:
    Qwen3-Next's split like Qwen3.5's (``linear_attn_layout``), Qwen3.5's value heads in
    llama.cpp's tiled order when key heads are fewer (``linear_value_order``). Multi-token
    prediction blocks (``nextn_predict_layers``) are not part of the decoder."""
    value_heads = get("ssm.time_step_rank")
    inner = get("ssm.inner_size")
    key_heads = get("ssm.group_count")
    settings: dict[str, Any] = {
        "model_type": HYBRID_ARCHS[arch],
        "linear_conv_kernel_dim": get("ssm.conv_kernel"),
        "linear_key_head_dim": get("ssm.state_size"),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads if inner and value_heads else None,
        "full_attention_interval": get("full_attention_interval"),
        "linear_attn_layout": "split",
        "norm_topk_prob": True,
    }
    if arch != "qwen3next" and key_heads and value_heads and key_heads != value_heads:
        settings["linear_value_order"] = "tiled"
    extra = get("nextn_predict_layers") or 0
    if isinstance(extra, int) and 0 < extra < (config.get("num_hidden_layers") or 0):
        settings["num_hidden_layers"] = config["num_hidden_layers"] - extra
    if arch == "qwen35":
        settings["num_experts"] = 0
    return settings


def hybrid_weights(
    weights: dict[str, mx.array], quantization: dict[str, QuantSpec], config: dict[str, Any]
) -> None:
    """Undo, in place, what llama.cpp's converter did to the hybrids' DeltaNet tensors: ``ssm_a``
    holds ``-exp(A_log)``, the conv weight lost its middle axis, and Qwen3-Next's b and a
    projections are one matrix whose rows run ``[b (r rows), a (r rows)]`` per key head (split
    here, packed or not, with the packing)."""
    for name in [n for n in weights if n.endswith("linear_attn.A_log")]:
        weights[name] = mx.log(-weights[name].astype(mx.float32))
    for name in [n for n in weights if n.endswith("linear_attn.conv1d.weight")]:
        if weights[name].ndim == 2:
            weights[name] = weights[name][:, None, :]  # [C, K] -> Hugging Face's [C, 1, K]
    for name in [n for n in weights if n.endswith("linear_attn.dt_bias.bias")]:
        weights[name.removesuffix(".bias")] = weights.pop(name)
    key_heads = int(config.get("linear_num_key_heads") or 1)
    r = int(config.get("linear_num_value_heads") or key_heads) // key_heads
    for module in [n.removesuffix(".weight") for n in weights if n.endswith("linear_attn.in_proj_ba.weight")]:
        stem = module.removesuffix("in_proj_ba")
        for part in ("weight", "scales", "biases"):
            array = weights.pop(f"{module}.{part}", None)
            if array is None:
                continue
            grouped = array.reshape(key_heads, 2 * r, *array.shape[1:])
            weights[f"{stem}in_proj_b.{part}"] = grouped[:, :r].reshape(key_heads * r, *array.shape[1:])
            weights[f"{stem}in_proj_a.{part}"] = grouped[:, r:].reshape(key_heads * r, *array.shape[1:])
        spec = quantization.pop(module, None)
        if spec is not None:
            quantization[f"{stem}in_proj_b"] = quantization[f"{stem}in_proj_a"] = spec


def gemma3_settings(config: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma 3 GGUF does not carry, as llama.cpp hard-codes it (``llama-model.cpp``): every
    6th layer global, local rope base 1e4, queries scaled by ``head_dim ** -0.5`` (all sizes but
    27B, whose ``query_pre_attn_scalar`` is ``hidden / heads``), no logit soft-capping."""
    head_dim = config.get("head_dim", 256)
    scalar = head_dim
    if config.get("num_hidden_layers") == 62 and config.get("hidden_size") == 5376:  # 27B
        scalar = config["hidden_size"] // (config.get("num_attention_heads") or 1)
    return {
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": scalar,
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


#: Gemma 4's config keys -> the ``gemma4.*`` metadata key each comes from (overriding
#: :data:`METADATA_KEYS` where llama.cpp stores them differently: ``key_length`` is the global
#: layers' head size, ``key_length_swa`` the sliding ones').
GEMMA4_KEYS = {
    "head_dim": "attention.key_length_swa",
    "global_head_dim": "attention.key_length",
    "num_global_key_value_heads": "attention.head_count_kv",
    "num_kv_shared_layers": "attention.shared_kv_layers",
    "hidden_size_per_layer_input": "embedding_length_per_layer_input",
    "layer_types": "attention.sliding_window_pattern",
    "final_logit_softcapping": "final_logit_softcapping",
    "use_double_wide_mlp": "feed_forward_length",
    "top_k_experts": "expert_used_count",
}
#: Metadata that may hold one value per layer, per architecture (read by its settings function).
PER_LAYER_KEYS = {"gemma4": ("num_key_value_heads", "intermediate_size")}
#: A ``rope_freqs`` factor at least this large stops its pair rotating (llama.cpp writes 1e30).
UNROTATED = 1e20


def gemma4_settings(
    config: dict[str, Any], tensors: dict[str, Any], get: Callable[..., Any]
) -> dict[str, Any]:
    """Gemma 4's config in ``Gemma4TextConfig``'s hub form, from what ``convert_hf_to_gguf`` writes:
    the layer kinds as a per-layer bool array (true: sliding), both head sizes, key/value heads
    and MLP widths that may be per-layer arrays (global layers' heads, double-wide MLPs on the
    shared layers), the shared layers and per-layer input width, both rope bases, and the global
    layers' ``proportional`` RoPE as ``rope_freqs``: 1.0 for each rotated pair, 1e30 for the rest."""
    limits = TransformerArgs.limits
    layers = config.get("num_hidden_layers") or 0

    def read(name: str, hint: Any, limit: Any = None, default: Any = None) -> Any:
        value = get(name)
        return default if value is None else check_value(f"gemma4.{name}", value, hint, limit)

    def refuse(detail: str, name: str) -> ModelLoadError:
        return ModelLoadError(detail, key=f"gemma4.{name}")

    settings: dict[str, Any] = {"model_type": "gemma4"}
    pattern = read("attention.sliding_window_pattern", list[bool])
    if pattern is not None:
        if len(pattern) != layers:
            raise refuse(f"{len(pattern)} layer kinds for {layers} layers", "attention.sliding_window_pattern")
        settings["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        sliding = pattern
    else:  # Hugging Face's default: every sixth layer global, and the last
        sliding = [bool((i + 1) % 6) and i < layers - 1 for i in range(layers)]
    shared = read("attention.shared_kv_layers", int, (0, layers), 0)
    settings["num_kv_shared_layers"] = shared
    first_shared = layers - shared

    global_dim = config.get("head_dim")  # attention.key_length
    settings["global_head_dim"] = global_dim
    head_dim = read("attention.key_length_swa", int, limits["head_dim"], global_dim)
    settings["head_dim"] = head_dim

    heads = config.get("num_attention_heads")
    kv = get("attention.head_count_kv")
    if isinstance(kv, list):
        kv = read("attention.head_count_kv", list[int], limits["num_key_value_heads"])
        local = {n for n, s in zip(kv, sliding, strict=False) if s}
        full = {n for n, s in zip(kv, sliding, strict=False) if not s}
        if len(kv) != layers or len(local) > 1 or len(full) > 1:
            raise refuse(
                f"{kv}: expected {layers} key/value head counts, one for the sliding layers and "
                "one for the global ones",
                "attention.head_count_kv",
            )
        for count in kv:
            if heads and heads % count:
                raise refuse(
                    f"{count} key/value heads do not divide the {heads} attention heads",
                    "attention.head_count_kv",
                )
        settings["num_key_value_heads"] = min(local) if local else min(full)
        if full:
            settings["num_global_key_value_heads"] = min(full)

    widths = get("feed_forward_length")
    if isinstance(widths, list):
        widths = read("feed_forward_length", list[int], limits["intermediate_size"])
        width = widths[0] if widths else 0
        doubled = [width if i < first_shared else 2 * width for i in range(layers)]
        if widths not in (doubled, [width] * layers):
            raise refuse(
                f"{widths}: expected {layers} MLP widths, {width} before the shared layers and "
                f"{width} or {2 * width} from layer {first_shared}",
                "feed_forward_length",
            )
        settings["intermediate_size"] = width
        settings["use_double_wide_mlp"] = widths == doubled and shared > 0

    table = tensors.get("per_layer_token_embd.weight")
    inferred = int(table.shape[0]) // layers if table is not None and layers else 0
    settings["hidden_size_per_layer_input"] = read(
        "embedding_length_per_layer_input", int, (0, 1 << 14), inferred
    )
    if table is not None:
        settings["vocab_size_per_layer_input"] = int(table.shape[-1])  # ggml: [L * P, vocab]
    settings["final_logit_softcapping"] = read(
        "final_logit_softcapping", float, limits["final_logit_softcapping"]
    )

    swa_dims = read("rope.dimension_count_swa", int, (0, 1 << 14))
    if swa_dims is not None and head_dim and swa_dims != head_dim:
        raise refuse(
            f"{swa_dims} rotary dimensions on sliding layers of head size {head_dim}: partial "
            "RoPE on sliding layers is not supported by the gemma4 graph",
            "rope.dimension_count_swa",
        )
    factor = 1.0
    factors = tensors.get("rope_freqs.weight")
    if factors is not None and global_dim:
        stored = np.asarray(factors.data, dtype=np.float32).reshape(-1)
        rotated = int((stored == 1.0).sum())
        if (
            stored.size != global_dim // 2
            or not (stored[:rotated] == 1.0).all()
            or not (stored[rotated:] >= UNROTATED).all()
        ):
            raise ModelLoadError(
                f"expected {global_dim // 2} factors (the global head size's pairs): 1.0 for each "
                "rotated pair, then 1e30 for each unrotated one",
                tensor="rope_freqs.weight",
            )
        factor = 2 * rotated / global_dim
    elif global_dim:
        dims = read("rope.dimension_count", int, (0, 1 << 14), global_dim)
        factor = dims / global_dim
    theta = limits["rope_theta"]
    settings["rope_parameters"] = {
        "sliding_attention": {
            "rope_type": "default",
            "rope_theta": read("rope.freq_base_swa", float, theta, 10_000.0),
        },
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": factor,
            "rope_theta": read("rope.freq_base", float, theta, 1_000_000.0),
        },
    }

    # Keys as values: a global layer with its own keys but no value projection.
    settings["attention_k_eq_v"] = any(
        f"blk.{i}.attn_k.weight" in tensors and f"blk.{i}.attn_v.weight" not in tensors
        for i in range(min(first_shared, len(sliding)))
        if not sliding[i]
    )
    experts = get("expert_count")
    if experts:
        settings.update(
            enable_moe_block=True,
            num_experts=experts,
            top_k_experts=get("expert_used_count"),
            moe_intermediate_size=get("expert_feed_forward_length"),
        )
    return settings


def gemma4_weights(weights: dict[str, mx.array], *modules: dict[str, Any]) -> None:
    """Split, in place, each ``experts.gate_up_proj`` (``ffn_gate_up_exps``: ``[E, 2I, H]``, gate
    rows first) into the stacked gate and up projections, packed or not (``modules``: the dicts
    keyed by module name that follow them: quantization, source types)."""
    for module in [n.removesuffix(".weight") for n in weights if n.endswith(".experts.gate_up_proj.weight")]:
        stem = module.removesuffix("gate_up_proj")
        for part in ("weight", "scales", "biases"):
            array = weights.pop(f"{module}.{part}", None)
            if array is None:
                continue
            if array.ndim != 3 or array.shape[1] % 2:
                raise ModelLoadError(
                    f"shape {list(array.shape)}: expected [experts, 2 * width, ...]",
                    tensor=f"blk.{module.split('.')[2]}.ffn_gate_up_exps.weight",
                )
            gate, up = mx.split(array, 2, axis=1)
            weights[f"{stem}gate_proj.{part}"], weights[f"{stem}up_proj.{part}"] = gate, up
        for table in modules:
            if module in table:
                table[f"{stem}gate_proj"] = table[f"{stem}up_proj"] = table.pop(module)


#: llama.cpp architecture -> (Hugging Face model_type, whether the router's top-k weights are
#: renormalized: llama.cpp hard-codes it per architecture, the file does not say).
MOE_ARCHS = {
    "qwen3moe": ("qwen3_moe", True),
    "qwen2moe": ("qwen2_moe", False),
    "llama": ("mixtral", True),
    "qwen3next": ("qwen3_next", True),
    "qwen35moe": ("qwen3_5_moe", True),
}


def moe_settings(
    arch: str, config: dict[str, Any], tensors: dict[str, Any], get: Callable[..., Any]
) -> dict[str, Any]:
    """A mixture of experts' keys: expert counts and widths, the family's routing rule, and the
    Hugging Face ``model_type`` (a ``llama`` file with experts is a Mixtral)."""
    if arch not in MOE_ARCHS:
        return {}
    model_type, normalize = MOE_ARCHS[arch]
    experts = get("expert_count")
    settings: dict[str, Any] = {
        "model_type": model_type,
        "num_experts": experts,
        "num_local_experts": experts,
        "num_experts_per_tok": get("expert_used_count"),
        "norm_topk_prob": normalize,
    }
    width = get("expert_feed_forward_length")
    if width:
        settings["moe_intermediate_size"] = width
    shared = get("expert_shared_feed_forward_length")
    if shared:
        settings["shared_expert_intermediate_size"] = shared
    if arch == "qwen2moe":
        settings["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    # Layers without a router are dense (Qwen's ``mlp_only_layers``). A valid file holds at least
    # one tensor per layer; a larger count is refused later, naming the key.
    count = config.get("num_hidden_layers") or 0
    layers = range(count if count <= len(tensors) else 0)
    dense = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    if dense:
        settings["mlp_only_layers"] = dense
    return settings


def gpt_oss_settings(config: dict[str, Any], get: Callable[..., Any]) -> dict[str, Any]:
    """gpt-oss's keys: the Hugging Face ``model_type``, the experts, and YaRN as Hugging Face
    computes it for these checkpoints (``truncate: false``; llama.cpp always truncates the
    correction range). The sliding layers are the even ones, as Hugging Face's default and
    llama.cpp's hard-coded pattern agree."""
    settings: dict[str, Any] = {
        "model_type": "gpt_oss",
        "num_local_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
    }
    width = get("expert_feed_forward_length")
    if width:
        settings["intermediate_size"] = width
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "yarn":
        settings["rope_scaling"] = {
            **scaling,
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
            "truncate": False,
        }
    return settings


def phi3_settings(
    config: dict[str, Any], tensors: dict[str, Any], get: Callable[..., Any]
) -> dict[str, Any]:
    """Phi-3's LongRoPE, stored by ``convert_hf_to_gguf`` as the ``rope_factors_long`` and
    ``rope_factors_short`` tensors, ``rope.scaling.original_context_length`` and
    ``rope.scaling.attn_factor``, back in the Hugging Face ``rope_scaling`` form."""
    settings: dict[str, Any] = {}
    original = get("rope.scaling.original_context_length")
    if original:
        settings["original_max_position_embeddings"] = original
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is not None and short is not None:
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": [float(f) for f in np.asarray(long.data, dtype=np.float32)],
            "short_factor": [float(f) for f in np.asarray(short.data, dtype=np.float32)],
            "original_max_position_embeddings": original or config["max_position_embeddings"],
        }
        attn_factor = get("rope.scaling.attn_factor")
        if attn_factor:
            scaling["attention_factor"] = attn_factor
        settings["rope_scaling"] = scaling
    return settings


def _to_mx(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(array).astype(dtype)


def _check_finite(array: np.ndarray, what: str, *, bf16_bits: bool = False) -> None:
    """Refuse a tensor holding NaN or infinity: a corrupt file, or one that would yield NaN logits."""
    # Raw bfloat16 bits: an all-ones exponent is infinity or NaN.
    finite = np.all((array & 0x7F80) != 0x7F80) if bf16_bits else np.isfinite(array).all()
    if not finite:
        raise ValueError(f"non-finite {what} (NaN or infinity)")


def _host_array(tensor: Any) -> np.ndarray:
    """A float tensor on the host: F32/F16 as stored, BF16 as its raw uint16 bits (numpy has no
    bfloat16), any other type dequantized to float32 by ``gguf``."""
    qtype = tensor.tensor_type
    if qtype in (QType.F32, QType.F16):
        return np.asarray(tensor.data)
    if qtype == QType.BF16:
        return np.ascontiguousarray(tensor.data).view("<u2")
    return gguf.quants.dequantize(tensor.data, qtype)


def tensor_share(tensor: Any, shard: Shard) -> np.ndarray | None:
    """The share ``shard`` of a matrix's data, copied out of the file's mapping (so only its pages
    are read), in the reader's layout: raw blocks of a quantized (or bfloat16) row are cut at whole
    blocks. None where the layout cannot be cut so (columns inside a block, a stack of experts)."""
    data = tensor.data
    if data.ndim > 2:
        return None
    # uint8 rows hold whole blocks (a block of one element for bfloat16); ranges count blocks.
    block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type][1] if data.dtype == np.uint8 else 1
    scale = block_bytes if shard.axis == 1 else 1
    try:
        ranges = shard.ranges(data.shape[shard.axis] // scale)
    except ValueError:
        return None
    pieces = [data[start * scale : stop * scale] if shard.axis == 0 else data[:, start * scale : stop * scale]
              for start, stop in ranges]  # fmt: skip
    return np.ascontiguousarray(pieces[0]) if len(pieces) == 1 else np.concatenate(pieces, axis=shard.axis)


def check_vocabulary(reader: gguf.GGUFReader, config: dict[str, Any], path: Path) -> None:
    """Refuse an embedding with fewer rows than the tokenizer has tokens: ids past its end would
    read memory that is not the model's (llama.cpp refuses such files too)."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    rows = config.get("vocab_size")
    if tokens is not None and isinstance(rows, int) and len(tokens.data) > rows:
        raise ModelLoadError(
            f"{rows} rows for the {len(tokens.data)} tokens of tokenizer.ggml.tokens",
            path=str(path),
            tensor="token_embd.weight",
        )


class GGUFFormat:
    """llama.cpp's GGUF: one file holding metadata, tokenizer and (quantized) tensors."""

    name = "gguf"

    def detect(self, path: Path) -> bool:
        """True for a file that starts with the GGUF magic."""
        return Path(path).is_file() and detect(Path(path))

    def load(self, path: Path, *, dtype: str = "float32") -> Checkpoint:
        """Read ``path``: exact MLX quantization where a block type has one, ``dtype`` arrays for the rest."""
        return self._read(Path(path), dtype, None)

    def load_shards(self, path: Path, plan: ShardPlan, *, dtype: str = "float32") -> Checkpoint:
        """:meth:`load`, each tensor ``plan`` splits read as this process's share: rows (whole
        heads, llama.cpp's rotary order undone per head) or input columns at whole blocks."""
        return self._read(Path(path), dtype, plan)

    def _read(self, path: Path, dtype: str, plan: ShardPlan | None) -> Checkpoint:
        if dtype not in DTYPES:
            raise ModelLoadError(
                f"unsupported dtype {dtype!r} (use one of {', '.join(DTYPES)})", path=str(path)
            )
        reader = open_reader(path)
        tensors = {tensor.name: tensor for tensor in reader.tensors}
        try:
            config = read_config(reader, tensors)
        except ModelLoadError as exc:
            raise ModelLoadError(exc.detail, path=str(path), tensor=exc.tensor, key=exc.key) from exc
        except Exception as exc:
            raise ModelLoadError(f"unreadable model metadata: {exc}", path=str(path)) from exc
        check_vocabulary(reader, config, path)

        # llama.cpp's architecture (a Mixtral file says ``llama``), which its tensor layout follows.
        arch = field_value(reader, "general.architecture")
        permute: dict[str, int | None] = {}
        if arch in PERMUTED_ARCHS:
            # A file without head counts fails in the architecture, naming the key.
            permute = {
                "attn_q": config.get("num_attention_heads"),
                "attn_k": config.get("num_key_value_heads"),
            }

        weights: dict[str, mx.array] = {}
        quantization: dict[str, QuantSpec] = {}
        suggested: dict[str, QuantSpec] = {}
        source_types: dict[str, str] = {}
        counts: Counter[str] = Counter()
        shares = plan(config) if plan is not None else None
        shard_bytes: Counter[str] = Counter()
        unsplit: list[str] = []
        for name, tensor in track(tensors.items(), len(tensors), f"reading {path.name}"):
            counts[tensor.tensor_type.name] += 1
            if name.endswith(NOT_WEIGHTS):
                continue
            target = hf_name(name, arch)
            heads = permute.get(name.split(".")[2]) if name.startswith("blk.") else None
            shift = 1.0 if shifted_norm(name, arch) else 0.0
            shard = shares(target) if shares is not None else None
            source = tensor
            if shard is not None and tensor.data.ndim > shard.axis:  # a row-parallel bias is whole
                share = tensor_share(tensor, shard)
                shard_bytes["whole"] += tensor.data.nbytes
                shard_bytes["read"] += tensor.data.nbytes if share is None else share.nbytes
                if share is None:
                    unsplit.append(f"{name} ({tensor.tensor_type.name} {list(map(int, tensor.shape))})")
                else:
                    tensor = tensor._replace(data=share)
                    heads = heads // shard.size if heads and shard.axis == 0 else heads
            try:
                arrays = self._convert(tensor, target, DTYPES[dtype], heads, quantization, shift)
            except Exception as exc:
                raise ModelLoadError(
                    f"cannot convert {tensor.tensor_type.name} tensor of shape "
                    f"{list(map(int, source.shape))}: {type(exc).__name__}: {exc}",
                    path=str(path),
                    tensor=name,
                ) from exc
            weights.update(arrays)
            if target.endswith(".weight") and tensor.data.ndim >= 2:
                module = target.removesuffix(".weight")
                source_types[module] = tensor.tensor_type.name
                if tensor.tensor_type not in (*EXACT_BITS, *FLOAT_TYPES, QType.MXFP4):
                    bits = NEAREST_BITS.get(tensor.tensor_type, 8)
                    suggested[module] = QuantSpec(bits=bits, group_size=GROUP_SIZE)

        if unsplit:
            log.info("%s: %d tensors to split are read whole, their layout does not split there: %s%s",
                     path.name, len(unsplit), unsplit[0], ", ..." if len(unsplit) > 1 else "")  # fmt: skip
        if arch in HYBRID_ARCHS:
            hybrid_weights(weights, quantization, config)
        if arch == "gemma4":
            try:
                gemma4_weights(weights, quantization, suggested, source_types)
            except ModelLoadError as exc:
                raise ModelLoadError(exc.detail, path=str(path), tensor=exc.tensor) from exc

        tokenizer = None
        try:
            if "tokenizer.ggml.model" in reader.fields:
                from mlxr_plugins.formats.gguf.tokenizer import tokenizer_data_from_reader

                tokenizer = TokenizerSpec(kind="gguf", data=tokenizer_data_from_reader(reader))
            chat_template = field_value(reader, "tokenizer.chat_template")
            name = field_value(reader, "general.name")
            file_type = field_value(reader, "general.file_type")
        except Exception as exc:
            raise ModelLoadError(
                f"unreadable metadata: {type(exc).__name__}: {exc}", path=str(path)
            ) from exc
        return Checkpoint(
            path=path,
            format=self.name,
            config=config,
            config_keys=config_keys(arch),
            weights=weights,
            quantization=quantization,
            suggested_quantization=suggested,
            source_types=source_types,
            tokenizer=tokenizer,
            chat_template=chat_template,
            metadata={
                "name": name,
                "file_type": file_type,
                "tensor_types": dict(counts),
                "dequantized_types": sorted({source_types[m] for m in suggested}),
                "resident_bytes": sum(array.nbytes for array in weights.values()),
                **({"shard_bytes": {"read": shard_bytes["read"], "whole": shard_bytes["whole"]}} if plan else {}),
            },
        )

    def load_projector(self, checkpoint: Checkpoint, path: Path, *, dtype: str = "float32") -> Checkpoint:
        """``checkpoint`` with the vision tower and projector of llama.cpp's mmproj file ``path``
        (:mod:`mlxr_plugins.formats.gguf.mmproj`)."""
        from mlxr_plugins.formats.gguf.mmproj import load_projector

        return load_projector(checkpoint, Path(path), dtype)

    @staticmethod
    def _convert(
        tensor: Any,
        target: str,
        dtype: mx.Dtype,
        heads: int | None,
        quantization: dict[str, QuantSpec],
        shift: float = 0.0,
    ) -> dict[str, mx.array]:
        """One GGUF tensor -> the checkpoint arrays it becomes (``weight`` or ``weight, scales, biases``).
        ``shift`` is subtracted from a dense tensor in float32, before the cast to ``dtype``."""
        qtype = tensor.tensor_type
        if qtype in EXACT_BITS and target.endswith(".weight") and tensor.data.ndim >= 2:
            packed = repack(tensor.data, qtype)
            _check_finite(packed.scales, "block scales")
            _check_finite(packed.biases, "block minimums")
            parts = {"weight": packed.weight, "scales": packed.scales, "biases": packed.biases}
            if heads:
                parts = {key: unpermute_rows(value, heads) for key, value in parts.items()}
            module = target.removesuffix(".weight")
            quantization[module] = QuantSpec(bits=packed.bits, group_size=GROUP_SIZE)
            return {
                f"{module}.weight": mx.array(parts["weight"]),
                f"{module}.scales": _to_mx(parts["scales"], dtype),
                f"{module}.biases": _to_mx(parts["biases"], dtype),
            }
        if qtype == QType.MXFP4 and target.endswith(".weight") and tensor.data.ndim >= 2:
            weight, scales = repack_mxfp4(tensor.data)
            if (scales == 255).any():  # e8m0's NaN
                raise ValueError("non-finite block scales (NaN)")
            if heads:
                weight, scales = unpermute_rows(weight, heads), unpermute_rows(scales, heads)
            module = target.removesuffix(".weight")
            quantization[module] = QuantSpec(bits=4, group_size=32, mode="mxfp4")
            return {f"{module}.weight": mx.array(weight), f"{module}.scales": mx.array(scales)}
        host = _host_array(tensor)
        _check_finite(host, "values", bf16_bits=qtype == QType.BF16)
        if heads:
            host = unpermute_rows(host, heads)
        if qtype == QType.BF16:
            array = mx.array(host).view(mx.bfloat16)
            return {target: (array.astype(mx.float32) - shift if shift else array).astype(dtype)}
        if shift:
            host = host.astype(np.float32) - np.float32(shift)
        return {target: _to_mx(host, dtype)}
