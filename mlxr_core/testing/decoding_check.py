"""Conformance checks of sampler and decoder plugins (see :func:`check_sampler`, :func:`check_decoder`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxr_core.engine.request import SamplingParams
    from mlxr_core.plugins import PluginHost

#: Prompts :func:`check_decoder` continues: plain, repeating (drafts find matches), long.
PROMPTS: tuple[tuple[int, ...], ...] = (
    (5, 6, 7, 8, 9, 10, 11),
    (40, 41, 42, 40, 41, 42, 40, 41),
    tuple(range(20, 60)),
)


def check_sampler(
    name: str,
    params: SamplingParams,
    *,
    host: PluginHost | None = None,
    vocab_size: int = 97,
    prompt_ids: Sequence[int] = (3, 4, 5),
    tokenizer: Any = None,
) -> None:
    """Raise AssertionError naming the first broken property of sampler plugin ``name``.

    ``params`` must make the sampler take part (its factory returns a processor for them). Checks:
    ``validate`` (when the factory has one) accepts ``params``; the processor maps ``[1, V]``
    float32 logits to ``[1, V]`` float32 logits, with no NaN and not every token masked; the same
    input gives the same output (randomness belongs to the draw, not to processors); a processor
    with ``accept`` takes emitted tokens and still answers; and the request's composed sampler
    (every registered processor, then the draw) returns an id inside the vocabulary.
    """
    import mlx.core as mx
    import numpy as np

    from mlxr_core.engine.decoding import SamplerContext, _call, make_sampler
    from mlxr_core.plugins import load_plugins

    host = host if host is not None else load_plugins()
    registry = host.registries.samplers
    assert name in registry, f"sampler {name!r} is not registered (registered: {', '.join(registry.names())})"
    factory = registry.get(name)
    context = SamplerContext(prompt_ids=tuple(prompt_ids), tokenizer=tokenizer, vocab_size=vocab_size)
    validate = getattr(factory, "validate", None)
    if callable(validate):
        validate(params, context)
    processor = _call(factory, params, context)
    assert processor is not None, f"sampler {name}: its factory returned None for {params!r}; pass params it acts on"
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(1, vocab_size)).astype(np.float32) * 3)

    def run(x: mx.array) -> np.ndarray:
        out = processor(x)
        assert isinstance(out, mx.array), f"sampler {name}: returned {type(out).__name__}, not an mx.array"
        assert out.shape == x.shape, f"sampler {name}: logits of shape {x.shape} became {out.shape}"
        assert out.dtype == mx.float32, f"sampler {name}: float32 logits became {out.dtype}"
        values = np.array(out)
        assert not np.isnan(values).any(), f"sampler {name}: produced NaN logits"
        assert np.isfinite(values).any(), f"sampler {name}: masked every token"
        return values

    first = run(logits)
    assert np.array_equal(first, run(logits)), f"sampler {name}: the same logits gave different results"
    accept = getattr(processor, "accept", None)
    if callable(accept):
        for token in (int(first.argmax()), 0, vocab_size - 1):
            accept(token)
            run(logits)
    sampler = make_sampler(params, registry, context)
    token = int(sampler(logits).item())  # type: ignore[arg-type]
    assert 0 <= token < vocab_size, f"sampler {name}: the composed sampler drew id {token} outside [0, {vocab_size})"


def check_decoder(
    name: str,
    model_path: str | Path,
    *,
    host: PluginHost | None = None,
    plugin_config: dict[str, Any] | None = None,
    max_tokens: int = 24,
) -> None:
    """Raise AssertionError naming the first broken property of decoder plugin ``name``.

    Serves ``model_path`` (a tiny float32 model: ``mlxr_core.testing.tiny.write_tiny_llama_gguf``)
    with the decoder configured for the model (``plugin_config`` is the ``plugins.config`` mapping
    it may need, e.g. a draft model) and checks: the engine starts (the decoder's preconditions
    hold); at temperature 0 the decoder emits plain decoding's tokens exactly, for prompts with
    and without repetition; exactly ``max_tokens`` tokens come out when EOS is ignored, and the
    usage says so; a seeded request at temperature 1 is reproducible and stays in the vocabulary;
    without ``ignore_eos`` it ends where plain decoding ends, for the same reason.
    """
    from mlxr_core.config.schema import Config, ModelConfig, PluginsConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    host = host if host is not None else load_plugins()
    assert name in host.registries.decoders, (
        f"decoder {name!r} is not registered (registered: {', '.join(host.registries.decoders.names())})"
    )
    config = Config(
        models=[ModelConfig(path=str(model_path), name="tiny", context_length=256, dtype="float32", decoder=name)],
        plugins=PluginsConfig(config=dict(plugin_config or {})),
    )
    engine = Engine(config, host)
    engine.start()
    try:
        vocab = engine.model("tiny").tokenizer.vocab_size

        def generate(prompt: Sequence[int], decoder: str, **params: Any) -> tuple[list[int], Finished]:
            params.setdefault("max_tokens", max_tokens)
            request = GenerationRequest(model="tiny", prompt_ids=list(prompt), params=SamplingParams(**params), decoder=decoder)
            events = list(engine.submit(request))
            done = events[-1]
            assert isinstance(done, Finished), f"decoder {name}: the request ended with {done!r}"
            return [t for e in events if isinstance(e, Delta) for t in e.token_ids], done

        for prompt in PROMPTS:
            plain, _ = generate(prompt, "plain", temperature=0.0, extra={"ignore_eos": True})
            ours, done = generate(prompt, name, temperature=0.0, extra={"ignore_eos": True})
            assert ours == plain, (
                f"decoder {name}: greedy tokens differ from plain decoding for prompt {list(prompt)} "
                f"(first at index {next((i for i, (a, b) in enumerate(zip(ours, plain, strict=False)) if a != b), min(len(ours), len(plain)))})"
            )
            assert len(ours) == max_tokens and done.usage.completion_tokens == max_tokens, (
                f"decoder {name}: {len(ours)} tokens (usage {done.usage.completion_tokens}) for max_tokens {max_tokens}"
            )
            assert done.reason == "length", f"decoder {name}: finished with {done.reason!r}, not 'length'"
        seeded = [generate(PROMPTS[2], name, temperature=1.0, seed=7, extra={"ignore_eos": True})[0] for _ in range(2)]
        assert seeded[0] == seeded[1], f"decoder {name}: a seeded request gave different tokens twice"
        assert all(0 <= t < vocab for t in seeded[0]), f"decoder {name}: drew ids outside the vocabulary"
        # Without ignore_eos: the same tokens and the same ending (EOS or length) as plain decoding.
        plain, plain_done = generate(PROMPTS[0], "plain", temperature=0.0, max_tokens=200)
        ours, done = generate(PROMPTS[0], name, temperature=0.0, max_tokens=200)
        assert (ours, done.reason) == (plain, plain_done.reason), (
            f"decoder {name}: without ignore_eos it gave {len(ours)} tokens ending {done.reason!r}; "
            f"plain decoding gave {len(plain)} ending {plain_done.reason!r}"
        )
    finally:
        engine.stop()
