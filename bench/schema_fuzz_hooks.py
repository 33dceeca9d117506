"""Schemathesis hooks for ``bench/schema_fuzz.py`` (``SCHEMATHESIS_HOOKS=schema_fuzz_hooks``): half of
the generated bodies name the served model, so they reach generation rather than a 404, as the
test suite's fuzzing does; Ollama's create goes over it, naming the blob the run uploads first, so
it reaches the engine's read of the adapter."""

from __future__ import annotations

import hashlib
from typing import Any

import schemathesis

#: A blob ``bench/schema_fuzz.py`` uploads before fuzzing: not an adapter, so a create naming it is
#: read by the engine and refused.
BLOB = b"not a LoRA adapter\n"
BLOB_DIGEST = f"sha256:{hashlib.sha256(BLOB).hexdigest()}"


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    """A body whose ``model`` (or ``from``) is a non-empty string of even length names ``tiny``
    instead; one whose ``adapters`` has a file name of even length names the uploaded blob."""
    if not isinstance(body, dict):
        return body
    model, source, files = body.get("model"), body.get("from"), body.get("adapters")
    creating = "from" in body or "adapters" in body  # model is the new name there
    if isinstance(model, str) and model and len(model) % 2 == 0 and not creating:
        body = {**body, "model": "tiny"}
    if isinstance(source, str) and source and len(source) % 2 == 0:
        body = {**body, "from": "tiny"}
    if isinstance(files, dict) and files and len(next(iter(files))) % 2 == 0:
        body = {**body, "adapters": dict.fromkeys(files, BLOB_DIGEST)}
    return body
