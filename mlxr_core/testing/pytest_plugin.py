"""pytest fixtures for mlxr and its plugins (registered through the ``pytest11`` entry point).

- ``fake_plugin_dist``: write a fake installed plugin distribution and put it on the import path
  (``sys.path`` for this process; ``dist.env()`` gives the environment for a subprocess).
- ``tiny_gguf``: the path of a tiny random llama GGUF, written once per session.

Importing this module stays cheap (pytest imports it in every run of every project that has mlxr
installed): MLX and the GGUF library are imported by the fixtures that need them, when used.
"""

from __future__ import annotations

import importlib
import sys
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
