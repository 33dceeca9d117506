"""The one mapping of a request's sampling fields onto
:class:`~mlxr_core.engine.request.SamplingParams`, shared by every API plugin.

An API plugin reads its own wire format (OpenAI's ``stop``, Anthropic's ``stop_sequences``,
Ollama's ``options.stop``) and passes the values here by keyword; what it left out stays None and
takes the config's ``sampling:`` default. Range checks live in each API's schema (the ranges
differ: Anthropic's temperature stops at 1); what no schema can say is checked here, with the
API's own field name in the error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from msgspec import Meta

from mlxr_core.config.schema import SamplingConfig
from mlxr_core.engine.request import Constraint, SamplingParams
from mlxr_core.errors import RequestError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.frontend import cap_max_tokens

#: Stop strings a request may send, and characters per string (OpenAI allows 4 strings).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
#: Stop strings as an API's schema declares them (``stop``, ``stop_sequences``, ``options.stop``):
#: one string or a list, the limits :func:`stop_strings` checks stated in the document.
StopString = Annotated[str, Meta(extra_json_schema={"minLength": 1, "maxLength": MAX_STOP_CHARS})]
StopList = Annotated[list[StopString], Meta(extra_json_schema={"maxItems": MAX_STOP_STRINGS})]
StopStrings = StopString | StopList


def sampling_params(
    ctx: ServerContext,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_param: str = "stop",
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    constraint: Constraint | None = None,
    extra: dict[str, Any] | None = None,
) -> SamplingParams:
    """A request's sampling fields, each None where the request left it out, over ``sampling:``,
    over the model's own defaults (its ``generation_config.json``: vLLM's and SGLang's rule), over
    the built-in ones (OpenAI's: temperature 1, top_p 1); fields neither the request nor
    ``sampling:`` sets are marked ``defaulted`` and the model's defaults fill them at admission
    (:func:`~mlxr_core.engine.request.model_defaults`).

    ``max_tokens`` is lowered to ``server.max_tokens_cap`` (:func:`cap_max_tokens`); an API whose
    ``max_tokens`` is an upper bound sets it again once the prompt is known
    (:func:`~mlxr_core.http.frontend.room_for`). ``top_k`` of 0 or less is off; ``seed`` is taken
    modulo 2**64 (MLX keys are uint64, OpenAI's seeds int64). ``stop`` is one string or a list
    (:func:`stop_strings`), ``stop_param`` the field the API reads it from, named in its errors.
    """
    defaults = ctx.config.sampling
    built_in = SamplingConfig()
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}
    # Left to the model's own defaults: what neither the request nor sampling: sets.
    defaulted = [
        key for key, value in given.items() if value is None and getattr(defaults, key) == getattr(built_in, key)
    ]
    if repetition_penalty is None:
        defaulted.append("repetition_penalty")
    return SamplingParams(
        max_tokens=cap_max_tokens(ctx, max_tokens),
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else max(top_k, 0),
        min_p=defaults.min_p if min_p is None else min_p,
        seed=None if seed is None else seed % 2**64,
        stop=stop_strings(stop, stop_param),
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        frequency_penalty=frequency_penalty or 0.0,
        presence_penalty=presence_penalty or 0.0,
        logit_bias=dict(logit_bias or {}),
        constraint=constraint,
        extra=dict(extra or {}),
        defaulted=tuple(defaulted),
    )


def stop_strings(stop: str | Sequence[str] | None, param: str = "stop") -> list[str]:
    """``stop`` as a list, refusing more than :data:`MAX_STOP_STRINGS`, empty strings and strings
    longer than :data:`MAX_STOP_CHARS` (a :class:`RequestError` naming ``param``)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", field=param)
    for text in stops:
        if not text:
            raise RequestError("stop strings must not be empty", field=param)
        if len(text) > MAX_STOP_CHARS:
            raise RequestError(f"stop strings must be at most {MAX_STOP_CHARS} characters", field=param)
    return stops


def template_variables(
    requested: dict[str, Any] | None = None, *, thinking: bool | None = None, effort: str | None = None
) -> dict[str, Any]:
    """A request's chat template variables: its ``chat_template_kwargs`` (vLLM's and llama.cpp's
    field), over the switches an API has its own field for: ``thinking`` as ``enable_thinking``
    (Qwen3-style templates; Ollama's ``think``, Anthropic's ``thinking.type``) and ``effort`` as
    ``reasoning_effort`` (Harmony's templates; OpenAI's ``reasoning_effort``, Ollama's
    ``think: "high"``). The model's ``models[].chat_template_kwargs`` lie under all of them
    (:func:`mlxr_core.chat.tools.prepare_chat`)."""
    variables: dict[str, Any] = {}
    if thinking is not None:
        variables["enable_thinking"] = thinking
    if effort is not None:
        variables["reasoning_effort"] = effort
    return {**variables, **(requested or {})}
