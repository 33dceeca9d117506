"""Whisper: an encoder over a log-Mel spectrogram, and a decoder that attends to it.

Encoder: two 1-D convolutions (the second halves the frames), each through GELU, plus learned
(sinusoid-initialized) positions, then pre-norm blocks of bidirectional self-attention and a
GELU MLP, then a LayerNorm. Decoder: token and learned position embeddings, pre-norm blocks of
causal self-attention (over a :class:`~mlxr_core.model.cache.KVCache`), cross-attention to the
encoder's output (its keys and values computed once per window: :meth:`Whisper.cross`) and the
MLP, a LayerNorm, and the LM head tied to the token embeddings. Self-attention is the shared
:class:`~mlxr_core.model.layers.Attention` (no rotation: positions are embedded), bound to the
attention kernel; Hugging Face's ``out_proj`` is loaded as its ``o_proj``, and the key
projection, which has no bias, gets a zero one. What the model does with sound (prompts, windows,
timestamps) is :mod:`mlxr_plugins.archs.whisper_decoding`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mlxr_core.errors import ModelLoadError
from mlxr_core.kernels import KernelSet
from mlxr_core.model.cache import KVCache
from mlxr_core.model.checkpoint import Checkpoint
from mlxr_core.model.layers import Attention, ConfigArgs
from mlxr_core.model.layers.args import MAX_DIM
from mlxr_core.model.tokenizer import Tokenizer
from mlxr_plugins.archs.whisper_audio import LogMel


@dataclasses.dataclass
class WhisperArgs(ConfigArgs):
    """The keys of ``WhisperConfig`` the graph reads."""

    family = "whisper"
    limits: ClassVar[dict[str, tuple[float, float]]] = {
        "d_model": (1, 1 << 14), "encoder_layers": (1, 1 << 12), "decoder_layers": (1, 1 << 12),
        "encoder_attention_heads": (1, 1 << 12), "decoder_attention_heads": (1, 1 << 12),
        "encoder_ffn_dim": (1, 1 << 20), "decoder_ffn_dim": (1, 1 << 20), "vocab_size": (1, 1 << 24),
        "num_mel_bins": (1, 1024), "max_source_positions": (1, MAX_DIM), "max_target_positions": (2, MAX_DIM),
        "median_filter_width": (1, 999),
    }  # fmt: skip
    #: The MLP's activation (exact GELU) and the unscaled embeddings transformers computes.
    computes = {"activation_function": ("gelu",)}

    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    vocab_size: int
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    max_target_positions: int = 448
    #: The median filter over the frames of word timings' attention weights (odd).
    median_filter_width: int = 7


def no_rotation(x: mx.array, offset: int | mx.array) -> mx.array:
    """Whisper embeds positions; its attention rotates nothing."""
    return x


def attention(dims: int, heads: int, kernels: KernelSet) -> Attention:
    return Attention(dims, heads, heads, dims // heads, kernels=kernels, rotary=no_rotation, qkv_bias=True, out_bias=True)


@dataclasses.dataclass
class HeadWeights:
    """A request to a decoder layer for its cross-attention weights: of these ``heads``, found
    in ``weights`` after the pass (``[B, len(heads), L, positions]``, float32)."""

    heads: list[int]
    weights: mx.array | None = None


class CrossAttention(Attention):
    """Queries from the decoder, keys and values from the encoder's output (:meth:`keys_values`,
    computed once per window); never fused, since its projections read different inputs."""

    def keys_values(self, encoded: mx.array) -> tuple[mx.array, mx.array]:
        B, S, _ = encoded.shape
        keys = self.k_proj(encoded).reshape(B, S, self.n_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(encoded).reshape(B, S, self.n_heads, -1).transpose(0, 2, 1, 3)
        return keys, values

    def attend(self, x: mx.array, keys: mx.array, values: mx.array, report: HeadWeights | None = None) -> mx.array:
        """The attended output; with a ``report``, its heads' weights over the encoder's
        positions go in it too."""
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        if report is not None:
            report.weights = self.weights(queries, keys, heads=report.heads)
        return self.output(self._attention(queries, keys, values, scale=self.scale, mask=None))

    def fuse_projections(self) -> bool:
        return False


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dims, hidden), nn.Linear(hidden, dims)

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.fc2(nn.gelu(self.fc1(x)))
        return out


class EncoderLayer(nn.Module):
    def __init__(self, args: WhisperArgs, kernels: KernelSet):
        super().__init__()
        D = args.d_model
        self.self_attn = attention(D, args.encoder_attention_heads, kernels)
        self.self_attn_layer_norm, self.final_layer_norm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.mlp = MLP(D, args.encoder_ffn_dim)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.self_attn_layer_norm(x), None, None)
        return x + self.mlp(self.final_layer_norm(x))


class Encoder(nn.Module):
    """``[B, mels, frames]`` -> ``[B, frames // 2, d_model]``."""

    def __init__(self, args: WhisperArgs, kernels: KernelSet):
        super().__init__()
        D = args.d_model
        self.conv1 = nn.Conv1d(args.num_mel_bins, D, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(D, D, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(args.max_source_positions, D)
        self.layers = [EncoderLayer(args, kernels) for _ in range(args.encoder_layers)]
        self.layer_norm = nn.LayerNorm(D)

    def __call__(self, features: mx.array) -> mx.array:
        x = nn.gelu(self.conv1(features.transpose(0, 2, 1)))  # MLX convolves [B, length, channels]
        x = nn.gelu(self.conv2(x))
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        out: mx.array = self.layer_norm(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: WhisperArgs, kernels: KernelSet):
        super().__init__()
        D, H = args.d_model, args.decoder_attention_heads
        self.self_attn = attention(D, H, kernels)
        self.encoder_attn = CrossAttention(D, H, H, D // H, kernels=kernels, rotary=no_rotation, qkv_bias=True, out_bias=True)
        self.self_attn_layer_norm, self.encoder_attn_layer_norm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.final_layer_norm = nn.LayerNorm(D)
        self.mlp = MLP(D, args.decoder_ffn_dim)

    def __call__(
        self, x: mx.array, mask: str | None, cache: KVCache | None, cross: tuple[mx.array, mx.array],
        report: HeadWeights | None = None,
    ) -> mx.array:  # fmt: skip
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask, cache)
        x = x + self.encoder_attn.attend(self.encoder_attn_layer_norm(x), *cross, report)
        return x + self.mlp(self.final_layer_norm(x))


class Decoder(nn.Module):
    def __init__(self, args: WhisperArgs, kernels: KernelSet):
        super().__init__()
        D = args.d_model
        self.embed_tokens = nn.Embedding(args.vocab_size, D)
        self.embed_positions = nn.Embedding(args.max_target_positions, D)
        self.layers = [DecoderLayer(args, kernels) for _ in range(args.decoder_layers)]
        self.layer_norm = nn.LayerNorm(D)


class Seq2Seq(nn.Module):
    def __init__(self, args: WhisperArgs, kernels: KernelSet):
        super().__init__()
        self.encoder = Encoder(args, kernels)
        self.decoder = Decoder(args, kernels)


class Whisper(nn.Module):
    """:meth:`encode` a window's features, :meth:`cross` its keys and values for every decoder
    layer, then ``model(tokens [B, L], cache, cross=...) -> logits [B, L, vocab]``; with
    ``cross_weights={layer: HeadWeights(heads)}``, those layers also report those heads'
    cross-attention weights (word timings: :mod:`mlxr_plugins.archs.whisper_timing`); nothing of
    it is computed otherwise."""

    def __init__(self, args: WhisperArgs, kernels: KernelSet):
        super().__init__()
        self.args = args
        self.model = Seq2Seq(args, kernels)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.decoder.layers

    def encode(self, features: mx.array) -> mx.array:
        """``[B, mels, frames]`` -> the encoder's output ``[B, frames // 2, d_model]``."""
        return self.model.encoder(features)

    def cross(self, encoded: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Every decoder layer's cross-attention keys and values over ``encoded``."""
        return [layer.encoder_attn.keys_values(encoded) for layer in self.layers]

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, *, cross: list[tuple[mx.array, mx.array]] | None = None,
        cross_weights: dict[int, HeadWeights] | None = None,
    ) -> mx.array:  # fmt: skip
        if cross is None:
            raise ValueError("a Whisper decoder step attends to a window of sound: pass cross=model.cross(...)")
        decoder = self.model.decoder
        offset = cache[0].offset if cache else 0
        if offset + inputs.shape[1] > self.args.max_target_positions:
            raise ValueError(f"Whisper's decoder holds at most {self.args.max_target_positions} positions")
        x = decoder.embed_tokens(inputs) + decoder.embed_positions.weight[offset : offset + inputs.shape[1]]
        mask = "causal" if inputs.shape[1] > 1 else None
        reports = cross_weights or {}
        for index, (layer, layer_cache, kv) in enumerate(zip(self.layers, cache or [None] * len(self.layers), cross, strict=True)):
            x = layer(x, mask, layer_cache, kv, reports.get(index))
        logits: mx.array = decoder.embed_tokens.as_linear(decoder.layer_norm(x))
        return logits


class WhisperArchitecture:
    """The :class:`~mlxr_core.model.arch.Architecture` of ``whisper``, with
    :class:`~mlxr_core.model.audio.ProvidesSpeech`."""

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        return Whisper(WhisperArgs.from_config(config), kernels)

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Hugging Face's names onto the module's: ``out_proj`` -> ``o_proj``, ``fc1``/``fc2``
        under ``mlp``, a zero bias for each key projection, convolutions as MLX lays them out
        (``[out, kernel, in]``), the tied ``proj_out`` dropped."""
        out = {}
        for name, array in weights.items():
            if name == "proj_out.weight":
                continue
            name = name.replace(".out_proj.", ".o_proj.").replace(".fc1.", ".mlp.fc1.").replace(".fc2.", ".mlp.fc2.")
            if name.endswith(("conv1.weight", "conv2.weight")) and array.shape[-1] == 3 and array.shape[1] != 3:
                array = array.transpose(0, 2, 1)
            out[name] = array
            if name.endswith(".k_proj.weight"):
                out[name.removesuffix("weight") + "bias"] = mx.zeros((array.shape[0],), dtype=array.dtype)
        return out

    def make_cache(self, model: nn.Module) -> list[Any]:
        return [KVCache() for _ in model.layers]

    def context_length(self, config: dict[str, Any]) -> int:
        return int(WhisperArgs.from_config(config).max_target_positions)

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        args = WhisperArgs.from_config(config)
        head_dim = args.d_model // args.decoder_attention_heads
        heads = args.decoder_attention_heads
        return {"head_dim": head_dim, "n_heads": heads, "n_kv_heads": heads, "rope_dims": head_dim,
                "rope_traditional": False, "masks": ("causal",)}  # fmt: skip

    def hidden_states(self, model: nn.Module, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        raise ValueError("Whisper transcribes sound; it has no text embeddings to pool")

    def speech(
        self, model: nn.Module, checkpoint: Checkpoint, tokenizer: Tokenizer, preprocessor: dict[str, Any] | None
    ) -> Any:
        """The transcriber (:mod:`mlxr_plugins.archs.whisper_decoding`), its special tokens read
        from ``generation_config.json`` (every Hugging Face Whisper folder has one)."""
        from mlxr_plugins.archs.whisper_decoding import WhisperSpeech

        path = checkpoint.path / "generation_config.json"
        if not path.is_file():
            raise ModelLoadError("a Whisper folder needs its generation_config.json (its special tokens)", path=str(path))
        try:
            generation = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read it: {exc}", path=str(path)) from None
        args = WhisperArgs.from_config(checkpoint.config)
        front_end = LogMel.from_config(preprocessor, args.num_mel_bins)
        if front_end.window_frames != 2 * args.max_source_positions:
            raise ModelLoadError(
                f"preprocessor_config.json's window ({front_end.chunk_length} s, {front_end.window_frames} frames) "
                f"is not the encoder's {2 * args.max_source_positions} frames (max_source_positions)",
                path=str(checkpoint.path / "preprocessor_config.json"), key="chunk_length",
            )  # fmt: skip
        return WhisperSpeech(model, tokenizer, front_end, generation, str(path))
