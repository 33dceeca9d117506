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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from mlxr_core.config.schema import DTYPES
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
        "--prefill-chunk", type=_positive_int, default=512, metavar="N",
        help="prompt tokens per prefill step (engine.prefill_chunk)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``mlxr bench``: print the report as JSON on stdout."""
    report = bench(
        args.model,
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        repeat=args.repeat,
        dtype=args.dtype,
        kernels=dict(args.kernels),
        concurrency=args.concurrency,
        prefill_chunk=args.prefill_chunk,
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
    tokens: list[int] = []
    for event in handle:
        now = time.perf_counter()
        if isinstance(event, Delta) and event.token_ids:
            first = first or now
            last = now
            tokens.extend(event.token_ids)
        elif isinstance(event, Failed):
            raise event.error
        elif isinstance(event, Finished) and len(tokens) != gen_tokens:
            raise MlxrError(
                f"the engine generated {len(tokens)} of {gen_tokens} tokens (finish reason {event.reason!r})"
            )
    return StreamTiming(prompt_tokens, submitted, first, last, tuple(tokens))


def measure_concurrent(
    engine: Engine, model: str, prompts: Sequence[list[int]], gen_tokens: int
) -> list[StreamTiming]:
    """Submit one request per prompt at once and time each from its own consumer thread."""
    from mlxr_core.engine.request import GenerationRequest, SamplingParams

    handles = []
    for prompt_ids in prompts:
        request = GenerationRequest(
            model=model,
            prompt_ids=list(prompt_ids),
            params=SamplingParams(max_tokens=gen_tokens, temperature=0.0, extra={"ignore_eos": True}),
        )
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


def summarize_concurrent(timings: Sequence[StreamTiming], *, max_batch_size: int) -> dict[str, Any]:
    """Aggregate speed of streams submitted together, and whether the engine overlapped them."""
    generated = sum(len(t.tokens) for t in timings)
    decode_window = max(t.last_token for t in timings) - min(t.first_token for t in timings)
    wall = max(t.last_token for t in timings) - min(t.submitted for t in timings)
    windows = sorted((t.first_token, t.last_token) for t in timings)
    interleaved = any(later[0] < earlier[1] for earlier, later in itertools.pairwise(windows))
    return {
        "streams": len(timings),
        "engine_max_batch_size": max_batch_size,
        # False means the engine ran the requests one after another.
        "interleaved": interleaved,
        "generated_tokens": generated,
        "wall_s": wall,
        "throughput_tps": generated / wall,
        "aggregate_decode_tps": generated / decode_window,
        "ttft_s_mean": statistics.mean(t.ttft_s for t in timings),
        "ttft_s_max": max(t.ttft_s for t in timings),
        "per_stream_decode_tps": [t.decode_tps for t in timings],
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
    kernels: Mapping[str, str]
    model_bytes: int
    device: str
    platform: str


class _LoadObserver:
    """Records each model as the engine loads it (``mlxr_model_loaded`` runs on the engine thread)."""

    def __init__(self) -> None:
        self.models: dict[str, ModelSummary] = {}

    @hookimpl
    def mlxr_model_loaded(self, name: str, model: LoadedModel) -> None:
        from mlxr_core.kernels import current_platform

        device, platform = current_platform()
        self.models[name] = ModelSummary(
            name=name,
            path=str(model.path),
            format=model.format,
            model_type=str(model.config.get("model_type")),
            dtype=model.dtype,
            kernels=dict(model.kernels.chosen),
            model_bytes=model.nbytes,
            device=device,
            platform=platform,
        )


def start_engine(
    model: str,
    *,
    dtype: str = "auto",
    kernels: Mapping[str, str] | None = None,
    prefill_chunk: int = 512,
    max_queue: int = 64,
    context_length: int | None = None,
) -> tuple[Engine, ModelSummary]:
    """Start an engine serving ``model`` alone and wait until it is loaded."""
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins

    observer = _LoadObserver()
    config = Config(
        models=[
            ModelConfig(path=model, dtype=dtype, kernels=dict(kernels or {}), context_length=context_length)
        ],
        engine=EngineConfig(prefill_chunk=prefill_chunk, max_queue=max_queue),
    )
    engine = Engine(config, load_plugins(extra=[("mlxr-bench", observer)]))
    engine.start()
    (summary,) = observer.models.values()
    return engine, summary


def stop_engine(engine: Engine, timeout: float = 5.0) -> None:
    """Stop ``engine`` and wait until its OS thread has really exited.

    ``Thread.join`` returns before the thread's C++ thread-local destructors run; MLX's take the
    GIL, and if the interpreter is finalizing by then the process aborts ("terminate called without
    an active exception"). Waiting for the kernel task to vanish closes that window (Linux).
    """
    threads = [t for t in threading.enumerate() if t.name == "mlxr-engine"]
    engine.stop()
    deadline = time.monotonic() + timeout
    for thread in threads:
        if thread.is_alive() or thread.native_id is None:
            continue
        task = Path(f"/proc/self/task/{thread.native_id}")
        while task.exists() and time.monotonic() < deadline:
            time.sleep(0.001)


def bench(
    model: str,
    *,
    prompt_tokens: int = 128,
    gen_tokens: int = 128,
    repeat: int = 3,
    dtype: str = "auto",
    kernels: Mapping[str, str] | None = None,
    concurrency: int = 1,
    prefill_chunk: int = 512,
) -> dict[str, Any]:
    """Load ``model``, warm up once, time ``repeat`` single-stream runs (and one concurrent round
    when ``concurrency > 1``) and return the report :func:`run` prints."""
    import mlx.core as mx

    from mlxr_core.blas import ensure_fast_blas

    engine, summary = start_engine(
        model, dtype=dtype, kernels=kernels, prefill_chunk=prefill_chunk, max_queue=max(64, concurrency)
    )
    try:
        tokenizer = engine.model(summary.name).tokenizer
        prompt = synthetic_prompt(tokenizer, prompt_tokens)
        # Warm-up: the first run pays for allocations and lazy initialisation.
        measure_stream(engine, summary.name, prompt, min(gen_tokens, 8))
        mx.reset_peak_memory()
        runs = [measure_stream(engine, summary.name, prompt, gen_tokens) for _ in range(repeat)]
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
            "kernels": dict(summary.kernels),
            "prompt_tokens": prompt_tokens,
            "gen_tokens": gen_tokens,
            "repeat": repeat,
            "prefill_chunk": prefill_chunk,
            **summarize(runs),
            "model_bytes": summary.model_bytes,
        }
        if concurrency > 1:
            prompts = [synthetic_prompt(tokenizer, prompt_tokens, offset=7 * i) for i in range(concurrency)]
            timings = measure_concurrent(engine, summary.name, prompts, gen_tokens)
            report["concurrent"] = summarize_concurrent(
                timings, max_batch_size=engine.config.engine.max_batch_size
            )
        report["peak_memory_bytes"] = mx.get_peak_memory()
        return report
    finally:
        stop_engine(engine)
