"""pytest fixtures for mlxr and its plugins (registered through the ``pytest11`` entry point).

- ``fake_plugin_dist``: write a fake installed plugin distribution and put it on the import path
  (``sys.path`` for this process; ``dist.env()`` gives the environment for a subprocess).
- ``tiny_gguf``: the path of a tiny random llama GGUF, written once per session.
- ``plugin_host``: a freshly loaded :class:`~mlxr_core.plugins.PluginHost` (entry points of this
  environment, fake distributions of the test included).
- ``tiny_model``: ``tiny_model(model_type)``, a tiny random module of any registered architecture
  (:data:`~mlxr_core.testing.conformance.TINY_CONFIG` shapes, reference kernels).
- ``toy_tokenizer``: the tiny GGUF's tokenizer (byte-level BPE, ChatML template).
- ``tiny_engine``: a started :class:`~mlxr_core.engine.engine.Engine` serving ``tiny_gguf`` as
  ``tiny``.
- ``live_server``: ``live_server(apis=[...], config=...)`` runs ``mlxr serve`` in a subprocess on
  a free port and returns its base URL (stopped with SIGINT at the end of the test).

Importing this module stays cheap (pytest imports it in every run of every project that has mlxr
installed): MLX and the GGUF library are imported by the fixtures that need them, when used.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from mlxr_core.testing.fake_dist import FakeDist, write_fake_dist

#: ``fake_plugin_dist(name, modules=..., entry_points=..., version=...)``.
MakeFakeDist = Callable[..., FakeDist]


@pytest.fixture
def fake_plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[MakeFakeDist]:
    """A factory that writes a fake installed distribution and makes it importable.

    ``fake_plugin_dist("mlxr-demo", modules={"mlxr_demo": SOURCE}, entry_points={"demo":
    "mlxr_demo"})`` returns a :class:`~mlxr_core.testing.fake_dist.FakeDist`; its entry points
    are seen by :func:`mlxr_core.plugins.load_plugins` until the test ends.
    """
    written: list[str] = []

    def make(
        name: str,
        *,
        modules: Mapping[str, str] | None = None,
        entry_points: Mapping[str, str] | None = None,
        version: str = "1.0.0",
        group: str = "mlxr",
    ) -> FakeDist:
        root = tmp_path / "fake-site" / f"{name}-{version}"
        dist = write_fake_dist(
            root, name, version=version, modules=modules, entry_points=entry_points, group=group
        )
        monkeypatch.syspath_prepend(str(root))
        written.extend(modules or {})
        importlib.invalidate_caches()
        return dist

    yield make
    # Modules of one test's fake plugins must not leak into the next test's imports.
    for module in written:
        for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
            del sys.modules[loaded]


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama GGUF (f32, GPT-2 style vocabulary, ChatML template)."""
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    path: Any = write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")
    return Path(path)


@pytest.fixture
def plugin_host() -> Any:
    """A fresh plugin host, loaded now (never shared between tests)."""
    from mlxr_core.plugins import load_plugins

    return load_plugins()


@pytest.fixture
def tiny_model(plugin_host: Any) -> Callable[..., Any]:
    """``tiny_model(model_type, **config)``: a tiny module of that architecture with O(1) random
    weights (:func:`mlxr_core.testing.conformance.random_model`), on the reference kernels."""
    from mlxr_core.kernels import OPS, bind_kernels
    from mlxr_core.testing.conformance import TINY_CONFIG, random_model

    def make(model_type: str, **config: Any) -> Any:
        arch = plugin_host.registries.archs.get(model_type)
        full = {**TINY_CONFIG, "model_type": model_type, **config}
        kernels = bind_kernels(
            plugin_host.registries.kernels, dtype="float32", shapes=arch.kernel_context(full),
            choices=dict.fromkeys(OPS, "reference"),
        )
        return random_model(arch, full, kernels)

    return make


@pytest.fixture(scope="session")
def toy_tokenizer(tiny_gguf: Path) -> Any:
    """The tokenizer of :func:`tiny_gguf`: a small byte-level BPE vocabulary with a ChatML template."""
    from mlxr_core.plugins import load_plugins

    registries = load_plugins().registries
    checkpoint = registries.formats.get("gguf").load(tiny_gguf)
    assert checkpoint.tokenizer is not None
    return registries.tokenizers.get(checkpoint.tokenizer.kind).build(
        checkpoint.tokenizer.data, chat_template=checkpoint.chat_template
    )


@pytest.fixture
def tiny_engine(tiny_gguf: Path, plugin_host: Any) -> Iterator[Any]:
    """A started engine serving :func:`tiny_gguf` as ``tiny`` (context 128); stopped afterwards."""
    from mlxr_core.config.schema import Config, ModelConfig
    from mlxr_core.engine.engine import Engine

    config = Config(models=[ModelConfig(path=str(tiny_gguf), name="tiny", context_length=128)])
    engine = Engine(config, plugin_host)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture
def live_server(tiny_gguf: Path, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """``live_server(apis=("openai",), config="", env=None)``: start ``mlxr serve`` on a free port
    serving :func:`tiny_gguf` as ``tiny``, wait until it listens, return its base URL.

    ``config`` is YAML appended to the generated server config (e.g. a ``plugins:`` section).
    """
    processes: list[subprocess.Popen[str]] = []

    def start(apis: Any = ("openai",), config: str = "", env: Mapping[str, str] | None = None) -> str:
        path = tmp_path / f"server-{len(processes)}.yaml"
        path.write_text(
            f"models:\n  - path: {tiny_gguf}\n    name: tiny\n    context_length: 128\n"
            f"apis: [{', '.join(apis)}]\n{config}"
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(path), "--port", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
        processes.append(process)
        return wait_for_url(process)

    yield start
    for process in processes:
        process.send_signal(signal.SIGINT)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def wait_for_url(process: subprocess.Popen[str], timeout: float = 60.0) -> str:
    """Read ``mlxr serve``'s output until it says where it serves; its base URL."""
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if match := re.search(r"serving .* at (http://\S+)", line):
            return match[1]
    process.kill()
    raise AssertionError("mlxr serve did not become ready:\n" + "".join(lines))
