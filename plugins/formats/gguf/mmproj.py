"""llama.cpp's multimodal projector files (``mmproj*.gguf``, ``general.architecture`` ``clip``):
a vision tower and projector beside a text GGUF, read into the names and config keys a Hugging
Face multimodal checkpoint of the same family holds, so the family's vision side loads them as it
loads a folder's.

Tensor and metadata names are llama.cpp's (``gguf.constants``: ``v.patch_embd``, ``v.blk.N.attn_q``,
``mm.input_projection``; ``clip.vision.*``). Supported projector types: ``gemma3`` (a SigLIP tower,
Gemma 3's pooling projector; ``convert_hf_to_gguf`` stores the projector's norm as ``1 + w``) and
``qwen2.5vl_merger`` (Qwen2.5-VL's tower and merger, served with a ``qwen2vl`` text GGUF; the
converter splits the fused ``qkv`` and the patch convolution's two frames, joined again here) and
``qwen3vl_merger`` (Qwen3-VL's tower, position table, merger and DeepStack mergers, served with a
``qwen3vl`` text GGUF; ``v.deepstack.N.*`` is numbered by the tower block it follows) and
``idefics3`` (SmolVLM's and Idefics3's SigLIP tower and pixel-shuffle connector beside a ``llama``
text GGUF, which it turns into an ``idefics3`` model).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
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
#: Gemma 3's other tensors, by module or (the projector's bare matrix) by whole name.
GEMMA3_TOP_NAMES = {
    "v.patch_embd": "vision_tower.embeddings.patch_embedding",
    "v.position_embd": "vision_tower.embeddings.position_embedding",
    "v.post_ln": "vision_tower.post_layernorm",
    "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
    "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
}
#: llama.cpp's default pooling of Gemma 3's 64x64 patches to 16x16 tokens.
GEMMA3_SCALE_FACTOR = 4
#: Hugging Face's Gemma 3 image token, which llama.cpp's Gemma 3 vocabulary stops before.
GEMMA3_IMAGE_TOKEN = "<image_soft_token>"
CONTROL_TOKEN = 3  # tokenizer.ggml.token_type of a control token


def checkpoint_name(name: str, top: dict[str, str], blocks: dict[str, str], layers: str) -> str | None:
    """An mmproj tensor's name in a transformers checkpoint: by whole name or module in ``top``,
    ``v.blk.N.<name>`` as ``{layers}.N.{blocks[name]}``; None for a tensor the family does not use."""
    if name in top:
        return top[name]
    module, _, kind = name.rpartition(".")
    if module in top:
        return f"{top[module]}.{kind}"
    parts = module.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in blocks:
        return f"{layers}.{parts[2]}.{blocks[parts[3]]}.{kind}"
    return None


class Getter:
    """``clip.vision.*`` values, checked: ModelLoadError naming a missing or malformed key."""

    def __init__(self, reader: gguf.GGUFReader):
        self.reader = reader

    def __call__(self, key: str, kind: type, default: Any = None) -> Any:
        value = field_value(self.reader, key, default)
        if value is None:
            raise ModelLoadError("missing", key=key)
        if kind is int and (type(value) is not int or value < 1):
            raise ModelLoadError(f"{value!r}: expected a positive integer", key=key)
        if kind is float and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
            raise ModelLoadError(f"{value!r}: expected a positive number", key=key)
        if kind is list and (not isinstance(value, list) or len(value) != 3):
            raise ModelLoadError(f"{value!r}: expected one value per channel (3)", key=key)
        return value

    def normalize(self) -> dict[str, Any]:
        return {"image_mean": self(Vision.IMAGE_MEAN, list, [0.5] * 3), "image_std": self(Vision.IMAGE_STD, list, [0.5] * 3)}


def siglip_config(get: Getter) -> dict[str, Any]:
    """A SigLIP tower's ``vision_config`` (transformers' names)."""
    return {
        "hidden_size": get(Vision.EMBEDDING_LENGTH, int),
        "intermediate_size": get(Vision.FEED_FORWARD_LENGTH, int),
        "num_hidden_layers": get(Vision.BLOCK_COUNT, int),
        "num_attention_heads": get(Vision.Attention.HEAD_COUNT, int),
        "image_size": get(Vision.IMAGE_SIZE, int),
        "patch_size": get(Vision.PATCH_SIZE, int),
        "layer_norm_eps": get(Vision.Attention.LAYERNORM_EPS, float, 1e-6),
        "hidden_act": "gelu_pytorch_tanh",  # ggml's GELU is the tanh approximation
        "vision_use_head": False,
    }


def gemma3_settings(get: Getter) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3's ``vision_config`` (transformers' SigLIP names), ``mm_tokens_per_image`` (the patch
    grid pooled by ``clip.vision.projector.scale_factor``) and the image processor's settings."""
    vision = siglip_config(get)
    size = vision["image_size"]
    factor = get(Vision.Projector.SCALE_FACTOR, int, GEMMA3_SCALE_FACTOR)
    side = size // vision["patch_size"]
    if side % factor:
        raise ModelLoadError(f"{factor} does not divide the {side} patches per side", key=Vision.Projector.SCALE_FACTOR)
    config = {"vision_config": vision, "mm_tokens_per_image": (side // factor) ** 2}
    return config, {**get.normalize(), "size": {"height": size, "width": size}}


#: Idefics3's and SmolVLM's other tensors (the tower under ``vision_model``, the connector's matrix).
IDEFICS3_TOP_NAMES = {
    "v.patch_embd": "vision_model.embeddings.patch_embedding",
    "v.position_embd": "vision_model.embeddings.position_embedding",
    "v.post_ln": "vision_model.post_layernorm",
    "mm.model.fc": "connector.modality_projection.proj",
}


def idefics3_settings(get: Getter) -> tuple[dict[str, Any], dict[str, Any]]:
    """Idefics3's ``vision_config``, ``scale_factor`` (the pixel shuffle's) and the processor's
    settings: tiles of the tower's ``image_size``, images resized to a longest edge of
    ``clip.vision.preproc_image_size`` (the converter's copy of ``size.longest_edge``)."""
    vision = siglip_config(get)
    tile = vision["image_size"]
    config = {"vision_config": vision, "scale_factor": get(Vision.Projector.SCALE_FACTOR, int, 2)}
    sizes = {"size": {"longest_edge": get(Vision.PREPROC_IMAGE_SIZE, int, 4 * tile)}, "max_image_size": {"longest_edge": tile}}
    return config, {**get.normalize(), **sizes}


#: Qwen2.5-VL's blocks (``v.blk.N.<name>``) -> its tower's modules under ``visual.blocks.N``;
#: llama.cpp splits the fused ``qkv`` (joined again by :func:`join_qwen25`).
QWEN25_BLOCK_NAMES = {
    "attn_q": "attn.q", "attn_k": "attn.k", "attn_v": "attn.v", "attn_out": "attn.proj",
    "ln1": "norm1", "ln2": "norm2", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
QWEN25_TOP_NAMES = {
    "v.post_ln": "visual.merger.ln_q", "mm.0": "visual.merger.mlp.0", "mm.2": "visual.merger.mlp.2",
    # the patch convolution's two frames, each a 2D convolution in llama.cpp
    "v.patch_embd.weight": "visual.patch_embed.frame0", "v.patch_embd.weight.1": "visual.patch_embed.frame1",
}  # fmt: skip


def qwen25_settings(get: Getter) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen2.5-VL's ``vision_config``: window attention except in every
    ``clip.vision.n_wa_pattern``-th block (all blocks without it), and the image processor's
    normalization and pixel bounds where the file has them."""
    depth = get(Vision.BLOCK_COUNT, int)
    pattern = get(Vision.N_WA_PATTERN, int, depth)
    vision = {
        "depth": depth,
        "hidden_size": get(Vision.EMBEDDING_LENGTH, int),
        "intermediate_size": get(Vision.FEED_FORWARD_LENGTH, int),
        "num_heads": get(Vision.Attention.HEAD_COUNT, int),
        "patch_size": get(Vision.PATCH_SIZE, int),
        "temporal_patch_size": 2,
        "spatial_merge_size": get(Vision.SPATIAL_MERGE_SIZE, int, 2),
        "window_size": get(Vision.WINDOW_SIZE, int, 112),
        "out_hidden_size": get(Vision.PROJECTION_DIM, int),
        "fullatt_block_indexes": [i for i in range(depth) if (i + 1) % pattern == 0],
        "hidden_act": "silu",
    }
    preprocessor = get.normalize()
    for key, name in ((Vision.IMAGE_MIN_PIXELS, "min_pixels"), (Vision.IMAGE_MAX_PIXELS, "max_pixels")):
        if key in get.reader.fields:
            preprocessor[name] = get(key, int)
    return {"vision_config": vision}, preprocessor


def join_qwen25(weights: dict[str, mx.array], quantization: dict[str, QuantSpec], names: dict[str, str]) -> None:
    """In place: each block's q, k, v (packed or not) as the fused ``qkv``, and the two frames of
    the patch convolution as its ``[D, C, 2, P, P]`` kernel."""
    for module in [n.removesuffix(".q.bias") for n in list(weights) if n.endswith("attn.q.bias")] + [
        n.removesuffix(".q.weight") for n in list(weights) if n.endswith("attn.q.weight")
    ]:
        for part in ("weight", "scales", "biases", "bias"):
            pieces = [weights.pop(f"{module}.{x}.{part}", None) for x in "qkv"]
            if all(piece is None for piece in pieces):
                continue
            if any(piece is None for piece in pieces):
                raise ModelLoadError(f"{module}: q, k and v must all hold a {part}", tensor=names.get(f"{module}.q.weight"))
            weights[f"{module}.qkv.{part}"] = mx.concatenate(pieces, axis=0)  # type: ignore[arg-type]
            names[f"{module}.qkv.{part}"] = names.get(f"{module}.q.{part}", "")
        specs = {quantization.pop(f"{module}.{x}", None) for x in "qkv"}
        if specs != {None}:
            if len(specs) != 1:
                raise ModelLoadError("q, k and v are quantized differently", tensor=names.get(f"{module}.qkv.weight"))
            quantization[f"{module}.qkv"] = specs.pop()  # type: ignore[assignment]
    frames = [weights.pop(f"visual.patch_embed.frame{t}", None) for t in (0, 1)]
    if frames[0] is not None and frames[1] is not None:
        weights["visual.patch_embed.proj.weight"] = mx.stack(frames, axis=2)  # type: ignore[arg-type]
        names["visual.patch_embed.proj.weight"] = "v.patch_embd.weight"


#: Qwen3-VL's blocks (``qkv`` kept fused) and other tensors; ``v.deepstack.N`` (N the tower block)
#: stays ``visual.deepstack.N`` until :func:`join_qwen3` numbers the mergers in block order.
QWEN3_BLOCK_NAMES = {
    "attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2",
    "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2",
}  # fmt: skip
QWEN3_TOP_NAMES = {
    "v.patch_embd.weight": "visual.patch_embed.frame0", "v.patch_embd.weight.1": "visual.patch_embed.frame1",
    "v.patch_embd": "visual.patch_embed.proj", "v.position_embd": "visual.pos_embed",
    "v.post_ln": "visual.merger.norm", "mm.0": "visual.merger.linear_fc1", "mm.2": "visual.merger.linear_fc2",
}  # fmt: skip
QWEN3_DEEPSTACK_NAMES = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


def qwen3_name(name: str) -> str | None:
    """A ``qwen3vl_merger`` tensor's name (see :data:`QWEN3_TOP_NAMES`)."""
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "deepstack"] and parts[2].isdigit() and parts[3] in QWEN3_DEEPSTACK_NAMES:
        return f"visual.deepstack.{parts[2]}.{QWEN3_DEEPSTACK_NAMES[parts[3]]}.{parts[4]}"
    return checkpoint_name(name, QWEN3_TOP_NAMES, QWEN3_BLOCK_NAMES, "visual.blocks")


def qwen3_settings(get: Getter) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3-VL's ``vision_config``: the position table of ``(image_size / patch_size) ** 2``
    entries (how llama.cpp's converter derives ``image_size``), DeepStack after each block
    ``clip.vision.is_deepstack_layers`` marks, GELU (tanh, as ggml's)."""
    depth = get(Vision.BLOCK_COUNT, int)
    patch = get(Vision.PATCH_SIZE, int)
    side, rest = divmod(get(Vision.IMAGE_SIZE, int), patch)
    if rest:
        raise ModelLoadError(f"the patch size {patch} does not divide it", key=Vision.IMAGE_SIZE)
    marks = field_value(get.reader, Vision.IS_DEEPSTACK_LAYERS, [])
    if not isinstance(marks, list) or len(marks) > depth or not all(type(m) is bool for m in marks):
        raise ModelLoadError(f"{marks!r}: expected at most one true/false per block ({depth})",
                             key=Vision.IS_DEEPSTACK_LAYERS)
    marked = [i for i, mark in enumerate(marks) if mark]
    held = sorted({int(name.split(".")[2]) for name in (t.name for t in get.reader.tensors)
                   if name.startswith("v.deepstack.") and name.split(".")[2].isdigit()})  # fmt: skip
    if held != marked:
        raise ModelLoadError(f"marks blocks {marked}, the file holds DeepStack mergers (v.deepstack.N) for {held}",
                             key=Vision.IS_DEEPSTACK_LAYERS)
    vision = {
        "depth": depth,
        "hidden_size": get(Vision.EMBEDDING_LENGTH, int),
        "intermediate_size": get(Vision.FEED_FORWARD_LENGTH, int),
        "num_heads": get(Vision.Attention.HEAD_COUNT, int),
        "patch_size": patch,
        "temporal_patch_size": 2,
        "spatial_merge_size": get(Vision.SPATIAL_MERGE_SIZE, int, 2),
        "out_hidden_size": get(Vision.PROJECTION_DIM, int),
        "num_position_embeddings": side * side,
        "deepstack_visual_indexes": marked,
        "hidden_act": "gelu_pytorch_tanh",
    }
    preprocessor = get.normalize()
    for key, name in ((Vision.IMAGE_MIN_PIXELS, "min_pixels"), (Vision.IMAGE_MAX_PIXELS, "max_pixels")):
        if key in get.reader.fields:
            preprocessor[name] = get(key, int)
    return {"vision_config": vision}, preprocessor


def join_qwen3(weights: dict[str, mx.array], quantization: dict[str, QuantSpec], names: dict[str, str]) -> None:
    """In place: the patch convolution's two frames joined (:func:`join_qwen25`), and each
    ``visual.deepstack.N`` renamed ``visual.deepstack_merger_list.K``, K its rank by block N."""
    join_qwen25(weights, quantization, names)
    blocks = sorted({int(name.split(".")[2]) for name in weights if name.startswith("visual.deepstack.")})

    def renamed(name: str) -> str:
        block, _, rest = name.removeprefix("visual.deepstack.").partition(".")
        return f"visual.deepstack_merger_list.{blocks.index(int(block))}.{rest}"

    for table in (weights, quantization, names):
        for name in [n for n in table if n.startswith("visual.deepstack.")]:
            table[renamed(name)] = table.pop(name)  # type: ignore[index, assignment]


@attrs.frozen
class Projector:
    """What one projector type needs: the text ``model_type`` it serves, its config and
    processor settings, tensor names, the image token (and its config key), any joining, and the
    multimodal ``model_type`` the text model then becomes where that differs (Idefics3: ``llama``)."""

    model_type: str
    settings: Callable[[Getter], tuple[dict[str, Any], dict[str, Any]]]
    name: Callable[[str], str | None]
    image_token: str
    image_token_key: str
    join: Callable[[dict[str, mx.array], dict[str, QuantSpec], dict[str, str]], None] | None = None
    becomes: str | None = None


PROJECTORS = {
    # transformers 5's names (``vision_tower.*`` without ``vision_model``)
    "gemma3": Projector(
        "gemma3", gemma3_settings,
        partial(checkpoint_name, top=GEMMA3_TOP_NAMES, blocks=SIGLIP_BLOCK_NAMES, layers="vision_tower.encoder.layers"),
        GEMMA3_IMAGE_TOKEN, "image_token_index",
    ),
    "qwen2.5vl_merger": Projector(
        "qwen2_5_vl", qwen25_settings,
        partial(checkpoint_name, top=QWEN25_TOP_NAMES, blocks=QWEN25_BLOCK_NAMES, layers="visual.blocks"),
        "<|image_pad|>", "image_token_id", join_qwen25,
    ),
    "qwen3vl_merger": Projector("qwen3_vl", qwen3_settings, qwen3_name, "<|image_pad|>", "image_token_id", join_qwen3),
    # SmolVLM's and Idefics3's text model is a llama GGUF
    "idefics3": Projector(
        "llama", idefics3_settings,
        partial(checkpoint_name, top=IDEFICS3_TOP_NAMES, blocks=SIGLIP_BLOCK_NAMES, layers="vision_model.encoder.layers"),
        "<image>", "image_token_id", becomes="idefics3",
    ),
}


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
    if kind not in PROJECTORS:
        raise refuse(f"projector type {kind!r} is not supported (supported: {', '.join(PROJECTORS)})", key=key)
    projector = PROJECTORS[kind]
    if model_type not in {projector.model_type, projector.becomes} - {None}:
        raise refuse(f"a {kind} projector does not fit the {model_type} text model {checkpoint.path.name}", key=key)
    try:
        settings, preprocessor = projector.settings(Getter(reader))
    except ModelLoadError as exc:
        raise refuse(exc.detail, key=exc.key or "") from exc
    deepstack = checkpoint.config.get("num_deepstack_layers")
    marked = len(settings["vision_config"].get("deepstack_visual_indexes", ()))
    if deepstack is not None and deepstack != marked:
        raise refuse(f"{marked} DeepStack layers, the text model {checkpoint.path.name} takes {deepstack}",
                     key=Vision.IS_DEEPSTACK_LAYERS)
    width = field_value(reader, Vision.PROJECTION_DIM)
    text_width = (checkpoint.config.get("text_config") or checkpoint.config).get("hidden_size")
    if width is not None and width != text_width:
        raise refuse(f"projects to {width} features, the text model's width is {text_width}",
                     key=Vision.PROJECTION_DIM)

    weights: dict[str, mx.array] = {}
    quantization: dict[str, QuantSpec] = {}
    names: dict[str, str] = {}
    for tensor in reader.tensors:
        target = projector.name(tensor.name)
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
        raise refuse(f"holds none of the vision tensors of a {kind} projector (v.blk.N.*, mm.*)")
    if projector.join is not None:
        try:
            projector.join(weights, quantization, names)
        except ModelLoadError as exc:
            raise refuse(exc.detail, tensor=exc.tensor or "") from exc
        except ValueError as exc:  # pieces that do not stack: shapes that do not fit each other
            raise refuse(f"{type(exc).__name__}: {exc}") from exc

    tokenizer, token_id = with_image_token(checkpoint.tokenizer, projector.image_token)
    config = {**checkpoint.config, **settings}
    if token_id is not None:
        config[projector.image_token_key] = token_id
    if projector.becomes is not None:
        config["model_type"] = projector.becomes
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
