"""Multi-token prediction: the MTP head the checkpoint carries drafts inside the batch
(``models[].speculative: {method: mtp, k: N}``; the head's math in
:mod:`mlxr_core.model.layers.mtp`).

Each row keeps the head's own cache. The batch hands the row's drafter the target's final hidden
states of every position it kept, with the tokens that followed them (the prompt's chunk by chunk
as it is prefilled, then each verification's accepted span:
:class:`~mlxr_core.engine.speculation.ReadsHidden`); the head reads them in one pass there. At the
next step its last position's output guesses the token after the row's next input, and each
further draft token chains the head on its own output. The chained positions are forgotten
before the head reads the target's states for them.
A gap in what the row was handed (a plain step of a large batch, a prompt from the prefix cache)
starts the head's cache afresh from there: the drafts get worse, the output stays the target's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxr_core.engine.request import GenerationRequest
from mlxr_core.engine.speculation import draft_choice
from mlxr_core.errors import ConfigError, MlxrError, ModelLoadError
from mlxr_core.model.cache import position_bytes
from mlxr_core.model.layers import CausalLM
from mlxr_core.model.layers.mtp import HasMtpHead, MtpHead
from mlxr_core.model.loader import DTYPES, LoadedModel
from mlxr_core.model.stages import open_checkpoint
from mlxr_plugins.decoders.plain import PlainDecoder

METHOD_KEY = "models[].speculative.method"


def load_mtp_head(model: LoadedModel, registries: Any) -> MtpHead:
    """The MTP head of ``model``'s checkpoint with its weights, in the model's dtype. Raises a
    :class:`ConfigError` naming ``models[].speculative.method`` when there is none to read."""
    arch = model.arch
    where = f"model {model.name}: speculative method mtp"
    if not isinstance(arch, HasMtpHead) or not isinstance(model.model, CausalLM):
        raise ConfigError(
            f"{where}: the {model.config.get('model_type')!r} architecture reads no multi-token-prediction "
            "head (Qwen3-Next, Qwen3.5 and DeepSeek-V3 checkpoints do); choose another method",
            field=METHOD_KEY,
        )
    opened = open_checkpoint(model.path, registries, format=model.format, dtype=model.dtype)
    weights = arch.mtp_weights(opened.checkpoint.weights, model.config)
    if not weights:
        raise ConfigError(
            f"{where}: the checkpoint {model.path} carries no multi-token-prediction weights "
            "(Qwen's mtp.*, DeepSeek's layer past num_hidden_layers); choose another method",
            field=METHOD_KEY,
        )
    head = arch.build_mtp(model.config, model.kernels)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{where}: the multi-token-prediction head's tensors do not load: {exc}",
                             path=str(model.path)) from None  # fmt: skip
    head.set_dtype(DTYPES[model.dtype])
    mx.eval(head.parameters())
    head.eval()
    return head


class MtpDrafter:
    """One request's MTP drafter (:class:`~mlxr_core.engine.speculation.Drafter` and
    :class:`~mlxr_core.engine.speculation.ReadsHidden`): greedy choices for a greedy request,
    draws at the request's temperature (with :attr:`draft_logits`) for a sampled one. A head of
    another kind (EAGLE-3's) changes what :meth:`read`, :meth:`chain`, :meth:`head_logits` and
    :meth:`choose` do."""

    #: The target's final (normed) hidden states.
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, target: CausalLM, head: Any, temperature: float = 0.0, seed: int | None = None):
        self.target = target
        self.head = head
        self.cache = head.make_cache()
        #: The head's outputs (``normed``, ``chained``: ``[1, 1, H]``) at the last position it
        #: read the target's state of, or None (nothing read since the last proposal).
        self.last: tuple[mx.array, mx.array] | None = None
        #: The target position of the next hidden state expected (None: nothing handed yet).
        self.expected: int | None = None
        #: Positions of the head's cache written by chained steps (forgotten before the next read).
        self.chained = 0
        self.temperature = temperature
        self._key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
        #: The logits the last proposal was drawn from (``[k, V]``), or None (greedy).
        self.draft_logits: mx.array | None = None

    def read(self, tokens: mx.array, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """The head over the target's states ``hidden [1, L, W]`` and the tokens that followed
        them (``[1, L]``), on this row's cache: ``(normed, chained)``."""
        normed, chained = self.head(self.target.embed(tokens), hidden, self.cache)
        return normed, chained

    def chain(self, tokens: mx.array, chained: mx.array) -> tuple[mx.array, mx.array]:
        """One chained step: the head over its own previous output and the token it drafted."""
        return self.read(tokens, chained)

    def head_logits(self, normed: mx.array) -> mx.array:
        """The logits of the head's normed outputs ``[R, 1, H]`` (every drafting row's)."""
        logits: mx.array = self.target.lm_logits(normed)
        return logits

    def choose(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """The drafted token ``[1]`` (a target id) from :meth:`head_logits`' row ``[1, V']``, and
        the target-vocabulary logits it was drawn from (None: the greedy choice)."""
        token, self._key, scaled = draft_choice(logits, self.temperature, self._key)
        return token, scaled

    def observe(self, start: int, hidden: mx.array, following: Sequence[int]) -> None:
        """The head reads the target's states with the tokens that followed, in one pass (its
        graph queued, not waited for): its cache then holds those positions."""
        if self.expected is not None and start != self.expected:
            self.cache, self.chained = self.head.make_cache(), 0  # a gap: start afresh from here
        self._forget_chain()
        tokens = mx.array(list(following), dtype=mx.int32)[None]
        normed, chained = self.read(tokens, hidden[None])
        self.last = (normed[:, -1:], chained[:, -1:])
        mx.async_eval(*self.last)
        self.expected = start + hidden.shape[0]

    def _forget_chain(self) -> None:
        if self.chained:
            self.cache.trim(self.chained)
            self.chained = 0

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        return self.propose_rows([self], [history], [k])[0]

    @classmethod
    def propose_rows(
        cls, drafters: Sequence[MtpDrafter], histories: Sequence[Sequence[int]], ks: Sequence[int]
    ) -> list[list[int]]:
        """Every row's draft (:class:`~mlxr_core.engine.speculation.DraftsTogether`): per chain
        step, each row's head pass on its own cache, then one LM head over all rows' outputs
        (the LM head's weights, the largest part of a step, read once, not once per row); one
        read back at the end."""
        rows: list[list[Any]] = []  # [index, drafter, normed, chained, k] of the rows that draft
        for index, (drafter, history, k) in enumerate(zip(drafters, histories, ks, strict=True)):
            drafter.draft_logits = None
            drafter._forget_chain()
            last, drafter.last = drafter.last, None
            # The states read must end just before the row's next input (history[-1]).
            if last is not None and k > 0 and drafter.expected == len(history) - 1:
                rows.append([index, drafter, *last, k])
        proposed: list[list[mx.array]] = [[] for _ in drafters]
        drawn: list[list[mx.array]] = [[] for _ in drafters]
        for step in range(max((row[4] for row in rows), default=0)):
            active = [row for row in rows if row[4] > step]
            logits = active[0][1].head_logits(mx.concatenate([row[2] for row in active]))[:, 0]
            for at, row in enumerate(active):
                index, drafter = row[0], row[1]
                token, scaled = drafter.choose(logits[at : at + 1])
                drawn[index].extend([] if scaled is None else [scaled])
                proposed[index].append(token)
                if step + 1 < row[4]:
                    row[2], row[3] = drafter.chain(token[:, None], row[3])
                    drafter.chained += 1
        for drafter, draws in zip(drafters, drawn, strict=True):
            drafter.draft_logits = mx.concatenate(draws) if draws else None
        tokens = [mx.concatenate(row) if row else mx.zeros((0,), dtype=mx.int32) for row in proposed]
        mx.eval(tokens)
        return [row.tolist() for row in tokens]  # type: ignore[misc]


class MtpDecoder(PlainDecoder):
    """Plain decoding whose requests draft with the checkpoint's MTP head inside the batch."""

    def __init__(self) -> None:
        #: model name -> its draft head (an :class:`MtpHead` here, a subclass's own kind).
        self.heads: dict[str, Any] = {}

    def prepare(self, model: LoadedModel, registries: Any, config: Any) -> None:
        """Read ``model``'s MTP head (refused, naming ``models[].speculative.method``, where the
        checkpoint has none), and tell the model what its keys and values cost a row per position."""
        if model.name not in self.heads:
            head = self.heads[model.name] = load_mtp_head(model, registries)
            shapes = model.arch.kernel_context(model.config)
            itemsize = DTYPES[model.dtype].size
            model.drafter_bytes_per_token = position_bytes(
                [head.make_cache()], int(shapes["n_kv_heads"]), int(shapes["head_dim"]), itemsize
            )

    def release(self, model_name: str) -> None:
        self.heads.pop(model_name, None)

    def row_drafter(self, model: LoadedModel, request: GenerationRequest) -> MtpDrafter:
        head = self.heads.get(model.name)
        if head is None or not isinstance(model.model, CausalLM):
            raise MlxrError(f"speculative method mtp: no MTP head was read for model {model.name}")
        params = request.params
        return MtpDrafter(model.model, head, temperature=params.temperature, seed=params.seed)
