"""The OpenAI-compatible HTTP API (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/models``).

Enable it with ``apis: [openai]`` (the default). Registration is lazy: the routes, and Litestar
with them, are imported only when the server builds its app.
"""

from __future__ import annotations

from mlxr_core.plugin_api import RegisterName, hookimpl


@hookimpl
def mlxr_register_apis(register: RegisterName) -> None:
    register("openai", "mlxr_plugins.apis.openai.routes:make_router")
    register("rerank", "mlxr_plugins.apis.openai.rerank:make_router")
