"""How long ``mlxr plugins`` takes with 20 third-party plugins installed, and whether it imports MLX.

Writes 20 fake installed distributions (a ``*.dist-info`` with an ``mlxr`` entry point, and a module
registering an architecture, a format, a kernel and a sampler by ``"module:attr"`` string, as a
well-behaved plugin does) into a temporary site folder, then runs ``mlxr plugins --json`` in a
subprocess with that folder on ``PYTHONPATH``, several times, and reports the median wall time
(interpreter start included) and the same for ``mlxr plugins`` alone without the fake plugins. A
last run asks the interpreter, after listing the plugins, whether ``mlx`` is in ``sys.modules``.

    python bench/plugins_startup.py [--runs 7] [--out bench/results/plugins_startup_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlxr_core.testing.fake_dist import write_fake_dist

PLUGIN = """
    from mlxr_core.plugins import hookimpl

    MLXR_HOOK_API = "1"

    @hookimpl
    def mlxr_register_archs(register):
        register("bench_arch_{i}", "mlxr_bench_{i}.model:Architecture")

    @hookimpl
    def mlxr_register_formats(register):
        register("bench_format_{i}", "mlxr_bench_{i}.model:Format")

    @hookimpl
    def mlxr_register_kernels(register):
        register("rms_norm", "bench_{i}", "mlxr_bench_{i}.model:kernel")

    @hookimpl
    def mlxr_register_samplers(register):
        register("bench_sampler_{i}", "mlxr_bench_{i}.model:make")
"""
#: Runs ``mlxr plugins`` in-process, then reports whether MLX got imported on the way.
PROBE = (
    "import contextlib, io, sys; from mlxr_core.cli.main import main\n"
    "with contextlib.redirect_stdout(io.StringIO()): code = main(['plugins', '--json'])\n"
    "print(code, 'mlx' in sys.modules, 'mlx.core' in sys.modules)"
)


def timed_runs(env: dict[str, str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "mlxr_core.cli.main", "plugins", "--json"],
            env=env, check=True, capture_output=True,
        )
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plugins", type=int, default=20)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mlxr-bench-plugins-") as site:
        for i in range(args.plugins):
            write_fake_dist(
                site, f"mlxr-bench-{i}", version="1.0.0",
                modules={f"mlxr_bench_{i}": PLUGIN.replace("{i}", str(i))},
                entry_points={f"bench_{i}": f"mlxr_bench_{i}"},
            )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
        listed = json.loads(
            subprocess.run(
                [sys.executable, "-m", "mlxr_core.cli.main", "plugins", "--json"],
                env=env, check=True, capture_output=True, text=True,
            ).stdout
        )
        fake = [p for p in listed if p["name"].startswith("bench_")]
        assert len(fake) == args.plugins and all(p["state"] == "ok" for p in fake), fake
        with_plugins = timed_runs(env, args.runs)
        probe = subprocess.run(
            [sys.executable, "-c", PROBE], env=env, check=True, capture_output=True, text=True
        ).stdout.split()
    baseline = timed_runs({**os.environ}, args.runs)
    bare_python = []
    for _ in range(args.runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        bare_python.append(time.perf_counter() - started)

    result = {
        "command": f"python bench/plugins_startup.py --plugins {args.plugins} --runs {args.runs}",
        "plugins_installed": len(listed),
        "third_party_plugins": len(fake),
        "runs": args.runs,
        "median_s": round(statistics.median(with_plugins), 4),
        "median_s_builtin_only": round(statistics.median(baseline), 4),
        "median_s_bare_python": round(statistics.median(bare_python), 4),
        "exit_code": int(probe[0]),
        "mlx_imported": probe[1] == "True",
        "mlx_core_imported": probe[2] == "True",
        "times_s": [round(t, 4) for t in with_plugins],
        # Shared machines: a load above the core count inflates every figure here.
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
