"""A request's LoRA adapter and its scale on the completion routes: llama.cpp's per-request
``lora`` (``[{"id": i, "scale": s}]``, ``id`` counting the model's adapters: ``models[].adapters``
in order, then those created while serving) on a request naming the base model, or mlxr's
``lora_scale`` on a request whose ``model`` names an adapter (``<model>:<adapter>``).

As in llama.cpp, an adapter the list leaves out runs at scale 0; unlike llama.cpp, one request
runs one adapter (rows of a batch each gather their own), so at most one entry has a scale other
than 0. Rows of one batch using the same adapter at different scales decode in the same step
(:mod:`mlxr_core.model.lora`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxr_core.engine.client import EngineClient
from mlxr_core.errors import RequestError
from mlxr_plugins.apis.openai.schemas import LoraScale


def adapter_choice(
    engine: EngineClient, model: str, lora: Sequence[LoraScale] | None, lora_scale: float | None
) -> tuple[str, float]:
    """The model a request runs (its ``model``, or the adapter ``lora`` picks, served as a model
    of its own) and the adapter's scale (``GenerationRequest.adapter_scale``)."""
    if lora is None:
        return model, 1.0 if lora_scale is None else lora_scale
    if lora_scale is not None:
        raise RequestError("lora_scale goes with a model naming a LoRA adapter, lora with a base model: "
                           "send one of them", field="lora_scale")  # fmt: skip
    if model in engine.adapters:
        raise RequestError(f"model {model!r} names a LoRA adapter already; lora picks among a base "
                           "model's adapters (or send lora_scale)", field="lora")  # fmt: skip
    base = engine.resolve(model)
    adapters = [served for served, (owner, _) in engine.adapters.items() if owner == base]
    ids = [entry.id for entry in lora]
    if len(set(ids)) != len(ids):
        raise RequestError("lora ids must be unique", field="lora")
    for i, entry in enumerate(lora):
        if entry.id >= len(adapters):
            raise RequestError(f"no adapter with id {entry.id}: model {base!r} has {len(adapters)} "
                               "(models[].adapters in order, then those created while serving)",
                               field=f"lora[{i}].id")  # fmt: skip
    chosen = [entry for entry in lora if entry.scale != 0]
    if len(chosen) > 1:
        raise RequestError("one adapter per request: at most one lora entry may have a scale other than 0",
                           field="lora")  # fmt: skip
    if not chosen:
        return model, 1.0  # every adapter at 0: the base model
    return adapters[chosen[0].id], chosen[0].scale
