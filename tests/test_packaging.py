"""A wheel holds every package: pyproject's explicit package list names each folder with an
``__init__.py`` under mlxr_core and plugins (a missing one imports from a checkout or an editable
install, and fails only once installed with ``pip install .``)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_in_the_wheel() -> None:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    roots = {name: REPO / folder for name, folder in setuptools["package-dir"].items()}
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(root).parts]))
    assert not found - listed, f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
