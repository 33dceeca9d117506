"""An architecture against transformers on tiny random weights: the checks every family's
reference test runs (logits, cached decoding, a batch of rows of different lengths, a prefix-cache
hit), written once.

:func:`tiny_reference` saves a transformers model with O(1) random weights (the default
initialization's 0.02 std gives near-zero logits, which prove little) and records its logits for
two prompts; :func:`check_reference` loads the folder through mlxr's safetensors format and
loader and compares. transformers and torch are imported only by :func:`tiny_reference`, so a
test module skips where they are not installed::

    reference = tiny_reference("Qwen3MoeForCausalLM", "Qwen3MoeConfig", SHAPE, tmp_path)
    check_reference(reference, registries, backend="mlx_fast")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from mlxr_core.plugins import Registries

#: Prompt lengths: a prefill of more than 64 (token, expert) pairs takes the sorted expert path.
PROMPT_LENGTHS = (40, 19)


@attrs.define
class Reference:
    """A saved tiny model, its prompts and transformers' logits (float32) for each."""

    folder: Path
    prompts: list[list[int]]
    logits: list[np.ndarray]
    config: dict[str, Any]


def o1_init(model: Any, torch: Any, skip: Callable[[str], bool] = lambda name: False) -> None:
    """Vectors near 1 (norms), matrices scaled by ``1/sqrt(fan_in)``; ``skip`` keeps some
    parameters as initialized (e.g. per-layer scalars whose meaning 1 is)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if skip(name):
                continue
            if parameter.ndim == 1:
                parameter.copy_(1.0 + 0.1 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)


def tiny_reference(
    model_class: str,
    config_class: str,
    shape: dict[str, Any],
    folder: Path,
    *,
    lengths: tuple[int, ...] = PROMPT_LENGTHS,
    seed: int = 0,
    init: Callable[[Any, Any], None] | None = None,
) -> Reference:
    """Save a tiny ``transformers.<model_class>`` (eager attention, float32) with O(1) random
    weights to ``folder`` and record its logits for random prompts of ``lengths`` tokens."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**shape, attn_implementation="eager")
    model = getattr(transformers, model_class)(config).eval()
    (init or (lambda m, t: o1_init(m, t)))(model, torch)
    model.save_pretrained(folder)
    write_tokenizer(folder, shape["vocab_size"])
    rng = np.random.default_rng(seed + 1)
    prompts = [rng.integers(0, shape["vocab_size"], n).tolist() for n in lengths]
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0].float().numpy() for ids in prompts]
    return Reference(folder, prompts, logits, config.to_dict())


@attrs.define
class GreedyReference:
    """A saved tiny model, a prompt, transformers' greedy tokens after it and the logits of the
    first of them (float32)."""

    folder: Path
    prompt: list[int]
    tokens: list[int]
    logits: np.ndarray


def greedy_reference(
    model_type: str, keys: dict[str, Any], folder: Path, *, tokens: int = 12, seed: int = 0
) -> GreedyReference:
    """Save a tiny ``model_type`` as a user of transformers gets it: its config class's defaults
    with ``keys`` over them (``AutoConfig.for_model``), O(1) random weights; record its greedy
    tokens (``generate``, end of sequence ignored) after a random 9-token prompt. Skips the test
    where torch or transformers is not installed."""
    import pytest

    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **keys)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    o1_init(model, torch)
    model.save_pretrained(folder)
    vocab_size = config.get_text_config().vocab_size  # a vision-language config keeps it in text_config
    write_tokenizer(folder, vocab_size)
    prompt = np.random.default_rng(seed + 1).integers(2, vocab_size, 9).tolist()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        logits = model(torch.tensor([prompt])).logits[0, -1].float().numpy()
    return GreedyReference(folder, prompt, out[0, len(prompt):].tolist(), logits)


def greedy_tokens(loaded: Any, prompt: list[int], count: int) -> tuple[list[int], np.ndarray]:
    """``count`` greedy tokens of a :class:`~mlxr_core.model.loader.LoadedModel` after ``prompt``
    (prefilled, then one token at a time through its cache), and the first step's logits."""
    model, cache = loaded.model, loaded.make_cache()
    step = model(mx.array([prompt]), cache=cache)[0, -1]
    first = np.array(step)
    tokens: list[int] = []
    for _ in range(count):
        tokens.append(int(mx.argmax(step)))
        step = model(mx.array([tokens[-1:]]), cache=cache)[0, -1]
    return tokens, first


def family_reference(
    families: dict[str, tuple[str, str, dict[str, Any]]], base: dict[str, Any], family: str, folder: Path
) -> Reference:
    """:func:`tiny_reference` of ``families[family]`` (model class, config class, keys over
    ``base``): what a test module's parametrized ``reference`` fixture returns. Skips the test
    where torch or transformers is not installed."""
    import pytest

    pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    pytest.importorskip("transformers", reason="the reference needs transformers")
    model_class, config_class, extra = families[family]
    return tiny_reference(model_class, config_class, {**base, **extra}, folder)


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level ``tokenizer.json`` of ``vocab_size`` tokens (``t0`` ... split on spaces, the
    first two ``<s>`` and ``</s>``) and a plain chat template, so the folder serves as it is."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    settings = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")


def load_reference_model(
    reference: Reference | GreedyReference, registries: Registries, backend: str = "mlx_fast"
) -> Any:
    """The folder through mlxr's loader (format detection, sanitize, strict weights), float32,
    every kernel op on ``backend``. Returns the :class:`~mlxr_core.model.loader.LoadedModel`."""
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.kernels import OPS
    from mlxr_core.model.loader import load_model

    config = ModelConfig(
        path=str(reference.folder),
        dtype="float32",
        kernels=dict.fromkeys(OPS, backend),
        compile_decode=False,
    )
    return load_model(config, registries)


def check_reference(
    reference: Reference, registries: Registries, *, backend: str = "mlx_fast", atol: float = 1e-4
) -> None:
    """Raise AssertionError naming the first of these that differs from transformers: one-pass
    logits of each prompt; prefill of half, then one token at a time; both prompts prefilled alone,
    joined in a left-padded batch and decoded together; both prefilled together in one pass
    (right-aligned, the shorter after padding, as the engine prefills requests arriving together:
    where the model's caches are plain attention caches) and decoded together; a prefix-cache hit
    continued."""
    from mlxr_core.engine.prefix_cache import PrefixCache
    from mlxr_core.model.cache import plain_attention, prefill_together

    loaded = load_reference_model(reference, registries, backend)
    model, arch = loaded.model, loaded.arch
    prompts, expected = reference.prompts, reference.logits

    for ids, want in zip(prompts, expected, strict=True):
        _close(np.array(model(mx.array([ids]))[0]), want, atol, f"one pass over {len(ids)} tokens")

    ids, want = prompts[0], expected[0]
    half = len(ids) // 2
    cache = arch.make_cache(model)
    steps = [model(mx.array([ids[:half]]), cache=cache)]
    steps += [model(mx.array([[token]]), cache=cache) for token in ids[half:]]
    _close(np.array(mx.concatenate(steps, axis=1)[0]), want, atol, "cached decoding")

    prefill = [len(prompts[0]) - 6, len(prompts[1]) - 6]
    rows = []
    for ids, n in zip(prompts, prefill, strict=True):
        cache = arch.make_cache(model)
        model(mx.array([ids[:n]]), cache=cache)
        rows.append([layer.to_batch() for layer in cache])
    batch = rows[0]
    for layer, other in zip(batch, rows[1], strict=True):
        layer.extend(other)
    _decode_together(model, batch, prompts, expected, prefill, atol, "batched decoding")
    if plain_attention(arch.make_cache(model)):
        together = prefill_together(model, [ids[:n] for ids, n in zip(prompts, prefill, strict=True)], len(batch))
        _decode_together(model, together, prompts, expected, prefill, atol, "prefilled together, decoding")

    ids, want = prompts[0], expected[0]
    prefix = PrefixCache(max_bytes=1 << 24)
    cache = arch.make_cache(model)
    model(mx.array([ids[:16]]), cache=cache)
    prefix.store(ids[:16], cache)
    reused, caches = prefix.lookup(ids, limit=len(ids) - 1, make_cache=lambda: arch.make_cache(model))
    assert reused == 16 and caches is not None, f"the prefix cache reused {reused} tokens, not 16"
    _close(np.array(model(mx.array([ids[16:]]), cache=caches)[0]), want[16:], atol, "a prefix-cache hit")


def _decode_together(
    model: Any, batch: list[Any], prompts: list[list[int]], expected: list[np.ndarray], prefill: list[int],
    atol: float, what: str,
) -> None:
    """Six steps of the batch ``batch`` (row ``i`` holding ``prompts[i][:prefill[i]]``), each
    row's logits against transformers'."""
    from mlxr_core.model.cache import batch_mask

    for step in range(6):
        tokens = mx.array([[ids[n + step]] for ids, n in zip(prompts, prefill, strict=True)])
        out = np.array(model(tokens, cache=batch, mask=batch_mask(batch))[:, -1])
        for row, n in enumerate(prefill):
            _close(out[row], expected[row][n + step], atol, f"{what}, row {row}, step {step}")


def _close(got: np.ndarray, want: np.ndarray, atol: float, what: str) -> None:
    worst = float(np.abs(got - want).max())
    assert worst <= atol, f"{what}: logits differ from transformers' by up to {worst:.3g} (atol {atol})"
    assert (got.argmax(-1) == want.argmax(-1)).all(), f"{what}: the argmax differs from transformers'"


def transformers_greedy(model_class: str, folder: Path, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """``steps`` greedy tokens for each prompt from ``transformers.<model_class>`` saved in
    ``folder`` (float32, eager attention), each token from a full forward pass (no cache)."""
    import torch
    import transformers

    model = getattr(transformers, model_class).from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(steps):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outputs.append(ids[len(prompt) :])
    return outputs


def engine_greedy(
    folder: Path, prompts: list[list[int]], steps: int, *, prefill_chunk: int = 24, compiled: bool = True
) -> list[list[int]]:
    """``steps`` greedy tokens for each prompt from mlxr's engine serving ``folder`` (float32), the
    prompts submitted together (continuous batching, prompts prefilled in chunks of
    ``prefill_chunk``); with ``compiled``, raises AssertionError unless the model decodes through
    the compiled step (models with recurrent layers decode uncompiled)."""
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    model = ModelConfig(path=str(folder), name="tiny", dtype="float32", context_length=128)
    engine = Engine(
        Config(models=[model], engine=EngineConfig(max_batch_size=4, prefill_chunk=prefill_chunk)), load_plugins()
    )
    engine.start()
    try:
        assert engine.model("tiny").compiled_decode or not compiled, "the model does not decode through the compiled step"
        params = SamplingParams(temperature=0.0, max_tokens=steps, extra={"ignore_eos": True})
        handles = [engine.submit(GenerationRequest(model="tiny", prompt_ids=p, params=params)) for p in prompts]
        outputs = []
        for handle in handles:
            events = list(handle)
            assert isinstance(events[-1], Finished), events[-1]
            outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
    finally:
        engine.stop()
    return outputs
