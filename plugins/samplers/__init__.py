"""Built-in logits processors: logit_bias, penalties, structured output (grammars), temperature,
top-k, top-p, min-p, the thinking budget.

Each factory gets one request's :class:`~mlxr_core.engine.request.SamplingParams` (and a
:class:`~mlxr_core.engine.decoding.SamplerContext`) and returns a ``[B, V] -> [B, V]`` logits
processor, or None when the request does not use it. The engine builds the chain once per request
and draws the token after it (argmax at temperature 0). Bias and penalties come before temperature.
"""

from mlxr_core.plugin_api import hookimpl

#: The sampler chain is how every request picks tokens: this plugin cannot be disabled.
MLXR_ESSENTIAL = True


@hookimpl
def mlxr_register_samplers(register):  # type: ignore[no-untyped-def]
    register("logit_bias", "mlxr_plugins.samplers.penalties:logit_bias", order=1)
    register("penalties", "mlxr_plugins.samplers.penalties:penalties", order=5)
    # After bias and penalties (they cannot revive a token the grammar forbids), before the draw's
    # shaping (temperature, top-k ... work on the allowed tokens only).
    register(
        "structured",
        "mlxr_plugins.samplers.structured:structured",
        order=8,
        constraints=("json_object", "json_schema", "regex", "lark", "gbnf", "choice"),
    )
    module = "mlxr_plugins.samplers.basic"
    register("temperature", f"{module}:temperature", order=10)
    register("top_k", f"{module}:top_k", order=20)
    register("top_p", f"{module}:top_p", order=30)
    register("min_p", f"{module}:min_p", order=40)
    # Last: a forced end-of-thinking token overrides every other choice.
    register("thinking_budget", "mlxr_plugins.samplers.thinking:thinking_budget", order=50)
