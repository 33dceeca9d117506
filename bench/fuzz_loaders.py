"""The loaders' semantic fuzzer at scale: valid GGUF files and ``config.json`` folders with absurd
values in every key the loaders read (one key at a time, then seeded pairs), loaded through the
whole pipeline in child processes (:mod:`mlxr_core.testing.loader_fuzz`). Prints a JSON summary:
outcomes, problems (internal errors, non-finite logits, errors naming no key or file, memory past
twice the file), any child that died, and the largest peak-memory growth. ``--templates N`` also
renders N mutated chat templates (:mod:`mlxr_core.testing.template_fuzz`).

    python bench/fuzz_loaders.py --cases 2000 --templates 1000 --out bench/results/fuzz_loaders_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from mlxr_core.testing import loader_fuzz as fuzz
from mlxr_core.testing.tiny import write_tiny_llama_gguf

HF_LLAMA = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny_hf" / "llama"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=250, help="files per child process")
    parser.add_argument("--templates", type=int, default=0, help="mutated chat templates to render")
    parser.add_argument("--render-seconds", type=float, default=0.5,
                        help="the render deadline while fuzzing templates (the server's is 5 s): "
                             "what is checked is that a render stops at it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    started = time.perf_counter()
    cases = fuzz.all_cases(args.cases, args.seed)[: args.cases]
    results: Counter[str] = Counter()
    found: list[str] = []
    deaths: list[str] = []
    grew = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        good = write_tiny_llama_gguf(root / "good.gguf")
        warm = fuzz.warmups(good, HF_LLAMA, root)
        for start in range(0, len(cases), args.batch):
            batch = cases[start : start + args.batch]
            paths = {fuzz.write_case(c, good, HF_LLAMA, root / f"case{start + i}"): c for i, c in enumerate(batch)}
            outcomes, death = fuzz.load_in_child(warm, list(paths), forward=True, timeout=3600)
            if death:
                deaths.append(death)
            results.update(o["result"] for o in outcomes.values())
            found += fuzz.problems(paths, outcomes)
            grew = max([grew, *(o["grew"] for o in outcomes.values())])
            print(f"{start + len(batch)}/{len(cases)} files, {len(found)} problems", file=sys.stderr, flush=True)
    template_problems = templates(args.templates, args.seed, args.render_seconds) if args.templates else []
    report = {
        "cases": len(cases),
        "kinds": dict(Counter(c.kind for c in cases)),
        "outcomes": dict(results),
        "problems": found,
        "children_died": deaths,
        "largest_peak_memory_growth_bytes": grew,
        "templates": args.templates,
        "render_deadline_seconds": args.render_seconds if args.templates else None,
        "template_problems": template_problems,
        "seconds": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if found or deaths or template_problems else 0


def templates(count: int, seed: int, seconds: float) -> list[str]:
    """Problems rendering ``count`` mutated templates (the shipped ones as the seed material)
    under a render deadline of ``seconds``."""
    from mlxr_core.model import chat_template
    from mlxr_core.testing import template_fuzz
    from mlxr_plugins.archs.gemma3 import Gemma3Architecture
    from mlxr_plugins.parsers.harmony_template import HARMONY_CHAT_TEMPLATE

    sources = [t for t in (Gemma3Architecture().default_chat_template({}), HARMONY_CHAT_TEMPLATE) if t]
    chat_template.MAX_RENDER_SECONDS = seconds
    found = []
    for case in template_fuzz.template_cases(sources, count, seed):
        problem = template_fuzz.judge(case, slack=1.0)
        if problem:
            found.append(f"{case[:200]!r}: {problem}")
    return found


if __name__ == "__main__":
    raise SystemExit(main())
