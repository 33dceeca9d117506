"""Built-in logits processors: temperature, top-k, top-p, min-p.

Each factory gets one request's :class:`~mlxr_core.engine.request.SamplingParams` and returns a
``[B, V] -> [B, V]`` logits processor, or None when the request does not use it. The engine builds
the chain once per request and draws the token after it (argmax at temperature 0).
"""

from mlxr_core.plugins import hookimpl

#: The sampler chain is how every request picks tokens: this plugin cannot be disabled.
MLXR_ESSENTIAL = True


@hookimpl
def mlxr_register_samplers(register):  # type: ignore[no-untyped-def]
    module = "mlxr_plugins.samplers.basic"
    register("temperature", f"{module}:temperature", order=10)
    register("top_k", f"{module}:top_k", order=20)
    register("top_p", f"{module}:top_p", order=30)
    register("min_p", f"{module}:min_p", order=40)
