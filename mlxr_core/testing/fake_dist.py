"""Fake installed distributions: a ``*.dist-info`` folder and modules in a folder of your choice.

Put the folder on ``sys.path`` (or ``PYTHONPATH`` for a subprocess) and ``importlib.metadata``
finds the distribution and its entry points exactly as if it had been pip-installed, which is how
a test makes a third-party mlxr plugin (broken ones included) without pip or a network.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path

import attrs


@attrs.frozen
class FakeDist:
    """A distribution written by :func:`write_fake_dist`."""

    name: str
    version: str
    #: The folder to put on ``sys.path`` / ``PYTHONPATH``.
    root: Path

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) with :attr:`root` first on ``PYTHONPATH``."""
        env = dict(os.environ if base is None else base)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.root), env.get("PYTHONPATH")]))
        return env


def write_fake_dist(
    root: str | os.PathLike[str],
    name: str,
    *,
    version: str = "1.0.0",
    modules: Mapping[str, str] | None = None,
    entry_points: Mapping[str, str] | None = None,
    group: str = "mlxr",
) -> FakeDist:
    """Write a distribution named ``name`` into the folder ``root``.

    :param modules: module name -> source (dedented); ``"pkg.mod"`` writes ``pkg/mod.py`` and
        empty ``__init__.py`` files for the packages on the way.
    :param entry_points: entry-point name -> ``"module[:attr]"`` in ``group``.
    :return: the distribution, whose :attr:`FakeDist.root` goes on the import path.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for module, source in (modules or {}).items():
        *packages, leaf = module.split(".")
        folder = root
        for package in packages:
            folder = folder / package
            folder.mkdir(exist_ok=True)
            (folder / "__init__.py").touch()
        (folder / f"{leaf}.py").write_text(textwrap.dedent(source))
    # The dist-info folder name uses the normalized name, as pip writes it.
    info = root / f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = [f"[{group}]", *(f"{ep} = {target}" for ep, target in (entry_points or {}).items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return FakeDist(name=name, version=version, root=root)
