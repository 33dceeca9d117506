"""Progress: rich steps on a terminal when a command enables them, plain log lines otherwise."""

from __future__ import annotations

import io
import logging

import pytest
from rich.console import Console

from mlxr_core.model import progress
from mlxr_core.model.progress import MIN_ITEMS, track


def test_quarters_are_logged_off_a_terminal(caplog):
    with caplog.at_level(logging.INFO, logger="mlxr_core.model.loader"):
        assert list(track(range(100), 100, "reading x")) == list(range(100))
    assert [r.getMessage() for r in caplog.records] == [
        "reading x: 25% (25/100)",
        "reading x: 50% (50/100)",
        "reading x: 75% (75/100)",
    ]


def test_short_loads_stay_quiet(caplog):
    with caplog.at_level(logging.INFO, logger="mlxr_core.model.loader"):
        assert list(track(range(MIN_ITEMS - 1), MIN_ITEMS - 1, "x")) == list(range(MIN_ITEMS - 1))
    assert not caplog.records


@pytest.fixture
def terminal():
    """Progress enabled on a fake terminal; its text so far."""
    console = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)
    assert progress.enable(console)
    try:
        yield console.file
    finally:
        progress.disable()


def test_steps_nest_in_one_display_on_a_terminal(terminal):
    with progress.step("loading model.gguf"), progress.step("timing runs", total=3) as advance:
        advance()
        progress._display.progress.refresh()
        assert progress._display.running == 2
    drawn = terminal.getvalue()
    assert "loading model.gguf" in drawn and "timing runs" in drawn and "1/3" in drawn
    assert progress._display.progress is None  # stopped with the last step


def test_track_draws_a_bar_instead_of_log_lines_on_a_terminal(terminal, caplog):
    with caplog.at_level(logging.INFO, logger="mlxr_core.model.loader"):
        assert list(track(range(40), 40, "reading tensors")) == list(range(40))
    assert "reading tensors" in terminal.getvalue() and not caplog.records


def test_nothing_is_drawn_off_a_terminal_or_when_turned_off(monkeypatch):
    piped = Console(file=io.StringIO())
    assert not progress.enable(piped)
    with progress.step("loading") as advance:
        advance()
    assert piped.file.getvalue() == "" and not progress.enabled()
    monkeypatch.setenv("MLXR_PROGRESS", "0")
    assert not progress.enable(Console(file=io.StringIO(), force_terminal=True))
