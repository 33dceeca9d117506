"""The Anthropic-compatible HTTP API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``).

Enable it with ``apis: [..., anthropic]`` and point Anthropic clients at the server's URL
(``base_url``, without ``/v1``). Registration is lazy: the routes, and Litestar with them, are
imported only when the server builds its app.
"""

from __future__ import annotations

from mlxr_core.plugin_api import RegisterName, hookimpl


@hookimpl
def mlxr_register_apis(register: RegisterName) -> None:
    register("anthropic", "mlxr_plugins.apis.anthropic.routes:make_router")
