"""``POST /v1/models/{id}/load`` and ``POST /v1/models/{id}/unload``: an operator loads or
unloads a served model (:mod:`mlxr_core.engine.lifecycle`); ``POST /v1/requests/{id}/cancel``:
an operator cancels a running generation request by its id (the ``x-request-id`` every answer
carries, or a background response's id), whatever API it came through and whoever sent it.

All are behind the server's API keys like every route (401 without a valid one). Load and unload
change what the server serves: with ``server.admin_api_keys`` set they need one of those (403 for
a key of ``api_keys`` alone); without, a loopback server answers any caller and a server reachable
from other machines none (403; :class:`~mlxr_core.http.access.AdminAccess`). Cancel acts on the
caller's own requests only; a server with no key answers it only on loopback. Load waits until the model is loaded (at most
``engine.model_load_wait_s``, then 503); unload waits as long for the model's running requests to
end, and answers ``loaded: true`` if they have not (it unloads once they do). A pinned model is
unloaded too: pins only keep a model from being unloaded for room or idleness. Send the POST as
JSON (``{}``), as every POST here: a web page cannot send that across sites unasked.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from litestar import Request, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath
from msgspec import Struct

from mlxr_core.config.schema import is_loopback
from mlxr_core.errors import MlxrError, ModelUnavailable, Overloaded
from mlxr_core.http.access import Forbidden, admin_access, key_owner
from mlxr_core.http.context import ServerContext
from mlxr_core.http.errors import RouteNotFound
from mlxr_core.http.frontend import loaded_model, ready_engine
from mlxr_core.http.openapi import documented
from mlxr_plugins.apis.openai import schemas as s

ACTIONS = ("load", "unload")


class RequestState(Struct):
    """What ``cancel`` answers: the request and whether a running one was cancelled."""

    id: str
    cancelled: bool
    object: str = "request"


class ModelState(Struct):
    """What ``load`` and ``unload`` answer: the model and whether it is loaded now."""

    id: str
    loaded: bool
    object: str = "model"


def cancel_guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Refuse cancelling on a server with no API key unless it listens on loopback (the app's key
    guard has already refused a missing or wrong key where keys are set)."""
    server = connection.app.state["mlxr"].config.server
    if not server.api_keys and not is_loopback(server.host):
        raise Forbidden(
            "cancelling requests needs an API key on a server reachable from other machines: "
            "set server.api_keys (or MLXR_API_KEY)"
        )


def model_admin_routes(ctx: ServerContext, paths: Any) -> list[Any]:
    """The routes, under the paths ``paths`` gives (``/v1`` and unprefixed)."""
    admin = admin_access(ctx.config.server)

    # Model names may hold slashes, so the action is the path's last segment.
    @post(
        paths("/models/{model_id:path}"),
        status_code=200,
        guards=[admin],
        operation_class=documented(error=s.ErrorBody, path_strings=("model_id",)),
        summary="Load or unload a model: POST /v1/models/{id}/load or /v1/models/{id}/unload",
    )
    async def administer(request: Request[Any, Any, Any]) -> ModelState:
        path = str(request.path_params["model_id"]).strip("/")
        name, _, action = path.rpartition("/")
        if action not in ACTIONS or not name:
            raise RouteNotFound(f"no route POST {request.url.path} (POST /v1/models/ID/load or /unload)")
        engine = ready_engine(ctx)
        if name in engine.adapters:  # a LoRA adapter served as a model: made resident or not
            job = asyncio.wrap_future(engine.administer_adapter(name, action))
            try:
                resident = await asyncio.wait_for(job, ctx.config.engine.model_load_wait_s)
            except TimeoutError:
                raise ModelUnavailable(
                    f"adapter {name} did not {action} within engine.model_load_wait_s "
                    f"({ctx.config.engine.model_load_wait_s:g} s); retry", field="model") from None  # fmt: skip
            if action == "load" and not resident:
                raise Overloaded(f"every adapter slot of {engine.adapters[name][0]} is in use by requests; retry")
            return ModelState(name, resident)
        if action == "load":
            info = await loaded_model(ctx, name)
            return ModelState(info.name, True)
        served = engine.resolve(name)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.wrap_future(engine.unload_model(served)), ctx.config.engine.model_load_wait_s)
        return ModelState(served, any(info.name == served for info, _ in engine.loaded_models()))

    @post(
        paths("/requests/{request_id:str}/cancel"),
        status_code=200,
        guards=[cancel_guard],
        operation_class=documented(error=s.ErrorBody),
        summary="Cancel a running generation request by its id (x-request-id, or a background response's id)",
    )
    async def cancel(request: Request[Any, Any, Any], request_id: FromPath[str]) -> RequestState:
        # Only the key that sent a request may cancel it (any caller where the server has no keys).
        if not ctx.inflight.cancel(request_id, key_owner(request)):
            raise RequestNotRunning(f"no running request with id {request_id[:64]!r}")
        return RequestState(request_id, True)

    return [administer, cancel]


class RequestNotRunning(MlxrError):
    status = 404
