"""SigLIP's vision tower (the image encoder of Gemma 3, PaliGemma, SmolVLM): non-overlapping
patches through one convolution, learned position embeddings, pre-norm encoder layers (layer
norm, multi-head attention over every patch, GELU MLP), a final layer norm.

Module names follow transformers' ``SiglipVisionTransformer`` (``embeddings.patch_embedding``,
``encoder.layers.N.self_attn.q_proj`` ...); :func:`sanitize_tower` maps a checkpoint's tensors onto
them. The attention-pooling head (``vision_use_head``) is not built: the multimodal families read
the last hidden states.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.layers import ConfigArgs

#: transformers' ``hidden_act`` names of the tanh approximation of GELU, and the exact one.
ACTIVATIONS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu_tanh": nn.gelu_approx, "gelu": nn.gelu}


@dataclasses.dataclass
class SiglipVisionArgs(ConfigArgs):
    """A ``siglip_vision_model`` config (Hugging Face names and defaults)."""

    family = "siglip vision"
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}",
                                 key="vision_config.hidden_act")
        if self.image_size % self.patch_size or self.hidden_size % self.num_attention_heads:
            raise ModelLoadError(
                f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}, and "
                f"hidden_size {self.hidden_size} of num_attention_heads {self.num_attention_heads}",
                key="vision_config",
            )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class VisionEmbeddings(nn.Module):
    def __init__(self, args: SiglipVisionArgs):
        super().__init__()
        D, P = args.hidden_size, args.patch_size
        self.patch_embedding = nn.Conv2d(args.num_channels, D, kernel_size=P, stride=P)
        self.position_embedding = nn.Embedding(args.patches_per_side**2, D)

    def __call__(self, pixels: mx.array) -> mx.array:
        """``[N, H, W, C]`` -> ``[N, patches, D]``, patches in row-major order."""
        patches = self.patch_embedding(pixels)
        N, rows, cols, D = patches.shape
        result: mx.array = patches.reshape(N, rows * cols, D) + self.position_embedding.weight
        return result


class VisionAttention(nn.Module):
    def __init__(self, args: SiglipVisionArgs):
        super().__init__()
        D = args.hidden_size
        self.heads = args.num_attention_heads
        self.scale = (D // self.heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D) for _ in range(3))
        self.out_proj = nn.Linear(D, D)

    def __call__(self, x: mx.array) -> mx.array:
        B, L, D = x.shape
        queries, keys, values = (
            proj(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale)
        result: mx.array = self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, D))
        return result


class VisionMLP(nn.Module):
    def __init__(self, args: SiglipVisionArgs):
        super().__init__()
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.activation = ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        result: mx.array = self.fc2(self.activation(self.fc1(x)))
        return result


class EncoderLayer(nn.Module):
    def __init__(self, args: SiglipVisionArgs):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.self_attn = VisionAttention(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = VisionMLP(args)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, args: SiglipVisionArgs):
        super().__init__()
        self.layers = [EncoderLayer(args) for _ in range(args.num_hidden_layers)]


class SiglipVisionTower(nn.Module):
    """``tower(pixels [N, H, W, C]) -> [N, patches, hidden]``: the last hidden states after
    ``post_layernorm``."""

    def __init__(self, args: SiglipVisionArgs):
        super().__init__()
        self.args = args
        self.embeddings = VisionEmbeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, pixels: mx.array) -> mx.array:
        h = self.embeddings(pixels)
        for layer in self.encoder.layers:
            h = layer(h)
        result: mx.array = self.post_layernorm(h)
        return result


def sanitize_tower(name: str, array: mx.array) -> tuple[str, mx.array] | None:
    """A tower tensor's name below the tower (``vision_model.`` dropped, transformers' older
    nesting) and value (the patch convolution's ``[D, C, P, P]`` as MLX's ``[D, P, P, C]``; one
    already channels-last, as mlx-vlm saves it, kept), or None for what the tower does not hold
    (the pooling head, position ids)."""
    name = name.removeprefix("vision_model.")
    if name.startswith("head.") or name.endswith("position_ids"):
        return None
    torch_layout = array.ndim == 4 and array.shape[2] == array.shape[3] != array.shape[1]
    if name == "embeddings.patch_embedding.weight" and torch_layout:
        array = array.transpose(0, 2, 3, 1)
    return name, array


def sanitize_vision(weights: dict[str, mx.array], tower: str, projector: str) -> dict[str, mx.array]:
    """A multimodal checkpoint's vision tensors, ``model.`` dropped: the tower's under ``tower``
    (through :func:`sanitize_tower`) and the projector's under ``projector``; the text model's
    left out."""
    out = {}
    for name, array in weights.items():
        name = name.removeprefix("model.")
        if name.startswith(tower):
            kept = sanitize_tower(name.removeprefix(tower), array)
            if kept is not None:
                out[tower + kept[0]] = kept[1]
        elif name.startswith(projector):
            out[name] = array
    return out
