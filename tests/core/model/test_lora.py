"""LoRA adapters served unmerged (mlxr_core.model.lora) against PEFT on a tiny random Llama:
logits of each adapter merged into the base by PEFT equal mlxr's base plus its gathered low-rank
update, for rows of one batch using different adapters (and none); PEFT, mlx-lm and llama.cpp
files of the same adapter give the same logits; adapters that do not fit are refused naming the
tensor or field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import AdapterConfig, ModelConfig
from mlxr_core.errors import ModelLoadError
from mlxr_core.model.loader import load_model
from mlxr_core.model.lora import load_adapter
from mlxr_core.testing.lora_reference import ADAPTERS, SHAPE, lora_reference

torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
peft = pytest.importorskip("peft", reason="the reference needs peft")

PROMPTS = [[5, 9, 17, 33, 2, 71, 40, 8, 13], [50, 3, 27, 91, 44, 6, 19, 60, 12]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The base folder, each adapter's PEFT folder and PEFT's merged logits per adapter and prompt."""
    reference = lora_reference(tmp_path_factory.mktemp("lora"), PROMPTS)
    return {"root": reference.root, "logits": reference.logits}


@pytest.fixture(scope="module")
def registries() -> Any:
    from mlxr_core.plugins import load_plugins

    return load_plugins().registries


def serve(tiny: dict[str, Any], registries: Any, **settings: Any) -> Any:
    root = tiny["root"]
    config = ModelConfig(path=str(root / "base"), dtype="float32", compile_decode=False,
                         adapters=[AdapterConfig(name, str(root / name)) for name in ADAPTERS], **settings)  # fmt: skip
    loaded = load_model(config, registries)
    for name in ADAPTERS:
        load_adapter(loaded, name, root / name, registries)
    return loaded


def forward(loaded: Any, prompts: list[list[int]], adapters: list[str | None]) -> np.ndarray:
    """One forward pass over equal-length ``prompts``, row i using ``adapters[i]``."""
    slots = [0 if name is None else loaded.adapters.slot(name) for name in adapters]
    with loaded.adapters.rows(slots):
        return np.array(loaded.model(mx.array(prompts)))


def test_rows_of_one_batch_match_peft_merged(tiny: dict[str, Any], registries: Any) -> None:
    loaded = serve(tiny, registries)
    names: list[str | None] = [*ADAPTERS, None]
    rows = [PROMPTS[i % 2] for i in range(len(names))]
    got = forward(loaded, rows, names)
    for i, name in enumerate(names):
        want = tiny["logits"][name][i % 2]
        np.testing.assert_allclose(got[i], want, atol=2e-4, err_msg=f"adapter {name}")
        if name is not None:  # the update is large enough for the comparison to mean something
            assert np.abs(want - tiny["logits"][None][i % 2]).max() > 0.5


def test_rows_at_different_scales_match_peft_scaled(tiny: dict[str, Any], registries: Any) -> None:
    """Rows of one pass using one adapter at different scales (llama.cpp's per-request ``lora``
    scales), another adapter whole and the base: each equals PEFT's merge with its layers' scaling
    times that scale (``scale_layer``)."""
    from mlxr_core.testing.lora_reference import LoraReference

    loaded = serve(tiny, registries)
    reference = LoraReference(tiny["root"], PROMPTS, tiny["logits"])
    rows: list[tuple[str | None, float]] = [("all", 0.5), ("all", -1.0), ("mlp", 1.0), ("all", 2.0), ("mlp", 0.0), (None, 1.0)]
    prompts = [PROMPTS[i % 2] for i in range(len(rows))]
    slots = [0 if name is None else loaded.adapters.slot(name) for name, _ in rows]
    with loaded.adapters.rows(slots, [scale for _, scale in rows]):
        got = np.array(loaded.model(mx.array(prompts)))
    for i, (name, scale) in enumerate(rows):
        with torch.no_grad():
            want = reference.merged(name, scale)(torch.tensor([prompts[i]])).logits[0].numpy()
        np.testing.assert_allclose(got[i], want, atol=2e-4, err_msg=f"{name} at {scale}")
    np.testing.assert_allclose(got[4], tiny["logits"][None][0], atol=2e-4)  # scale 0: the base
    assert np.abs(got[0] - tiny["logits"]["all"][0]).max() > 0.5  # the scale changed the logits


def test_cached_decoding_with_adapter(tiny: dict[str, Any], registries: Any) -> None:
    loaded = serve(tiny, registries)
    prompt = PROMPTS[0]
    cache = loaded.make_cache()
    with loaded.adapters.rows([loaded.adapters.slot("all")]):
        first = np.array(loaded.model(mx.array([prompt[:5]]), cache=cache))[0]
        steps = [
            np.array(loaded.model(mx.array([[token]]), cache=cache))[0, -1] for token in prompt[5:]
        ]
    got = np.concatenate([first, np.stack(steps)])
    np.testing.assert_allclose(got, tiny["logits"]["all"][0], atol=2e-4)


def test_packed_base(tiny: dict[str, Any], registries: Any) -> None:
    """Over 8-bit packed base weights, the update is added to the packed matmul's output: against
    PEFT merged into the same weights dequantized."""
    import mlx.nn as nn

    loaded = serve(tiny, registries, quantization="q8")
    packed = {path: module for path, module in loaded.model.named_modules()
              if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))}  # fmt: skip
    assert any(path.endswith("q_proj") for path in packed)
    reference = transformers.LlamaForCausalLM.from_pretrained(tiny["root"] / "base").eval()
    state = reference.state_dict()
    for path, module in packed.items():
        dense = mx.dequantize(module["weight"], module["scales"], module.get("biases"),
                              group_size=module.group_size, bits=module.bits)  # fmt: skip
        state[f"{path}.weight"] = torch.from_numpy(np.array(dense))
    reference.load_state_dict(state)
    merged = peft.PeftModel.from_pretrained(reference, tiny["root"] / "qv").merge_and_unload()
    with torch.no_grad():
        want = merged(torch.tensor(PROMPTS)).logits.numpy()
    got = forward(loaded, PROMPTS, ["qv", "qv"])
    np.testing.assert_allclose(got, want, atol=2e-4)


def test_unload_and_reload_keep_the_others(tiny: dict[str, Any], registries: Any) -> None:
    loaded = serve(tiny, registries)
    loaded.adapters.remove("qv")
    got = forward(loaded, PROMPTS, ["mlp", "all"])
    np.testing.assert_allclose(got[0], tiny["logits"]["mlp"][0], atol=2e-4)
    np.testing.assert_allclose(got[1], tiny["logits"]["all"][1], atol=2e-4)
    load_adapter(loaded, "qv", tiny["root"] / "qv", registries)
    np.testing.assert_allclose(
        forward(loaded, PROMPTS, ["qv", None])[0], tiny["logits"]["qv"][0], atol=2e-4
    )


def peft_tensors(tiny: dict[str, Any], name: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    from safetensors.numpy import load_file

    folder = tiny["root"] / name
    return load_file(folder / "adapter_model.safetensors"), json.loads(
        (folder / "adapter_config.json").read_text()
    )


def test_mlx_lm_folder(tiny: dict[str, Any], registries: Any, tmp_path: Path) -> None:
    """The "qv" adapter as mlx-lm saves it: lora_a [in, r], lora_b [r, out], its scale as is."""
    from safetensors.numpy import save_file

    tensors, config = peft_tensors(tiny, "qv")
    out = {}
    for key, value in tensors.items():
        module = key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        out[f"{module}.lora_{'a' if '.lora_A.' in key else 'b'}"] = np.ascontiguousarray(value.T)
    save_file(out, str(tmp_path / "adapters.safetensors"))
    settings = {"fine_tune_type": "lora", "num_layers": 2,
                "lora_parameters": {"rank": 4, "scale": config["lora_alpha"] / config["r"], "dropout": 0.0}}  # fmt: skip
    (tmp_path / "adapter_config.json").write_text(json.dumps(settings))
    loaded = serve(tiny, registries)
    loaded.adapters.remove("mlp")
    load_adapter(loaded, "mlx", tmp_path, registries)
    np.testing.assert_allclose(
        forward(loaded, PROMPTS, ["mlx", None])[0], tiny["logits"]["qv"][0], atol=2e-4
    )


def test_llama_cpp_gguf(tiny: dict[str, Any], registries: Any, tmp_path: Path) -> None:
    """The "all" adapter as llama.cpp's convert_lora_to_gguf writes it (B's query and key rows in
    ggml's RoPE order, llama.cpp tensor names, adapter.lora.alpha) over the safetensors base."""
    import gguf

    from mlxr_core.testing.tiny import _permute_for_ggml

    tensors, config = peft_tensors(tiny, "all")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}  # fmt: skip
    writer = gguf.GGUFWriter(str(tmp_path / "all.gguf"), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    # rsLoRA's scale alpha / sqrt(r) as llama.cpp's alpha / r (the converter writes it so).
    writer.add_float32("adapter.lora.alpha", config["lora_alpha"] * config["r"] ** 0.5)
    for key, value in sorted(tensors.items()):
        module = key.removeprefix("base_model.model.model.layers.")
        layer, rest = module.split(".", 1)
        part = rest.split(".lora_")[0]
        if ".lora_B." in key and part in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = (
                SHAPE["num_attention_heads"] if "q_proj" in part else SHAPE["num_key_value_heads"]
            )
            value = _permute_for_ggml(value, heads)
        suffix = "lora_a" if ".lora_A." in key else "lora_b"
        writer.add_tensor(
            f"blk.{layer}.{names[part]}.weight.{suffix}",
            np.ascontiguousarray(value, dtype=np.float32),
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = serve(tiny, registries)
    loaded.adapters.remove("all")
    load_adapter(loaded, "gguf", tmp_path / "all.gguf", registries)
    np.testing.assert_allclose(
        forward(loaded, PROMPTS, [None, "gguf"])[1], tiny["logits"]["all"][1], atol=2e-4
    )


def bad_folder(
    tiny: dict[str, Any],
    tmp_path: Path,
    name: str,
    change: Any,
    settings: dict[str, Any] | None = None,
) -> Path:
    from safetensors.numpy import save_file

    tensors, config = peft_tensors(tiny, name)
    save_file(change(dict(tensors)), str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **(settings or {})}))
    return tmp_path


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("change", "settings", "named"),
    [
        # lora_A of another base's width (48 inputs, not 64)
        (lambda t: {**t, Q_A: t[Q_A][:, :48].copy()}, None, f"tensor {Q_A!r}"),
        # lora_B of another rank than its lora_A
        (lambda t: {**t, Q_B: t[Q_B][:, :3].copy()}, None, f"tensor {Q_B!r}"),
        # a module the base does not have
        (
            lambda t: {k.replace("q_proj", "qq_proj"): v for k, v in t.items()},
            None,
            "qq_proj.lora_A",
        ),
        # a rank the config does not say
        (lambda t: t, {"r": 5}, f"tensor {Q_A!r}"),
        (lambda t: t, {"use_dora": True}, "key 'use_dora'"),
        (lambda t: t, {"modules_to_save": ["lm_head"]}, "key 'modules_to_save'"),
        (lambda t: t, {"bias": "all"}, "key 'bias'"),
    ],
    ids=["width", "rank", "module", "config-rank", "dora", "modules-to-save", "bias"],
)
def test_refused_naming_the_tensor(
    tiny: dict[str, Any], registries: Any, tmp_path: Path, change: Any, settings: Any, named: str
) -> None:
    loaded = serve(tiny, registries)
    loaded.adapters.remove("qv")
    folder = bad_folder(tiny, tmp_path, "qv", change, settings)
    with pytest.raises(ModelLoadError) as refused:
        load_adapter(loaded, "bad", folder, registries)
    assert named in str(refused.value)
    assert loaded.adapters.slot("bad") is None
    got = forward(loaded, PROMPTS, ["all", None])  # the base and the other adapters keep serving
    np.testing.assert_allclose(got[0], tiny["logits"]["all"][0], atol=2e-4)
    np.testing.assert_allclose(got[1], tiny["logits"][None][1], atol=2e-4)
