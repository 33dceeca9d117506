"""Drafting inside the batch (mlxr_core.engine.speculation): eight concurrent rows with different
drafters (prompt lookup, a right prediction, a wrong one, random tokens, none) and so different
draft lengths give plain decoding's greedy tokens exactly, on dense, sliding-window, MoE and
quantized-KV models; grammars, stop strings, logprobs and penalties agree with plain decoding;
sampled verification keeps the target's distribution (chi-square); each row's cache forgets its
own rejected tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxr_core.config.schema import Config, KVCacheConfig, ModelConfig, SpeculationConfig
from mlxr_core.engine.decoding import RequestSampler
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Constraint, Delta, Finished, GenerationRequest, SamplingParams
from mlxr_core.engine.speculation import lookup_draft, next_k, verify_rows
from mlxr_core.model.cache import (
    BatchKVCache,
    BatchStateCache,
    KVCache,
    RecurrentCache,
    StateCache,
    rolls_back,
)
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.statistics import chi_square_p
from mlxr_core.testing.tiny import write_tiny_llama_gguf

TOKENS = 64
ROWS = 8
#: Prompts of different lengths (so the rows are padded differently), some repeating themselves
#: (prompt lookup finds drafts there).
PROMPTS = [
    [40, 41, 42, 43, 40, 41, 42, 43, 40, 41],
    [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],
    [20, 21, 22, 23, 24],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 30, 31],
    [50, 51, 50, 51, 50, 51, 50],
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79],
    [11, 12, 13, 14, 15, 16],
    [80, 81, 82, 80, 81, 82, 80, 81, 82],
]
HOST = load_plugins()


def serve(path, **model) -> Engine:
    model.setdefault("speculative", SpeculationConfig(method="prompt_lookup", k=3, max_k=6))
    config = Config(models=[ModelConfig(path=str(path), name="tiny", context_length=256, dtype="float32", **model)])
    engine = Engine(config, HOST)
    engine.start()
    return engine


def run(engine, rows: list[dict]) -> list[tuple[list[int], Finished, list]]:
    """Submit every row at once (they decode in one batch), then read each one's events."""
    handles = []
    for i, row in enumerate(rows):
        params = {"temperature": 0.0, "max_tokens": TOKENS, "extra": {"ignore_eos": True}, **row.get("params", {})}
        request = GenerationRequest(
            model="tiny", prompt_ids=list(row.get("prompt", PROMPTS[i])), params=SamplingParams(**params),
            prediction=row.get("prediction"), speculative=row.get("speculative", True),
        )
        handles.append(engine.submit(request))
    results = []
    for handle in handles:
        events = list(handle)
        done = events[-1]
        assert isinstance(done, Finished), done
        deltas = [e for e in events if isinstance(e, Delta)]
        results.append(([t for e in deltas for t in e.token_ids], done, deltas))
    return results


def drafts_of(engine) -> dict[str, dict]:
    return {name: dict(figures) for name, figures in engine.stats()["decoders"].get("tiny", {}).items()}


def mixed_rows(plain: list[list[int]], vocab: int) -> list[dict]:
    """Row by row: prompt lookup (the model's method), right predictions, predictions wrong from
    their 6th token (an edit) and right again after it, random tokens, and a row that opted out."""
    rng = np.random.default_rng(3)
    rows: list[dict] = [{}, {}]
    rows += [{"prediction": plain[2]}, {"prediction": plain[3][:40]}]
    rows += [{"prediction": [*plain[i][:5], *rng.integers(2, vocab, 4).tolist(), *plain[i][9:]]} for i in (4, 5)]
    rows += [{"prediction": rng.integers(2, vocab, TOKENS).tolist()}, {"speculative": False}]
    return rows


def check_exact(engine, vocab: int = 97) -> None:
    plain = [tokens for tokens, _, _ in run(engine, [{"speculative": False}] * ROWS)]
    before = drafts_of(engine)
    drafted = run(engine, mixed_rows(plain, vocab))
    for row, (tokens, done, _) in enumerate(drafted):
        assert tokens == plain[row], f"row {row}: first difference at {next(i for i, (a, b) in enumerate(zip(tokens, plain[row], strict=False)) if a != b)}"
        assert done.usage.completion_tokens == TOKENS
    after = drafts_of(engine)
    for method in ("prompt_lookup", "prediction"):
        grew = after[method]["drafted"] - before.get(method, {}).get("drafted", 0)
        assert grew > 0, f"{method} drafted nothing"
    assert after["prediction"]["accepted"] > before.get("prediction", {}).get("accepted", 0)
    # The right prediction is taken almost whole; the random one mostly rejected.
    assert drafted[2][1].usage.accepted_prediction_tokens > TOKENS // 2
    assert drafted[6][1].usage.rejected_prediction_tokens > drafted[6][1].usage.accepted_prediction_tokens
    assert drafted[7][1].usage.accepted_prediction_tokens == drafted[7][1].usage.rejected_prediction_tokens == 0


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("spec") / "dense.gguf", seed=0)


@pytest.fixture(scope="module")
def dense(dense_path):
    engine = serve(dense_path)
    yield engine
    engine.stop()


def test_dense_rows_with_different_drafts_decode_as_plain(dense):
    check_exact(dense)


@pytest.mark.parametrize(
    "kv_cache",
    [KVCacheConfig(bits=8, group_size=32), KVCacheConfig(bits=4, group_size=32, start_after=12)],
    ids=["q8", "q4-after-12"],
)
def test_quantized_kv_rows_decode_as_plain(tmp_path, kv_cache):
    path = write_tiny_llama_gguf(tmp_path / "wide.gguf", seed=1, hidden=128)  # heads of 32
    engine = serve(path, kv_cache=kv_cache)
    try:
        check_exact(engine)
    finally:
        engine.stop()


@pytest.mark.parametrize(
    "model_type, keys",
    [
        ("gemma3_text", {"sliding_window": 8}),  # sliding-window layers, and global ones
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ],
    ids=["sliding-window", "moe"],
)
def test_sliding_window_and_moe_rows_decode_as_plain(tmp_path, model_type, keys):
    from mlxr_core.testing.hf_reference import greedy_reference

    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 96, "vocab_size": 97}  # fmt: skip
    reference = greedy_reference(model_type, {**sizes, **keys}, tmp_path, tokens=1)
    engine = serve(reference.folder)
    try:
        check_exact(engine)
    finally:
        engine.stop()


def test_a_draft_model_drafts_for_every_row(dense_path, tmp_path):
    from mlxr_core.config.schema import PluginsConfig

    draft = write_tiny_llama_gguf(tmp_path / "draft.gguf", seed=0, quant="q8_0")  # mostly agrees
    config = Config(
        models=[ModelConfig(path=str(dense_path), name="tiny", context_length=256, dtype="float32",
                            decoder="speculative", speculative=SpeculationConfig(method="speculative", k=3))],
        plugins=PluginsConfig(config={"decoders": {"speculative": {"draft": str(draft)}}}),
    )  # fmt: skip
    engine = Engine(config, HOST)
    engine.start()
    try:
        plain = [tokens for tokens, _, _ in run(engine, [{"speculative": False}] * ROWS)]
        rows = [{}] * (ROWS - 2) + [{"speculative": False}, {"params": {"temperature": 0.8, "seed": 5}}]
        drafted = run(engine, rows)
        for row in range(ROWS - 1):
            assert drafted[row][0] == plain[row], f"row {row}"
        assert len(drafted[-1][0]) == TOKENS  # sampled (drafts drawn at 0.8): the same length
        figures = drafts_of(engine)["speculative"]
        assert figures["accepted"] > figures["drafted"] // 2  # an 8-bit copy agrees mostly
    finally:
        engine.stop()


def test_latent_attention_rows_decode_as_plain(tmp_path):
    """DeepSeek-V3's multi-head latent attention (each position's latent and rotary key cached;
    a verification of up to 16 positions attends in the absorbed form), with its routed experts."""
    from mlxr_core.testing.hf_reference import tiny_reference

    shape = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
             "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10, "n_routed_experts": 8,
             "n_shared_experts": 1, "num_experts_per_tok": 2, "max_position_embeddings": 256,
             "tie_word_embeddings": False, "q_lora_rank": 24, "n_group": 1, "topk_group": 1,
             "first_k_dense_replace": 1}  # fmt: skip
    reference = tiny_reference("DeepseekV3ForCausalLM", "DeepseekV3Config", shape, tmp_path, lengths=(4,))
    engine = serve(reference.folder)
    try:
        check_exact(engine)
    finally:
        engine.stop()


# --- what the sampler chain does keeps working -------------------------------------------------


def test_penalties_logprobs_and_stop_strings_agree_with_plain(dense):
    params = [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.8, "presence_penalty": 0.5},
        {"logprobs": 3},
        {"logprobs": 0},
    ]
    base = [{"params": p} for p in params]
    plain = run(dense, [{**row, "speculative": False} for row in base])
    drafted = run(dense, [{**row, "prediction": tokens} for row, (tokens, _, _) in zip(base, plain, strict=True)])
    for (want, _, _), (got, done, _) in zip(plain, drafted, strict=True):
        assert got == want
        assert done.usage.accepted_prediction_tokens > 0
    for index in (2, 3):  # logprobs: the same tokens, alternatives and values
        want = [lp for d in plain[index][2] for lp in d.logprobs]
        got = [lp for d in drafted[index][2] for lp in d.logprobs]
        assert len(got) == len(want) == TOKENS
        for a, b in zip(got, want, strict=True):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # A stop string inside the output: where plain decoding stops, drafting stops.
    free, _, deltas = run(dense, [{"speculative": False}])[0]
    text = "".join(d.text for d in deltas)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    rows = [{"params": {"stop": [stop]}, "prompt": PROMPTS[0]}]
    want = run(dense, [{**rows[0], "speculative": False}])[0]
    got = run(dense, [{**rows[0], "prediction": free}])[0]
    assert got[0] == want[0] and got[1].reason == want[1].reason == "stop"
    assert "".join(d.text for d in got[2]) == "".join(d.text for d in want[2])


def test_a_drafted_token_outside_the_grammar_is_never_fed(dense):
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"a": {"enum": ["xy", "zw"]}}, "required": ["a"]}
    constraint = Constraint("json_schema", schema)
    row = {"params": {"constraint": constraint, "max_tokens": 24, "extra": {}}, "prompt": PROMPTS[2]}
    want, want_done, _ = run(dense, [{**row, "speculative": False}])[0]
    tokenizer = dense.model("tiny").tokenizer
    wrong = tokenizer.encode("!!", add_special_tokens=False)
    prediction = [*want[:2], *wrong, *want[2:]]  # right, then tokens no JSON document allows
    got, done, _ = run(dense, [{**row, "prediction": prediction}])[0]
    assert got == want and done.reason == want_done.reason
    assert done.usage.accepted_prediction_tokens >= 2


def test_valid_prefix_cuts_a_draft_at_the_first_token_the_grammar_refuses(toy_tokenizer):
    pytest.importorskip("llguidance")
    from mlxr_core.engine.decoding import SamplerContext
    from mlxr_plugins.samplers.structured import structured

    mask = structured(
        SamplingParams(constraint=Constraint("json_schema", {"enum": ["red", "green"]})),
        SamplerContext(tokenizer=toy_tokenizer),
    )
    good = toy_tokenizer.encode('"gre', add_special_tokens=False)
    bad = toy_tokenizer.encode("x", add_special_tokens=False)
    sampler = RequestSampler([mask], SamplingParams(temperature=0.0))
    assert sampler.valid_prefix([*good, *bad, *good]) == len(good)
    assert sampler.valid_prefix(good) == len(good)
    assert RequestSampler([], SamplingParams()).valid_prefix([*good, *bad]) == len(good) + len(bad)


# --- sampled verification keeps the target's distribution --------------------------------------


class Follows:
    """A stateless processor made stateful (it is told each emitted token): verification then
    goes position by position (:func:`verify_in_order`)."""

    def __call__(self, logits):
        return logits

    def accept(self, token: int) -> None:
        pass


VOCAB, DRAWS, ROWS_A_BATCH = 6, 10_000, 1_000


def check_first_tokens(logits: mx.array, make_drafts, q_logits: mx.array | None, stateful: bool) -> None:
    """Verify ``DRAWS`` seeded rows (``make_drafts()`` gives a batch's drafts) against the
    toy target whose distribution depends only on the position: the first emitted token must
    follow ``p_0``, and the second, after an accepted first draft token, ``p_1`` (chi-square)."""
    p = np.array(mx.softmax(logits, axis=-1))
    first, second = np.zeros(VOCAB), np.zeros(VOCAB)
    for batch in range(DRAWS // ROWS_A_BATCH):
        drafts = make_drafts()
        samplers = [
            RequestSampler([Follows()] if stateful else [], SamplingParams(temperature=1.0, seed=batch * ROWS_A_BATCH + i))
            for i in range(ROWS_A_BATCH)
        ]
        batch_logits = mx.broadcast_to(logits, (ROWS_A_BATCH, 3, VOCAB))
        drawn = None if q_logits is None else [q_logits] * ROWS_A_BATCH
        emitted, failed = verify_rows(batch_logits, drafts, samplers, drawn)
        assert not failed
        for draft, tokens in zip(drafts, emitted, strict=True):
            first[tokens[0]] += 1
            if tokens[0] == draft[0] and len(tokens) > 1:
                second[tokens[1]] += 1
    assert chi_square_p(first, p[0]) > 0.001, (first / first.sum(), p[0])
    assert second.sum() > 1_000
    assert chi_square_p(second, p[1]) > 0.001, (second / second.sum(), p[1])


#: The in-order path syncs with the device at every position of every row: ~30 s here, slow.
STATEFUL = [pytest.param(False, id="batched"), pytest.param(True, id="in-order", marks=pytest.mark.slow)]


@pytest.mark.parametrize("stateful", STATEFUL)
def test_sampled_verification_draws_the_first_tokens_as_plain_sampling(stateful):
    """A deterministic draft (n-grams, a prediction): a point mass."""
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(3, VOCAB)).astype(np.float32) * 1.5)
    p = np.array(mx.softmax(logits, axis=-1))
    draft = [int(np.argsort(p[0])[-2]), int(np.argsort(p[1])[0])]  # likely-ish, then unlikely
    check_first_tokens(logits, lambda: [draft] * ROWS_A_BATCH, None, stateful)


@pytest.mark.parametrize("stateful", STATEFUL)
def test_drafts_drawn_from_a_distribution_keep_the_targets(stateful):
    """Drafts drawn from another distribution q (a draft model's, over a smaller vocabulary),
    q handed over with them."""
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(size=(3, VOCAB)).astype(np.float32) * 1.5)
    q_logits = mx.array(rng.normal(size=(2, VOCAB - 1)).astype(np.float32))
    q = np.array(mx.softmax(q_logits, axis=-1)).astype(np.float64)
    q /= q.sum(axis=-1, keepdims=True)

    def drafts() -> list[list[int]]:
        return [[int(rng.choice(VOCAB - 1, p=q[0])), int(rng.choice(VOCAB - 1, p=q[1]))] for _ in range(ROWS_A_BATCH)]

    check_first_tokens(logits, drafts, q_logits, stateful)


# --- caches and policy -------------------------------------------------------------------------


def test_each_row_forgets_its_own_rejected_positions():
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=(1, 2, n, 4)).astype(np.float32) for n in (5, 3, 7)]
    cache = BatchKVCache.empty()
    first = True
    for row in rows:
        single = BatchKVCache.from_cache(KVCache.from_arrays(mx.array(row), mx.array(row)))
        if first:
            cache, first = single, False
        else:
            cache.extend(single)
    new = rng.normal(size=(3, 2, 4, 4)).astype(np.float32)  # a verification of 4 positions a row
    cache.update_and_fetch(mx.array(new), mx.array(new))
    drop = [3, 0, 2]
    cache.rollback(drop)
    for i, row in enumerate(rows):
        kept = np.concatenate([row[0], new[i][:, : 4 - drop[i]]], axis=1)
        extracted = cache.extract(i)
        np.testing.assert_array_equal(np.array(extracted.keys[0, :, : extracted.offset]), kept)
        assert extracted.offset == kept.shape[1]
    mask = np.array(cache.draft_mask(2))[:, 0]  # each row sees its own positions only
    for i, row in enumerate(rows):
        own = row.shape[2] + 4 - drop[i]
        assert mask[i, 0].sum() == own + 1 and mask[i, 1].sum() == own + 2


def test_a_recurrent_state_rolls_back_to_each_rows_last_kept_position():
    # The mlx-lm bridge's recurrent layers keep no per-position states: their rows draft nothing.
    assert not rolls_back([BatchStateCache([None, None], [0], StateCache(2))])
    assert rolls_back([BatchKVCache.empty()])
    cache = BatchStateCache([mx.zeros((3, 2, 4)), mx.zeros((3, 5))], [7, 7, 7], RecurrentCache((2, 4), (5,)))
    assert rolls_back([cache])
    convs = [mx.full((3, 2, 4), float(j)) for j in range(4)]  # after positions 0..3 of the span
    states = [mx.full((3, 5), float(10 + j)) for j in range(4)]
    cache.keep_positions(convs, states)
    cache.update(convs[-1], states[-1], 4)
    cache.rollback([3, 0, 1])
    assert cache.positions == [8, 11, 10]
    assert np.array(cache.conv_state)[:, 0, 0].tolist() == [0.0, 3.0, 2.0]
    assert np.array(cache.recurrent_state)[:, 0].tolist() == [10.0, 13.0, 12.0]


#: Hybrid families (recurrent and attention layers) and tiny configs of them.
HYBRIDS = {
    "qwen3_next": {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 96, "vocab_size": 97, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
    "kimi_linear": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
                    "intermediate_size": 96, "vocab_size": 97, "num_local_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12,
                    "v_head_dim": 10, "linear_head_dim": 16, "linear_num_heads": 4, "pad_token_id": 0,
                    "bos_token_id": 0, "eos_token_id": 1,
                    "layer_types": ["linear_attention", "full_attention", "linear_attention"]},
    "nemotron_h": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "intermediate_size": 96, "vocab_size": 97, "mamba_num_heads": 8, "mamba_head_dim": 16,
                   "n_groups": 2, "ssm_state_size": 16, "chunk_size": 16, "n_routed_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
                   "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"]},
}  # fmt: skip


@pytest.mark.slow  # transformers' reference hybrids run their recurrences in plain torch
@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_hybrid_rows_with_different_drafts_decode_as_plain(tmp_path, model_type):
    """Qwen3-Next (Gated DeltaNet and gated attention layers, MoE), Kimi Linear (Kimi delta
    attention and latent attention), Nemotron-H (Mamba-2, attention, MLP and MoE layers): the
    recurrent layers keep each verified position's states,
    so every row undoes its own rejected tokens."""
    from mlxr_core.testing.hf_reference import greedy_reference

    reference = greedy_reference(model_type, HYBRIDS[model_type], tmp_path, tokens=1)
    engine = serve(reference.folder)
    try:
        check_exact(engine)
    finally:
        engine.stop()


def test_k_adapts_to_each_rows_acceptance():
    settings = SpeculationConfig(method="prompt_lookup", k=4, min_k=2, max_k=5)
    assert next_k(4, 4, 4, settings) == 5 and next_k(5, 5, 5, settings) == 5
    assert next_k(4, 4, 1, settings) == 3 and next_k(2, 2, 0, settings) == 2
    assert next_k(4, 4, 3, settings) == 4
    assert next_k(4, 4, 0, SpeculationConfig(method="prompt_lookup", adaptive=False)) == 4


def test_lookup_in_another_text_resumes_after_an_edit():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8]
    assert lookup_draft(prediction, [9, 9, 4, 5], 3, 3, 2) == [6, 7, 8]
    assert lookup_draft(prediction, [9, 9], 3, 3, 2) == []


def test_speculation_steps_aside_for_a_large_batch():
    from types import SimpleNamespace

    from mlxr_core.engine.batch import BatchRunner

    runner = BatchRunner.__new__(BatchRunner)
    row = SimpleNamespace(drafter=object(), draft_k=3)
    runner.model = SimpleNamespace(vision=None)
    runner.caches, runner.speculation = [BatchKVCache.empty()], SpeculationConfig(method="prompt_lookup", max_batch=2)
    runner.running, runner.shifts = [row, row], [0, 0]
    assert runner._speculating()
    runner.running, runner.shifts = [row, row, row], [0, 0, 0]
    assert not runner._speculating()  # above max_batch: a plain step
    runner.running, runner.shifts = [SimpleNamespace(drafter=None, draft_k=0)], [0]
    assert not runner._speculating()  # nobody drafts


# --- configuration -------------------------------------------------------------------------------


def test_a_bad_speculative_setting_names_its_key(tmp_path):
    from mlxr_core.checks import unregistered_names
    from mlxr_core.config.loader import ConfigProblems, load_config

    path = tmp_path / "server.yaml"
    path.write_text("models:\n  - path: x.gguf\n    speculative: {method: prompt_lookup, kk: 3}\n")
    with pytest.raises(ConfigProblems) as caught:
        load_config(path, environ={})
    assert any("models[0].speculative" in problem and "kk" in problem for problem in map(str, caught.value.problems))
    path.write_text("models:\n  - path: x.gguf\n    speculative: {method: prompt_lookup, min_k: 4, max_k: 2}\n")
    with pytest.raises(ConfigProblems) as caught:
        load_config(path, environ={})
    assert any("max_k" in str(problem) for problem in caught.value.problems)
    config = Config(models=[ModelConfig(path="x.gguf", speculative=SpeculationConfig(method="plain"))])
    found = [problem for problem in unregistered_names(config, HOST) if "speculative" in str(problem)]
    assert len(found) == 1 and "method" in str(found[0]) and "prompt_lookup" in str(found[0])


def test_metrics_count_drafts_per_method_and_their_acceptance_distribution(dense):
    import attrs
    from litestar.testing import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from mlxr_core.http.context import ServerContext
    from mlxr_core.http.server import build_app

    plain = run(dense, [{"speculative": False}])[0][0]
    run(dense, [{"prediction": plain}, {}])
    config = attrs.evolve(dense.config, apis=["ollama"])
    with TestClient(build_app(ServerContext(config=config, host=HOST, engine=dense))) as client:
        text = client.get("/metrics").text
    samples = [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model") == "tiny"
    ]

    def value(name: str, method: str, **labels: str) -> float:
        return next(
            s.value for s in samples
            if s.name == name and s.labels.get("decoder") == method and all(s.labels.get(k) == v for k, v in labels.items())
        )  # fmt: skip

    for method in ("prediction", "prompt_lookup"):
        figures = dense.stats()["decoders"]["tiny"][method]
        assert value("mlxr_draft_tokens_total", method) == figures["drafted"] > 0
        assert value("mlxr_draft_accepted_tokens_total", method) == figures["accepted"]
        assert value("mlxr_draft_accepted_per_verification_count", method) == figures["steps"]
        assert value("mlxr_draft_accepted_per_verification_sum", method) == figures["accepted"]
        assert value("mlxr_draft_accepted_per_verification_bucket", method, le="+Inf") == figures["steps"]
        zero = value("mlxr_draft_accepted_per_verification_bucket", method, le="0")
        assert zero == figures["accepted_per_pass"].get("0", 0)


def test_the_kv_budget_reserves_the_positions_a_verification_writes(dense):
    from mlxr_core.engine.batch import sequence_bytes
    from mlxr_core.engine.request import RequestHandle

    runner = dense.scheduler.runners["tiny"]
    request = GenerationRequest(model="tiny", prompt_ids=PROMPTS[0], params=SamplingParams(max_tokens=10))
    per_token, tokens = runner.kv_bytes_per_token, len(PROMPTS[0]) + 10
    drafting = sequence_bytes(runner.model, tokens + runner.speculation.max_k + 1, per_token)
    assert runner.reserve_bytes(RequestHandle(request)) == drafting > sequence_bytes(runner.model, tokens, per_token)


def test_rows_joining_and_leaving_a_drafting_batch_decode_as_plain(dense):
    """Rows join while others draft (their first step is their prompt's last token) and leave at
    different lengths; every one gives its plain tokens."""
    plain = [tokens for tokens, _, _ in run(dense, [{"speculative": False}] * ROWS)]

    def submit(i: int, max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra={"ignore_eos": True})
        return dense.submit(GenerationRequest(model="tiny", prompt_ids=PROMPTS[i], params=params, prediction=plain[i]))

    first = [submit(i, TOKENS - 8 * i) for i in range(4)]
    stream = iter(first[0])
    early = [next(stream) for _ in range(3)]  # the first wave is decoding
    second = [submit(i, TOKENS) for i in range(4, ROWS)]
    events = [[*early, *stream], *(list(handle) for handle in [*first[1:], *second])]
    for i, row in enumerate(events):
        assert isinstance(row[-1], Finished), row[-1]
        tokens = [t for e in row if isinstance(e, Delta) for t in e.token_ids]
        expected = TOKENS - 8 * i if i < 4 else TOKENS
        assert tokens == plain[i][:expected], i


def test_lookup_draft_agrees_with_a_plain_scan_on_random_sequences() -> None:
    """The byte search finds what a scan from the end finds: the latest occurrence of the longest
    suffix n-gram followed by a token (ids up to 2**31 - 1, whose bytes can match across two ids)."""
    import random

    def scan(source: list[int], context: list[int], k: int, top: int, low: int) -> list[int]:
        size, same = len(context), source is context
        for n in range(min(top, size - 1 if same else size), low - 1, -1):
            for start in range((size - n - 1) if same else len(source) - n, -1, -1):
                if source[start : start + n] == context[size - n :]:
                    draft: list[int] = []
                    for i in range(start + n, start + n + k):
                        if i < len(source):
                            draft.append(source[i])
                        elif same:
                            draft.append(draft[i - size])
                    if draft:
                        return draft
        return []

    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 300, 70_000, 2**31 - 1])
        source = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        context = source if rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        k, (top, low) = rng.randrange(0, 6), rng.choice([(4, 2), (3, 1), (2, 2)])
        assert lookup_draft(source, context, k, top, low) == scan(source, context, k, top, low)
    assert lookup_draft([0x01000000, 0x02], [0x0201], 2, 1, 1) == []  # bytes across two ids are no match
