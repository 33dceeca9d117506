"""Tiny random models written on the fly, so tests load a complete model in milliseconds.

:func:`write_tiny_llama_gguf` writes a deterministic llama GGUF the way llama.cpp's converter would
(Q/K rows permuted for ggml's rotary layout, quantized with the ``gguf`` package's reference
quantizers) with a small but valid GPT-2-style byte-level BPE vocabulary and a ChatML template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

Quant = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0"]

#: Control tokens, first in the vocabulary like SmolLM2's.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: gpt-oss's (Harmony's) special tokens in its order, for a tiny model that speaks Harmony.
HARMONY_SPECIAL_TOKENS = (
    "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
    "<|end|>", "<|message|>", "<|call|>",
)  # fmt: skip
#: A few BPE merges over the byte alphabet (``Ġ`` is the GPT-2 symbol for a space).
MERGES = (
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("r", "e"),
    ("Ġ", "a"),
    ("Ġ", "s"),
    ("l", "l"),
    ("Ġ", "w"),
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def gpt2_byte_symbols() -> list[str]:
    """The printable stand-in GPT-2 uses for each of the 256 bytes, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def tiny_gpt2_vocab(
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny vocabulary: specials, 256 bytes, merged tokens."""
    import gguf

    tokens = [*special_tokens, *gpt2_byte_symbols(), *(a + b for a, b in MERGES)]
    types = [gguf.TokenType.CONTROL] * len(special_tokens) + [gguf.TokenType.NORMAL] * (
        len(tokens) - len(special_tokens)
    )
    return tokens, [int(t) for t in types], [f"{a} {b}" for a, b in MERGES]


def _permute_for_ggml(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (see ``mlxr_plugins.formats.gguf.quants``)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_llama_gguf(
    path: str | Path,
    *,
    quant: Quant = "f32",
    vocab: Literal["gpt2"] = "gpt2",
    seed: int = 0,
    n_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    context_length: int = 512,
    rope_theta: float = 10000.0,
    tied_embeddings: bool = False,
    chat_template: str = CHATML_TEMPLATE,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    eos_token: str = "<|im_end|>",
    sampling: Mapping[str, float] | None = None,
) -> Path:
    """Write a tiny random llama GGUF to ``path`` and return the path.

    ``quant`` is the type of every matrix (norms stay F32); ``q5_0`` is repacked as MLX 5-bit.
    ``chat_template`` replaces the ChatML template (tests give hostile ones); ``special_tokens``
    (control tokens, ``<|endoftext|>`` among them: the BOS) and ``eos_token`` replace ChatML's.
    ``sampling`` writes llama.cpp's ``general.sampling.<key>`` defaults (``temp``, ``top_k`` ...).
    The same arguments always produce the same bytes.
    """
    import gguf

    if vocab != "gpt2":
        raise ValueError(f"unknown tiny vocabulary {vocab!r} (only 'gpt2')")
    qtype = gguf.GGMLQuantizationType[quant.upper()]
    file_type = (
        gguf.LlamaFileType.ALL_F32
        if quant == "f32"
        else gguf.LlamaFileType[f"MOSTLY_{quant.upper()}"]
    )
    path = Path(path)
    tokens, token_types, merges = tiny_gpt2_vocab(special_tokens)
    n_vocab, head_dim = len(tokens), hidden // heads
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_file_type(file_type)
    writer.add_block_count(n_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index(eos_token))
    writer.add_add_bos_token(False)
    for key, value in (sampling or {}).items():
        if isinstance(value, int):
            writer.add_int32(f"general.sampling.{key}", value)
        else:
            writer.add_float32(f"general.sampling.{key}", value)
    writer.add_chat_template(chat_template)

    def add(name: str, array: np.ndarray) -> None:
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    add("token_embd.weight", (0.5 * rng.standard_normal((n_vocab, hidden))).astype(np.float32))
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", norm())
        add(f"blk.{i}.attn_q.weight", _permute_for_ggml(matrix(heads * head_dim, hidden), heads))
        add(
            f"blk.{i}.attn_k.weight",
            _permute_for_ggml(matrix(kv_heads * head_dim, hidden), kv_heads),
        )
        add(f"blk.{i}.attn_v.weight", matrix(kv_heads * head_dim, hidden))
        add(f"blk.{i}.attn_output.weight", matrix(hidden, heads * head_dim))
        add(f"blk.{i}.ffn_norm.weight", norm())
        add(f"blk.{i}.ffn_gate.weight", matrix(intermediate, hidden))
        add(f"blk.{i}.ffn_up.weight", matrix(intermediate, hidden))
        add(f"blk.{i}.ffn_down.weight", matrix(hidden, intermediate))
    add("output_norm.weight", norm())
    if not tied_embeddings:
        add("output.weight", matrix(n_vocab, hidden))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_value(writer: Any, key: str, value: Any) -> None:
    """Write one metadata value with the type the converter gives it: bools, strings, float32,
    arrays, unsigned 32-bit ints (signed or 64-bit ones outside that range)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    elif value < 0:
        writer.add_int32(key, value) if value >= -(2**31) else writer.add_int64(key, value)
    elif value >= 2**32:
        writer.add_uint64(key, value)
    else:
        writer.add_uint32(key, value)


def write_gguf(
    path: str | Path,
    arch: str,
    metadata: dict[str, int | float | str | bool | list[int] | list[float]],
    tensors: dict[str, np.ndarray],
    *,
    quant: Quant = "f32",
    quants: Mapping[str, str] | None = None,
) -> Path:
    """Write ``tensors`` (llama.cpp names, float32, Hugging Face ``[out, in]`` layout) and
    ``metadata`` (keys without the ``{arch}.`` prefix) as a GGUF of architecture ``arch``.

    For converting a tiny Hugging Face checkpoint the way ``convert_hf_to_gguf`` would, once the
    caller has renamed (and, where llama.cpp does, permuted) its tensors. Vectors stay F32; every
    matrix is stored as ``quant``, or as the ggml type ``quants`` names for it (``{"blk.0.
    ffn_down_exps.weight": "mxfp4"}``: llama.cpp's gpt-oss files keep only the experts MXFP4).
    Values are typed as the converter types them: ints as uint32, floats as float32, lists as
    arrays.
    """
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        add_value(writer, f"{arch}.{key}", value)
    for name, array in tensors.items():
        array = np.asarray(array, dtype=np.float32)
        qtype = gguf.GGMLQuantizationType[(quants or {}).get(name, quant).upper()]
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
