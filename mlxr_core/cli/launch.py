"""``mlxr launch``: start the ranks of a distributed config through ``mlx.launch``.

A thin helper: it reads ``distributed:`` from the config and replaces itself with
``mlx.launch [--backend B] (-n N | --hosts ... | --hostfile F) [--starting-port P] -- python -m
mlxr_core.cli.main serve --config FILE``; ``--dry-run`` prints that command instead. Each rank then
runs ``mlxr serve``, which joins the group (:mod:`mlxr_core.distributed`); rank 0 serves HTTP.
``mlx.launch`` relays every rank's output and stops the others when one fails, but itself exits 0
whatever its ranks did; ``mlxr launch`` reads its report of each rank (``Node with rank N exited
with code C`` / ``was killed``) as it relays it and exits non-zero when a rank failed.

Ranks started on this machine share its cores: each gets ``OPENBLAS_NUM_THREADS`` of its share
(unless set), since OpenBLAS otherwise starts a busy-waiting thread per core in every rank, and
two SmolLM2 pipeline stages on 2 cores ran each stage's layers in 2.3 s instead of 0.4 s, a step
past ``distributed.step_timeout_s``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from mlxr_core.config.schema import LOG_LEVELS, DistributedConfig
from mlxr_core.errors import ConfigError, MlxrError


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``launch`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "launch",
        help="serve across several processes: start every rank of distributed: through mlx.launch",
        description=(
            "Start distributed.tensor_parallel x distributed.pipeline_parallel ranks of `mlxr serve "
            "--config FILE` through MLX's mlx.launch (its backend, hosts or hostfile from the config's "
            "distributed: section). Rank 0 serves HTTP."
        ),
    )
    parser.add_argument("--config", metavar="FILE", required=True, help="server config (YAML)")
    parser.add_argument("--host", help="address rank 0 binds (server.host)")
    parser.add_argument("--port", type=int, help="port rank 0 binds (server.port)")
    parser.add_argument(
        "--log-level", type=str.lower, choices=LOG_LEVELS, metavar="LEVEL",
        help=f"log level of every rank: {', '.join(LOG_LEVELS)} (server.log_level)",
    )  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="print the mlx.launch command, run nothing")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from mlxr_core.config.loader import load_config

    config = load_config(args.config)  # a bad config fails here, before any rank starts
    command = launch_command(
        config.distributed,
        config_path=str(Path(args.config).resolve()),
        serve_flags=[
            flag
            for name, value in (("--host", args.host), ("--port", args.port), ("--log-level", args.log_level))
            if value is not None
            for flag in (name, str(value))
        ],
    )
    if args.dry_run:
        print(shlex.join(command))
        return 0
    sys.stdout.flush()
    return run_ranks(command, {**os.environ, **thread_limits(config.distributed, os.environ)})


#: How ``mlx.launch`` reports a rank that failed (on its standard error).
RANK_FAILED = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")


def run_ranks(command: list[str], env: Mapping[str, str]) -> int:
    """Run ``mlx.launch``, relaying its standard error, and return non-zero when it reported a
    failed rank (the first failed rank's code, 1 for a killed one) or itself failed."""
    failed = 0
    with subprocess.Popen(command, env=dict(env), stderr=subprocess.PIPE) as launcher:
        assert launcher.stderr is not None
        for line in iter(launcher.stderr.readline, b""):
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            found = RANK_FAILED.search(line.decode(errors="replace"))
            if found and not failed:
                failed = int(found.group(2) or 1) or 1
    return failed or launcher.returncode


def launch_command(distributed: DistributedConfig, *, config_path: str, serve_flags: list[str]) -> list[str]:
    """The ``mlx.launch`` command line starting every rank of ``distributed``."""
    size = distributed.world_size
    if size == 1:
        raise ConfigError(
            "distributed.tensor_parallel and pipeline_parallel are both 1: there is one process to "
            "start; run `mlxr serve --config FILE` (or raise distributed.tensor_parallel)",
            field="distributed.tensor_parallel",
        )
    if distributed.hosts and len(distributed.hosts) != size:
        raise ConfigError(
            f"distributed.hosts: lists {len(distributed.hosts)} hosts for {size} ranks "
            "(tensor_parallel x pipeline_parallel); list one host per rank",
            field="distributed.hosts",
        )
    command = [_mlx_launch()]
    if distributed.backend != "auto":
        command += ["--backend", distributed.backend]
    if distributed.hostfile is not None:
        command += ["--hostfile", str(Path(distributed.hostfile).resolve())]
    elif distributed.hosts:
        command += ["--hosts", ",".join(distributed.hosts)]
    else:
        command += ["--hosts", "127.0.0.1", "-n", str(size)]
    command += ["--starting-port", str(distributed.port), "--cwd", os.getcwd()]
    command += ["--", sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", config_path]
    return command + serve_flags


#: Addresses that start a rank on this machine.
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def thread_limits(distributed: DistributedConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment each rank of ``distributed`` started on this machine needs: its share of
    the cores for OpenBLAS (``OPENBLAS_NUM_THREADS``) unless ``environ`` sets it, or nothing when
    the ranks run on other hosts."""
    local = distributed.hostfile is None and all(host in LOCAL_HOSTS for host in distributed.hosts or ())
    if not local or "OPENBLAS_NUM_THREADS" in environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"OPENBLAS_NUM_THREADS": str(max(1, cores // distributed.world_size))}


def _mlx_launch() -> str:
    """The ``mlx.launch`` script of this Python's MLX (beside the interpreter), else on PATH."""
    beside = Path(sys.executable).parent / "mlx.launch"
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if found is None:
        raise MlxrError("mlx.launch is not installed beside this Python; it comes with MLX (pip install mlx)")
    return found
