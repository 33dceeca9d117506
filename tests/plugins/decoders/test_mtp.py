"""The checkpoint's multi-token-prediction head as a drafter inside the batch
(mlxr_plugins.decoders.mtp): on a tiny Qwen3.5-shaped checkpoint written by transformers, with
random ``mtp.*`` tensors added to its safetensors, the head's draft logits (one position and
chained) equal a torch function written here from the model card's formula; eight concurrent
rows decode plain decoding's greedy tokens exactly; a checkpoint without the head is refused."""

from __future__ import annotations

import numpy as np
import pytest

from mlxr_core.config.schema import Config, ModelConfig, SpeculationConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, GenerationRequest, SamplingParams
from mlxr_core.errors import ConfigError
from mlxr_core.plugins import load_plugins

torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
transformers = pytest.importorskip("transformers", reason="the checkpoint is written by transformers")

HOST = load_plugins()
VOCAB = 97
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 16, "linear_value_head_dim": 16, "tie_word_embeddings": False,
         "max_position_embeddings": 512}  # fmt: skip
TOKENS = 64
ROWS = 8


#: family -> (config class, model class, extra config keys): dense Qwen3.5, and Qwen3-Next with
#: experts (its MTP layer has them too: a router, experts, a gated shared expert).
FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48}),
}  # fmt: skip


def decoder_layer(config):
    """transformers' decoder layer of ``config``'s family, as a full-attention layer (index 1)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    kind = Qwen3NextDecoderLayer if config.model_type == "qwen3_next" else Qwen3_5DecoderLayer
    return kind(config, layer_idx=1)


def write_checkpoint(folder, *, mtp: bool = True, family: str = "qwen3_5") -> dict[str, torch.Tensor]:
    """A tiny ``qwen3_5_text`` (or ``qwen3_next``) model saved by transformers (O(1) random
    weights); with ``mtp``, an MTP layer's random tensors added under Qwen's names (``mtp.fc``,
    ``mtp.pre_fc_norm_*``, ``mtp.norm``, ``mtp.layers.0.*``: a full-attention decoder layer).
    Returns those tensors."""
    from safetensors.torch import load_file, save_file

    from mlxr_core.testing.hf_reference import o1_init, write_tokenizer

    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SHAPE, **extra, attn_implementation="eager")
    model = getattr(transformers, model_class)(config).eval()
    o1_init(model, torch)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    if not mtp:
        return {}
    H = SHAPE["hidden_size"]
    layer = decoder_layer(config)  # a full_attention layer's shapes
    o1_init(layer, torch)
    tensors = {f"mtp.layers.0.{name}": value for name, value in layer.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.randn(H, 2 * H) / (2 * H) ** 0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = 0.1 * torch.randn(H)  # Qwen's norms scale by 1 + weight
    path = folder / "model.safetensors"
    save_file({**load_file(path), **{name: t.contiguous() for name, t in tensors.items()}}, path, metadata={"format": "pt"})
    return tensors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen35_mtp")
    return folder, write_checkpoint(folder)


# --- the head against the model card's formula ------------------------------------------------


def rms_norm(x, weight, eps=1e-6):
    """Qwen3-Next's RMS norm: ``x / rms(x) * (1 + weight)``, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


def torch_mtp_logits(checkpoint_tensors, target, hidden, tokens):
    """The MTP head over positions ``0..n-1`` (no cache: the whole span causally), per Qwen's
    card and vLLM's Qwen3-Next MTP: ``x = fc([norm_e(embed(t_{i+1})); norm_h(h_i)])``, one
    full-attention decoder layer, ``norm``, the target's LM head. ``hidden [n, H]`` and
    ``tokens [n]`` (``t_{i+1}``). Returns the logits ``[n, V]`` and the normed outputs."""
    t = checkpoint_tensors
    layer = decoder_layer(target.config).eval()
    layer.load_state_dict({name[len("mtp.layers.0."):]: v for name, v in t.items() if name.startswith("mtp.layers.0.")})
    embeddings = target.model.embed_tokens(torch.tensor(tokens))
    x = torch.cat([rms_norm(embeddings, t["mtp.pre_fc_norm_embedding.weight"]),
                   rms_norm(hidden, t["mtp.pre_fc_norm_hidden.weight"])], dim=-1) @ t["mtp.fc.weight"].T  # fmt: skip
    n = len(tokens)
    positions = torch.arange(n)[None]
    rotary = target.model.rotary_emb(x[None], positions)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = layer(x[None], attention_mask=mask, position_ids=positions, position_embeddings=rotary)
    out = out[0] if isinstance(out, tuple) else out
    normed = rms_norm(out[0], t["mtp.norm.weight"])
    return target.lm_head(normed), normed


def load(folder, speculative=None):
    from mlxr_core.model.loader import load_model

    config = ModelConfig(path=str(folder), name="tiny", dtype="float32", context_length=512, speculative=speculative)
    return load_model(config, HOST.registries)


def test_the_head_and_its_chain_draw_as_the_model_card_says(checkpoint):
    """One pass over a prompt's positions, then three chained steps (the head reading its own
    normed output and the token it drew): its draft logits against the torch function."""
    folder, tensors = checkpoint
    check_against_card(folder, tensors, transformers.Qwen3_5ForCausalLM)


def test_qwen3_next_heads_with_experts_draw_as_the_model_card_says(tmp_path):
    """Qwen3-Next's MTP layer has experts and a gated shared expert (saved as transformers
    writes them); the same check."""
    tensors = write_checkpoint(tmp_path, family="qwen3_next")
    assert any(".mlp.experts." in name for name in tensors)
    check_against_card(tmp_path, tensors, transformers.Qwen3NextForCausalLM)


def check_against_card(folder, tensors, target_class) -> None:
    import mlx.core as mx

    from mlxr_plugins.decoders.mtp import MtpDrafter, load_mtp_head

    loaded = load(folder)
    head = load_mtp_head(loaded, HOST.registries)
    prompt = np.random.default_rng(1).integers(2, VOCAB, 12).tolist()
    # The target's final hidden states of every prompt position but the last (a prefill).
    hidden = loaded.model.model(mx.array([prompt[:-1]]))
    drafter = MtpDrafter(loaded.model, head, temperature=1.0, seed=3)
    drafter.observe(0, hidden[0], prompt[1:])
    drafted = drafter.propose(prompt, 4)
    assert len(drafted) == 4 and drafter.draft_logits is not None
    ours = np.array(drafter.draft_logits)

    target = target_class.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        states = target.model(torch.tensor([prompt[:-1]])).last_hidden_state[0]
        tokens = list(prompt[1:])
        expected = []
        for step in range(4):  # each chained position reads the normed output of the one before
            logits, normed = torch_mtp_logits(tensors, target, states, tokens)
            expected.append(logits[-1].numpy())
            states = torch.cat([states, normed[-1:]])
            tokens.append(drafted[step])
    np.testing.assert_allclose(ours, np.stack(expected), atol=2e-4, rtol=1e-4)
    # The first step also over every prompt position (the head's cache holds them).
    with torch.no_grad():
        whole, _ = torch_mtp_logits(tensors, target, target.model(torch.tensor([prompt[:-1]])).last_hidden_state[0], prompt[1:])
    normed, _ = head(loaded.model.embed(mx.array([prompt[1:]])), hidden, head.make_cache())
    np.testing.assert_allclose(np.array(loaded.model.lm_logits(normed)[0]), whole.numpy(), atol=2e-4, rtol=1e-4)


def test_rows_proposing_together_draft_as_each_alone_reading_the_lm_head_once_a_step(checkpoint):
    import mlx.core as mx

    from mlxr_plugins.decoders.mtp import MtpDrafter, load_mtp_head

    folder, _ = checkpoint
    loaded = load(folder)
    head = load_mtp_head(loaded, HOST.registries)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (5, 11, 8)]
    ks = [3, 1, 4]

    def drafters() -> list[MtpDrafter]:
        made = []
        for prompt in prompts:
            drafter = MtpDrafter(loaded.model, head)
            drafter.observe(0, loaded.model.model(mx.array([prompt[:-1]]))[0], prompt[1:])
            made.append(drafter)
        return made

    alone = [drafter.propose(prompt, k) for drafter, prompt, k in zip(drafters(), prompts, ks, strict=True)]
    calls = []
    lm_logits = loaded.model.lm_logits
    loaded.model.lm_logits = lambda h: calls.append(h.shape[0]) or lm_logits(h)
    try:
        together = MtpDrafter.propose_rows(drafters(), prompts, ks)
    finally:
        del loaded.model.lm_logits
    assert together == alone and [len(draft) for draft in together] == ks
    assert calls == [3, 2, 2, 1]  # one LM head a chain step, over the rows still drafting


@pytest.mark.parametrize("family", ["checkpoint", "deepseek"])
def test_the_head_runs_once_over_every_row_of_a_step_as_each_row_alone(family, request, monkeypatch):
    """Rows whose head caches hold different numbers of positions, handed accepted spans of
    different lengths (1, 3, 2), draw at temperature 1 the tokens and logits each draws alone;
    together, a step runs the head's decoder layer once over the rows, then once per further
    chain step over those still drafting (not once per row)."""
    import mlx.core as mx

    from mlxr_core.testing.drafting import two_drafting_steps
    from mlxr_plugins.decoders.mtp import MtpDrafter, load_mtp_head

    fixture = request.getfixturevalue(family)
    loaded = load(fixture[0] if family == "checkpoint" else fixture)
    head = load_mtp_head(loaded, HOST.registries)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (5, 12, 8)]
    longer = [prompt + rng.integers(2, VOCAB, n).tolist() for prompt, n in zip(prompts, (1, 3, 2), strict=True)]
    states = [loaded.model.model(mx.array([row[:-1]]))[0] for row in longer]
    ks = [3, 1, 4]

    def two_steps(together: bool) -> list[tuple[list[int], np.ndarray]]:
        def make(row: int) -> MtpDrafter:
            return MtpDrafter(loaded.model, head, temperature=1.0, seed=row)

        return two_drafting_steps(make, prompts, longer, states, ks, together=together)

    alone = two_steps(False)
    rows = []
    block = type(head.block)
    call = block.__call__
    monkeypatch.setattr(block, "__call__", lambda self, x, *a, **kw: rows.append(x.shape[0]) or call(self, x, *a, **kw))
    together = two_steps(True)
    for (ours, logits), (theirs, expected) in zip(together, alone, strict=True):
        assert ours == theirs
        np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
    assert rows == [3, 2, 2, 1] * 2  # per step: the read over 3 rows, chains over those left


# --- inside the batch --------------------------------------------------------------------------


def serve(folder, k: int = 3) -> Engine:
    speculative = SpeculationConfig(method="mtp", k=k, max_k=5)
    model = ModelConfig(path=str(folder), name="tiny", context_length=256, dtype="float32", speculative=speculative)
    engine = Engine(Config(models=[model]), HOST)
    engine.start()
    return engine


def run(engine, prompts, *, speculative=True, **params) -> list[list[int]]:
    from mlxr_core.testing.drafting import decode_together

    return decode_together(engine, "tiny", prompts, TOKENS, speculative=speculative, **params)


def controlled(engine, references: dict[tuple[int, ...], list[int]], acceptance: float):
    """Make the MTP rows' drafts the plain output's tokens with probability ``acceptance``
    (the head still runs: its cache, its chain), so that long drafts are accepted too."""
    from mlxr_core.testing.drafting import control_acceptance

    control_acceptance(engine.host.registries.decoders.get("mtp"), references, acceptance, seed=0)


def test_eight_rows_drafting_with_the_head_decode_as_plain(checkpoint):
    folder, _ = checkpoint
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, VOCAB, int(n)).tolist() for n in rng.integers(3, 20, ROWS)]
    engine = serve(folder)
    try:
        plain = run(engine, prompts, speculative=False)
        drafted = run(engine, prompts)
        for row in range(ROWS):
            assert drafted[row] == plain[row], f"row {row}"
        figures = dict(engine.stats()["decoders"]["tiny"]["mtp"])
        assert figures["drafted"] > 0
        # The head's drafts forced right 80% of the time: long accepted spans, chained drafts.
        controlled(engine, {tuple(p): out for p, out in zip(prompts, plain, strict=True)}, 0.8)
        forced = run(engine, prompts)
        for row in range(ROWS):
            assert forced[row] == plain[row], f"row {row} (controlled acceptance)"
        after = dict(engine.stats()["decoders"]["tiny"]["mtp"])
        accepted = after["accepted"] - figures["accepted"]
        assert accepted > (after["drafted"] - figures["drafted"]) // 2
    finally:
        engine.stop()


def test_chunked_prompts_gaps_and_sampled_rows(checkpoint):
    """Prompts prefilled 4 tokens a chunk (the head reads each chunk's states as it comes), a
    batch above ``max_batch`` (plain steps: the rows' heads start afresh when the batch shrinks
    under it and drafting resumes), rows leaving at different lengths, two sampled rows: the
    greedy rows give plain decoding's tokens, the sampled ones their full length."""
    from mlxr_core.config.schema import EngineConfig

    folder, _ = checkpoint
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, VOCAB, int(n)).tolist() for n in rng.integers(5, 24, ROWS)]
    speculative = SpeculationConfig(method="mtp", k=3, max_k=5, max_batch=4)
    model = ModelConfig(path=str(folder), name="tiny", context_length=256, dtype="float32", speculative=speculative)
    engine = Engine(Config(models=[model], engine=EngineConfig(prefill_chunk=4)), HOST)
    engine.start()
    try:
        plain = run(engine, prompts, speculative=False)
        controlled(engine, {tuple(p): out for p, out in zip(prompts, plain, strict=True)}, 0.8)
        lengths = [TOKENS - 6 * row for row in range(ROWS)]
        handles = []
        for row, prompt in enumerate(prompts):
            sampled = {"temperature": 0.8, "seed": row} if row >= ROWS - 2 else {}
            params = SamplingParams(**{"temperature": 0.0, "max_tokens": lengths[row], "extra": {"ignore_eos": True}, **sampled})
            handles.append(engine.submit(GenerationRequest(model="tiny", prompt_ids=prompt, params=params)))
        outputs = [[t for e in handle if isinstance(e, Delta) for t in e.token_ids] for handle in handles]
        for row in range(ROWS - 2):
            assert outputs[row] == plain[row][: lengths[row]], f"row {row}"
        assert [len(out) for out in outputs[-2:]] == lengths[-2:]
        assert dict(engine.stats()["decoders"]["tiny"]["mtp"])["accepted"] > 0
    finally:
        engine.stop()


def test_a_checkpoint_without_the_head_is_refused_naming_the_key(tmp_path):
    write_checkpoint(tmp_path, mtp=False)
    engine = Engine(Config(models=[ModelConfig(path=str(tmp_path), name="tiny", dtype="float32",
                                               speculative=SpeculationConfig(method="mtp"))]), HOST)  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        engine.start()
    engine.stop()
    assert caught.value.field == "models[].speculative.method"
    assert "mtp" in str(caught.value) and "no multi-token-prediction weights" in str(caught.value)


def test_an_architecture_without_mtp_heads_is_refused_naming_the_key(tmp_path):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path / "llama.gguf", seed=0)
    engine = Engine(Config(models=[ModelConfig(path=str(path), name="tiny", dtype="float32",
                                               speculative=SpeculationConfig(method="mtp"))]), HOST)  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        engine.start()
    engine.stop()
    assert caught.value.field == "models[].speculative.method"
    assert "'llama' architecture reads no multi-token-prediction head" in str(caught.value)


# --- DeepSeek-V3's next-token layer ------------------------------------------------------------

DEEPSEEK = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10, "n_routed_experts": 4,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "max_position_embeddings": 512,
            "tie_word_embeddings": False, "q_lora_rank": 24, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "rope_interleave": False}  # fmt: skip


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 saved by transformers, its next-token layer added as layer 2 in the
    released layout: random tensors shaped as the saved layer 1's (a MoE block), ``enorm``,
    ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the embedding and LM head."""
    from safetensors.torch import load_file, save_file

    from mlxr_core.testing.hf_reference import write_tokenizer

    folder = tmp_path_factory.mktemp("deepseek_mtp")
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**DEEPSEEK, attn_implementation="eager")
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    from mlxr_core.testing.hf_reference import o1_init

    o1_init(model, torch)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    path = folder / "model.safetensors"
    saved = load_file(path)
    H = DEEPSEEK["hidden_size"]
    added = {}
    for name, value in saved.items():
        if name.startswith("model.layers.1."):
            noise = 1.0 + 0.1 * torch.randn_like(value) if value.ndim == 1 else torch.randn_like(value) / value.shape[-1] ** 0.5
            added["model.layers.2." + name[len("model.layers.1."):]] = noise
    added["model.layers.2.mlp.gate.e_score_correction_bias"] = 0.3 * torch.randn(DEEPSEEK["n_routed_experts"])
    added["model.layers.2.eh_proj.weight"] = torch.randn(H, 2 * H) / (2 * H) ** 0.5
    for name in ("enorm", "hnorm", "shared_head.norm"):
        added[f"model.layers.2.{name}.weight"] = 1.0 + 0.1 * torch.randn(H)
    added["model.layers.2.embed_tokens.weight"] = saved["model.embed_tokens.weight"].clone()
    added["model.layers.2.shared_head.head.weight"] = saved["lm_head.weight"].clone()
    save_file({**saved, **added}, path, metadata={"format": "pt"})
    return folder


def test_deepseek_next_token_layer_against_transformers_and_the_paper(deepseek):
    """The first draft's logits over a prompt's positions against transformers' own MTP layer
    (``MtpModel``, which ``generate(use_mtp=True)`` runs); chained steps against the paper's
    recurrence, the block's output before ``shared_head.norm`` read as the next ``h``."""
    import mlx.core as mx
    from transformers.modeling_layers import MtpModel

    from mlxr_plugins.decoders.mtp import MtpDrafter, load_mtp_head

    loaded = load(deepseek)
    head = load_mtp_head(loaded, HOST.registries)
    prompt = np.random.default_rng(4).integers(2, VOCAB, 10).tolist()
    hidden = loaded.model.model(mx.array([prompt[:-1]]))
    drafter = MtpDrafter(loaded.model, head, temperature=1.0, seed=5)
    drafter.observe(0, hidden[0], prompt[1:])
    drafted = drafter.propose(prompt, 3)
    assert drafter.draft_logits is not None
    ours = np.array(drafter.draft_logits)

    target = transformers.DeepseekV3ForCausalLM.from_pretrained(deepseek, attn_implementation="eager").eval()
    # transformers finds the layer by its released index (61); this checkpoint's is 2.
    target._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]
    mtp = MtpModel.from_pretrained(target).eval()
    layer = mtp.layers[0]
    with torch.no_grad():
        states = target.model(torch.tensor([prompt[:-1]])).last_hidden_state
        tokens = list(prompt[1:])
        expected = []
        for step in range(3):
            n = len(tokens)
            positions = torch.arange(n)[None]
            embeddings = mtp.embed_tokens(torch.tensor([tokens]))
            rotary = mtp.rotary_emb(embeddings, positions)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            if step == 0:  # transformers' layer as it is: enorm, hnorm, eh_proj, block, post norm
                normed = layer(embeddings, states, rotary, mask, positions, None)
            x = layer.eh_proj(torch.cat([layer.enorm(embeddings), layer.hnorm(states)], dim=-1))
            block = layer.mtp_block(x, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
            block = block[0] if isinstance(block, tuple) else block
            if step == 0:
                torch.testing.assert_close(layer.post_norm(block), normed)
            expected.append(mtp.shared_head(layer.post_norm(block))[0, -1].numpy())
            states = torch.cat([states, block[:, -1:]], dim=1)  # the paper's h^k, before the norm
            tokens.append(drafted[step])
    np.testing.assert_allclose(ours, np.stack(expected), atol=2e-4, rtol=1e-4)


def test_deepseek_rows_drafting_with_the_next_token_layer_decode_as_plain(deepseek):
    rng = np.random.default_rng(6)
    prompts = [rng.integers(2, VOCAB, int(n)).tolist() for n in rng.integers(3, 20, ROWS)]
    engine = serve(deepseek, k=2)
    try:
        plain = run(engine, prompts, speculative=False)
        controlled(engine, {tuple(p): out for p, out in zip(prompts[::2], plain[::2], strict=True)}, 0.8)
        drafted = run(engine, prompts)  # half the rows forced right 80% of the time
        for row in range(ROWS):
            assert drafted[row] == plain[row], f"row {row}"
        figures = dict(engine.stats()["decoders"]["tiny"]["mtp"])
        assert figures["accepted"] > 0
    finally:
        engine.stop()


def test_mtp_tensors_of_the_wrong_shape_are_a_load_error_naming_them(tmp_path):
    from safetensors.torch import load_file, save_file

    from mlxr_core.errors import ModelLoadError

    write_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["mtp.fc.weight"] = torch.zeros(SHAPE["hidden_size"], SHAPE["hidden_size"])  # [H, H], not [H, 2H]
    save_file(tensors, path, metadata={"format": "pt"})
    engine = Engine(Config(models=[ModelConfig(path=str(tmp_path), name="tiny", dtype="float32",
                                               speculative=SpeculationConfig(method="mtp"))]), HOST)  # fmt: skip
    with pytest.raises(ModelLoadError) as caught:
        engine.start()
    engine.stop()
    assert "multi-token-prediction head's tensors do not load" in str(caught.value) and "proj" in str(caught.value)


def test_the_kv_budget_reserves_the_heads_keys_and_values(checkpoint):
    """A row of a model drafting with its MTP head reserves the head's keys and values per
    position too (one attention layer: 2 x 2 key/value heads x 16 x 4 bytes)."""
    from mlxr_core.config.schema import EngineConfig
    from mlxr_core.engine.batch import BatchRunner
    from mlxr_core.engine.request import RequestHandle
    from mlxr_plugins.decoders.mtp import MtpDecoder

    folder, _ = checkpoint
    loaded = load(folder, speculative=SpeculationConfig(method="mtp", k=3, max_k=5))
    runner = BatchRunner(loaded, EngineConfig(), HOST.registries.samplers, None)
    handle = RequestHandle(GenerationRequest(model="tiny", prompt_ids=[5] * 10, params=SamplingParams(max_tokens=20)))
    before = runner.reserve_bytes(handle)
    MtpDecoder().prepare(loaded, HOST.registries, None)
    assert loaded.drafter_bytes_per_token == 2 * 2 * 16 * 4
    assert runner.reserve_bytes(handle) - before == (10 + 20 + 5 + 1) * loaded.drafter_bytes_per_token
