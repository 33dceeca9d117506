"""Multi-token prediction: the MTP head the checkpoint carries drafts inside the batch
(``models[].speculative: {method: mtp, k: N}``; the head's math in
:mod:`mlxr_core.model.layers.mtp`).

Each row keeps the head's own cache. The batch hands the row's drafter the target's final hidden
states of every position it kept, with the tokens that followed them (the prompt's chunk by chunk
as it is prefilled, then each verification's accepted span:
:class:`~mlxr_core.engine.speculation.ReadsHidden`). The rows of a step read their spans together
when they propose: one pass of the head over every row (the rows' caches joined into one batch
cache, right-aligned; spans of different lengths padded at the end and masked, the padding
dropped after, as verification's drafts are), whose last position per row guesses the token
after the row's next input; each further draft token is one more pass over the rows still
drafting, chaining the head on its own output. Each row's cache is its own again after the step,
and its chained positions are forgotten before the head reads the target's states for them.
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
from mlxr_core.model.cache import BatchKVCache, KVCache, position_bytes
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
        #: The target's states (``[L, W]``) and the tokens that followed them (``[L]``) handed
        #: since the last proposal, read when the rows propose together (None: nothing handed).
        self.pending: tuple[mx.array, mx.array] | None = None
        #: The target position of the next hidden state expected (None: nothing handed yet).
        self.expected: int | None = None
        #: Positions of the head's cache written by chained steps (forgotten before the next read).
        self.chained = 0
        self.temperature = temperature
        self._key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
        #: The logits the last proposal was drawn from (``[k, V]``), or None (greedy).
        self.draft_logits: mx.array | None = None

    def read(self, tokens: mx.array, hidden: mx.array, cache: Any, mask: Any = None) -> tuple[mx.array, mx.array]:
        """The head over the target's states ``hidden [B, L, W]`` and the tokens that followed
        them (``[B, L]``), on ``cache`` (this row's, or the drafting rows' batch cache) with
        ``mask`` (None: causal): ``(normed, chained)``."""
        normed, chained = self.head(self.target.embed(tokens), hidden, cache, mask)
        return normed, chained

    def chain(self, tokens: mx.array, chained: mx.array, cache: Any, mask: Any = None) -> tuple[mx.array, mx.array]:
        """One chained step: the head over its own previous output and the token it drafted."""
        return self.read(tokens, chained, cache, mask)

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
        """Keep the target's states with the tokens that followed, for the head to read when the
        rows next propose (together); a span handed before it was read (a prompt's earlier
        chunk) is read first, alone (its graph queued, not waited for)."""
        if self.expected is not None and start != self.expected:
            self.cache, self.chained, self.pending = self.head.make_cache(), 0, None  # a gap: afresh
        elif self.pending is not None:
            tokens, states = self.pending
            self.pending = None
            mx.async_eval(*self.read(tokens[None], states[None], self.cache))
        self._forget_chain()
        self.pending = (mx.array(list(following), dtype=mx.int32), hidden)
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
        """Every row's draft (:class:`~mlxr_core.engine.speculation.DraftsTogether`): one head
        pass over every row's pending span (:class:`HeadRows`), then per chain step one LM head
        over the drafting rows' outputs and one head pass over those that draft further; one
        read back at the end."""
        for drafter in drafters:
            drafter.draft_logits = None
            drafter._forget_chain()
        reading = [index for index, drafter in enumerate(drafters) if drafter.pending is not None]
        drafting = [
            index for index in reading if ks[index] > 0 and drafters[index].expected == len(histories[index]) - 1
        ]  # the states read must end just before the row's next input (history[-1])
        proposed: list[list[mx.array]] = [[] for _ in drafters]
        drawn: list[list[mx.array]] = [[] for _ in drafters]
        if reading:
            spans = [drafters[index].pending for index in reading]
            room = max(len(span[0]) for span in spans if span is not None) + max(ks)
            rows = HeadRows([drafters[index] for index in reading], room)
            normed, chained = rows.read()
            keep = [at for at, index in enumerate(reading) if index in drafting]
            normed, chained = rows.keep(keep, normed, chained)
            step = 0
            while drafting:
                logits = drafters[drafting[0]].head_logits(normed)[:, 0]
                tokens = []
                for at, index in enumerate(drafting):
                    token, scaled = drafters[index].choose(logits[at : at + 1])
                    drawn[index].extend([] if scaled is None else [scaled])
                    proposed[index].append(token)
                    tokens.append(token)
                step += 1
                further = [at for at, index in enumerate(drafting) if ks[index] > step]
                if further:
                    normed, chained = rows.keep(further, normed, chained)
                    picked = mx.concatenate([tokens[at] for at in further])[:, None]
                    normed, chained = rows.chain(picked, chained)
                else:
                    rows.keep([], normed, chained)
                drafting = [drafting[at] for at in further]
        for drafter, draws in zip(drafters, drawn, strict=True):
            drafter.draft_logits = mx.concatenate(draws) if draws else None
        tokens = [mx.concatenate(row) if row else mx.zeros((0,), dtype=mx.int32) for row in proposed]
        mx.eval(tokens)
        return [row.tolist() for row in tokens]  # type: ignore[misc]


class HeadRows:
    """The rows of one step that the head runs over together: their pending spans read in one
    pass, then chained steps over those still drafting. Two or more rows' caches are joined into
    one :class:`~mlxr_core.model.cache.BatchKVCache` (right-aligned: each row's own rotary
    positions, its padding masked); a row that leaves (:meth:`keep`) gets its own cache back,
    holding exactly the positions it wrote (one row alone runs on its own cache)."""

    def __init__(self, drafters: Sequence[MtpDrafter], room: int):
        self.drafters = list(drafters)
        self.cache: Any = self.drafters[0].cache
        if len(self.drafters) > 1:
            self.cache = self._join([drafter.cache for drafter in self.drafters], room)

    @staticmethod
    def _join(caches: list[Any], room: int) -> BatchKVCache:
        """The rows' caches as one batch cache, right-aligned, with ``room`` free positions after
        (one copy of every row's positions)."""
        if any(type(cache) is not KVCache for cache in caches):  # another kind: its own batching
            batch = caches[0].to_batch()
            for cache in caches[1:]:
                batch.extend(cache.to_batch())
            return batch  # type: ignore[no-any-return]
        length = max(cache.offset for cache in caches)
        written = [cache for cache in caches if cache.keys is not None and cache.offset > 0]
        if not written:
            return BatchKVCache.for_prompts([0] * len(caches))
        like = written[0]
        capacity = -(-(length + room) // BatchKVCache.step) * BatchKVCache.step

        def rows(name: str) -> mx.array:
            parts = []
            for cache in caches:
                buffer = getattr(cache, name) if cache.offset > 0 else None
                if buffer is None:
                    shape = getattr(like, name).shape
                    parts.append(mx.zeros((1, shape[1], capacity, shape[3]), getattr(like, name).dtype))
                else:
                    before = length - cache.offset
                    after = capacity - length
                    parts.append(mx.pad(buffer[:, :, : cache.offset], [(0, 0), (0, 0), (before, after), (0, 0)]))
            return mx.concatenate(parts, axis=0)

        padding = [length - cache.offset for cache in caches]
        return BatchKVCache(rows("keys"), rows("values"), padding, length)

    def _mask(self, queries: int) -> mx.array | None:
        batched = isinstance(self.cache, BatchKVCache)
        if batched and (queries > 1 or self.cache.padded):
            mask: mx.array = self.cache.draft_mask(queries)
            return mask
        return None  # one row (the head's causal mask), or rows of one length and one query

    def read(self) -> tuple[mx.array, mx.array]:
        """One pass over every row's pending span (shorter spans padded at the end, their padding
        dropped from the cache after): each row's ``(normed, chained)`` at its span's last
        position, ``[R, 1, H]`` each."""
        spans = [drafter.pending for drafter in self.drafters if drafter.pending is not None]
        assert len(spans) == len(self.drafters)
        lengths = [int(tokens.shape[0]) for tokens, _ in spans]
        longest = max(lengths)
        tokens = mx.stack([mx.pad(part, (0, longest - part.shape[0])) for part, _ in spans])
        hidden = mx.stack([mx.pad(part, [(0, longest - part.shape[0]), (0, 0)]) for _, part in spans])
        for drafter in self.drafters:
            drafter.pending = None
        normed, chained = self.drafters[0].read(tokens, hidden, self.cache, self._mask(longest))
        if isinstance(self.cache, BatchKVCache) and longest > min(lengths):
            self.cache.rollback([longest - n for n in lengths])
        last = mx.array([n - 1 for n in lengths])[:, None, None]
        return mx.take_along_axis(normed, last, axis=1), mx.take_along_axis(chained, last, axis=1)

    def chain(self, tokens: mx.array, chained: mx.array) -> tuple[mx.array, mx.array]:
        """One chained step of every row left (``tokens [R, 1]``, ``chained [R, 1, H]``)."""
        for drafter in self.drafters:
            drafter.chained += 1
        return self.drafters[0].chain(tokens, chained, self.cache, self._mask(1))

    def keep(self, rows: list[int], *outputs: mx.array) -> tuple[mx.array, ...]:
        """Keep rows ``rows`` (in order) of the pass and of ``outputs``; the others' caches go
        back to them."""
        if rows == list(range(len(self.drafters))):
            return outputs
        if isinstance(self.cache, BatchKVCache):
            for at, drafter in enumerate(self.drafters):
                if at not in rows:
                    drafter.cache = self._extract(at, drafter.cache)
            if len(rows) == 1:
                self.cache = self._extract(rows[0], self.drafters[rows[0]].cache)
                self.drafters[rows[0]].cache = self.cache
            elif rows:
                self.cache.filter(rows)
        self.drafters = [self.drafters[at] for at in rows]
        index = mx.array(rows, dtype=mx.int32)
        return tuple(output[index] for output in outputs)

    def _extract(self, row: int, own: Any) -> Any:
        extracted = self.cache.extract(row)
        extracted.width = getattr(own, "width", None)
        return extracted


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
