"""Which stored tensor holds which expert of which layer, and the model's stacked experts
replaced by :class:`~mlxr_core.model.experts.layer.StreamedExperts`.

The format leaves expert tensors in their files (:func:`is_expert_tensor` names them, in the
checkpoint's naming). Architectures rename and stack them in ``sanitize`` (Hugging Face's one tensor
per expert, Mixtral's ``w1``/``w3``/``w2``); rather than a second copy of each architecture's
rules, ``sanitize`` itself is run over stand-ins (:func:`tag_stored`): each left tensor becomes a
one-element integer array naming it, so what sanitize makes of them says where each expert of
each stacked parameter lies (a stand-in passed through: the stored tensor is the stack, one row
per expert; stand-ins stacked: one stored tensor per expert). An architecture whose sanitize does
more than rename and stack (splitting a fused tensor) is refused with the reason.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlxr_core.errors import ConfigError
from mlxr_core.model.checkpoint import Checkpoint, QuantSpec
from mlxr_core.model.experts.layer import StreamedExperts
from mlxr_core.model.experts.store import ExpertSource, ExpertStore, LayerExperts
from mlxr_core.model.layers.moe import SparseMoE, SwitchGLU

#: A checkpoint tensor of the routed experts: per expert (``mlp.experts.3.up_proj.weight``,
#: ``block_sparse_moe.experts.3.w1.weight``) or stacked (``mlp.switch_mlp.up_proj.weight``).
#: Shared experts (``shared_expert``, ``shared_experts``) are not.
EXPERT_TENSOR = re.compile(r"\.(?:experts|switch_mlp)\.")
#: A stacked experts' parameter after sanitize: its module and the parameter within it.
STACKED = re.compile(r"^(?P<module>.+)\.(?P<param>[a-z_]+_proj\.(?:weight|scales|biases|bias))$")
FIELD = "models[].experts"


def is_expert_tensor(name: str) -> bool:
    """Whether the checkpoint tensor ``name`` holds routed experts (see :data:`EXPERT_TENSOR`)."""
    return EXPERT_TENSOR.search(name) is not None


#: llama.cpp's names of routed experts: stacked (``blk.0.ffn_up_exps.weight``) or per expert
#: (older Mixtral files: ``blk.0.ffn_up.3.weight``).
GGUF_EXPERT_TENSOR = re.compile(r"_exps\.|\.ffn_(?:gate|up|down)\.\d+\.")


def resident_file_bytes(path: Path) -> int | None:
    """The bytes of a checkpoint's tensors that stay resident when its experts stream (all but
    the routed experts), from the files' headers alone: a GGUF file or a folder of safetensors
    files; None for anything else or a header that cannot be read (the load then says why)."""
    try:
        if path.is_file() and path.suffix == ".gguf":
            import gguf

            reader = gguf.GGUFReader(path)
            return sum(int(t.n_bytes) for t in reader.tensors if not GGUF_EXPERT_TENSOR.search(t.name))
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
        total = 0
        for file in files:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            total += sum(end - begin for name, entry in header.items() if name != "__metadata__"
                         and not is_expert_tensor(name) for begin, end in [entry["data_offsets"]])  # fmt: skip
        return total if files else None
    except Exception:  # an unreadable header: the load reports it
        return None


def tag_stored(checkpoint: Checkpoint) -> tuple[dict[str, mx.array], list[str]]:
    """A stand-in for each tensor left in the files (``int32 [1]``, its index in the returned
    names), to pass through the architecture's ``sanitize`` with the loaded weights."""
    names = sorted(checkpoint.stored)
    return {name: mx.array([index], dtype=mx.int32) for index, name in enumerate(names)}, names


def stream_experts(
    model: nn.Module,
    sanitized: dict[str, mx.array],
    names: list[str],
    checkpoint: Checkpoint,
    store: ExpertStore,
    quantization: Mapping[str, QuantSpec],
    suggested: Mapping[str, QuantSpec],
    policy: str,
) -> dict[str, mx.array]:
    """Replace every :class:`SwitchGLU` of ``model`` by a :class:`StreamedExperts` reading from
    ``store``; ``sanitized`` (weights and stand-ins after the architecture's sanitize) less the
    stand-ins is returned. ``quantization`` and ``suggested`` are the checkpoint's (renamed as
    sanitize names modules); ``policy`` is ``models[].quantization`` resolved (``keep`` or
    ``dequantize``: packed experts kept packed or dequantized as they are read; a policy that would
    requantize them is refused). Raises ConfigError naming ``models[].experts`` where the experts
    cannot stream."""
    weights: dict[str, mx.array] = {}
    placed: dict[str, dict[str, np.ndarray]] = {}
    for name, array in sanitized.items():
        match = STACKED.match(name)
        if array.dtype == mx.int32 and array.shape[-1:] == (1,) and array.ndim <= 2 and match is not None:
            placed.setdefault(match["module"], {})[match["param"]] = np.array(array)[..., 0]
        elif array.dtype == mx.int32 and array.shape == (1,) and is_expert_tensor(name):
            raise ConfigError(f"{checkpoint.path.name}: the {checkpoint.config.get('model_type')} architecture makes "
                              f"{name} of the stored experts, which is no stacked projection; its experts cannot "
                              f"stream (remove {FIELD})", field=FIELD)  # fmt: skip
        else:
            weights[name] = array
    switches = [(path, module) for path, module in model.named_modules() if isinstance(module, SwitchGLU)]
    if not switches:
        raise ConfigError(f"{checkpoint.path.name}: the model has no mixture of experts to stream; remove {FIELD}",
                          field=FIELD)  # fmt: skip
    switches.sort(key=lambda item: _layer_order(item[0]))
    routers: list[SparseMoE | None] = []
    streamed: list[StreamedExperts] = []
    for path, module in switches:
        flat: list[tuple[str, mx.array]] = tree_flatten(module.parameters())  # type: ignore[assignment]
        wanted = {name for name, _ in flat}
        found = placed.pop(path, {})
        given = {param for param in found if not param.endswith((".scales", ".biases"))}
        if given != wanted:
            missing = sorted(wanted - given) or sorted(given - wanted)
            raise ConfigError(f"{checkpoint.path.name}: the stored experts do not give {path}'s "
                              f"{', '.join(missing)}; its experts cannot stream (remove {FIELD})", field=FIELD)  # fmt: skip
        experts = LayerExperts(
            {param: _source(tags, names, checkpoint, module.experts) for param, tags in found.items()},
            *_packing(path, quantization, suggested, policy, checkpoint),
        )
        layer = StreamedExperts(store, store.add_layer(experts), module.experts, module.top_k,
                                module._activation, module.gate_proj._gather_matmul,
                                sum(array.size for _, array in flat))  # fmt: skip
        parent_path, _, attribute = path.rpartition(".")
        parent = _module(model, parent_path)
        setattr(parent, attribute, layer)
        routers.append(parent if isinstance(parent, SparseMoE) else None)
        streamed.append(layer)
    for layer, router in zip(streamed, routers[1:], strict=False):
        layer.ahead = (lambda x, r=router: r.choose(x)[0]) if router is not None else None
    if placed:
        raise ConfigError(f"{checkpoint.path.name}: stored experts for {sorted(placed)[0]}, which the model does not "
                          f"hold as stacked experts; they cannot stream (remove {FIELD})", field=FIELD)  # fmt: skip
    return weights


def _source(tags: np.ndarray, names: list[str], checkpoint: Checkpoint, experts: int) -> ExpertSource:
    if tags.ndim == 0:
        return ExpertSource(experts, stack=checkpoint.stored[names[int(tags)]])
    return ExpertSource(experts, each=tuple(checkpoint.stored[names[int(tag)]] for tag in tags))


def _packing(
    path: str, quantization: Mapping[str, QuantSpec], suggested: Mapping[str, QuantSpec], policy: str,
    checkpoint: Checkpoint,
) -> tuple[dict[str, QuantSpec], frozenset[str]]:
    """The packed projections of the experts at ``path`` and those used dense."""
    packing, dense = {}, set()
    for projection in ("gate_proj", "up_proj", "down_proj"):
        spec = quantization.get(f"{path}.{projection}")
        if f"{path}.{projection}" in suggested and policy != "dequantize":
            raise ConfigError(f"{checkpoint.path.name}: streamed experts are served as stored; their storage has "
                              f"no exact MLX packing, which models[].quantization {policy} would requantize (use "
                              "dequantize, or remove models[].experts)", field="models[].quantization")  # fmt: skip
        if spec is not None:
            packing[projection] = spec
            if policy == "dequantize":
                dense.add(projection)
            elif policy != "keep":
                raise ConfigError(f"{checkpoint.path.name}: streamed experts are served as stored (packed, or "
                                  f"dequantized); models[].quantization {policy} would requantize them (use keep, "
                                  "dequantize or auto, or remove models[].experts)", field="models[].quantization")  # fmt: skip
        elif policy not in ("keep", "dequantize"):
            raise ConfigError(f"{checkpoint.path.name}: streamed experts are served as stored; "
                              f"models[].quantization {policy} would convert them (use keep, dequantize or auto, "
                              "or remove models[].experts)", field="models[].quantization")  # fmt: skip
    return packing, frozenset(dense)


def _layer_order(path: str) -> tuple[int, str]:
    found = re.search(r"\.layers\.(\d+)\.", path)
    return (int(found.group(1)) if found else -1, path)


def _module(model: nn.Module, path: str) -> nn.Module:
    module = model
    for part in path.split("."):
        module = module[int(part)] if isinstance(module, list) else module[part]
    return module
