"""Starting ranks of the ring backend on loopback for tests and benchmarks."""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on 127.0.0.1 now (the ring backend
    listens on one per rank, counting up from ``--starting-port``)."""
    for _ in range(200):
        first = random.randrange(20000, 60000 - count)
        sockets = []
        try:
            for port in range(first, first + count):
                listener = socket.socket()
                sockets.append(listener)
                listener.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for listener in sockets:
                listener.close()
    raise RuntimeError(f"no {count} consecutive free ports found on 127.0.0.1")


def mlx_launch(ranks: int, port: int, backend: str = "ring") -> list[str]:
    """``mlx.launch`` starting ``ranks`` processes of ``backend`` on 127.0.0.1 (with ``nccl``,
    one GPU each); append the command each rank runs."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    start = [str(launcher)] if launcher.exists() else [
        sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]
    ports = ["--starting-port", str(port)] if backend == "ring" else ["--nccl-port", str(port)]
    return [*start, "--backend", backend, "--hosts", "127.0.0.1", "-n", str(ranks), *ports, "--"]


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the processes ``mlx.launch`` (process ``launcher_pid``) started on this
    machine, read from ``/proc`` (Linux)."""
    found = {}
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for entry in environ:
                if entry.startswith(b"MLX_RANK="):
                    found[int(entry[len(b"MLX_RANK=") :])] = int(child)
    return found
