"""examples/mlxr-gpt2-arch and examples/mlxr-kernel-override, pip-installed like third-party plugins.

Each is installed into its own virtualenv layered on the test environment (see
``test_example_plugin.py``, whose helpers this module reuses), then checked through
``mlxr plugins --json`` and through mlxr's own loading pipeline in that venv's interpreter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import venv
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_example_plugin import _wait_for_url, can_build_wheels_offline, mlxr

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TOKENIZER = Path(__file__).resolve().parent / "fixtures" / "tiny_hf" / "llama" / "tokenizer.json"
GPT2_CONFIG: dict[str, Any] = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "n_ctx": 64,
    "vocab_size": 400,
    "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu_new",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}
#: Token ids whose logits are compared with transformers.
IDS = [3, 17, 250, 42, 9, 399, 128, 7]


def install_example(root: Path, example: str) -> Path:
    """The python of a fresh venv under ``root``, layered on this environment, with ``example``
    (a folder of ``examples/``) pip-installed into its own site-packages."""
    if not can_build_wheels_offline():
        pytest.skip("pip cannot build the example offline: pip install -U 'setuptools>=70.1' (or wheel)")
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
    source = shutil.copytree(
        EXAMPLES / example, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info")
    )
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", str(source)],
        check=True, capture_output=True, text=True,
    )
    return python


def run_python(python: Path, script: str, cwd: Path) -> str:
    """Run ``script`` in ``python``; its stdout, or a test failure showing stderr."""
    result = subprocess.run(
        [python, "-c", textwrap.dedent(script)], capture_output=True, text=True, cwd=cwd, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def plugins_json(python: Path, cwd: Path) -> dict[str, dict[str, Any]]:
    result = mlxr(python, "plugins", "--json", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return {plugin["name"]: plugin for plugin in json.loads(result.stdout)}


# -- mlxr-gpt2-arch -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_example(tmp_path_factory.mktemp("gpt2-env"), "mlxr-gpt2-arch")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face GPT-2 folder with random weights in HF's layout (``Conv1D`` as ``[in, out]``)."""
    import mlx.core as mx

    folder = tmp_path_factory.mktemp("tiny-gpt2")
    D, V, P = GPT2_CONFIG["n_embd"], GPT2_CONFIG["vocab_size"], GPT2_CONFIG["n_positions"]
    rng = np.random.default_rng(0)

    def matrix(fan_in: int, fan_out: int) -> np.ndarray:
        return rng.standard_normal((fan_in, fan_out)).astype(np.float32) / np.sqrt(fan_in)

    def vector(n: int, around: float) -> np.ndarray:
        return (around + 0.1 * rng.standard_normal(n)).astype(np.float32)

    weights = {
        "transformer.wte.weight": matrix(V, D) * np.sqrt(V) / np.sqrt(D),
        "transformer.wpe.weight": 0.1 * matrix(P, D),
        "transformer.ln_f.weight": vector(D, 1.0),
        "transformer.ln_f.bias": vector(D, 0.0),
    }
    for n in range(int(GPT2_CONFIG["n_layer"])):
        prefix = f"transformer.h.{n}"
        for norm in ("ln_1", "ln_2"):
            weights[f"{prefix}.{norm}.weight"] = vector(D, 1.0)
            weights[f"{prefix}.{norm}.bias"] = vector(D, 0.0)
        for name, (fan_in, fan_out) in {
            "attn.c_attn": (D, 3 * D), "attn.c_proj": (D, D), "mlp.c_fc": (D, 4 * D), "mlp.c_proj": (4 * D, D),
        }.items():
            weights[f"{prefix}.{name}.weight"] = matrix(fan_in, fan_out)
            weights[f"{prefix}.{name}.bias"] = vector(fan_out, 0.0)
    mx.save_safetensors(
        str(folder / "model.safetensors"),
        {name: mx.array(array) for name, array in weights.items()},
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text(json.dumps(GPT2_CONFIG))
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def gpt2_loaded(gpt2_env: Path, tiny_gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Load the folder through mlxr's pipeline in the plugin's venv, run the conformance check on
    what loaded, and report the architecture, the kernels and the logits of :data:`IDS`."""
    out = tmp_path_factory.mktemp("gpt2-out")
    report = run_python(
        gpt2_env,
        f"""
        import json
        import mlx.core as mx
        import numpy as np
        from mlxr_core.config.schema import ModelConfig
        from mlxr_core.model.loader import load_model
        from mlxr_core.plugins import load_plugins
        from mlxr_core.testing.conformance import check_architecture

        loaded = load_model(ModelConfig(path={str(tiny_gpt2)!r}, dtype="float32"), load_plugins().registries)
        check_architecture(loaded.arch, loaded.config, loaded.kernels)
        logits = loaded.model(mx.array([{IDS!r}]))[0].astype(mx.float32)
        np.save({str(out / "logits.npy")!r}, np.array(logits))
        print(json.dumps({{
            "arch": type(loaded.arch).__module__ + ":" + type(loaded.arch).__qualname__,
            "kernels": dict(loaded.kernels.chosen),
            "context_length": loaded.context_length,
            "encoded": loaded.tokenizer.encode("the water"),
        }}))
        """,
        cwd=out,
    )
    return {**json.loads(report.splitlines()[-1]), "logits": np.load(out / "logits.npy")}


def test_gpt2_plugin_is_listed(gpt2_env: Path, tmp_path: Path) -> None:
    gpt2 = plugins_json(gpt2_env, tmp_path)["gpt2"]
    assert (gpt2["distribution"], gpt2["version"], gpt2["state"]) == ("mlxr-gpt2-arch", "0.1.0", "ok")
    assert gpt2["provides"] == {"archs": ["gpt2"]}


def test_gpt2_checkpoint_loads_and_conforms(gpt2_loaded: dict[str, Any]) -> None:
    assert gpt2_loaded["arch"] == "mlxr_gpt2_arch.gpt2:GPT2Architecture"
    assert set(gpt2_loaded["kernels"]) >= {"attention"}
    assert gpt2_loaded["context_length"] == GPT2_CONFIG["n_positions"]
    assert gpt2_loaded["encoded"]
    logits = gpt2_loaded["logits"]
    assert logits.shape == (len(IDS), GPT2_CONFIG["vocab_size"]) and np.isfinite(logits).all()
    assert logits.std() > 0.1  # random weights scaled for O(1) logits, not near-zero ones


def test_gpt2_matches_transformers(gpt2_loaded: dict[str, Any], tiny_gpt2: Path) -> None:
    """The same folder through transformers' own GPT-2 gives the same logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([IDS])).logits[0].numpy()
    # 2e-2 covers MLX's TF32-like float32 matmuls on a GPU; on CPU they agree to ~1e-5.
    np.testing.assert_allclose(gpt2_loaded["logits"], expected, atol=2e-2, rtol=0)


def test_gpt2_is_served(gpt2_env: Path, tiny_gpt2: Path, tmp_path: Path) -> None:
    """``mlxr serve`` loads the GPT-2 folder through the plugin and completes a prompt."""
    import httpx

    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {tiny_gpt2}\n    name: tiny-gpt2\napis: [openai]\n")
    process = subprocess.Popen(
        [gpt2_env, "-m", "mlxr_core.cli.main", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = _wait_for_url(process)
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny-gpt2", "prompt": "the water", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] > 0
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


# -- mlxr-kernel-override -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def override_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_example(tmp_path_factory.mktemp("override-env"), "mlxr-kernel-override")


def test_override_is_attributed(override_env: Path, tmp_path: Path) -> None:
    plugins = plugins_json(override_env, tmp_path)
    override = plugins["counting_rms_norm"]
    assert (override["distribution"], override["state"]) == ("mlxr-kernel-override", "ok")
    assert override["provides"] == {"kernels": ["rms_norm:reference"]}
    assert override["overrides"] == ["kernels:rms_norm:reference (from kernels)"]
    assert "kernels:rms_norm:reference (by counting_rms_norm)" in plugins["kernels"]["overridden"]
    # Only the one op is replaced: the built-in plugin still provides every other reference kernel.
    assert "attention:reference" in plugins["kernels"]["provides"]["kernels"]
    assert "rms_norm:reference" not in plugins["kernels"]["provides"]["kernels"]


def test_config_selecting_the_overridden_backend_checks(
    override_env: Path, tmp_path: Path, tiny_gguf: Path
) -> None:
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {tiny_gguf}\nkernels:\n  rms_norm: reference\n")
    result = mlxr(override_env, "config", "check", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OK:")


def test_selected_backend_is_the_override(override_env: Path, tmp_path: Path) -> None:
    """Binding ``rms_norm: reference`` gives the plugin's kernel, which matches the reference."""
    report = run_python(
        override_env,
        """
        import mlx.core as mx
        from mlxr_core.kernels import bind_kernels
        from mlxr_core.plugins import load_plugins
        from mlxr_plugins.kernels.reference import rms_norm
        import mlxr_kernel_override.kernels as counting

        kernels = bind_kernels(
            load_plugins().registries.kernels, dtype="float32", shapes={}, choices={"rms_norm": "reference"}
        )
        x, weight = mx.random.normal((2, 5, 16)), mx.random.normal((16,))
        same = mx.allclose(kernels.rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6)).item()
        print(kernels.chosen["rms_norm"], counting.calls, same)
        """,
        cwd=tmp_path,
    )
    assert report.split() == ["reference", "1", "True"]


if sys.platform == "win32":  # pragma: no cover - venv layout differs; mlxr targets macOS and Linux
    pytestmark = pytest.mark.skip("POSIX venv layout")


def test_the_override_passes_the_kernel_parity_check(override_env: Path, tmp_path: Path) -> None:
    report = run_python(
        override_env,
        """
        from mlxr_core.plugins import load_plugins
        from mlxr_core.testing.kernel_check import check_kernel_parity
        import mlxr_kernel_override.kernels as counting

        report = check_kernel_parity(load_plugins().registries.kernels, "rms_norm", "reference")
        print(len(report.ran), len(report.skipped), counting.calls == len(report.ran))
        """,
        cwd=tmp_path,
    )
    ran, skipped, counted = report.split()
    assert int(ran) >= 9 and skipped == "0" and counted == "True"


def test_serve_runs_on_the_override(override_env: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    """``mlxr serve`` with ``kernels: {rms_norm: reference}`` names the plugin at startup and
    answers through the overriding kernel."""
    import httpx

    config = tmp_path / "server.yaml"
    config.write_text(
        f"models:\n  - path: {tiny_gguf}\n    name: tiny\n    context_length: 128\n"
        "apis: [openai]\nkernels:\n  rms_norm: reference\n"
    )
    process = subprocess.Popen(
        [override_env, "-m", "mlxr_core.cli.main", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    startup: list[str] = []
    try:
        assert process.stdout is not None
        url = ""
        for line in process.stdout:
            startup.append(line)
            if match := re.search(r"serving .* at (http://\S+)", line):
                url = match[1]
                break
        assert url, "".join(startup)
        reply = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "the wine", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
    assert any("mlxr-kernel-override" in line for line in startup), "".join(startup)
