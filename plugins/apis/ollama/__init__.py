"""The Ollama-compatible HTTP API (``/api/chat``, ``/api/generate``, ``/api/tags`` ...).

Enable it with ``apis: [..., ollama]``; point Ollama clients at the server's URL (``OLLAMA_HOST``).
Registration is lazy: the routes, and Litestar with them, are imported only when the server builds
its app.
"""

from __future__ import annotations

from mlxr_core.plugin_api import RegisterName, hookimpl


@hookimpl
def mlxr_register_apis(register: RegisterName) -> None:
    register("ollama", "mlxr_plugins.apis.ollama.routes:make_router")
