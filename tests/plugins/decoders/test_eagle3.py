"""EAGLE-3 draft heads as a drafter inside the batch (mlxr_plugins.decoders.eagle3): on a tiny
Llama saved by transformers and a tiny random EAGLE-3 draft written here (safetensors from numpy:
``fc``, ``midlayer.*``, ``norm``, ``lm_head`` over a smaller draft vocabulary, ``d2t``), the head's
draft logits (one pass and chained) equal a torch function written here from the paper's and
vLLM's formula, with the target's layer inputs from transformers; eight concurrent rows decode
plain decoding's greedy tokens exactly; bad drafts are refused naming the key or tensor."""

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
VOCAB, DRAFT_VOCAB, H, LAYERS = 97, 48, 64, 8
HEADS, KV_HEADS, HEAD_DIM, FFN = 4, 2, 16, 96
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


def write_draft(folder, *, seed: int = 0, embeddings: bool = False, layer_ids=None, **overrides) -> dict[str, np.ndarray]:
    """A random EAGLE-3 draft in the released layout; returns its tensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)

    def matrix(rows: int, columns: int) -> np.ndarray:
        return (rng.standard_normal((rows, columns)) / columns**0.5).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)

    targets = np.sort(rng.choice(VOCAB, DRAFT_VOCAB, replace=False))
    tensors = {
        "fc.weight": matrix(H, 3 * H),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": matrix(HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": matrix(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": matrix(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": matrix(H, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": matrix(FFN, H),
        "midlayer.mlp.up_proj.weight": matrix(FFN, H),
        "midlayer.mlp.down_proj.weight": matrix(H, FFN),
        "norm.weight": norm(),
        "lm_head.weight": matrix(DRAFT_VOCAB, H),
        "d2t": (targets - np.arange(DRAFT_VOCAB)).astype(np.int64),
        "t2d": np.isin(np.arange(VOCAB), targets),
    }
    if embeddings:
        tensors["embed_tokens.weight"] = rng.standard_normal((VOCAB, H)).astype(np.float32)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": FFN, "num_hidden_layers": 1, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "hidden_act": "silu",
              "tie_word_embeddings": False, "max_position_embeddings": 512, **overrides}  # fmt: skip
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_target")
    write_target(folder)
    return folder


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3") / "draft"
    return folder, write_draft(folder)


# --- the head against the paper's formula ------------------------------------------------------


def rms_norm(x, weight, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x, positions, theta=10000.0):
    """Llama's RoPE in the Hugging Face layout (feature i pairs with i + D/2), ``x [L, heads, D]``."""
    D = x.shape[-1]
    inverse = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    angles = positions[:, None].float() * inverse[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return x * cos + half * sin


def torch_eagle3(t, embeddings, xs):
    """EAGLE-3's draft layer over positions ``0..m-1`` causally (no cache), as the paper and vLLM's
    ``llama_eagle3.py`` write it: ``u = [norm_in(e); norm_hidden(x)]`` (2H), attention with q/k/v
    from 2H and o back to H, ``h = x + attn``, ``g = h + mlp(norm_post(h))``, logits ``lm_head(norm(g))``
    over the draft vocabulary. Returns ``g [m, H]`` and the draft logits ``[m, draft_vocab]``."""
    w = {name: torch.from_numpy(np.asarray(value)) for name, value in t.items()}
    m = xs.shape[0]
    u = torch.cat([rms_norm(embeddings, w["midlayer.input_layernorm.weight"]),
                   rms_norm(xs, w["midlayer.hidden_norm.weight"])], -1)  # fmt: skip
    q = (u @ w["midlayer.self_attn.q_proj.weight"].T).view(m, HEADS, HEAD_DIM)
    k = (u @ w["midlayer.self_attn.k_proj.weight"].T).view(m, KV_HEADS, HEAD_DIM)
    v = (u @ w["midlayer.self_attn.v_proj.weight"].T).view(m, KV_HEADS, HEAD_DIM)
    positions = torch.arange(m)
    q, k = rotate(q, positions), rotate(k, positions)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5 + torch.full((m, m), float("-inf")).triu(1)
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(m, HEADS * HEAD_DIM)
    h = xs + attended @ w["midlayer.self_attn.o_proj.weight"].T
    normed = rms_norm(h, w["midlayer.post_attention_layernorm.weight"])
    gate, up = normed @ w["midlayer.mlp.gate_proj.weight"].T, normed @ w["midlayer.mlp.up_proj.weight"].T
    g = h + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    return g, rms_norm(g, w["norm.weight"]) @ w["lm_head.weight"].T


def in_target_vocabulary(t, draft_logits):
    """vLLM's ``compute_logits``: draft id ``d``'s logit at target id ``d + d2t[d]``, ``-inf`` elsewhere."""
    targets = torch.arange(DRAFT_VOCAB) + torch.from_numpy(t["d2t"])
    full = torch.full((draft_logits.shape[0], VOCAB), float("-inf"))
    full[:, targets] = draft_logits
    return full


def load(folder, speculative=None):
    from mlxr_core.model.loader import load_model

    config = ModelConfig(path=str(folder), name="tiny", dtype="float32", context_length=512, speculative=speculative)
    return load_model(config, HOST.registries)


@pytest.mark.parametrize(("embeddings", "layer_ids"), [(False, None), (True, [1, 3, 6])])
def test_the_head_and_its_chain_draw_as_the_paper_says(target, tmp_path, embeddings, layer_ids):
    """One pass over a prompt's positions, then three chained steps (the head reading its own
    output before the norm, with the token it drew): its draft logits, mapped to target ids,
    against the torch function. The target's layer inputs are transformers' hidden states
    (``hidden_states[i]`` enters layer ``i``): the default layers 2, n // 2, n - 3, or the
    config's ``eagle_aux_hidden_state_layer_ids``; the embedding the target's or the draft's own."""
    import mlx.core as mx

    from mlxr_core.engine.speculation import drafter_hidden
    from mlxr_plugins.decoders.eagle3 import Eagle3Drafter, load_eagle3_head

    tensors = write_draft(tmp_path / "draft", seed=1, embeddings=embeddings, layer_ids=layer_ids)
    loaded = load(target, SpeculationConfig(method="eagle3", path=str(tmp_path / "draft")))
    head, layers, _ = load_eagle3_head(loaded, HOST.registries)
    chosen = layer_ids or [2, LAYERS // 2, LAYERS - 3]
    assert layers == tuple(chosen)
    prompt = np.random.default_rng(1).integers(2, VOCAB, 12).tolist()
    final, taps = loaded.model.forward_hidden(mx.array([prompt[:-1]]), layers=layers)
    drafter = Eagle3Drafter(loaded.model, head, layers, temperature=1.0, seed=3)
    drafter.observe(0, drafter_hidden(drafter, final, taps)[0], prompt[1:])
    drafted = drafter.propose(prompt, 4)
    assert len(drafted) == 4 and drafter.draft_logits is not None
    ours = np.array(drafter.draft_logits)

    reference = transformers.LlamaForCausalLM.from_pretrained(target, attn_implementation="eager").eval()
    table = torch.from_numpy(tensors["embed_tokens.weight"]) if embeddings else reference.model.embed_tokens.weight
    with torch.no_grad():
        states = reference.model(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states
        xs = torch.cat([states[i][0] for i in chosen], -1) @ torch.from_numpy(tensors["fc.weight"]).T
        tokens = list(prompt[1:])
        expected = []
        for step in range(4):  # each chained position reads g of the one before
            g, logits = torch_eagle3(tensors, table[torch.tensor(tokens)], xs)
            expected.append(in_target_vocabulary(tensors, logits[-1:])[0].numpy())
            xs = torch.cat([xs, g[-1:]])
            tokens.append(drafted[step])
    np.testing.assert_allclose(ours, np.stack(expected), atol=2e-4, rtol=1e-4)
    assert set(drafted) <= set((np.arange(DRAFT_VOCAB) + tensors["d2t"]).tolist())


def test_the_layer_runs_once_over_every_row_of_a_step_as_each_row_alone(target, draft, monkeypatch):
    """Rows whose head caches hold different numbers of positions, handed accepted spans of
    different lengths (1, 3, 2), draw at temperature 1 the tokens and (widened) logits each draws
    alone; together, a step runs ``midlayer`` once over the rows, then once per further chain
    step over those still drafting."""
    import mlx.core as mx

    from mlxr_core.engine.speculation import drafter_hidden
    from mlxr_core.model.layers.eagle3 import Eagle3Layer
    from mlxr_core.testing.drafting import two_drafting_steps
    from mlxr_plugins.decoders.eagle3 import Eagle3Drafter, load_eagle3_head

    folder, _ = draft
    loaded = load(target, SpeculationConfig(method="eagle3", path=str(folder)))
    head, layers, _ = load_eagle3_head(loaded, HOST.registries)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (5, 12, 8)]
    longer = [prompt + rng.integers(2, VOCAB, n).tolist() for prompt, n in zip(prompts, (1, 3, 2), strict=True)]
    ks = [3, 1, 4]

    def states(row: list[int]) -> mx.array:
        final, taps = loaded.model.forward_hidden(mx.array([row[:-1]]), layers=layers)
        return drafter_hidden(Eagle3Drafter(loaded.model, head, layers), final, taps)[0]

    hidden = [states(row) for row in longer]

    def two_steps(together: bool) -> list[tuple[list[int], np.ndarray]]:
        def make(row: int) -> Eagle3Drafter:
            return Eagle3Drafter(loaded.model, head, layers, temperature=1.0, seed=row)

        return two_drafting_steps(make, prompts, longer, hidden, ks, together=together)

    alone = two_steps(False)
    rows = []
    call = Eagle3Layer.__call__
    monkeypatch.setattr(Eagle3Layer, "__call__", lambda self, e, *a: rows.append(e.shape[0]) or call(self, e, *a))
    together = two_steps(True)
    for (ours, logits), (theirs, expected) in zip(together, alone, strict=True):
        assert ours == theirs
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
    assert rows == [3, 2, 2, 1] * 2  # per step: the read over 3 rows, chains over those left


# --- inside the batch --------------------------------------------------------------------------


def serve(target, draft_folder, k: int = 3, max_batch: int = 8, **engine) -> Engine:
    speculative = SpeculationConfig(method="eagle3", path=str(draft_folder), k=k, max_k=5, max_batch=max_batch)
    model = ModelConfig(path=str(target), name="tiny", context_length=256, dtype="float32", speculative=speculative)
    started = Engine(Config(models=[model], engine=EngineConfig(**engine)), HOST)
    started.start()
    return started


def run(engine, prompts, *, speculative=True, **params) -> list[list[int]]:
    from mlxr_core.testing.drafting import decode_together

    return decode_together(engine, "tiny", prompts, TOKENS, speculative=speculative, **params)


def test_eight_rows_drafting_with_the_head_decode_as_plain(target, draft):
    """8 concurrent rows x 64 greedy tokens, prompts prefilled 5 tokens a chunk: the random head's
    own drafts, then its drafts forced right 80% of the time (long accepted spans, chained drafts):
    plain decoding's tokens both times."""
    from mlxr_core.testing.drafting import control_acceptance

    folder, _ = draft
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, VOCAB, int(n)).tolist() for n in rng.integers(3, 20, ROWS)]
    engine = serve(target, folder, prefill_chunk=5)
    try:
        plain = run(engine, prompts, speculative=False)
        drafted = run(engine, prompts)
        for row in range(ROWS):
            assert drafted[row] == plain[row], f"row {row}"
        figures = dict(engine.stats()["decoders"]["tiny"]["eagle3"])
        assert figures["drafted"] > 0
        references = {tuple(p): out for p, out in zip(prompts, plain, strict=True)}
        control_acceptance(engine.host.registries.decoders.get("eagle3"), references, 0.8, seed=0)
        forced = run(engine, prompts)
        for row in range(ROWS):
            assert forced[row] == plain[row], f"row {row} (controlled acceptance)"
        after = dict(engine.stats()["decoders"]["tiny"]["eagle3"])
        assert after["accepted"] - figures["accepted"] > (after["drafted"] - figures["drafted"]) // 2
    finally:
        engine.stop()


def test_gaps_and_sampled_rows(target, draft):
    """A batch above ``max_batch`` (plain steps: the rows' heads start afresh from the states
    handed after it shrinks), rows leaving at different lengths, two sampled rows (drafts drawn
    from the draft vocabulary's distribution placed at target ids): the greedy rows give plain
    decoding's tokens, the sampled ones their full length."""
    from mlxr_core.testing.drafting import control_acceptance, decode_together

    folder, _ = draft
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, VOCAB, int(n)).tolist() for n in rng.integers(5, 24, ROWS)]
    lengths = [TOKENS - 6 * row for row in range(ROWS)]
    # The two longest rows sample: they still run when the batch is small enough to draft.
    rows = [{"max_tokens": n, "temperature": 0.8, "seed": row} for row, n in enumerate(lengths[:2])]
    rows += [{"max_tokens": n} for n in lengths[2:]]
    engine = serve(target, folder, max_batch=4)
    try:
        plain = run(engine, prompts, speculative=False)
        # The greedy rows' drafts forced right half the time; the sampled rows draw the head's own.
        references = {tuple(p): out for p, out in zip(prompts[2:], plain[2:], strict=True)}
        control_acceptance(engine.host.registries.decoders.get("eagle3"), references, 0.5, seed=1)
        outputs = decode_together(engine, "tiny", prompts, TOKENS, rows=rows)
        for row in range(2, ROWS):
            assert outputs[row] == plain[row][: lengths[row]], f"row {row}"
        assert [len(out) for out in outputs[:2]] == lengths[:2]
        assert dict(engine.stats()["decoders"]["tiny"]["eagle3"])["accepted"] > 0
    finally:
        engine.stop()


def test_a_quantized_target_hands_its_states_to_the_head(target, draft):
    """A 4-bit target (its embedding packed: the head's width checks read the final norm's) serves
    the head; its rows decode the 4-bit model's plain greedy tokens."""
    folder, _ = draft
    speculative = SpeculationConfig(method="eagle3", path=str(folder), k=3)
    model = ModelConfig(path=str(target), name="tiny", context_length=256, dtype="float32", quantization="q4",
                        speculative=speculative)  # fmt: skip
    engine = Engine(Config(models=[model]), HOST)
    engine.start()
    try:
        from mlxr_core.testing.drafting import decode_together

        prompts = [np.random.default_rng(row).integers(2, VOCAB, 9).tolist() for row in range(3)]
        plain = decode_together(engine, "tiny", prompts, 24, speculative=False)
        assert decode_together(engine, "tiny", prompts, 24) == plain
        assert dict(engine.stats()["decoders"]["tiny"]["eagle3"])["drafted"] > 0
    finally:
        engine.stop()


# --- refusals ------------------------------------------------------------------------------------


def head_error(target, path) -> BaseException:
    """What reading the draft at ``path`` for the tiny target raises."""
    from mlxr_plugins.decoders.eagle3 import load_eagle3_head

    loaded = load(target, SpeculationConfig(method="eagle3", path=None if path is None else str(path)))
    with pytest.raises((ConfigError, ModelLoadError)) as caught:
        load_eagle3_head(loaded, HOST.registries)
    return caught.value


def test_a_missing_or_foreign_draft_is_refused_naming_the_path_key(target, tmp_path):
    """At startup (the engine does not start), and for a path that does not resolve or a folder
    that is no EAGLE-3 draft (a plain Llama)."""
    model = ModelConfig(path=str(target), name="tiny", dtype="float32", context_length=256,
                        speculative=SpeculationConfig(method="eagle3"))  # fmt: skip
    engine = Engine(Config(models=[model]), HOST)
    try:
        with pytest.raises(ConfigError) as caught:
            engine.start()
    finally:
        engine.stop()
    assert caught.value.field == "models[].speculative.path"
    for path in (tmp_path / "nowhere", target):
        error = head_error(target, path)
        assert isinstance(error, ConfigError) and error.field == "models[].speculative.path"
    assert "no EAGLE-3 draft" in str(error)


def test_a_draft_that_does_not_fit_is_a_load_error_naming_the_tensor_or_key(target, tmp_path):
    from safetensors.numpy import save_file

    tensors = write_draft(tmp_path / "shape")
    tensors["midlayer.self_attn.q_proj.weight"] = tensors["midlayer.self_attn.q_proj.weight"][:, :H]  # H, not 2H
    save_file(tensors, str(tmp_path / "shape" / "model.safetensors"))
    tensors = write_draft(tmp_path / "d2t")
    tensors["d2t"] = tensors["d2t"] + VOCAB  # target ids past the vocabulary
    save_file(tensors, str(tmp_path / "d2t" / "model.safetensors"))
    write_draft(tmp_path / "layers", layer_ids=[1, 3, LAYERS])  # past the target's last layer
    write_draft(tmp_path / "vocab", vocab_size=VOCAB + 3)
    for folder, named in (("shape", "midlayer.self_attn.q_proj.weight"), ("d2t", "d2t"),
                          ("layers", "eagle_aux_hidden_state_layer_ids"), ("vocab", "vocab_size")):  # fmt: skip
        error = head_error(target, tmp_path / folder)
        assert isinstance(error, ModelLoadError) and named in str(error), (folder, error)


def test_config_check_names_a_missing_draft_path(tmp_path, target):
    """A path that does not resolve; eagle3 without a path."""
    from mlxr_core.checks import missing_models, unregistered_names

    def config(**speculative) -> Config:
        return Config(models=[ModelConfig(path=str(target), name="tiny", speculative=SpeculationConfig(**speculative))])

    problems = missing_models(config(method="eagle3", path=str(tmp_path / "nowhere")))
    assert [problem.path for problem in problems] == [("models", 0, "speculative", "path")]
    problems = unregistered_names(config(method="eagle3"), HOST)
    assert [problem.path for problem in problems] == [("models", 0, "speculative", "path")]
    assert "set its folder" in str(problems[0])
    assert unregistered_names(config(method="eagle3", path=str(target)), HOST) == []
