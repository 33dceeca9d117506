"""The tutorials in docs/ work when followed verbatim.

Each tutorial's ``bash`` blocks run, in order and unchanged, as one script in an empty folder, in a
fresh virtualenv layered on this one (a ``.pth`` file adds this interpreter's site-packages, so
mlxr and its dependencies are there as they would be after ``pip install mlxr``; the plugin is
pip-installed into the new venv). Offline, pip is told through its environment not to reach an
index nor to build in isolation: the commands themselves are the reader's.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def shell_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", markdown, flags=re.MULTILINE | re.DOTALL)


def layered_venv(root: Path) -> Path:
    """A venv at ``root`` whose interpreter also sees this environment's packages; its bin folder."""
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site_packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    parents = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site_packages) / "_mlxr_test_parent.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
    )
    # The venv's own `pip` and `mlxr` (pip and mlxr's modules come from the parent): without them
    # the parent's scripts would be found on PATH and install into, and read, the parent.
    for script, module in (("pip", "pip"), ("mlxr", "mlxr_core.cli.main")):
        path = root / "bin" / script
        path.write_text(f'#!/bin/sh\nexec "{python}" -m {module} "$@"\n')
        path.chmod(0o755)
    return root / "bin"


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def can_build_wheels_offline() -> bool:
    import importlib.util

    import setuptools
    from packaging.version import Version

    # setuptools builds wheels by itself from 70.1; before, it needs the `wheel` package.
    return Version(setuptools.__version__) >= Version("70.1") or importlib.util.find_spec("wheel") is not None


def run_tutorial(name: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    if not can_build_wheels_offline():
        pytest.skip("pip cannot build offline: pip install -U 'setuptools>=70.1' (or wheel)")
    text = (DOCS / name).read_text()
    for port in set(re.findall(r"127\.0\.0\.1:(\d+)", text)):
        if not port_is_free(int(port)):
            pytest.skip(f"port {port}, which the tutorial serves on, is taken")
    blocks = shell_blocks(text)
    assert blocks, f"{name} has no bash blocks"
    bin_dir = layered_venv(tmp_path / "venv")
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "VIRTUAL_ENV": str(bin_dir.parent),
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",  # pip's spelling of "do not isolate the build"
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    env.pop("PYTHONPATH", None)
    script = "set -euo pipefail\n" + "\n".join(blocks)
    result = subprocess.run(
        ["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    # The plugin went into the tutorial's venv, not into the environment running the tests.
    from mlxr_core.plugins import load_plugins

    assert not [p for p in load_plugins().plugins.values() if p.state == "failed"]
    return result


@pytest.mark.slow
def test_architecture_tutorial(tmp_path):
    result = run_tutorial("tutorial-architecture-plugin.md", tmp_path)
    out = result.stdout
    assert "{'archs': ['scaled_llama']}" in out  # mlxr plugins --json
    assert "scaled_llama" in out.split("{'archs'")[0]  # the table
    assert re.search(r"\b2 passed\b", out)  # the conformance tests
    completion = re.search(r'\{"id":.*"object":"text_completion".*\}', out)
    assert completion and '"completion_tokens":5' in completion[0]
    assert "mlxr-scaled-llama 0.1.0: scaled_llama" in out  # the server's plugin log line


@pytest.mark.slow
def test_api_tutorial(tmp_path):
    out = run_tutorial("tutorial-api-plugin.md", tmp_path).stdout
    assert "['GET /v1/ping', 'POST /v1/count']" in out
    assert '{"ok":true,"models":["tiny"]}' in out
    assert re.search(r'\{"ok":true,"tokens":\d+\}', out)
    assert re.search(r'\{"ok":false,"error":"[^"]*nope[^"]*"\}', out)
