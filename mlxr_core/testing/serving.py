"""Starting ``mlxr serve`` (or ``mlxr launch``) as a subprocess for tests and benchmarks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path


def serve_command(config: Path, *, command: str = "serve") -> list[str]:
    """``mlxr serve`` (or ``mlxr launch``) of ``config`` on a free port, with this interpreter."""
    return [sys.executable, "-m", "mlxr_core.cli.main", command, "--config", str(config), "--port", "0"]


def start(
    command: list[str], timeout: float = 120, *, new_session: bool = False
) -> tuple[subprocess.Popen[str], str, list[str]]:
    """``command`` (an ``mlxr serve`` or ``mlxr launch``) once it prints its serving line: the
    process, its URL and the lines it printed (still filled by a reader thread). With
    ``new_session``, it leads a process group of its own (a signal to the group reaches its
    children too, as a terminal's Ctrl-C does).

    :raises RuntimeError: with what it printed, when it ends or does not become ready in time.
    """
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=new_session,
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if "serving" in line and "http://" in line:
                ready.set()
        ready.set()  # it ended

    threading.Thread(target=read, daemon=True).start()
    ready.wait(timeout)
    serving = [line for line in lines if "serving" in line and "http://" in line]
    if not serving:
        process.kill()
        raise RuntimeError("the server did not become ready:\n" + "".join(lines))
    url = re.search(r"at (http://\S+)", serving[0])
    assert url is not None
    return process, url[1], lines
