"""Reading the small JSON files of a model folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxr_core.errors import ModelLoadError


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ModelLoadError naming the file (and line) when it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(
            f"invalid JSON (line {exc.lineno}): {exc.msg}", path=str(path)
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"unreadable: {exc}", path=str(path)) from exc
    except RecursionError:
        raise ModelLoadError("invalid JSON: nested too deeply", path=str(path)) from None
    if not isinstance(value, dict):
        raise ModelLoadError(
            f"expected a JSON object, found {type(value).__name__}", path=str(path)
        )
    return value
