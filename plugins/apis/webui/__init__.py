"""The web page (``/ui/``): chat with any served model, and watch the server's status live.

On by default when the server binds a loopback address (``127.0.0.1``, ``::1``, ``localhost``) and
``apis:`` is not set; on any other address it is served only when ``apis:`` lists ``webui``, and
an ``apis:`` without it turns it off. The page talks to the server through the ``openai`` API and
``GET /metrics`` only. Registration is lazy: the routes are imported when the server builds its app.
"""

from __future__ import annotations

from mlxr_core.plugin_api import RegisterName, hookimpl


@hookimpl
def mlxr_register_apis(register: RegisterName) -> None:
    register("webui", "mlxr_plugins.apis.webui.routes:make_router")
