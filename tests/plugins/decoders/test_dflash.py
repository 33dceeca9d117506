"""DFlash block drafters inside the batch (mlxr_plugins.decoders.dflash): on a tiny Llama saved
by transformers and a tiny random DFlash draft written here in z-lab's layout (``fc``,
``hidden_norm``, Qwen3 ``layers.N.*`` with ``q_norm``/``k_norm``, ``norm``; ``dflash_config``
with ``target_layer_ids`` and ``mask_token_id``), one block's draft logits equal a torch function
written here from the paper's and z-lab's reference formula (context from transformers'
``hidden_states[l + 1]``, non-causal attention over context and block); eight concurrent rows
decode plain decoding's greedy tokens exactly; bad drafts are refused naming the key or tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, SpeculationConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.errors import ConfigError, ModelLoadError
from mlxr_core.plugins import load_plugins

torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
transformers = pytest.importorskip("transformers", reason="the target is written by transformers")

HOST = load_plugins()
VOCAB, H, LAYERS, DRAFT_LAYERS, BLOCK = 97, 64, 4, 2, 6
HEADS, KV_HEADS, HEAD_DIM, FFN = 4, 2, 16, 96
MASK = VOCAB - 1
TARGET = {"vocab_size": VOCAB, "hidden_size": H, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
          "tie_word_embeddings": False, "max_position_embeddings": 512, "rms_norm_eps": 1e-5}  # fmt: skip
TOKENS = 64
ROWS = 8


def write_target(folder) -> None:
    from mlxr_core.testing.hf_reference import o1_init, write_tokenizer

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TARGET, attn_implementation="eager")).eval()
    o1_init(model, torch)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)


def write_draft(folder, *, seed: int = 0, layer_ids=None, prefix: str = "", **dflash) -> dict[str, np.ndarray]:
    """A random DFlash draft in z-lab's layout (``DFlashDraftModel``'s state dict); returns its tensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)

    def matrix(rows: int, columns: int) -> np.ndarray:
        return (rng.standard_normal((rows, columns)) / columns**0.5).astype(np.float32)

    def norm(width: int = H) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(width)).astype(np.float32)

    fused = len(layer_ids) if layer_ids is not None else DRAFT_LAYERS
    tensors = {"fc.weight": matrix(H, fused * H), "hidden_norm.weight": norm(), "norm.weight": norm()}
    for layer in range(DRAFT_LAYERS):
        at = f"layers.{layer}."
        tensors |= {
            at + "input_layernorm.weight": norm(),
            at + "post_attention_layernorm.weight": norm(),
            at + "self_attn.q_proj.weight": matrix(HEADS * HEAD_DIM, H),
            at + "self_attn.k_proj.weight": matrix(KV_HEADS * HEAD_DIM, H),
            at + "self_attn.v_proj.weight": matrix(KV_HEADS * HEAD_DIM, H),
            at + "self_attn.o_proj.weight": matrix(H, HEADS * HEAD_DIM),
            at + "self_attn.q_norm.weight": norm(HEAD_DIM),
            at + "self_attn.k_norm.weight": norm(HEAD_DIM),
            at + "mlp.gate_proj.weight": matrix(FFN, H),
            at + "mlp.up_proj.weight": matrix(FFN, H),
            at + "mlp.down_proj.weight": matrix(H, FFN),
        }
    options: dict = {"mask_token_id": MASK, **dflash}
    if layer_ids is not None:
        options["target_layer_ids"] = layer_ids
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
              "intermediate_size": FFN, "num_hidden_layers": DRAFT_LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "vocab_size": VOCAB, "hidden_act": "silu", "tie_word_embeddings": False,
              "max_position_embeddings": 512, "block_size": BLOCK, "num_target_layers": LAYERS,
              "layer_types": ["full_attention"] * DRAFT_LAYERS, "dflash_config": options}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({prefix + name: value for name, value in tensors.items()}, str(folder / "model.safetensors"))
    return tensors


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_target")
    write_target(folder)
    return folder


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dflash") / "draft"
    return folder, write_draft(folder)


# --- one block against the reference formula ---------------------------------------------------


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, theta=10000.0):
    """RoPE in the Hugging Face (neox) layout (feature i pairs with i + D/2), ``x [L, heads, D]``."""
    D = x.shape[-1]
    inverse = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    angles = positions[:, None].float() * inverse[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + half * sin


def torch_dflash(t, fused, block, lm_head):
    """DFlash's draft over a block as z-lab's ``DFlashDraftModel.forward`` and the paper write it:
    context ``c = hidden_norm(fc(fused))`` at positions ``0..p-1``; per layer, queries from
    ``n = input_layernorm(x)`` of the block (positions ``p..p+k``), keys/values from
    ``[c; n]`` (``k_norm`` per head, no input norm on ``c``), RoPE at absolute positions, no mask;
    ``h = x + o``, ``x = h + mlp(post_norm(h))``; logits ``lm_head(norm(x))`` of block positions
    ``1..k``. ``fused [p, m H]``, ``block [k + 1, H]`` (embeddings)."""
    w = {name: torch.from_numpy(np.asarray(value)) for name, value in t.items()}
    context = rms_norm(fused @ w["fc.weight"].T, w["hidden_norm.weight"])
    p, m = context.shape[0], block.shape[0]
    positions = torch.arange(p + m)
    x = block
    for layer in range(DRAFT_LAYERS):
        a = f"layers.{layer}."
        n = rms_norm(x, w[a + "input_layernorm.weight"])
        both = torch.cat([context, n])
        q = rms_norm((n @ w[a + "self_attn.q_proj.weight"].T).view(m, HEADS, HEAD_DIM), w[a + "self_attn.q_norm.weight"])
        k = rms_norm((both @ w[a + "self_attn.k_proj.weight"].T).view(p + m, KV_HEADS, HEAD_DIM),
                     w[a + "self_attn.k_norm.weight"])  # fmt: skip
        v = (both @ w[a + "self_attn.v_proj.weight"].T).view(p + m, KV_HEADS, HEAD_DIM)
        q, k = rotate(q, positions[p:]), rotate(k, positions)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5  # no mask: the block sees itself whole
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(m, HEADS * HEAD_DIM)
        h = x + attended @ w[a + "self_attn.o_proj.weight"].T
        normed = rms_norm(h, w[a + "post_attention_layernorm.weight"])
        gate, up = normed @ w[a + "mlp.gate_proj.weight"].T, normed @ w[a + "mlp.up_proj.weight"].T
        x = h + (torch.nn.functional.silu(gate) * up) @ w[a + "mlp.down_proj.weight"].T
    return (rms_norm(x, w["norm.weight"]) @ lm_head.T)[1:]


def load(folder, speculative=None):
    from mlxr_core.model.loader import load_model

    config = ModelConfig(path=str(folder), name="tiny", dtype="float32", context_length=512, speculative=speculative)
    return load_model(config, HOST.registries)


@pytest.mark.parametrize(("layer_ids", "prefix"), [(None, ""), ([0, 2, 1], "model.")])
def test_a_block_drafts_as_the_reference_formula(target, tmp_path, layer_ids, prefix):
    """The context handed in two spans (as prefill chunks), then one block of ``BLOCK - 1`` drafts
    drawn at temperature 1: the block's logits against the torch function, with the target layers
    of z-lab's default (1 and n - 3 for two draft layers: layer 1 twice for 4) or the config's
    ``target_layer_ids`` out of order (tensors with or without vLLM's ``model.`` prefix); a longer
    ``k`` is cut to the block."""
    import mlx.core as mx

    from mlxr_core.engine.speculation import drafter_hidden
    from mlxr_plugins.decoders.dflash import DFlashDrafter, load_dflash

    tensors = write_draft(tmp_path / "draft", seed=1, layer_ids=layer_ids, prefix=prefix)
    loaded = load(target, SpeculationConfig(method="dflash", path=str(tmp_path / "draft")))
    spec, _ = load_dflash(loaded, HOST.registries)
    chosen = layer_ids or [1, LAYERS - 3]
    assert spec.layers == tuple(index + 1 for index in chosen)
    prompt = np.random.default_rng(1).integers(2, MASK, 12).tolist()
    final, taps = loaded.model.forward_hidden(mx.array([prompt[:-1]]), layers=spec.layers)
    drafter = DFlashDrafter(loaded.model, spec, temperature=1.0, seed=3)
    states = drafter_hidden(drafter, final, taps)[0]
    drafter.observe(0, states[:5], prompt[1:6])
    drafter.observe(5, states[5:], prompt[6:])
    drafted = drafter.propose(prompt, BLOCK + 3)
    assert len(drafted) == BLOCK - 1 and drafter.draft_logits is not None
    ours = np.array(drafter.draft_logits)

    reference = transformers.LlamaForCausalLM.from_pretrained(target, attn_implementation="eager").eval()
    with torch.no_grad():
        hidden = reference.model(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states
        fused = torch.cat([hidden[i + 1][0] for i in chosen], -1)  # z-lab's extract_context_feature
        block = reference.model.embed_tokens.weight[torch.tensor([prompt[-1]] + [MASK] * (BLOCK - 1))]
        expected = torch_dflash(tensors, fused, block, reference.lm_head.weight).numpy()
    np.testing.assert_allclose(ours, expected, atol=2e-4, rtol=1e-4)
    # The block's keys and values are gone: the next block over the same context drafts the same.
    again = DFlashDrafter(loaded.model, spec, temperature=0.0)
    again.observe(0, states, prompt[1:])
    greedy = np.argmax(expected, -1).tolist()
    assert again.propose(prompt, BLOCK - 1) == greedy and again.draft_logits is None
    assert again.propose(prompt, BLOCK - 1) == greedy


# --- inside the batch --------------------------------------------------------------------------


def serve(target, draft_folder, k: int = 4, max_batch: int = 8, **engine) -> Engine:
    speculative = SpeculationConfig(method="dflash", path=str(draft_folder), k=k, max_k=5, max_batch=max_batch)
    model = ModelConfig(path=str(target), name="tiny", context_length=256, dtype="float32", speculative=speculative)
    started = Engine(Config(models=[model], engine=EngineConfig(**engine)), HOST)
    started.start()
    return started


def run(engine, prompts, *, speculative=True, **params) -> list[list[int]]:
    from mlxr_core.testing.drafting import decode_together

    return decode_together(engine, "tiny", prompts, TOKENS, speculative=speculative, **params)


def test_eight_rows_drafting_blocks_decode_as_plain(target, draft):
    """8 concurrent rows x 64 greedy tokens, prompts prefilled 5 tokens a chunk: the random
    drafter's own blocks, then its blocks forced right 80% of the time (long accepted spans):
    plain decoding's tokens both times."""
    from mlxr_core.testing.drafting import control_acceptance

    folder, _ = draft
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, MASK, int(n)).tolist() for n in rng.integers(3, 20, ROWS)]
    engine = serve(target, folder, prefill_chunk=5)
    try:
        plain = run(engine, prompts, speculative=False)
        drafted = run(engine, prompts)
        for row in range(ROWS):
            assert drafted[row] == plain[row], f"row {row}"
        figures = dict(engine.stats()["decoders"]["tiny"]["dflash"])
        assert figures["drafted"] > 0
        references = {tuple(p): out for p, out in zip(prompts, plain, strict=True)}
        control_acceptance(engine.host.registries.decoders.get("dflash"), references, 0.8, seed=0)
        forced = run(engine, prompts)
        for row in range(ROWS):
            assert forced[row] == plain[row], f"row {row} (controlled acceptance)"
        after = dict(engine.stats()["decoders"]["tiny"]["dflash"])
        assert after["accepted"] - figures["accepted"] > (after["drafted"] - figures["drafted"]) // 2
    finally:
        engine.stop()


def test_gaps_and_sampled_rows(target, draft):
    """A batch above ``max_batch`` (plain steps: the rows' contexts start afresh from the states
    handed after it shrinks), rows leaving at different lengths, two sampled rows (each block
    position drawn at the row's temperature): the greedy rows give plain decoding's tokens, the
    sampled ones their full length."""
    from mlxr_core.testing.drafting import control_acceptance, decode_together

    folder, _ = draft
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, MASK, int(n)).tolist() for n in rng.integers(5, 24, ROWS)]
    lengths = [TOKENS - 6 * row for row in range(ROWS)]
    rows = [{"max_tokens": n, "temperature": 0.8, "seed": row} for row, n in enumerate(lengths[:2])]
    rows += [{"max_tokens": n} for n in lengths[2:]]
    engine = serve(target, folder, max_batch=4)
    try:
        plain = run(engine, prompts, speculative=False)
        references = {tuple(p): out for p, out in zip(prompts[2:], plain[2:], strict=True)}
        control_acceptance(engine.host.registries.decoders.get("dflash"), references, 0.5, seed=1)
        outputs = decode_together(engine, "tiny", prompts, TOKENS, rows=rows)
        for row in range(2, ROWS):
            assert outputs[row] == plain[row][: lengths[row]], f"row {row}"
        assert [len(out) for out in outputs[:2]] == lengths[:2]
        assert dict(engine.stats()["decoders"]["tiny"]["dflash"])["accepted"] > 0
    finally:
        engine.stop()


def test_a_quantized_target_hands_its_states_to_the_drafter(target, draft):
    """A 4-bit target (its embedding table and LM head packed: the drafter embeds the block and
    reads its logits through them) serves the drafter; its rows decode the 4-bit model's plain
    greedy tokens."""
    from mlxr_core.testing.drafting import decode_together

    folder, _ = draft
    speculative = SpeculationConfig(method="dflash", path=str(folder), k=4)
    model = ModelConfig(path=str(target), name="tiny", context_length=256, dtype="float32", quantization="q4",
                        speculative=speculative)  # fmt: skip
    engine = Engine(Config(models=[model]), HOST)
    engine.start()
    try:
        prompts = [np.random.default_rng(row).integers(2, MASK, 9).tolist() for row in range(3)]
        plain = decode_together(engine, "tiny", prompts, 24, speculative=False)
        assert decode_together(engine, "tiny", prompts, 24) == plain
        assert dict(engine.stats()["decoders"]["tiny"]["dflash"])["drafted"] > 0
    finally:
        engine.stop()


# --- refusals ------------------------------------------------------------------------------------


def drafter_error(target, path) -> BaseException:
    """What reading the draft at ``path`` for the tiny target raises."""
    from mlxr_plugins.decoders.dflash import load_dflash

    loaded = load(target, SpeculationConfig(method="dflash", path=str(path)))
    with pytest.raises((ConfigError, ModelLoadError)) as caught:
        load_dflash(loaded, HOST.registries)
    return caught.value


def test_a_missing_or_foreign_draft_is_refused_naming_the_path_key(target, tmp_path):
    """At startup (the engine does not start), and for a path that does not resolve or a folder
    that is no DFlash draft (a plain Llama)."""
    model = ModelConfig(path=str(target), name="tiny", dtype="float32", context_length=256,
                        speculative=SpeculationConfig(method="dflash"))  # fmt: skip
    engine = Engine(Config(models=[model]), HOST)
    try:
        with pytest.raises(ConfigError) as caught:
            engine.start()
    finally:
        engine.stop()
    assert caught.value.field == "models[].speculative.path"
    for path in (tmp_path / "nowhere", target):
        error = drafter_error(target, path)
        assert isinstance(error, ConfigError) and error.field == "models[].speculative.path"
    assert "no DFlash draft" in str(error)


def test_a_draft_asking_for_other_math_or_not_fitting_is_a_load_error_naming_the_key(target, tmp_path):
    """Each config key that asks for math not computed here, and a tensor of the wrong shape."""
    from safetensors.numpy import save_file

    cases = [
        ({"layer_ids": [1, LAYERS - 1]}, "dflash_config.target_layer_ids"),  # no layer after the last
        ({"causal": True}, "dflash_config.causal"),
        ({"use_swa": True}, "dflash_config.use_swa"),
        ({"mask_token_id": VOCAB}, "dflash_config.mask_token_id"),
    ]
    for at, (options, named) in enumerate(cases):
        write_draft(tmp_path / str(at), **options)
        error = drafter_error(target, tmp_path / str(at))
        assert isinstance(error, ModelLoadError) and named in str(error), named
    tensors = write_draft(tmp_path / "shape")
    tensors["fc.weight"] = tensors["fc.weight"][:, :H]  # one target layer's width, not two
    save_file(tensors, str(tmp_path / "shape" / "model.safetensors"))
    error = drafter_error(target, tmp_path / "shape")
    assert isinstance(error, ModelLoadError) and "fc.weight" in str(error)


def test_config_check_names_a_missing_draft_path(target):
    """``mlxr config check``: dflash drafts from a folder of its own, so a missing path is named."""
    from mlxr_core.checks import unregistered_names

    speculative = SpeculationConfig(method="dflash")
    problems = unregistered_names(Config(models=[ModelConfig(path=str(target), name="tiny", speculative=speculative)]), HOST)
    assert [problem.path for problem in problems] == [("models", 0, "speculative", "path")]
