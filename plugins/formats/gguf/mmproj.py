"""llama.cpp's multimodal projector files (``mmproj*.gguf``, ``general.architecture`` ``clip``):
a vision tower and projector beside a text GGUF, read into the names and config keys a Hugging
Face multimodal checkpoint of the same family holds, so the family's vision side loads them as it
loads a folder's.

Tensor and metadata names are llama.cpp's (``gguf.constants``: ``v.patch_embd``, ``v.blk.N.attn_q``,
``mm.input_projection``; ``clip.vision.*``). Supported projector types: ``gemma3`` (a SigLIP tower,
Gemma 3's pooling projector; ``convert_hf_to_gguf`` stores the projector's norm as ``1 + w``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import gguf
import mlx.core as mx

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.checkpoint import Checkpoint, QuantSpec, TokenizerSpec
from mlxr_plugins.formats.gguf.checkpoint import DTYPES, GGUFFormat, field_value, open_reader

Vision = gguf.Keys.ClipVision
#: llama.cpp's SigLIP tensors (``v.blk.N.<name>``) -> transformers' module under ``encoder.layers.N``.
SIGLIP_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
SIGLIP_TOP_NAMES = {
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
}
#: Gemma 3's projector: its matrix is a bare parameter (``mm_input_projection_weight``).
GEMMA3_PROJECTOR_NAMES = {
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
}
#: Projector type -> the Hugging Face ``model_type`` of the text models it serves.
PROJECTOR_MODEL_TYPES = {"gemma3": "gemma3"}
#: llama.cpp's default pooling of Gemma 3's 64x64 patches to 16x16 tokens.
GEMMA3_SCALE_FACTOR = 4
#: Hugging Face's Gemma 3 image token, which llama.cpp's Gemma 3 vocabulary stops before.
GEMMA3_IMAGE_TOKEN = "<image_soft_token>"
CONTROL_TOKEN = 3  # tokenizer.ggml.token_type of a control token


def gemma3_name(name: str) -> str | None:
    """An mmproj tensor's name in a transformers Gemma 3 checkpoint (``vision_tower.*`` without
    ``vision_model``, as transformers 5 saves it), or None for one Gemma 3 does not use."""
    if name in GEMMA3_PROJECTOR_NAMES:
        return GEMMA3_PROJECTOR_NAMES[name]
    module, _, kind = name.rpartition(".")
    if module in SIGLIP_TOP_NAMES:
        return f"vision_tower.{SIGLIP_TOP_NAMES[module]}.{kind}"
    parts = module.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in SIGLIP_BLOCK_NAMES:
        return f"vision_tower.encoder.layers.{parts[2]}.{SIGLIP_BLOCK_NAMES[parts[3]]}.{kind}"
    return None


def read_vision_config(reader: gguf.GGUFReader) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tower's ``vision_config`` (transformers' SigLIP names) and the image processor's
    settings from ``clip.vision.*``; ModelLoadError naming a missing or malformed key."""

    def get(key: str, kind: type, default: Any = None) -> Any:
        value = field_value(reader, key, default)
        if value is None:
            raise ModelLoadError("missing", key=key)
        if kind is int and (type(value) is not int or value < 1):
            raise ModelLoadError(f"{value!r}: expected a positive integer", key=key)
        if kind is float and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
            raise ModelLoadError(f"{value!r}: expected a positive number", key=key)
        if kind is list and (not isinstance(value, list) or len(value) != 3):
            raise ModelLoadError(f"{value!r}: expected one value per channel (3)", key=key)
        return value

    size = get(Vision.IMAGE_SIZE, int)
    config = {
        "hidden_size": get(Vision.EMBEDDING_LENGTH, int),
        "intermediate_size": get(Vision.FEED_FORWARD_LENGTH, int),
        "num_hidden_layers": get(Vision.BLOCK_COUNT, int),
        "num_attention_heads": get(Vision.Attention.HEAD_COUNT, int),
        "image_size": size,
        "patch_size": get(Vision.PATCH_SIZE, int),
        "layer_norm_eps": get(Vision.Attention.LAYERNORM_EPS, float, 1e-6),
        # ggml's GELU is the tanh approximation.
        "hidden_act": "gelu_pytorch_tanh",
        "vision_use_head": False,
    }
    preprocessor = {
        "image_mean": get(Vision.IMAGE_MEAN, list, [0.5] * 3),
        "image_std": get(Vision.IMAGE_STD, list, [0.5] * 3),
        "size": {"height": size, "width": size},
    }
    return config, preprocessor


def gemma3_tokens(config: dict[str, Any], reader: gguf.GGUFReader) -> int:
    """``mm_tokens_per_image``: the patch grid pooled by ``clip.vision.projector.scale_factor``."""
    factor = field_value(reader, Vision.Projector.SCALE_FACTOR, GEMMA3_SCALE_FACTOR)
    side = config["image_size"] // config["patch_size"]
    if type(factor) is not int or factor < 1 or side % factor:
        raise ModelLoadError(f"{factor!r} does not divide the {side} patches per side",
                             key=Vision.Projector.SCALE_FACTOR)
    return (side // factor) ** 2


def with_image_token(tokenizer: TokenizerSpec | None, token: str) -> tuple[TokenizerSpec | None, int | None]:
    """A GGUF vocabulary with ``token`` appended as a control token where it lacks it, and the
    token's id (None for a tokenizer of another kind)."""
    if tokenizer is None or tokenizer.kind != "gguf":
        return tokenizer, None
    tokens = list(tokenizer.data.get("tokenizer.ggml.tokens") or [])
    if token in tokens:
        return tokenizer, tokens.index(token)
    data = dict(tokenizer.data)
    data["tokenizer.ggml.tokens"] = [*tokens, token]
    if "tokenizer.ggml.token_type" in data:
        data["tokenizer.ggml.token_type"] = [*data["tokenizer.ggml.token_type"], CONTROL_TOKEN]
    if "tokenizer.ggml.scores" in data:
        data["tokenizer.ggml.scores"] = [*data["tokenizer.ggml.scores"], 0.0]
    return TokenizerSpec(tokenizer.kind, data), len(tokens)


def load_projector(checkpoint: Checkpoint, path: Path, dtype: str = "float32") -> Checkpoint:
    """``checkpoint`` with the mmproj at ``path`` added (see the module's docs)."""
    reader = open_reader(path)

    def refuse(detail: str, **where: str) -> ModelLoadError:
        return ModelLoadError(detail, path=str(path), **where)

    if field_value(reader, "general.architecture") != "clip":
        raise refuse("not a multimodal projector (general.architecture is not 'clip')", key="general.architecture")
    if field_value(reader, gguf.Keys.Clip.HAS_VISION_ENCODER) is False:
        raise refuse("the file holds no vision encoder", key=gguf.Keys.Clip.HAS_VISION_ENCODER)
    key = Vision.PROJECTOR_TYPE if Vision.PROJECTOR_TYPE in reader.fields else gguf.Keys.Clip.PROJECTOR_TYPE
    kind = field_value(reader, key)
    model_type = checkpoint.config.get("model_type")
    if kind not in PROJECTOR_MODEL_TYPES:
        raise refuse(f"projector type {kind!r} is not supported (supported: {', '.join(PROJECTOR_MODEL_TYPES)})",
                     key=key)
    if PROJECTOR_MODEL_TYPES[kind] != model_type:
        raise refuse(f"a {kind} projector does not fit the {model_type} text model {checkpoint.path.name}", key=key)
    try:
        vision_config, preprocessor = read_vision_config(reader)
        tokens = gemma3_tokens(vision_config, reader)
    except ModelLoadError as exc:
        raise refuse(exc.detail, key=exc.key or "") from exc
    width = field_value(reader, Vision.PROJECTION_DIM)
    text_width = (checkpoint.config.get("text_config") or checkpoint.config).get("hidden_size")
    if width is not None and width != text_width:
        raise refuse(f"projects to {width} features, the text model's width is {text_width}",
                     key=Vision.PROJECTION_DIM)

    weights: dict[str, mx.array] = {}
    quantization: dict[str, QuantSpec] = {}
    names: dict[str, str] = {}
    for tensor in reader.tensors:
        target = gemma3_name(tensor.name)
        if target is None:
            continue
        shift = 1.0 if tensor.name == "mm.soft_emb_norm.weight" else 0.0
        try:
            arrays = GGUFFormat._convert(tensor, target, DTYPES[dtype], None, quantization, shift)
        except Exception as exc:
            raise refuse(f"cannot convert {tensor.tensor_type.name} tensor of shape "
                         f"{list(map(int, tensor.shape))}: {type(exc).__name__}: {exc}", tensor=tensor.name) from exc
        weights.update(arrays)
        names.update(dict.fromkeys(arrays, tensor.name))
    if not weights:
        raise refuse("holds none of the vision tensors of a Gemma 3 projector (v.blk.N.*, mm.*)")

    tokenizer, token_id = with_image_token(checkpoint.tokenizer, GEMMA3_IMAGE_TOKEN)
    config = {**checkpoint.config, "vision_config": vision_config, "mm_tokens_per_image": tokens}
    if token_id is not None:
        config["image_token_index"] = token_id
    return attrs.evolve(
        checkpoint,
        config=config,
        weights={**checkpoint.weights, **weights},
        quantization={**checkpoint.quantization, **quantization},
        tokenizer=tokenizer,
        tensor_names={**checkpoint.tensor_names, **names},
        vision_path=path,
        preprocessor=preprocessor,
    )
