"""The native CPU kernels' extension module, for the tests that call it (skipped where it cannot
be built, with the reason)."""

from __future__ import annotations

import pytest

from mlxr_plugins.kernels import native


@pytest.fixture(scope="module")
def module():
    loaded, why = native.load()
    if loaded is None:
        pytest.skip(f"native CPU kernels unavailable: {why}")
    return loaded
