"""The GGUF format: exact quant repacking, name and config mapping, Q/K un-permutation, errors."""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.checkpoint import QuantSpec
from mlxr_core.testing.tiny import CHATML_TEMPLATE, write_tiny_llama_gguf
from mlxr_plugins.formats.gguf.checkpoint import GGUFFormat, hf_name
from mlxr_plugins.formats.gguf.quants import (
    EXACT_BITS,
    pack_bits,
    permute_rows,
    repack,
    repack_mxfp4,
    unpermute_rows,
)

#: Types whose 32-element (sub-)blocks are MLX affine groups; ``gguf`` can write the first five.
EXACT = [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q5_0, QType.Q5_1, QType.Q4_K, QType.Q5_K]
QUANTIZABLE = EXACT[:5]
#: type -> (block bytes, bytes of float16 header: d, and m / dmin where there is one).
BLOCK_BYTES = {
    QType.Q4_0: (18, 2),
    QType.Q4_1: (20, 4),
    QType.Q8_0: (34, 2),
    QType.Q5_0: (22, 2),
    QType.Q5_1: (24, 4),
    QType.Q4_K: (144, 4),
    QType.Q5_K: (176, 4),
}


def random_blocks(qtype: QType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Raw ggml blocks with random (finite, either-signed) float16 scales and random quant bytes,
    so every nibble and int8 value occurs."""
    rng = np.random.default_rng(seed)
    block_bytes, head = BLOCK_BYTES[qtype]
    n = rows * blocks_per_row
    halves = (rng.standard_normal((n, head // 2)) * 10.0 ** rng.uniform(-4, 1, (n, 1))).astype(
        np.float16
    )
    quants = rng.integers(0, 256, (n, block_bytes - head), dtype=np.uint8)
    return np.concatenate([halves.view(np.uint8), quants], axis=1).reshape(
        rows, blocks_per_row * block_bytes
    )


def quantized_floats(qtype: QType, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 5.0, (6, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    return gguf.quants.quantize(x, qtype)


def mlx_dequantize(raw: np.ndarray, qtype: QType, dtype: mx.Dtype = mx.float32) -> np.ndarray:
    packed = repack(raw, qtype)
    w = mx.dequantize(
        mx.array(packed.weight),
        mx.array(packed.scales).astype(dtype),
        mx.array(packed.biases).astype(dtype),
        group_size=32,
        bits=packed.bits,
    )
    return np.array(w.astype(mx.float32))


@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
@pytest.mark.parametrize("source", ["random_bytes", "quantized"])
def test_repacking_is_exact_in_float32(qtype, source):
    if source == "quantized" and qtype not in QUANTIZABLE:
        pytest.skip(f"gguf has no {qtype.name} quantizer; random blocks cover every bit pattern")
    raw = (
        random_blocks(qtype, 5, 4, seed=1)
        if source == "random_bytes"
        else quantized_floats(qtype, seed=2)
    )
    expected = gguf.quants.dequantize(raw, qtype)
    # float32 holds the float16 scale, every d*q and the bias (-8d, m, -128d) exactly: bit-equal.
    # K-quants: MLX computes (d*sc)*q + (-dmin*m) in float32, the very operations ggml does.
    np.testing.assert_array_equal(mlx_dequantize(raw, qtype), expected)
    assert repack(raw, qtype).bits == EXACT_BITS[qtype]


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda q: q.name)
@pytest.mark.parametrize(
    "dtype,tolerance",
    # float16: scales stay exact, the products and sums round (two f16 roundings of values up to
    # 15/8 of the group's largest weight). bfloat16: the float16 scale and minimum themselves round
    # to 8 significant bits, about 1.5% of the group's range at worst.
    [(mx.float16, 2.0**-9), (mx.bfloat16, 2.0**-5)],
    ids=["float16", "bfloat16"],
)
def test_repacking_in_half_precision_is_within_rounding(qtype, dtype, tolerance):
    raw = quantized_floats(qtype, seed=3)
    expected = gguf.quants.dequantize(raw, qtype)
    group_max = np.abs(expected).reshape(expected.shape[0], -1, 32).max(-1, keepdims=True)
    error = np.abs(mlx_dequantize(raw, qtype, dtype) - expected).reshape(group_max.shape[0], -1, 32)
    assert (error <= tolerance * group_max).all()


def test_mxfp4_repacking_is_exact():
    """ggml's MXFP4 (scale byte, then element j and j + 16 in byte j) as MLX ``mxfp4`` words:
    bit-equal to ``gguf``'s dequantization for every code and every scale whose values are
    finite (0 to 250; ggml's and MLX's denormal scales 0 and 1 included)."""
    rng = np.random.default_rng(4)
    scales = rng.permutation(np.concatenate([np.arange(251), [0, 1, 127, 250]])).astype(np.uint8)[:, None]
    raw = np.concatenate([scales, rng.integers(0, 256, (255, 16), dtype=np.uint8)], axis=1)
    raw = raw.reshape(5, 3, 17 * 17)  # a stack of experts: [E, rows, bytes]
    weight, mlx_scales = repack_mxfp4(raw)
    assert weight.dtype == np.uint32 and weight.shape == (5, 3, 17 * 32 // 8)
    assert mlx_scales.dtype == np.uint8 and mlx_scales.shape == (5, 3, 17)
    dense = mx.dequantize(
        mx.array(weight), mx.array(mlx_scales), group_size=32, bits=4, mode="mxfp4", dtype=mx.float32
    )
    np.testing.assert_array_equal(np.array(dense), gguf.quants.dequantize(raw, QType.MXFP4))


def test_repack_rejects_misaligned_rows_and_other_types():
    with pytest.raises(ValueError, match="18-byte blocks"):
        repack(np.zeros((2, 20), dtype=np.uint8), QType.Q4_0)
    with pytest.raises(ValueError, match="Q6_K"):
        repack(np.zeros((2, 210), dtype=np.uint8), QType.Q6_K)


def test_unpermute_restores_hugging_face_row_order():
    # One head of 4 rows: HF pairs rows (0, 2) and (1, 3); llama.cpp stores them adjacent.
    hf = np.arange(4)[:, None] * np.ones((1, 3))
    assert permute_rows(hf, 1)[:, 0].tolist() == [0, 2, 1, 3]
    assert unpermute_rows(permute_rows(hf, 1), 1)[:, 0].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("heads,head_dim", [(4, 16), (3, 64), (1, 8)])
def test_unpermute_round_trips(heads, head_dim):
    x = np.random.default_rng(0).standard_normal((heads * head_dim, 5))
    np.testing.assert_array_equal(unpermute_rows(permute_rows(x, heads), heads), x)
    np.testing.assert_array_equal(permute_rows(unpermute_rows(x, heads), heads), x)
    bias = np.arange(heads * head_dim)
    np.testing.assert_array_equal(unpermute_rows(permute_rows(bias, heads), heads), bias)


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(ValueError, match="heads"):
        unpermute_rows(np.zeros((10, 4)), 4)


@pytest.mark.parametrize(
    "gguf_name,expected",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.11.attn_k.bias", "model.layers.11.self_attn.k_proj.bias"),
        ("blk.2.attn_v.weight", "model.layers.2.self_attn.v_proj.weight"),
        ("blk.2.attn_output.weight", "model.layers.2.self_attn.o_proj.weight"),
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("blk.4.ffn_gate.weight", "model.layers.4.mlp.gate_proj.weight"),
        ("blk.4.ffn_up.weight", "model.layers.4.mlp.up_proj.weight"),
        ("blk.4.ffn_down.weight", "model.layers.4.mlp.down_proj.weight"),
        ("blk.5.some_future_tensor.weight", "blk.5.some_future_tensor.weight"),
    ],
)
def test_tensor_names_map_to_hugging_face(gguf_name, expected):
    assert hf_name(gguf_name) == expected


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {
        q: write_tiny_llama_gguf(root / f"{q}.gguf", quant=q)
        for q in ("f32", "q4_0", "q4_1", "q8_0", "q5_0")
    }


def test_config_and_metadata_come_from_the_file(tiny_files):
    checkpoint = GGUFFormat().load(tiny_files["q4_1"])
    assert checkpoint.format == "gguf"
    assert checkpoint.config == {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": 271,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
    assert checkpoint.chat_template == CHATML_TEMPLATE
    assert checkpoint.tokenizer is not None and checkpoint.tokenizer.kind == "gguf"
    assert checkpoint.metadata["tensor_types"] == {"F32": 5, "Q4_1": 16}
    assert checkpoint.metadata["resident_bytes"] == sum(
        a.nbytes for a in checkpoint.weights.values()
    )
    matrices = [m for m in checkpoint.quantization if not m.endswith("norm")]
    assert len(matrices) == 16 and set(checkpoint.quantization.values()) == {
        QuantSpec(bits=4, group_size=32)
    }
    assert "lm_head" in checkpoint.quantization and "model.embed_tokens" in checkpoint.quantization


def test_tied_embeddings_when_the_file_has_no_output_tensor(tmp_path):
    checkpoint = GGUFFormat().load(
        write_tiny_llama_gguf(tmp_path / "tied.gguf", tied_embeddings=True)
    )
    assert checkpoint.config["tie_word_embeddings"] is True
    assert not any(name.startswith("lm_head") for name in checkpoint.weights)


@pytest.mark.parametrize("quant", ["q4_0", "q4_1", "q8_0"])
def test_loaded_quantized_weights_equal_ggml_dequantization(tiny_files, quant):
    checkpoint = GGUFFormat().load(tiny_files[quant], dtype="float32")
    reader = gguf.GGUFReader(tiny_files[quant])
    raw = {t.name: t for t in reader.tensors}
    spec = checkpoint.quantization["model.layers.1.self_attn.q_proj"]

    def loaded(module):
        w = checkpoint.weights
        return np.array(
            mx.dequantize(
                w[f"{module}.weight"],
                w[f"{module}.scales"],
                w[f"{module}.biases"],
                group_size=spec.group_size,
                bits=spec.bits,
            )
        )

    def ggml(name):
        return gguf.quants.dequantize(raw[name].data, raw[name].tensor_type)

    # Q and K come back in Hugging Face row order; the rest untouched.
    np.testing.assert_array_equal(
        loaded("model.layers.1.self_attn.q_proj"), unpermute_rows(ggml("blk.1.attn_q.weight"), 4)
    )
    np.testing.assert_array_equal(
        loaded("model.layers.1.self_attn.k_proj"), unpermute_rows(ggml("blk.1.attn_k.weight"), 2)
    )
    np.testing.assert_array_equal(
        loaded("model.layers.1.mlp.down_proj"), ggml("blk.1.ffn_down.weight")
    )
    np.testing.assert_array_equal(loaded("model.embed_tokens"), ggml("token_embd.weight"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dense_and_quantized_tensors_take_the_model_dtype(tiny_files, dtype):
    for quant in ("f32", "q8_0"):
        checkpoint = GGUFFormat().load(tiny_files[quant], dtype=dtype)
        for name, array in checkpoint.weights.items():
            expected = (
                mx.uint32
                if name in {f"{m}.weight" for m in checkpoint.quantization}
                else getattr(mx, dtype)
            )
            assert array.dtype == expected, name


def test_q5_0_is_repacked_exactly_as_five_bits(tiny_files):
    checkpoint = GGUFFormat().load(tiny_files["q5_0"])
    assert checkpoint.quantization["model.layers.0.mlp.up_proj"] == QuantSpec(bits=5, group_size=32)
    assert checkpoint.source_types["model.layers.0.mlp.up_proj"] == "Q5_0"
    assert checkpoint.suggested_quantization == {}
    reader = gguf.GGUFReader(tiny_files["q5_0"])
    (up,) = [t for t in reader.tensors if t.name == "blk.0.ffn_up.weight"]
    w = mx.dequantize(
        *(
            checkpoint.weights[f"model.layers.0.mlp.up_proj.{part}"]
            for part in ("weight", "scales", "biases")
        ),
        group_size=32,
        bits=5,
    )
    np.testing.assert_array_equal(np.array(w), gguf.quants.dequantize(up.data, up.tensor_type))


def test_types_without_an_exact_layout_are_dequantized_with_a_suggested_format(tmp_path):
    """Q6_K (16-element sub-blocks): dense exact values, and 8-bit group 32 suggested for ``keep``."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (4, 210), dtype=np.uint8)
    raw[:, 208:] = np.float16(0.01).reshape(1).view(np.uint8)  # d is the block's last 2 bytes
    writer = gguf.GGUFWriter(tmp_path / "q6.gguf", "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=QType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    checkpoint = GGUFFormat().load(tmp_path / "q6.gguf")
    module = "model.layers.0.mlp.up_proj"
    assert checkpoint.quantization == {}
    assert checkpoint.suggested_quantization == {module: QuantSpec(bits=8, group_size=32)}
    assert checkpoint.metadata["dequantized_types"] == ["Q6_K"]
    np.testing.assert_array_equal(
        np.array(checkpoint.weights[f"{module}.weight"]), gguf.quants.dequantize(raw, QType.Q6_K)
    )


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_bits_is_mlx_packing(bits):
    q = np.random.default_rng(bits).integers(0, 2**bits, (3, 64), dtype=np.uint8)
    ones = mx.ones((3, 2))
    unpacked = mx.dequantize(mx.array(pack_bits(q, bits)), ones, 0 * ones, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(unpacked), q.astype(np.float32))


def test_detect_checks_the_magic(tiny_files, tmp_path):
    fmt = GGUFFormat()
    assert fmt.detect(tiny_files["f32"])
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    assert not fmt.detect(tmp_path / "model.safetensors")
    assert not fmt.detect(tmp_path)
    assert not fmt.detect(tmp_path / "missing.gguf")


def test_bad_magic_names_the_file(tmp_path):
    bad = tmp_path / "not-really.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ModelLoadError, match="magic") as info:
        GGUFFormat().load(bad)
    assert info.value.path == str(bad)


def test_truncated_file_names_the_file_and_tensor(tiny_files, tmp_path):
    data = tiny_files["q8_0"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 3000])
    with pytest.raises(ModelLoadError, match="truncated") as info:
        GGUFFormat().load(cut)
    assert info.value.path == str(cut)
    assert info.value.tensor == "output.weight"  # the last tensor in the file
    assert str(cut) in str(info.value) and "output.weight" in str(info.value)


def test_file_cut_inside_the_header_names_the_file(tiny_files, tmp_path):
    cut = tmp_path / "header.gguf"
    cut.write_bytes(tiny_files["f32"].read_bytes()[:200])
    with pytest.raises(ModelLoadError) as info:
        GGUFFormat().load(cut)
    assert info.value.path == str(cut)


def test_unknown_dtype_is_refused(tiny_files):
    with pytest.raises(ModelLoadError, match="float64"):
        GGUFFormat().load(tiny_files["f32"], dtype="float64")


def test_tiny_writer_is_deterministic(tmp_path):
    first = write_tiny_llama_gguf(tmp_path / "a.gguf", quant="q4_1", seed=3).read_bytes()
    again = write_tiny_llama_gguf(tmp_path / "b.gguf", quant="q4_1", seed=3).read_bytes()
    other = write_tiny_llama_gguf(tmp_path / "c.gguf", quant="q4_1", seed=4).read_bytes()
    assert first == again and first != other


def test_the_fast_metadata_reader_reads_what_gguf_reads(tiny_files):
    from mlxr_plugins.formats.gguf.checkpoint import open_reader

    ours, theirs = open_reader(tiny_files["f32"]), gguf.GGUFReader(tiny_files["f32"])
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
        assert ours.fields[key].types == field.types, key


def test_a_string_array_past_the_end_names_the_file(tiny_files, tmp_path):
    data = tiny_files["f32"].read_bytes()
    start = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4
    bad = tmp_path / "huge-count.gguf"
    bad.write_bytes(data[:start] + (2**40).to_bytes(8, "little") + data[start + 8 :])
    with pytest.raises(ModelLoadError, match="corrupt GGUF header") as info:
        GGUFFormat().load(bad)
    assert info.value.path == str(bad)


def test_llama_cpps_sampling_defaults_are_the_models_generation_defaults(tmp_path):
    """``general.sampling.*`` (llama.cpp's) read under generation_config.json's names, which the
    engine serves to requests that leave sampling out; a file without them has none."""
    path = write_tiny_llama_gguf(tmp_path / "s.gguf", sampling={"temp": 0.6, "top_k": 20, "top_p": 0.95, "penalty_repeat": 1.1})
    defaults = GGUFFormat().load(path).metadata["generation_defaults"]
    assert defaults.keys() == {"temperature", "top_k", "top_p", "repetition_penalty"}
    assert defaults["top_k"] == 20 and abs(defaults["temperature"] - 0.6) < 1e-6
    assert abs(defaults["top_p"] - 0.95) < 1e-6 and abs(defaults["repetition_penalty"] - 1.1) < 1e-6
    assert GGUFFormat().load(write_tiny_llama_gguf(tmp_path / "plain.gguf")).metadata["generation_defaults"] == {}
