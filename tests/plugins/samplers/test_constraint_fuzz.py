"""The constraint fuzzer (:mod:`mlxr_core.testing.constraint_fuzz`): every family of JSON schema,
Lark and GBNF grammar, regular expression and choice list, grown until refused, through an engine
in a child process: no crash, no 500, no panic or backtrace told, none held past the time bound.
Small limits keep it to seconds; ``bench/fuzz_constraints.py`` runs the defaults and the ceilings."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxr_core.testing import constraint_fuzz as fuzz

#: Small limits, so every ladder is refused after a few cheap constraints.
LIMITS = {"max_bytes": 8192, "max_depth": 32, "max_rules": 64, "max_alternatives": 256,
          "max_repetition": 1000, "compile_timeout_s": 10.0}  # fmt: skip


@pytest.mark.parametrize("core", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_every_family_grows_until_refused_and_nothing_breaks(tiny_gguf: Path, core: str) -> None:
    outcomes, death = fuzz.run_in_child(str(tiny_gguf), core=core, limits=LIMITS, timeout=300)
    assert death is None
    assert fuzz.problems(outcomes, bound=LIMITS["compile_timeout_s"]) == []
    refusals = [o["message"] for o in outcomes if o["result"] == "refused"]
    assert len(refusals) == len(fuzz.FAMILIES)
    assert all("engine.constraint_limits." in message for message in refusals), refusals


@pytest.mark.slow
def test_the_default_limits_refuse_every_family(tiny_gguf: Path) -> None:
    outcomes, death = fuzz.run_in_child(str(tiny_gguf), core="thread", timeout=600)
    assert death is None
    assert fuzz.problems(outcomes, bound=10.0) == []
