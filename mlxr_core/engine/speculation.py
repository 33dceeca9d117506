"""Speculation inside the batch: each row's drafter proposes tokens, the target verifies every
row's draft in one forward pass, each row accepts its own prefix and forgets the rest alone.

A row's draft ``d_1..d_k`` follows its next input ``t`` (the token the plain step would feed).
The batch feeds ``[t, d_1..d_K]`` to every row, ``K`` the longest draft, shorter drafts padded at
the end (a padded position is a rejected draft token like any other: the causal mask keeps it from
the positions before it). Row ``j`` of a row's logits is the target's distribution after ``d_j``
(row 0: after ``t``). At temperature 0 the longest prefix of the draft equal to the target's
choices is accepted, then the target's own choice after it, so the output is the target's greedy
output token for token. Otherwise draft token ``d_j`` is accepted with probability
``min(1, p_j(d_j) / q_j(d_j))``; the first rejected one is replaced by a draw from
``norm(max(0, p_j - q_j))``, and when all are accepted a bonus token is drawn from ``p_{k+1}``
(Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"): the output
is distributed as the target's. A drafter that draws its tokens says from what (``draft_logits``:
``q_j = softmax``); n-grams and a client's prediction are deterministic, a point mass,
``q_j(d_j) = 1``.

A row whose sampler follows the emitted tokens (penalties, grammars: ``stateful``) is verified
position by position, its processors told each accepted draft token before the next position's
logits are processed, exactly as plain decoding would have told them. A grammar's drafts are cut
at the first token it does not allow before they are verified (``valid_prefix``), so a drafted
token outside the grammar is never fed, let alone emitted.

Drafters are registered as decoders (``mlxr_register_decoders``) that offer ``row_drafter`` (see
:class:`DraftingDecoder`); the plain decoder is the one that proposes nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import mlx.core as mx

if TYPE_CHECKING:
    from mlxr_core.config.schema import SpeculationConfig
    from mlxr_core.engine.decoding import RequestSampler
    from mlxr_core.engine.request import GenerationRequest
    from mlxr_core.model.loader import LoadedModel

#: The decoder (``mlxr_register_decoders``) whose ``row_drafter`` drafts from a request's
#: ``prediction`` (OpenAI's Predicted Outputs), whatever the model's own method.
PREDICTION_METHOD = "prediction"


@runtime_checkable
class Drafter(Protocol):
    """One request's drafter: proposes the tokens it expects to follow, for one row of the batch."""

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens expected after ``history`` (the prompt and every token emitted so
        far; its last one is the row's next input). Called on the engine thread once per step in
        which the row may draft; cheap, or batched by the drafter itself. A drafter that draws
        its tokens also sets ``draft_logits``: the ``[n, V]`` logits the ``n`` tokens it proposed
        were drawn from (their softmax), or None for deterministic tokens (read with ``getattr``)."""
        ...


@runtime_checkable
class DraftsTogether(Protocol):
    """A drafter whose rows of one step propose in one call: what every row would compute
    alone is batched where it can be (an MTP head's LM head over every row's position at once)."""

    @classmethod
    def propose_rows(
        cls, drafters: Sequence[DraftsTogether], histories: Sequence[Sequence[int]], ks: Sequence[int]
    ) -> list[list[int]]:
        """Each drafter's :meth:`Drafter.propose` of its row's history and ``k`` (all of this
        class), each setting its own ``draft_logits`` as that would."""
        ...


@runtime_checkable
class ReadsHidden(Protocol):
    """A drafter that drafts from the target's hidden states (an MTP head, an EAGLE-3 head): the
    batch hands it the hidden states of the positions its row keeps, computed by the passes that
    run anyway: the prompt's prefill, and each verification's accepted span. Which states:
    :attr:`hidden_layers`."""

    #: Empty: the final (normed) hidden states. Else the target layers whose inputs (the
    #: residual stream entering layer ``i``; ``0``: the embeddings) it reads, concatenated in
    #: this order (``[n, len(hidden_layers) * H]``).
    hidden_layers: tuple[int, ...]

    def observe(self, start: int, hidden: mx.array, following: Sequence[int]) -> None:
        """``hidden`` (``[n, W]``) of target positions ``start .. start + n - 1`` and the ``n``
        tokens that followed them (the last is the row's next input). A ``start`` past the last
        position handed means the row decoded steps without them."""
        ...


def drafter_hidden(drafter: ReadsHidden, final: mx.array, layers: Mapping[int, mx.array]) -> mx.array:
    """The states ``drafter`` reads (:attr:`ReadsHidden.hidden_layers`) from one pass's final
    hidden states and its layers' inputs (``[..., L, W]``)."""
    wanted = drafter.hidden_layers
    return final if not wanted else mx.concatenate([layers[index] for index in wanted], axis=-1)


@runtime_checkable
class DraftingDecoder(Protocol):
    """A decoder that drafts inside the batch: registered through ``mlxr_register_decoders`` and
    named by ``models[].speculative.method`` (or ``models[].decoder``). Its ``prepare`` (see
    :class:`~mlxr_core.engine.decoding.Decoder`) runs once per model first."""

    def row_drafter(self, model: LoadedModel, request: GenerationRequest) -> Drafter | None:
        """The drafter of one request of ``model`` (its own state, if any), or None when it has
        nothing to draft for that request. Called on the engine thread when the request is admitted."""
        ...


def draft_choice(logits: mx.array, temperature: float, key: mx.array) -> tuple[mx.array, mx.array, mx.array | None]:
    """A drafter's next token from its logits ``[1, V]`` (lazy): the greedy choice at temperature
    0, else a draw at ``temperature``. Returns the token ``[1]``, the key to draw with next, and
    the scaled logits it was drawn from (None for the greedy choice: a point mass)."""
    if temperature <= 0:
        return mx.argmax(logits, axis=-1).astype(mx.int32), key, None
    scaled = logits.astype(mx.float32) / temperature
    key, draw = mx.random.split(key)
    return mx.random.categorical(scaled, key=draw).astype(mx.int32), key, scaled


def speculative_sample(
    target_logits: mx.array, draft: mx.array, draft_logits: mx.array | None, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Rejection sampling of a ``k``-token draft against the target (lazy arrays).

    :param target_logits: ``[k + 1, V]`` processed target logits (temperature etc. applied).
    :param draft: ``[k]`` draft token ids.
    :param draft_logits: ``[k, V]`` processed logits the draft tokens were drawn from, or None for
        a deterministic draft.
    :return: ``accepted`` (``[k]`` bool: draft token ``i`` passes its test) and ``replacement``
        (``[k + 1]`` ids: row ``i < k`` is what to emit when draft token ``i`` is the first
        rejected one, row ``k`` the bonus token when every draft token is accepted).
    """
    k = draft.shape[0]
    log_p = target_logits - mx.logsumexp(target_logits, axis=-1, keepdims=True)
    p = mx.exp(log_p[:k])
    index = draft.astype(mx.int32)[:, None]
    p_x = mx.take_along_axis(p, index, axis=-1)[:, 0]
    if draft_logits is None:
        q_x = mx.ones_like(p_x)
        columns = mx.arange(p.shape[-1])[None, :]
        residual = mx.where(columns == index, 0.0, p)
    else:
        q = mx.softmax(draft_logits, axis=-1)
        q_x = mx.take_along_axis(q, index, axis=-1)[:, 0]
        residual = mx.maximum(p - q, 0.0)
    accept_key, draw_key = mx.random.split(key)
    u = mx.random.uniform(shape=(k,), key=accept_key)
    accepted = u * q_x < p_x
    # A residual of zero mass only happens where p == q, and then the draft token is always
    # accepted (u < 1); fall back to p there so the draw is well defined.
    empty = mx.sum(residual, axis=-1, keepdims=True) <= 0
    residual_logits = mx.where(empty, log_p[:k], mx.log(residual))
    rows = mx.concatenate([residual_logits, log_p[k:]], axis=0)
    replacement = mx.random.categorical(rows, key=draw_key)
    return accepted, replacement


def verify_rows(
    logits: mx.array,
    drafts: Sequence[Sequence[int]],
    samplers: Sequence[RequestSampler],
    draft_logits: Sequence[mx.array | None] | None = None,
) -> tuple[list[list[int]], dict[int, BaseException]]:
    """Each row's tokens to emit: its accepted draft prefix, then one token of the target's.

    :param logits: ``[B, K + 1, V]`` raw target logits over each row's ``[t, *draft, *padding]``.
    :param draft_logits: per row, the logits its draft was drawn from (``[k, V']``, ``V' <= V``),
        or None for a deterministic draft (see :class:`Drafter`); used by sampled rows only.
    :return: the tokens per row, and the rows whose sampler raised (with placeholder tokens).
    """
    widths = draft_logits if draft_logits is not None else [None] * len(drafts)
    qs = [None if q is None else _widened(q, logits.shape[-1]) for q in widths]
    emitted: list[list[int]] = [[] for _ in drafts]
    failed: dict[int, BaseException] = {}
    lazy: dict[int, tuple[mx.array, ...]] = {}
    for i, (draft, sampler) in enumerate(zip(drafts, samplers, strict=True)):
        if sampler.stateful:
            continue
        try:
            rows = logits[i, : len(draft) + 1]
            if sampler.greedy:
                lazy[i] = (mx.argmax(rows if sampler.plain_greedy else sampler.process(rows), axis=-1),)
            elif not draft:
                lazy[i] = (sampler(rows),)
            else:
                proposed = mx.array(list(draft), dtype=mx.int32)
                lazy[i] = speculative_sample(sampler.process(rows), proposed, qs[i], sampler.next_key())
        except Exception as exc:
            failed[i] = exc
    mx.eval([array for arrays in lazy.values() for array in arrays])
    for i, arrays in lazy.items():
        draft = list(drafts[i])
        if len(arrays) == 1:  # the target's choice at every position
            choices: list[int] = arrays[0].tolist()  # type: ignore[assignment]
            n = 0
            while n < len(draft) and draft[n] == choices[n]:
                n += 1
            emitted[i] = [*draft[:n], choices[n]]
        else:
            passed: list[bool] = arrays[0].tolist()  # type: ignore[assignment]
            replacements: list[int] = arrays[1].tolist()  # type: ignore[assignment]
            n = 0
            while n < len(draft) and passed[n]:
                n += 1
            emitted[i] = [*draft[:n], replacements[n]]
    for i, (draft, sampler) in enumerate(zip(drafts, samplers, strict=True)):
        if sampler.stateful:
            try:
                emitted[i] = verify_in_order(logits[i, : len(draft) + 1], list(draft), sampler, qs[i])
            except Exception as exc:
                failed[i] = exc
    for i in failed:
        emitted[i] = [0]
    return emitted, failed


def _widened(draft_logits: mx.array, width: int) -> mx.array:
    """``[k, V']`` draft logits as wide as the target's (``-inf`` past the draft's vocabulary)."""
    extra = width - draft_logits.shape[-1]
    if extra <= 0:
        return draft_logits[:, :width]
    return mx.pad(draft_logits.astype(mx.float32), [(0, 0), (0, extra)], constant_values=-mx.inf)


def verify_in_order(
    logits: mx.array, draft: list[int], sampler: RequestSampler, draft_logits: mx.array | None = None
) -> list[int]:
    """A stateful sampler's row: position by position, each accepted draft token told to its
    processors (``accept``) before the next position's logits are processed. The last token
    returned (the target's own) is not told: the next step tells it, as plain decoding does."""
    for j, token in enumerate(draft):
        processed = sampler.process(logits[j : j + 1])
        if sampler.greedy:
            choice = int(mx.argmax(processed, axis=-1).item())  # type: ignore[arg-type]
            if choice != token:
                return [*draft[:j], choice]
        else:
            accepted, replacement = speculative_sample(
                processed,
                mx.array([token], dtype=mx.int32),
                None if draft_logits is None else draft_logits[j : j + 1],
                sampler.next_key(),
            )
            if not bool(accepted.item()):
                return [*draft[:j], int(replacement[0].item())]  # type: ignore[arg-type]
        sampler.accept(token)
    return [*draft, int(sampler(logits[len(draft) :]).item())]  # type: ignore[arg-type]


def next_k(k: int, drafted: int, accepted: int, settings: SpeculationConfig) -> int:
    """A row's next draft length from its last verification: one more after a draft accepted
    whole, one fewer after one rejected in its first half, within ``[min_k, max_k]``."""
    if not settings.adaptive or drafted == 0:
        return k
    if accepted == drafted and drafted >= k:
        return min(k + 1, settings.max_k)
    if accepted < (drafted + 1) // 2:
        return max(k - 1, settings.min_k)
    return k


def lookup_draft(source: Sequence[int], context: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed, in ``source``, the latest occurrence of the longest
    suffix n-gram of ``context`` (``n`` from ``max_ngram`` down to ``min_ngram``); empty without a
    match. Where ``source`` is ``context`` itself (prompt lookup), a match close to the end
    continues into the draft, so periodic text drafts ``k`` tokens too."""
    size, same = len(context), source is context
    # The search runs over the ids as 4-byte words with bytes.rfind (C speed): a pure-Python scan
    # of a long prompt or prediction at every step held the whole batch (1.5 s a step at 1M ids).
    words = array("i", source).tobytes()
    for n in range(min(max_ngram, size - 1 if same else size), min_ngram - 1, -1):
        suffix = array("i", context[size - n :]).tobytes()
        # The latest start with a token after the match (periodic text continues into the draft).
        last_start = size - n - 1 if same else len(source) - n - 1
        at = words.rfind(suffix, 0, (last_start + n) * 4) if last_start >= 0 and k > 0 else -1
        while at > 0 and at % 4:  # a match across two ids' bytes: look further back
            at = words.rfind(suffix, 0, at + len(suffix) - 1)
        if at < 0:
            continue
        start = at // 4
        draft: list[int] = []
        for i in range(start + n, start + n + k):
            if i < len(source):
                draft.append(source[i])
            elif same:
                draft.append(draft[i - size])
            else:
                break
        return draft
    return []


def draft_inputs(tokens: Sequence[int], drafts: Sequence[Sequence[int]]) -> tuple[mx.array, int]:
    """``[B, K + 1]`` inputs of a verification: each row's next input then its draft, padded at
    the end (with its last token) to the longest draft's ``K``; and ``K``."""
    longest = max((len(draft) for draft in drafts), default=0)
    rows = [
        [token, *draft, *([draft[-1] if draft else token] * (longest - len(draft)))]
        for token, draft in zip(tokens, drafts, strict=True)
    ]
    return mx.array(rows, dtype=mx.int32), longest

