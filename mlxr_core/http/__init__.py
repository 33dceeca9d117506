"""The HTTP layer: the Litestar app and what every API plugin shares.

Modules, lowest first; a module imports only modules above it in this list:

- :mod:`~mlxr_core.http.errors`: exception handlers an API mounts around its own error body;
- :mod:`~mlxr_core.http.openapi`: the OpenAPI document, msgspec's schema of each struct, and what
  a route's annotations cannot say (its API's errors, streamed replies);
- :mod:`~mlxr_core.http.connections`: read deadlines, a minimum body rate and a budget for
  uvicorn's connections, and a quiet log of a process out of file descriptors;
- :mod:`~mlxr_core.http.hosts`: the ``Host`` names a server answers (against DNS rebinding);
- :mod:`~mlxr_core.http.metrics`: the Prometheus metrics of one server (``GET /metrics``);
- :mod:`~mlxr_core.http.access`: API keys, the JSON body guard, request ids and the access log;
- :mod:`~mlxr_core.http.context`: :class:`~mlxr_core.http.context.ServerContext`, what every API
  factory receives, with the requests in flight;
- :mod:`~mlxr_core.http.frontend`: typed bodies decoded strictly (the app's request class),
  submission, tracked event streams, whole replies, JSON replies;
- :mod:`~mlxr_core.http.constraints`: the grammar fields clients send (vLLM's, llama.cpp's) and
  the one constraint a request's fields make;
- :mod:`~mlxr_core.http.requests`: the one mapping of a request's sampling fields onto
  ``SamplingParams`` that every API plugin calls with its own field names;
- :mod:`~mlxr_core.http.server`: the app (:func:`~mlxr_core.http.server.build_app`), ``/health``
  and graceful shutdown.

Importing this package imports none of them.
"""
