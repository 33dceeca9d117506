"""The constraint fuzzer at full size: every family of :mod:`mlxr_core.testing.constraint_fuzz`
(JSON schema ``$defs`` chains and nesting, Lark and GBNF rule chains, sequences and alternatives,
regular expressions, choice lists) doubled until refused, through an engine serving a tiny model in
a child process, with the default ``engine.constraint_limits`` or their ceilings, in either engine
mode. Prints a JSON summary: cases, refusals by limit, the slowest case, problems (a child that
died, a 500, a panic or backtrace told, a case past the time bound, a family never refused).

    python bench/fuzz_constraints.py --core thread --limits default --out bench/results/fuzz_constraints_cpu.json
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from collections import Counter
from pathlib import Path

import attrs

from mlxr_core.engine.constraint_limits import CEILINGS
from mlxr_core.testing import constraint_fuzz as fuzz
from mlxr_core.testing.tiny import write_tiny_llama_gguf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--core", choices=["thread", "process"], action="append")
    parser.add_argument("--limits", choices=["default", "ceilings"], default="default")
    parser.add_argument("--bound", type=float, default=None, help="seconds a case may take (default: the compile timeout + 5)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    limits = attrs.asdict(CEILINGS) if args.limits == "ceilings" else {}
    if args.limits == "ceilings":
        limits["compile_timeout_s"] = 10.0
    bound = args.bound or limits.get("compile_timeout_s", 10.0) + 5.0
    report: dict[str, object] = {"limits": args.limits, "bound_seconds": bound}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_llama_gguf(Path(tmp) / "tiny.gguf")
        for core in args.core or ["thread", "process"]:
            started = time.perf_counter()
            outcomes, death = fuzz.run_in_child(str(model), core=core, limits=limits, timeout=3600)
            found = fuzz.problems(outcomes, bound=bound)
            refused_by = Counter(
                (re.search(r"constraint_limits\.(\w+)", o["message"]) or re.search(r"^(.{0,40})", o["message"])).group(1)  # type: ignore[union-attr]
                for o in outcomes if o["result"] != "accepted"
            )  # fmt: skip
            slowest = max(outcomes, key=lambda o: o["seconds"], default=None)
            report[core] = {
                "cases": len(outcomes),
                "accepted": sum(o["result"] == "accepted" for o in outcomes),
                "refused_by": dict(refused_by),
                "largest_accepted": {f: max((o["n"] for o in outcomes if o["family"] == f and o["result"] == "accepted"),
                                            default=0) for f in fuzz.FAMILIES},
                "slowest": slowest,
                "problems": found,
                "child_died": death,
                "seconds": round(time.perf_counter() - started, 1),
            }  # fmt: skip
            failed = failed or bool(found or death)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
