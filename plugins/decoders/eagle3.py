"""EAGLE-3 draft heads inside the batch (``models[].speculative: {method: eagle3, path: <draft
folder>, k: N}``; the head's math in :mod:`mlxr_core.model.layers.eagle3`).

The draft folder is an EAGLE-3 checkpoint (``config.json`` with ``architectures:
["LlamaForCausalLMEagle3"]``, tensors ``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, ``d2t``, optionally ``embed_tokens.weight``; ``t2d`` is not needed). The
batch hands each row's drafter the residual stream entering the three target layers the head
fuses (:attr:`~mlxr_core.engine.speculation.ReadsHidden.hidden_layers`), from the prompt's prefill
and each verification's accepted span; the rest (the head's own cache per row, chaining, one LM
head over all drafting rows a chain step, the layer run once over every row of a step, greedy or
drawn drafts) is the MTP drafter's
(:class:`~mlxr_plugins.decoders.mtp.MtpDrafter`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxr_core.engine.request import GenerationRequest
from mlxr_core.engine.speculation import draft_choice
from mlxr_core.errors import MlxrError, ModelLoadError
from mlxr_core.model.cache import position_bytes
from mlxr_core.model.layers import CausalLM
from mlxr_core.model.layers.eagle3 import Eagle3Args, Eagle3Head
from mlxr_core.model.loader import DTYPES, LoadedModel
from mlxr_plugins.decoders.draft_folder import open_draft
from mlxr_plugins.decoders.mtp import MtpDecoder, MtpDrafter

#: The ``architectures`` an EAGLE-3 draft folder names (EAGLE's and SpecForge's; vLLM's class).
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def load_eagle3_head(model: LoadedModel, registries: Any) -> tuple[Eagle3Head, tuple[int, ...], Eagle3Args]:
    """The EAGLE-3 head at ``models[].speculative.path`` for ``model``, its weights loaded in the
    model's dtype, with the target layers it reads. Raises ConfigError naming the key for a
    missing draft or a target that cannot hand over its layers' states, ModelLoadError naming
    the config key or tensor that does not fit."""
    folder = open_draft(model, registries, "eagle3", "EAGLE-3", ARCHITECTURES)
    lm, config, weights = folder.target, folder.config, folder.weights
    target_hidden = int(lm.model.norm.weight.shape[-1])  # (a quantized embedding's columns are packed)
    try:
        args = Eagle3Args.from_config(config)
        layers = args.aux_layers(len(lm.layers))
        if (args.target_hidden_size or args.hidden_size) != target_hidden:
            raise ModelLoadError(f"the target's hidden size is {target_hidden}, the draft's "
                                 f"{args.target_hidden_size or args.hidden_size}", key="target_hidden_size")  # fmt: skip
        if args.vocab_size != lm.model.embed_tokens.weight.shape[0]:
            raise ModelLoadError(f"vocab_size {args.vocab_size} is not the target's "
                                 f"{lm.model.embed_tokens.weight.shape[0]}", key="vocab_size")  # fmt: skip
        weights = {name.removeprefix("model."): array for name, array in weights.items() if name != "t2d"}
        d2t = weights.pop("d2t", None)
        own = "embed_tokens.weight" in weights
        if not own and args.hidden_size != target_hidden:
            raise ModelLoadError(f"no embed_tokens.weight, and the target's embeddings are {target_hidden} wide, "
                                 f"not hidden_size {args.hidden_size}", key="embed_tokens.weight")  # fmt: skip
        head = Eagle3Head(args, model.kernels, own_embedding=own)
        head.map_vocabulary(d2t)
        head.load_weights(list(weights.items()), strict=True)
    except (ModelLoadError, ValueError) as exc:
        raise folder.not_fitting(exc) from None
    folder.ready(head, layers, model.dtype)
    return head, layers, args


class Eagle3Drafter(MtpDrafter):
    """One request's EAGLE-3 drafter: the MTP drafter's row logic over an :class:`Eagle3Head`,
    reading the target layers' inputs, drafting over the draft vocabulary mapped to target ids."""

    head: Eagle3Head

    def __init__(self, target: CausalLM, head: Eagle3Head, layers: tuple[int, ...], temperature: float = 0.0,
                 seed: int | None = None):  # fmt: skip
        super().__init__(target, head, temperature, seed)
        self.hidden_layers = layers

    def read(self, tokens: mx.array, hidden: mx.array, cache: Any, mask: Any = None) -> tuple[mx.array, mx.array]:
        return self.head(self.head.embed(self.target, tokens), self.head.fc(hidden), cache, mask)

    def chain(self, tokens: mx.array, chained: mx.array, cache: Any, mask: Any = None) -> tuple[mx.array, mx.array]:
        return self.head(self.head.embed(self.target, tokens), chained, cache, mask)

    def head_logits(self, normed: mx.array) -> mx.array:
        logits: mx.array = self.head.lm_head(normed)
        return logits

    def choose(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        token, self._key, scaled = draft_choice(logits, self.temperature, self._key)
        return self.head.targets[token], None if scaled is None else self.head.widen(scaled)


class Eagle3Decoder(MtpDecoder):
    """Plain decoding whose requests draft with an EAGLE-3 head inside the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: dict[str, tuple[int, ...]] = {}

    def prepare(self, model: LoadedModel, registries: Any, config: Any) -> None:
        """Read the EAGLE-3 head of ``models[].speculative.path`` (errors naming the key, see
        :func:`load_eagle3_head`), and tell the model what its keys and values cost a row per position."""
        if model.name not in self.heads:
            head, self.layers[model.name], args = load_eagle3_head(model, registries)
            self.heads[model.name] = head
            itemsize = DTYPES[model.dtype].size
            model.drafter_bytes_per_token = position_bytes([head.make_cache()], args.kv_heads, args.dims, itemsize)

    def release(self, model_name: str) -> None:
        super().release(model_name)
        self.layers.pop(model_name, None)

    def row_drafter(self, model: LoadedModel, request: GenerationRequest) -> Eagle3Drafter:
        head = self.heads.get(model.name)
        if not isinstance(head, Eagle3Head) or not isinstance(model.model, CausalLM):
            raise MlxrError(f"speculative method eagle3: no EAGLE-3 head was read for model {model.name}")
        params = request.params
        return Eagle3Drafter(model.model, head, self.layers[model.name], params.temperature, params.seed)
