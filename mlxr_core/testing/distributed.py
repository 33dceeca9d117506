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
    """``{rank: pid}`` of the processes ``mlx.launch`` started on this machine under process
    ``launcher_pid`` (``mlxr launch``, whose child ``mlx.launch`` is, or ``mlx.launch`` itself),
    read from ``/proc`` (Linux): the first processes down the tree that carry ``MLX_RANK``."""
    found: dict[int, int] = {}
    parents = [launcher_pid]
    while parents:
        pid = parents.pop()
        try:
            children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(e[len(b"MLX_RANK=") :]) for e in environ if e.startswith(b"MLX_RANK=")), None)
            if rank is None:
                parents.append(child)
            else:
                found[rank] = child
    return found
