"""docs/hooks.md documents every hook of mlxr_core/hookspecs.py, and no hook that is gone."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from mlxr_core import hookspecs

DOC = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"


def hookspec_names() -> set[str]:
    return {
        name
        for name, function in inspect.getmembers(hookspecs, inspect.isfunction)
        if getattr(function, "mlxr_spec", None) is not None
    }


def documented_names() -> list[str]:
    return re.findall(r"^## `(mlxr_\w+)`$", DOC.read_text(), flags=re.MULTILINE)


def test_every_hook_is_documented():
    missing = sorted(hookspec_names() - set(documented_names()))
    assert not missing, (
        f"hooks without a section in docs/hooks.md: {', '.join(missing)}. Whoever adds a hook to "
        "mlxr_core/hookspecs.py documents it there: a '## `HOOK_NAME`' section saying when it is "
        "called, what `register` (or each argument) takes and what to return"
    )


def test_no_stale_or_duplicate_sections():
    documented = documented_names()
    stale = sorted(set(documented) - hookspec_names())
    assert not stale, f"docs/hooks.md documents hooks that no longer exist: {', '.join(stale)}"
    assert len(documented) == len(set(documented)), "a hook is documented twice in docs/hooks.md"


def test_each_section_shows_the_hooks_signature():
    text = DOC.read_text()
    for name in hookspec_names():
        params = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert f"`{name}({params})`" in text, f"docs/hooks.md: the {name} section lacks `{name}({params})`"
