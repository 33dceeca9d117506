"""``mlxr generate MODEL PROMPT``: load one model through the engine and stream a completion.

The text goes to stdout as it is generated (nothing else does, so it can be piped); ``--stats``
prints token counts and speed to stderr. The model is loaded exactly as ``mlxr serve`` loads it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlxr_core.cli.commands import Subparsers
from mlxr_core.config.schema import DTYPES
from mlxr_core.errors import MlxrError

if TYPE_CHECKING:
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Finished


def _number(kind: Callable[[str], float], *, low: float, high: float | None = None, low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        too_low = value <= low if low_open else value < low
        if too_low or (high is not None and value > high):
            bounds = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"must be in {bounds}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def add_parser(subparsers: Subparsers) -> None:
    """Add the ``generate`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text from a prompt with one model (streams to stdout)",
        description=(
            "Load MODEL and stream a completion of PROMPT to stdout. With a chat template (the "
            "default when the model has one) PROMPT is sent as a user message."
        ),
    )
    parser.add_argument("model", metavar="MODEL", help="a model file or folder, or pkg:DISTRIBUTION[/path]")
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt; - reads it from stdin")
    parser.add_argument("--max-tokens", type=_number(int, low=1), default=256, metavar="N",
                        help="tokens to generate at most (default 256)")
    parser.add_argument("--temperature", type=_number(float, low=0.0, high=2.0), default=0.0, metavar="T",
                        help="sampling temperature; 0 is greedy (default 0)")
    parser.add_argument("--top-p", type=_number(float, low=0.0, high=1.0, low_open=True), default=1.0, metavar="P")
    parser.add_argument("--top-k", type=_number(int, low=0), default=0, metavar="K", help="0: off")
    parser.add_argument("--min-p", type=_number(float, low=0.0, high=1.0), default=0.0, metavar="P")
    parser.add_argument("--seed", type=int, help="random seed, for a reproducible sampled completion")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop before this text (repeatable)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="apply the model's chat template (default: when the model has one)")
    parser.add_argument("--system", metavar="TEXT", help="a system message (with --chat)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="activation dtype (auto: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--stats", action="store_true", help="print token counts and speed to stderr")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handle ``mlxr generate``."""
    from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, SamplingConfig
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Failed, Finished, GenerationRequest, SamplingParams
    from mlxr_core.model.progress import enable, step
    from mlxr_core.plugins import load_plugins

    enable()  # spinners on stderr until the first token, on a terminal only
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = Config(
        models=[ModelConfig(path=args.model, dtype=args.dtype)],
        engine=EngineConfig(default_max_tokens=args.max_tokens),
        sampling=SamplingConfig(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p
        ),
    )
    engine = Engine(config, load_plugins())
    with step(f"loading {args.model}"):
        engine.start()
    waiting = contextlib.ExitStack()
    try:
        (name,) = engine.models
        prompt_ids = _encode(engine, name, prompt, chat=args.chat, system=args.system)
        sampling = config.sampling
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            seed=args.seed,
            stop=list(args.stop),
        )
        started = time.perf_counter()
        handle = engine.submit(GenerationRequest(model=name, prompt_ids=prompt_ids, params=params))
        waiting.enter_context(step(f"reading the prompt ({len(prompt_ids)} tokens)"))
        text_ended_with_newline = True
        try:
            for event in handle:
                waiting.close()  # the spinner goes before the text comes
                if isinstance(event, Delta) and event.text:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                    text_ended_with_newline = event.text.endswith("\n")
                elif isinstance(event, Failed):
                    raise event.error
                elif isinstance(event, Finished):
                    if not text_ended_with_newline:
                        sys.stdout.write("\n")
                    sys.stdout.flush()
                    if args.stats:
                        _print_stats(event, time.perf_counter() - started)
        except KeyboardInterrupt:
            handle.cancel()
            raise
    finally:
        waiting.close()
        engine.stop()
    return 0


def _encode(engine: Engine, name: str, prompt: str, *, chat: bool | None, system: str | None) -> list[int]:
    """The prompt's token ids, through the chat template when ``chat`` (None: if the model has one)."""
    tokenizer = engine.model(name).tokenizer
    if chat is None:
        chat = bool(tokenizer.chat_template)
    if not chat:
        if system:
            raise MlxrError("--system needs the chat template (drop --no-chat)")
        return engine.encode(name, prompt)
    if not tokenizer.chat_template:
        raise MlxrError(f"the model {name!r} has no chat template; use --no-chat for raw completion")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    from mlxr_core.chat.prompt import encode_chat

    return encode_chat(engine.model(name), messages)


def _print_stats(finished: Finished, wall_s: float) -> None:
    usage = finished.usage
    decode_s = finished.total_s - finished.ttft_s
    decode_tps = (usage.completion_tokens - 1) / decode_s if usage.completion_tokens > 1 and decode_s > 0 else 0.0
    print(
        f"prompt: {usage.prompt_tokens} tokens, {usage.prompt_tokens / finished.ttft_s:.1f} tok/s "
        f"(first token after {finished.ttft_s:.3f} s); completion: {usage.completion_tokens} tokens, "
        f"{decode_tps:.1f} tok/s; finish: {finished.reason}; wall {wall_s:.2f} s",
        file=sys.stderr,
    )
