"""Schemathesis hooks for ``bench/schema_fuzz.py`` (``SCHEMATHESIS_HOOKS=schema_fuzz_hooks``): half of
the generated bodies name the served model, so they reach generation rather than a 404, as the
test suite's fuzzing does."""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    """A body whose ``model`` is a non-empty string of even length names ``tiny`` instead."""
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and model and len(model) % 2 == 0:
        return {**body, "model": "tiny"}
    return body
