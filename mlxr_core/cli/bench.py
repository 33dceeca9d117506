"""``mlxr bench``: prompt and decode speed of one model through the real engine, printed as JSON.

The model is loaded by an :class:`~mlxr_core.engine.engine.Engine` exactly as ``mlxr serve`` loads
it, and timed from the caller's side of the request queue, as a client would see it:

- time to first token (TTFT): from ``submit`` to the first token's event; prompt tokens/s is the
  prompt length over TTFT (it includes the first forward pass that samples the first token);
- decode tokens/s: tokens after the first over the time from the first to the last token.

Prompts are ordinary text tokens and generation ignores EOS, so every run decodes exactly
``--gen-tokens`` tokens. The helpers here (:class:`StreamTiming`, :func:`summarize`,
:func:`synthetic_prompt`) are shared with ``bench/compare_mlx_lm.py`` so every peer is measured by
the same definitions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.config.schema import DTYPES, QUANTIZATION_POLICIES, EngineConfig
from mlxr_core.model.progress import step
from mlxr_core.plugins import hookimpl

if TYPE_CHECKING:
    from mlxr_core.engine.engine import Engine
    from mlxr_core.model.loader import LoadedModel
    from mlxr_core.model.tokenizer import Tokenizer

#: Tiled to the requested length: a prompt of ordinary words, not special or unused ids.
PROMPT_TEXT = (
    "The river town woke slowly. Bakers lit their ovens before dawn, fishermen checked their nets "
    "by lantern light, and the first ferry of the morning sounded its horn across the water. "
    "Children walked to school along the old stone bridge, counting the boats moored below, while "
    "the clock in the square struck seven and the market stalls opened one after another. "
)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _at_least_two(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 to time decoding, got {value}")
    return value


def _kernel_choice(text: str) -> tuple[str, str]:
    op, sep, backend = text.partition("=")
    if not sep or not op or not backend:
        raise argparse.ArgumentTypeError(f"expected OP=BACKEND (e.g. attention=reference), got {text!r}")
    return op.strip(), backend.strip()


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "bench",
        help="measure prompt and decode speed of a model (JSON)",
        description=(
            "Load MODEL through the engine, warm up once, then time --repeat runs of a synthetic "
            "prompt of --prompt-tokens tokens followed by --gen-tokens greedy tokens (EOS ignored). "
            "Prints JSON with medians over the runs."
        ),
    )
    parser.add_argument("model", help="a model file or folder, or pkg:DISTRIBUTION[/path]")
    parser.add_argument("--prompt-tokens", type=_positive_int, default=128, metavar="N")
    parser.add_argument("--gen-tokens", type=_at_least_two, default=128, metavar="N")
    parser.add_argument("--repeat", type=_positive_int, default=3, metavar="R")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="activation dtype (auto: float32 on CPU)")
    parser.add_argument(
        "--kernels", type=_kernel_choice, nargs="+", action="extend", default=[], metavar="OP=BACKEND",
        help="kernel backend per op, e.g. attention=reference",
    )
    parser.add_argument(
        "--concurrency", type=_positive_int, default=1, metavar="N",
        help="also submit N requests at once and report their aggregate speed",
    )
    parser.add_argument(
        "--quantization", choices=QUANTIZATION_POLICIES, default="auto",
        help="quantized weights: keep them packed, dequantize them, or auto (packed, but dequantized on a CPU without cpu_native)",
    )
    parser.add_argument(
        "--prefill-chunk", type=_positive_int, default=EngineConfig().prefill_chunk, metavar="N",
        help="prompt tokens per prefill step (engine.prefill_chunk)",
    )
    parser.add_argument(
        "--max-batch-size", type=_positive_int, default=EngineConfig().max_batch_size, metavar="N",
        help="requests decoded together (engine.max_batch_size)",
    )
    parser.add_argument(
        "--prefix-cache", action="store_true",
        help="keep the prefix cache on (repeated runs then skip most of the prefill)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``mlxr bench``: print the report as JSON on stdout (progress on a terminal's stderr)."""
    from mlxr_core.model.progress import enable

    enable()
    report = bench(
        args.model,
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        repeat=args.repeat,
        dtype=args.dtype,
        kernels=dict(args.kernels),
        concurrency=args.concurrency,
        quantization=args.quantization,
        prefill_chunk=args.prefill_chunk,
        max_batch_size=args.max_batch_size,
        prefix_cache=args.prefix_cache,
    )
    print(json.dumps(report, indent=2))
    return 0


# -- measuring ---------------------------------------------------------------------------------


@attrs.frozen
class StreamTiming:
    """When one request's events arrived, on :func:`time.perf_counter`'s clock."""

    prompt_tokens: int
    submitted: float
    first_token: float
    last_token: float
    tokens: tuple[int, ...]
    #: First and last token as the engine timed them (its ``Finished`` event): unlike the
    #: arrivals above, not delayed by a busy consumer thread.
    engine_window: tuple[float, float] = (0.0, 0.0)

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.submitted

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tps(self) -> float:
        return (len(self.tokens) - 1) / (self.last_token - self.first_token)

    def as_dict(self) -> dict[str, float]:
        return {
            "ttft_s": self.ttft_s,
            "prompt_tps": self.prompt_tps,
            "decode_tps": self.decode_tps,
        }


def summarize(runs: Sequence[StreamTiming]) -> dict[str, Any]:
    """Medians over ``runs`` (drift on shared machines makes the mean misleading), plus every run."""
    return {
        "prompt_tps": statistics.median(r.prompt_tps for r in runs),
        "decode_tps": statistics.median(r.decode_tps for r in runs),
        "ttft_s": statistics.median(r.ttft_s for r in runs),
        "runs": [r.as_dict() for r in runs],
    }


def synthetic_prompt(tokenizer: Tokenizer, length: int, *, offset: int = 0) -> list[int]:
    """Exactly ``length`` ids of ordinary English text (BOS first when the model wants it).

    ``offset`` starts the text that many tokens later, so concurrent streams share no prefix.
    """
    text_ids = [
        i for i in tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
        if i not in tokenizer.eos_token_ids and i != tokenizer.bos_token_id
    ]
    if not text_ids:
        raise ValueError("the tokenizer encodes the benchmark text to no ordinary tokens")
    head = [tokenizer.bos_token_id] if tokenizer.add_bos and tokenizer.bos_token_id is not None else []
    body_length = length - len(head)
    repeats = (offset + body_length) // len(text_ids) + 1
    body = (text_ids * repeats)[offset : offset + body_length]
    return (head + body)[:length]


def measure_stream(engine: Engine, model: str, prompt_ids: list[int], gen_tokens: int) -> StreamTiming:
    """Submit one greedy request that ignores EOS and time its events."""
    from mlxr_core.engine.request import GenerationRequest, SamplingParams

    request = GenerationRequest(
        model=model,
        prompt_ids=list(prompt_ids),
        params=SamplingParams(max_tokens=gen_tokens, temperature=0.0, extra={"ignore_eos": True}),
    )
    submitted = time.perf_counter()
    return _collect(engine.submit(request), submitted, len(prompt_ids), gen_tokens)


def _collect(handle: Any, submitted: float, prompt_tokens: int, gen_tokens: int) -> StreamTiming:
    from mlxr_core.engine.request import Delta, Failed, Finished
    from mlxr_core.errors import MlxrError

    first = last = 0.0
    window = (0.0, 0.0)
    tokens: list[int] = []
    for event in handle:
        now = time.perf_counter()
        if isinstance(event, Delta) and event.token_ids:
            first = first or now
            last = now
            tokens.extend(event.token_ids)
        elif isinstance(event, Failed):
            raise event.error
        elif isinstance(event, Finished):
            if len(tokens) != gen_tokens:
                raise MlxrError(
                    f"the engine generated {len(tokens)} of {gen_tokens} tokens (finish reason {event.reason!r})"
                )
            window = (event.first_token_at, event.finished_at)
    return StreamTiming(prompt_tokens, submitted, first, last, tuple(tokens), window)


def measure_concurrent(
    engine: Engine, model: str, prompts: Sequence[list[int]], gen_tokens: int, *, logprobs: int | None = None
) -> list[StreamTiming]:
    """Submit one request per prompt at once and time each from its own consumer thread
    (``logprobs``: each token's log-probability asked too, as an HTTP client may ask it)."""
    from mlxr_core.engine.request import GenerationRequest, SamplingParams

    handles = []
    for prompt_ids in prompts:
        params = SamplingParams(max_tokens=gen_tokens, temperature=0.0, logprobs=logprobs, extra={"ignore_eos": True})
        request = GenerationRequest(model=model, prompt_ids=list(prompt_ids), params=params)
        handles.append((time.perf_counter(), engine.submit(request)))
    results: list[StreamTiming | BaseException | None] = [None] * len(handles)

    def consume(index: int) -> None:
        submitted, handle = handles[index]
        try:
            results[index] = _collect(handle, submitted, len(prompts[index]), gen_tokens)
        except BaseException as exc:
            results[index] = exc

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(handles))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    timings = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        timings.append(result)
    return timings


def summarize_concurrent(rounds: Sequence[Sequence[StreamTiming]], *, max_batch_size: int) -> dict[str, Any]:
    """Aggregate speed of streams submitted together (medians over ``rounds``), and whether the
    engine actually overlapped them."""

    def aggregate(timings: Sequence[StreamTiming]) -> dict[str, Any]:
        generated = sum(len(t.tokens) for t in timings)
        last = max(t.last_token for t in timings)
        windows = sorted(t.engine_window for t in timings)
        return {
            "generated_tokens": generated,
            "wall_s": last - min(t.submitted for t in timings),
            "throughput_tps": generated / (last - min(t.submitted for t in timings)),
            "aggregate_decode_tps": generated / (last - min(t.first_token for t in timings)),
            "ttft_s_mean": statistics.mean(t.ttft_s for t in timings),
            "ttft_s_max": max(t.ttft_s for t in timings),
            "per_stream_decode_tps": [t.decode_tps for t in timings],
            "interleaved": any(b[0] < a[1] for a, b in itertools.pairwise(windows)),
        }

    runs = [aggregate(timings) for timings in rounds]
    medians = {
        key: statistics.median(run[key] for run in runs)
        for key in ("wall_s", "throughput_tps", "aggregate_decode_tps", "ttft_s_mean", "ttft_s_max")
    }
    return {
        "streams": len(rounds[0]),
        "engine_max_batch_size": max_batch_size,
        # False: the engine ran the requests one after another.
        "interleaved": all(run["interleaved"] for run in runs),
        "generated_tokens": runs[0]["generated_tokens"],
        **medians,
        "runs": [{k: v for k, v in run.items() if k != "interleaved"} for run in runs],
    }


# -- the engine --------------------------------------------------------------------------------


@attrs.frozen
class ModelSummary:
    """What the report says about the loaded model, read on the engine thread."""

    name: str
    path: str
    format: str
    model_type: str
    dtype: str
    #: "quantized" when any module kept packed weights, else "dense".
    weights: str
    kernels: Mapping[str, str]
    model_bytes: int
    device: str
    platform: str
    #: "compiled" or "eager" (``models[].compile_decode`` and whether the graph allows it).
    decode_step: str = "eager"


class _LoadObserver:
    """Records each model as the engine loads it (``mlxr_model_loaded`` runs while the engine waits)."""

    def __init__(self) -> None:
        self.models: dict[str, ModelSummary] = {}

    @hookimpl
    def mlxr_model_loaded(self, name: str, model: LoadedModel) -> None:
        import mlx.nn as nn

        from mlxr_core.kernels import current_platform

        device, platform = current_platform()
        packed = (nn.QuantizedLinear, nn.QuantizedEmbedding)
        quantized = any(isinstance(module, packed) for _, module in model.model.named_modules())
        self.models[name] = ModelSummary(
            name=name,
            path=str(model.path),
            format=model.format,
            model_type=str(model.config.get("model_type")),
            dtype=model.dtype,
            weights="quantized" if quantized else "dense",
            kernels=dict(model.kernels.chosen),
            model_bytes=model.nbytes,
            device=device,
            platform=platform,
            decode_step="compiled" if model.compiled_decode is not None else "eager",
        )


def start_engine(
    model: str,
    *,
    dtype: str = "auto",
    kernels: Mapping[str, str] | None = None,
    quantization: str = "auto",
    engine_config: EngineConfig | None = None,
) -> tuple[Engine, ModelSummary]:
    """Start an engine serving ``model`` alone and wait until it is loaded.

    ``engine_config`` defaults to the engine settings a benchmark wants: the defaults, with the prefix
    cache off so that repeating a prompt still prefills it.
    """
    from mlxr_core.config.schema import Config, ModelConfig, PrefixCacheConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins

    observer = _LoadObserver()
    config = Config(
        models=[
            ModelConfig(path=model, dtype=dtype, kernels=dict(kernels or {}), quantization=quantization)
        ],
        engine=engine_config or EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False)),
    )
    engine = Engine(config, load_plugins(extra=[("mlxr-bench", observer)]))
    with step(f"loading {model}"):
        engine.start()
    (summary,) = observer.models.values()
    return engine, summary


def bench(
    model: str,
    *,
    prompt_tokens: int = 128,
    gen_tokens: int = 128,
    repeat: int = 3,
    dtype: str = "auto",
    kernels: Mapping[str, str] | None = None,
    concurrency: int = 1,
    quantization: str = "auto",
    prefill_chunk: int | None = None,
    max_batch_size: int | None = None,
    prefix_cache: bool = False,
) -> dict[str, Any]:
    """Load ``model``, warm up once, time ``repeat`` single-stream runs (and ``repeat`` concurrent
    rounds when ``concurrency > 1``) and return the report :func:`run` prints."""
    import mlx.core as mx

    from mlxr_core.blas import ensure_fast_blas
    from mlxr_core.config.schema import PrefixCacheConfig

    defaults = EngineConfig()
    engine_config = EngineConfig(
        prefill_chunk=prefill_chunk or defaults.prefill_chunk,
        max_batch_size=max_batch_size or defaults.max_batch_size,
        max_queue=max(defaults.max_queue, concurrency),
        prefix_cache=PrefixCacheConfig(enabled=prefix_cache),
    )
    engine, summary = start_engine(
        model, dtype=dtype, kernels=kernels, quantization=quantization, engine_config=engine_config
    )
    try:
        tokenizer = engine.model(summary.name).tokenizer
        prompt = synthetic_prompt(tokenizer, prompt_tokens)
        # Warm-up: the first run pays for allocations and lazy initialisation.
        with step("warming up"):
            measure_stream(engine, summary.name, prompt, min(gen_tokens, 8))
        mx.reset_peak_memory()
        runs = []
        with step(f"{prompt_tokens} prompt + {gen_tokens} generated tokens, run", total=repeat) as advance:
            for _ in range(repeat):
                runs.append(measure_stream(engine, summary.name, prompt, gen_tokens))
                advance()
        report: dict[str, Any] = {
            "model": model,
            "path": summary.path,
            "format": summary.format,
            "model_type": summary.model_type,
            "device": summary.device,
            "backend": summary.platform,
            "blas": ensure_fast_blas() if summary.device == "cpu" else None,
            "mlx_version": version("mlx"),
            "dtype": summary.dtype,
            "quantization": quantization,
            "weights": summary.weights,
            "kernels": dict(summary.kernels),
            "decode_step": summary.decode_step,
            "prompt_tokens": prompt_tokens,
            "gen_tokens": gen_tokens,
            "repeat": repeat,
            "prefill_chunk": engine_config.prefill_chunk,
            "prefix_cache": prefix_cache,
            **summarize(runs),
            "peak_memory_bytes": mx.get_peak_memory(),
            "model_bytes": summary.model_bytes,
        }
        if concurrency > 1:
            # Distinct prompts: no shared prefix even with the prefix cache on.
            prompts = [synthetic_prompt(tokenizer, prompt_tokens, offset=7 * i) for i in range(concurrency)]
            with step(f"warming up {concurrency} concurrent streams"):
                measure_concurrent(engine, summary.name, prompts, min(gen_tokens, 8))
            mx.reset_peak_memory()
            rounds = []
            with step(f"{concurrency} concurrent streams, round", total=repeat) as advance:
                for _ in range(repeat):
                    rounds.append(measure_concurrent(engine, summary.name, prompts, gen_tokens))
                    advance()
            report["concurrent"] = summarize_concurrent(
                rounds, max_batch_size=engine_config.max_batch_size
            )
            report["concurrent"]["peak_memory_bytes"] = mx.get_peak_memory()
        return report
    finally:
        engine.stop()
