"""Load progress: plain log lines when stderr is not a terminal."""

from __future__ import annotations

import logging

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
