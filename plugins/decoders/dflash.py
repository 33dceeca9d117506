"""DFlash block drafters inside the batch (``models[].speculative: {method: dflash, path: <draft
folder>, k: N}``; the drafter's math in :mod:`mlxr_core.model.layers.dflash`).

The draft folder is a DFlash checkpoint as z-lab publishes it and vLLM reads it
(``config.json`` with ``architectures: ["DFlashDraftModel"]``, ``block_size``,
``dflash_config: {target_layer_ids, mask_token_id}``; tensors ``fc.weight``, ``hidden_norm.weight``,
``layers.N.*`` (Qwen3 layers with ``q_norm``/``k_norm``), ``norm.weight``, optionally under
``model.``). The batch hands each row's drafter the outputs of the target layers it reads
(:attr:`~mlxr_core.engine.speculation.ReadsHidden.hidden_layers`: the inputs of the layers
after them) from the prompt's prefill and each verification's accepted span; the drafter turns
them into its layers' keys and values at once. A step's draft is one pass over the row's next
input and ``k`` mask tokens (``k`` at most ``block_size - 1``); the rows drafting in a step share
one LM head call over all their block positions. A greedy row takes each position's argmax, a
sampled row draws each position at its temperature (``draft_logits``: the block's logits, each
position drawn independently, so verification's rejection sampling keeps the target's distribution).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxr_core.engine.request import GenerationRequest
from mlxr_core.engine.speculation import draft_choice
from mlxr_core.errors import MlxrError, ModelLoadError
from mlxr_core.model.cache import position_bytes
from mlxr_core.model.layers import CausalLM
from mlxr_core.model.layers.dflash import DFlashArgs, DFlashHead
from mlxr_core.model.loader import DTYPES, LoadedModel
from mlxr_plugins.decoders.draft_folder import open_draft
from mlxr_plugins.decoders.plain import PlainDecoder

#: The ``architectures`` a DFlash draft folder names (z-lab's class; vLLM's).
ARCHITECTURES = ("DFlashDraftModel", "DFlashQwen3ForCausalLM")


class DFlashSpec:
    """What a row's drafter needs besides the head: the target layers it reads (as layer
    inputs), the mask id and the longest block."""

    def __init__(self, head: DFlashHead, layers: tuple[int, ...], mask_token: int, block_size: int):
        self.head, self.layers, self.mask_token, self.block_size = head, layers, mask_token, block_size


def load_dflash(model: LoadedModel, registries: Any) -> tuple[DFlashSpec, DFlashArgs]:
    """The DFlash drafter at ``models[].speculative.path`` for ``model``, in the model's dtype.
    Raises ConfigError naming the key for a missing or foreign draft or a target that cannot hand
    over its layers' states, ModelLoadError naming the config key or tensor that does not fit."""
    folder = open_draft(model, registries, "dflash", "DFlash", ARCHITECTURES)
    lm = folder.target
    target_hidden = int(lm.model.norm.weight.shape[-1])  # (a quantized embedding's columns are packed)
    try:
        args = DFlashArgs.from_config(folder.config)
        ids = args.target_layers(len(lm.layers))
        mask = args.mask_token
        vocab = int(lm.model.embed_tokens.weight.shape[0])
        if args.vocab_size != vocab:
            raise ModelLoadError(f"vocab_size {args.vocab_size} is not the target's {vocab}", key="vocab_size")
        if args.hidden_size != target_hidden:
            raise ModelLoadError(f"hidden_size {args.hidden_size}: the draft reads the target's embeddings, "
                                 f"{target_hidden} wide", key="hidden_size")  # fmt: skip
        if (args.target_hidden_size or target_hidden) != target_hidden:
            raise ModelLoadError(f"the target's hidden size is {target_hidden}", key="target_hidden_size")
        head = DFlashHead(args, model.kernels, len(ids) * target_hidden)
        weights = [(name.removeprefix("model."), array) for name, array in folder.weights.items()]
        head.load_weights(weights, strict=True)
    except (ModelLoadError, ValueError) as exc:
        raise folder.not_fitting(exc) from None
    # Hugging Face's hidden_states[l + 1], the output of layer l, is the input of layer l + 1.
    layers = tuple(index + 1 for index in ids)
    folder.ready(head, layers, model.dtype)
    return DFlashSpec(head, layers, mask, args.block_size), args


class DFlashDrafter:
    """One request's DFlash drafter (:class:`~mlxr_core.engine.speculation.Drafter`,
    :class:`~mlxr_core.engine.speculation.ReadsHidden` and
    :class:`~mlxr_core.engine.speculation.DraftsTogether`): its layers' caches hold the
    context's keys and values of every target position handed to it."""

    def __init__(self, target: CausalLM, spec: DFlashSpec, temperature: float = 0.0, seed: int | None = None):
        self.target, self.spec, self.head = target, spec, spec.head
        self.hidden_layers = spec.layers
        self.caches = self.head.make_cache()
        #: The target position of the next hidden state expected (None: nothing handed yet).
        self.expected: int | None = None
        self.temperature = temperature
        self._key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
        #: The logits the last proposal was drawn from (``[k, V]``), or None (greedy).
        self.draft_logits: mx.array | None = None

    def observe(self, start: int, hidden: mx.array, following: Sequence[int]) -> None:
        """The target's states of positions ``start ..`` become context (a gap starts the
        context afresh: RoPE is relative, the drafts only see less)."""
        if self.expected is not None and start != self.expected:
            self.caches = self.head.make_cache()
        self.head.write_context(hidden[None], self.caches)
        mx.async_eval([array for cache in self.caches for array in (cache.keys, cache.values) if array is not None])
        self.expected = start + hidden.shape[0]

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        return self.propose_rows([self], [history], [k])[0]

    @classmethod
    def propose_rows(
        cls, drafters: Sequence[DFlashDrafter], histories: Sequence[Sequence[int]], ks: Sequence[int]
    ) -> list[list[int]]:
        """Every row's block (one pass of the drafter each, on its own context), then one LM head
        over all rows' block positions, one read back."""
        rows: list[tuple[int, DFlashDrafter, int]] = []
        outputs: list[mx.array] = []
        for index, (drafter, history, k) in enumerate(zip(drafters, histories, ks, strict=True)):
            drafter.draft_logits = None
            k = min(k, drafter.spec.block_size - 1)
            # The context must end just before the row's next input (history[-1]).
            if k <= 0 or not history or drafter.expected != len(history) - 1:
                continue
            block = mx.array([[history[-1]] + [drafter.spec.mask_token] * k], dtype=mx.int32)
            embeddings = drafter.target.model.embed_tokens(block)  # the unscaled table, as trained
            outputs.append(drafter.head.block(embeddings, drafter.caches)[0, 1:])
            rows.append((index, drafter, k))
        proposed: list[mx.array] = [mx.zeros((0,), dtype=mx.int32) for _ in drafters]
        if rows:
            logits = rows[0][1].target.lm_logits(mx.concatenate(outputs)[None])[0]
            at = 0
            for index, drafter, k in rows:
                tokens, drafter._key, scaled = draft_choice(logits[at : at + k], drafter.temperature, drafter._key)
                proposed[index], drafter.draft_logits = tokens, scaled
                at += k
        mx.eval(proposed)
        return [row.tolist() for row in proposed]  # type: ignore[misc]


class DFlashDecoder(PlainDecoder):
    """Plain decoding whose requests draft blocks with a DFlash drafter inside the batch."""

    def __init__(self) -> None:
        #: model name -> its drafter.
        self.heads: dict[str, DFlashSpec] = {}

    def prepare(self, model: LoadedModel, registries: Any, config: Any) -> None:
        """Read the DFlash drafter of ``models[].speculative.path`` (errors naming the key, see
        :func:`load_dflash`), and tell the model what its context keys and values cost a row per position."""
        if model.name not in self.heads:
            spec, args = load_dflash(model, registries)
            self.heads[model.name] = spec
            itemsize = DTYPES[model.dtype].size
            model.drafter_bytes_per_token = position_bytes(spec.head.make_cache(), args.kv_heads, args.dims, itemsize)

    def release(self, model_name: str) -> None:
        self.heads.pop(model_name, None)

    def row_drafter(self, model: LoadedModel, request: GenerationRequest) -> DFlashDrafter:
        spec = self.heads.get(model.name)
        if spec is None or not isinstance(model.model, CausalLM):
            raise MlxrError(f"speculative method dflash: no DFlash drafter was read for model {model.name}")
        return DFlashDrafter(model.model, spec, request.params.temperature, request.params.seed)
