"""Gemma 3n's audio side: the log-Mel front end, the USM-style conformer tower and the embedder
that projects its soft tokens into the text model's space.

- :class:`~mlxr_plugins.archs.gemma3n_audio_features.Gemma3nLogMel` (numpy only, in its own
  module): the log-Mel features of a 16 kHz sound.
- :class:`Gemma3nAudioEncoder`: two 2-D convolutions (time padded after, frequency by one each
  side, stride 2 both ways), each followed by a group norm whose statistics accumulate over time
  and a ReLU, flattened and projected; then conformer blocks (half-step feed-forward, chunked
  local self-attention with a learned relative position term and a logit soft cap, a causal
  depthwise "light" convolution, a second half-step feed-forward, a norm), every
  ``conf_reduction_factor``-th frame kept, invalid frames zeroed.
- :class:`Gemma3nAudioEmbedder`: soft tokens through an RMS norm, a projection to the text width
  and a scale-free RMS norm; a hard token of the audio vocabulary the same way from its table.

The math follows transformers' ``Gemma3nAudioEncoder`` / ``Gemma3nMultimodalEmbedder`` /
``Gemma3nAudioFeatureExtractor``; the tensor names are the checkpoint's (under
``model.audio_tower.`` and ``model.embed_audio.``).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ModelLoadError


@attrs.frozen
class AudioArgs:
    """The tower's settings, from a ``gemma3n`` config's ``audio_config`` (transformers' names and
    defaults)."""

    hidden_size: int = 1536
    input_feat_size: int = 128
    vocab_size: int = 128
    vocab_offset: int = 262_144 + 128
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    conf_attention_chunk_size: int = 12
    conf_attention_context_left: int = 13
    conf_attention_context_right: int = 0
    conf_attention_logit_cap: float = 50.0
    conf_num_attention_heads: int = 8
    conf_num_hidden_layers: int = 12
    conf_conv_kernel_size: int = 5
    conf_reduction_factor: int = 4
    conf_residual_weight: float = 0.5
    sscp_conv_channel_size: tuple[int, ...] = (128, 32)
    sscp_conv_group_norm_eps: float = 1e-3
    sscp_conv_kernel_size: tuple[tuple[int, int], ...] = ((3, 3), (3, 3))
    sscp_conv_stride_size: tuple[tuple[int, int], ...] = ((2, 2), (2, 2))

    @classmethod
    def from_config(cls, audio: dict[str, Any]) -> AudioArgs:
        names = {field.name for field in attrs.fields(cls)}
        kept: dict[str, Any] = {k: v for k, v in audio.items() if k in names and v is not None}
        for key in ("sscp_conv_channel_size",):
            if key in kept:
                kept[key] = tuple(int(v) for v in kept[key])
        for key in ("sscp_conv_kernel_size", "sscp_conv_stride_size"):
            if key in kept:
                kept[key] = tuple((int(a), int(b)) for a, b in kept[key])
        args = cls(**kept)
        for key in ("sscp_conv_channel_size", "sscp_conv_kernel_size", "sscp_conv_stride_size"):
            if len(getattr(args, key)) != 2:
                raise ModelLoadError(f"Gemma 3n's audio tower has two subsampling convolutions, not "
                                     f"{len(getattr(args, key))}", key=f"audio_config.{key}")  # fmt: skip
        if args.hidden_size % args.conf_num_attention_heads:
            raise ModelLoadError("hidden_size is not a multiple of conf_num_attention_heads",
                                 key="audio_config.hidden_size")  # fmt: skip
        return args

    @property
    def time_stride(self) -> int:
        return math.prod(stride[0] for stride in self.sscp_conv_stride_size)


def rms_norm(x: mx.array, weight: mx.array | None, eps: float) -> mx.array:
    """``x * (mean(x^2) + eps)^-1/2 * weight`` in float32 (Gemma 3n's norm: the weight as stored)."""
    out = x.astype(mx.float32) * mx.rsqrt(mx.mean(mx.square(x.astype(mx.float32)), axis=-1, keepdims=True) + eps)
    if weight is not None:
        out = out * weight.astype(mx.float32)
    return out.astype(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)


class CumulativeGroupNorm(nn.Module):
    """A group norm of one group over every feature and channel of a time step, with the mean and
    variance accumulated from the first step to this one; a per-channel scale, no bias."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.weight = mx.ones((channels,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:  # [B, T, F, C]
        h = x.astype(mx.float32)
        count = mx.cumsum(mx.full((x.shape[1],), x.shape[2] * x.shape[3], mx.float32))[None, :, None, None]
        mean = mx.cumsum(mx.sum(h, axis=(2, 3), keepdims=True), axis=1) / count
        variance = mx.cumsum(mx.sum(mx.square(h - mean), axis=(2, 3), keepdims=True), axis=1) / count
        return ((h - mean) * mx.rsqrt(variance + self.eps) * self.weight).astype(x.dtype)


class SubsampleBlock(nn.Module):
    def __init__(self, args: AudioArgs, index: int):
        super().__init__()
        channels = args.sscp_conv_channel_size
        self.kernel = args.sscp_conv_kernel_size[index]
        self.conv = nn.Conv2d(1 if index == 0 else channels[index - 1], channels[index], self.kernel,
                              stride=args.sscp_conv_stride_size[index], bias=False)  # fmt: skip
        self.norm = CumulativeGroupNorm(channels[index], args.sscp_conv_group_norm_eps)

    def __call__(self, x: mx.array) -> mx.array:  # [B, T, F, C]: time padded after, frequency by one each side
        x = mx.pad(x, [(0, 0), (0, self.kernel[0] - 1), (1, 1), (0, 0)])
        return nn.relu(self.norm(self.conv(x)))


class SubsampleProjection(nn.Module):
    def __init__(self, args: AudioArgs):
        super().__init__()
        self.conv_0 = SubsampleBlock(args, 0)
        self.conv_1 = SubsampleBlock(args, 1)
        freq = args.input_feat_size
        for (_, kw), (_, sw) in zip(args.sscp_conv_kernel_size, args.sscp_conv_stride_size, strict=True):
            freq = (freq + 2 - kw) // sw + 1
        self.input_proj_linear = nn.Linear(freq * args.sscp_conv_channel_size[-1], args.hidden_size, bias=False)

    def __call__(self, features: mx.array) -> mx.array:  # [B, T, F]
        x = self.conv_1(self.conv_0(features[..., None]))
        B, T, F, C = x.shape
        return self.input_proj_linear(x.reshape(B, T, F * C))


class RelativePosition(nn.Module):
    """The query-position term of the chunked attention: sinusoids of the relative distances
    ``left - 1 .. -right`` projected per head, shifted so each query's row lines up with its keys."""

    def __init__(self, args: AudioArgs):
        super().__init__()
        self.heads = args.conf_num_attention_heads
        self.back, self.ahead = max(0, args.conf_attention_context_left - 1), args.conf_attention_context_right
        self.pos_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        n = args.hidden_size // 2
        self._inv_timescales = mx.exp(mx.arange(n, dtype=mx.float32) * -(math.log(1.0e4) / max(n - 1, 1)))

    def __call__(self, queries: mx.array, keys: mx.array) -> mx.array:
        """``queries [B, U, W, N, H]``, ``keys [B, U, C, N, H]`` -> logits ``[B, N, U, W, C]``."""
        B, U, W, N, H = queries.shape
        C = keys.shape[2]
        distance = mx.arange(self.back, -self.ahead - 1, -1).astype(mx.float32)[:, None] * self._inv_timescales
        signal = mx.concatenate([mx.sin(distance), mx.cos(distance)], axis=-1).astype(queries.dtype)
        F = signal.shape[0]
        positions = self.pos_proj(signal).reshape(F, N, H).transpose(1, 2, 0)  # [N, H, F]
        q = queries.transpose(0, 3, 1, 2, 4)  # [B, N, U, W, H]
        content = q @ keys.transpose(0, 3, 1, 4, 2)  # [B, N, U, W, C]
        position = (q.reshape(B, N, U * W, H) @ positions).reshape(B, N, U, W, F)
        # row w's term for distance f goes to key column w + f
        position = mx.pad(position, [(0, 0)] * 4 + [(0, C + 1 - F)]).reshape(B, N, U, W * (C + 1))
        return content + position[..., : W * C].reshape(B, N, U, W, C)


class ChunkedAttention(nn.Module):
    """Local self-attention in chunks of ``W`` queries, each seeing its chunk and the
    ``context_left - 1`` frames before it (and ``context_right`` after): per-dimension query
    scales, the relative position term, a ``tanh`` soft cap, invalid frames masked."""

    def __init__(self, args: AudioArgs):
        super().__init__()
        self.heads, self.head_dim = args.conf_num_attention_heads, args.hidden_size // args.conf_num_attention_heads
        self.chunk = args.conf_attention_chunk_size
        self.back, self.ahead = max(0, args.conf_attention_context_left - 1), args.conf_attention_context_right
        self.context = self.chunk + self.back + self.ahead
        self.cap = args.conf_attention_logit_cap
        self.relative_position_embedding = RelativePosition(args)
        self.per_dim_scale = mx.zeros((self.head_dim,))
        self.q_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        w, c = np.arange(self.chunk)[:, None], np.arange(self.context)[None, :]
        self._local = mx.array((c >= w) & (c <= w + self.back + self.ahead))  # [W, C]

    def _frames(self, x: mx.array, blocks: int) -> mx.array:
        """``x [B, T, ...]`` -> ``[B, blocks, C, ...]``: block ``u`` sees ``u*W - back ..``."""
        pad = [(0, 0), (self.back, self.ahead + self.chunk - 1)] + [(0, 0)] * (x.ndim - 2)
        x = mx.pad(x, pad)
        index = mx.arange(blocks)[:, None] * self.chunk + mx.arange(self.context)[None, :]
        return x[:, index]

    def __call__(self, x: mx.array, valid: mx.array) -> mx.array:  # [B, T, D], [B, T] -> [B, T, N, H]
        B, T, _ = x.shape
        shape = (B, T, self.heads, self.head_dim)
        scale = (self.head_dim**-0.5 / math.log(2.0)) * nn.softplus(self.per_dim_scale.astype(mx.float32))
        q = self.q_proj(x).reshape(shape) * scale.astype(x.dtype)
        k, v = self.k_proj(x).reshape(shape), self.v_proj(x).reshape(shape)
        blocks = -(-T // self.chunk)
        q = mx.pad(q, [(0, 0), (0, blocks * self.chunk - T), (0, 0), (0, 0)]).reshape(
            B, blocks, self.chunk, self.heads, self.head_dim
        )
        keys, values = self._frames(k, blocks), self._frames(v, blocks)  # [B, U, C, N, H]
        allowed = self._frames(valid, blocks)[:, None, :, None, :] & self._local  # [B, 1, U, W, C]
        logits = self.relative_position_embedding(q, keys)
        logits = mx.tanh(logits / self.cap) * self.cap
        logits = mx.where(allowed, logits, mx.finfo(logits.dtype).min)
        probs = mx.softmax(logits.astype(mx.float32), axis=-1).astype(values.dtype)  # [B, N, U, W, C]
        out = probs.transpose(0, 2, 1, 3, 4) @ values.transpose(0, 1, 3, 2, 4)  # [B, U, N, W, H]
        out = out.transpose(0, 1, 3, 2, 4).reshape(B, blocks * self.chunk, self.heads, self.head_dim)
        return out[:, :T]


class ConformerAttention(nn.Module):
    def __init__(self, args: AudioArgs):
        super().__init__()
        self.clip = args.gradient_clipping
        self.pre_attn_norm = RMSNorm(args.hidden_size)
        self.attn = ChunkedAttention(args)
        self.post = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.post_norm = RMSNorm(args.hidden_size)

    def __call__(self, x: mx.array, valid: mx.array) -> mx.array:
        h = self.attn(self.pre_attn_norm(mx.clip(x, -self.clip, self.clip)), valid)
        h = mx.clip(self.post(h.reshape(*x.shape)), -self.clip, self.clip)
        return x + self.post_norm(h)


class ConformerFeedForward(nn.Module):
    def __init__(self, args: AudioArgs):
        super().__init__()
        self.clip, self.residual_weight = args.gradient_clipping, args.conf_residual_weight
        self.pre_layer_norm = RMSNorm(args.hidden_size)
        self.ffw_layer_1 = nn.Linear(args.hidden_size, args.hidden_size * 4, bias=False)
        self.ffw_layer_2 = nn.Linear(args.hidden_size * 4, args.hidden_size, bias=False)
        self.post_layer_norm = RMSNorm(args.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.ffw_layer_1(self.pre_layer_norm(mx.clip(x, -self.clip, self.clip)))
        h = mx.clip(self.ffw_layer_2(nn.silu(h)), -self.clip, self.clip)
        return x + self.post_layer_norm(h) * self.residual_weight


class LightConv(nn.Module):
    """A gated linear unit, a causal depthwise convolution, a norm, SiLU and a projection."""

    def __init__(self, args: AudioArgs):
        super().__init__()
        D, self.clip, self.kernel = args.hidden_size, args.gradient_clipping, args.conf_conv_kernel_size
        self.pre_layer_norm = RMSNorm(D, args.rms_norm_eps)
        self.linear_start = nn.Linear(D, D * 2, bias=False)
        self.depthwise_conv1d = nn.Conv1d(D, D, self.kernel, groups=D, bias=False)
        self.conv_norm = RMSNorm(D, args.rms_norm_eps)
        self.linear_end = nn.Linear(D, D, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.linear_start(self.pre_layer_norm(x))
        a, gate = mx.split(h, 2, axis=-1)
        h = self.depthwise_conv1d(mx.pad(a * mx.sigmoid(gate), [(0, 0), (self.kernel - 1, 0), (0, 0)]))
        h = self.linear_end(nn.silu(self.conv_norm(mx.clip(h, -self.clip, self.clip))))
        return h + x


class ConformerBlock(nn.Module):
    def __init__(self, args: AudioArgs):
        super().__init__()
        self.clip = args.gradient_clipping
        self.ffw_layer_start = ConformerFeedForward(args)
        self.attention = ConformerAttention(args)
        self.lconv1d = LightConv(args)
        self.ffw_layer_end = ConformerFeedForward(args)
        self.norm = RMSNorm(args.hidden_size)

    def __call__(self, x: mx.array, valid: mx.array) -> mx.array:
        x = self.attention(self.ffw_layer_start(x), valid)
        x = self.lconv1d(x * valid[..., None].astype(x.dtype))
        return self.norm(mx.clip(self.ffw_layer_end(x), -self.clip, self.clip))


class Gemma3nAudioEncoder(nn.Module):
    """``tower(features [B, T, F], valid [B, T]) -> (encodings [B, T', D], valid [B, T'])``,
    ``T' = ceil(ceil(T / 2) / 2 / reduction)``; invalid frames' encodings are zero."""

    def __init__(self, args: AudioArgs):
        super().__init__()
        self.args = args
        self.subsample_conv_projection = SubsampleProjection(args)
        self.conformer = [ConformerBlock(args) for _ in range(args.conf_num_hidden_layers)]

    def __call__(self, features: mx.array, valid: mx.array) -> tuple[mx.array, mx.array]:
        x = self.subsample_conv_projection(features)
        index = mx.minimum(mx.arange(x.shape[1]) * self.args.time_stride, valid.shape[1] - 1)
        kept = valid[:, index]
        for block in self.conformer:
            x = block(x, kept)
        step = max(1, self.args.conf_reduction_factor)
        x, kept = x[:, ::step], kept[:, ::step]
        return mx.where(kept[..., None], x, 0.0).astype(x.dtype), kept


class Gemma3nAudioEmbedder(nn.Module):
    """Soft tokens ``[..., audio hidden]`` (or hard ids of the audio vocabulary) -> ``[..., text
    hidden]``: a norm, a projection, a scale-free norm (transformers' ``embed_audio``)."""

    def __init__(self, args: AudioArgs, text_hidden: int):
        super().__init__()
        self.eps, self.offset = args.rms_norm_eps, args.vocab_offset
        self.embedding = nn.Embedding(args.vocab_size, args.hidden_size)
        self.hard_embedding_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.soft_embedding_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.embedding_projection = nn.Linear(args.hidden_size, text_hidden, bias=False)

    def __call__(self, soft: mx.array) -> mx.array:
        return rms_norm(self.embedding_projection(self.soft_embedding_norm(soft)), None, self.eps)

    def hard(self, ids: mx.array) -> mx.array:
        """Token ids of the audio vocabulary (``vocab_offset ..``) -> ``[..., text hidden]``."""
        h = self.hard_embedding_norm(self.embedding(ids - self.offset))
        return rms_norm(self.embedding_projection(h), None, self.eps)


class Gemma3nAudio(nn.Module):
    """The tower and embedder of one checkpoint: ``module(features [B, T, F], valid [B, T]) ->
    [B, tokens, text hidden]``, every sound's soft tokens followed by the padding token's
    embedding (the last of the audio vocabulary) up to ``tokens`` (transformers fills invalid
    frames and the rest of the 30 s window so)."""

    def __init__(self, args: AudioArgs, text_hidden: int, tokens: int):
        super().__init__()
        self.tokens = tokens
        self.pad_id = args.vocab_offset + args.vocab_size - 1
        self.audio_tower = Gemma3nAudioEncoder(args)
        self.embed_audio = Gemma3nAudioEmbedder(args, text_hidden)

    def __call__(self, features: mx.array, valid: mx.array) -> mx.array:
        encodings, kept = self.audio_tower(features, valid)
        soft = self.embed_audio(encodings)
        pad = self.embed_audio.hard(mx.array([self.pad_id]))[0].astype(soft.dtype)
        soft = mx.where(kept[..., None], soft, pad)[:, : self.tokens]
        B, T, D = soft.shape
        if self.tokens > T:
            soft = mx.concatenate([soft, mx.broadcast_to(pad, (B, self.tokens - T, D))], axis=1)
        return soft


def sanitize(weights: dict[str, mx.array], args: AudioArgs | None = None) -> dict[str, mx.array]:
    """The checkpoint's audio tensors (``model.audio_tower.*``, ``model.embed_audio.*``, or the
    same without ``model.``) under :class:`Gemma3nAudio`'s names, convolutions in MLX's layout
    (channels last). A convolution already in that layout (an MLX conversion's) is kept: told
    apart by its shape against ``args`` (the defaults without), PyTorch's layout where both fit."""
    args = args or AudioArgs()
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        key = name[len("model."):] if name.startswith("model.") else name
        if not key.startswith(("audio_tower.", "embed_audio.")):
            continue
        if key.endswith(".conv.weight") and value.ndim == 4:
            out[key] = value if mlx_layout(value.shape, key, args) else value.transpose(0, 2, 3, 1)
        elif key.endswith("depthwise_conv1d.weight") and value.ndim == 3:
            torch = value.shape[1] == 1 and value.shape[2] == args.conf_conv_kernel_size  # [D, 1, K]
            out[key] = value.transpose(0, 2, 1) if torch else value
        else:
            out[key] = value
    return out


def mlx_layout(shape: tuple[int, ...], key: str, args: AudioArgs) -> bool:
    """Whether a subsampling convolution's weight is ``[O, kh, kw, I]`` rather than PyTorch's
    ``[O, I, kh, kw]``."""
    index = 1 if ".conv_1." in key else 0
    channels = 1 if index == 0 else args.sscp_conv_channel_size[0]
    kernel = tuple(args.sscp_conv_kernel_size[index])
    torch = shape[1] == channels and tuple(shape[2:]) == kernel
    return not torch and tuple(shape[1:3]) == kernel and shape[3] == channels


@attrs.frozen
class AudioTokens:
    """Where one sound's soft tokens go in a ``gemma3n`` prompt: :attr:`tokens` positions of
    :attr:`audio_token_id`, written ``\\n\\n<start_of_audio>`` + the tokens + ``<end_of_audio>\\n\\n``
    (transformers' ``Gemma3nProcessor``); a prompt's ids at or past :attr:`vocab_offset` (the
    end-of-audio marker) take the audio embedder's hard embeddings, as transformers' model does."""

    audio_token_id: int = 262_273
    tokens: int = 188
    vocab_offset: int = 262_272
    vocab_size: int = 128
    before: str = "\n\n<start_of_audio>"
    token_text: str = "<audio_soft_token>"
    after: str = "<end_of_audio>\n\n"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AudioTokens:
        audio = config.get("audio_config") or {}
        defaults = cls()
        return cls(
            int(config.get("audio_token_id", defaults.audio_token_id)),
            int(config.get("audio_soft_tokens_per_image", defaults.tokens)),
            int(audio.get("vocab_offset", defaults.vocab_offset)),
            int(audio.get("vocab_size", defaults.vocab_size)),
        )

    def text(self) -> str:
        """One sound's run as a prompt writes it."""
        return self.before + self.token_text * self.tokens + self.after


def build_audio(config: dict[str, Any]) -> Gemma3nAudio:
    """The tower and embedder of a ``gemma3n`` config (its ``audio_config`` and the text width)."""
    text = config.get("text_config") or config
    return Gemma3nAudio(AudioArgs.from_config(config.get("audio_config") or {}), int(text["hidden_size"]),
                        AudioTokens.from_config(config).tokens)  # fmt: skip


def embeddings_with_audio(
    text_model: Any, inputs: mx.array, sounds: mx.array | None, audio: Gemma3nAudio, tokens: AudioTokens
) -> mx.array:
    """The packed stream of the ``gemma3n`` text model (``text_model.model``) for ``inputs [B, L]``
    with ``sounds`` (``[N, tokens, hidden]`` from :class:`Gemma3nAudio`, in order; None: none in
    these inputs) at the audio token positions: scaled token embeddings, ids of the audio
    vocabulary through the audio embedder's table, soft tokens merged, then the AltUp streams and
    per-layer inputs made from those (transformers' ``Gemma3nModel``: per-layer inputs read row 0
    for ids past their table). Pass it as ``text_model(inputs, cache, embeddings=...)``."""
    from mlxr_core.model.layers import DecoderModel
    from mlxr_core.model.vision import merge_embeddings

    model = text_model.model
    hard = (inputs >= tokens.vocab_offset) & (inputs < tokens.vocab_offset + tokens.vocab_size)
    h = DecoderModel.embed(model, mx.where(hard, 0, inputs))
    marked = audio.embed_audio.hard(mx.where(hard, inputs, tokens.vocab_offset)).astype(h.dtype)
    h = mx.where(hard[..., None], marked, h)
    if sounds is not None:
        h = merge_embeddings(h, inputs, sounds, tokens.audio_token_id)
    packed: mx.array = model.streams_in(h, model.per_layer_inputs(inputs, h))
    return packed
