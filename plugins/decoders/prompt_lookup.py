"""Prompt lookup decoding: drafts copied from n-gram matches in the prompt and the output so far.

Editing, summarising or quoting a given text repeats long runs of it: when the last ``n`` tokens
occurred earlier, the tokens that followed them there are a good guess for what comes next. The
guess is verified by one forward pass of the model (see :mod:`mlxr_plugins.decoders.drafting`), so
the output is the model's own: token for token at temperature 0, in distribution otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from mlxr_core.engine.decoding import DraftStats, RequestSampler
from mlxr_core.engine.request import GenerationRequest
from mlxr_core.engine.speculation import lookup_draft
from mlxr_core.model.loader import LoadedModel
from mlxr_plugins.decoders.config import DecodersConfig, PromptLookupConfig
from mlxr_plugins.decoders.drafting import check_trimmable, trim, verify
from mlxr_plugins.decoders.plain import prefill


def find_draft(tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix
    n-gram of ``tokens`` (``n`` from ``max_ngram`` down to ``min_ngram``); empty without a match.

    A match close to the end continues into the draft itself, so periodic text drafts ``k``
    tokens too (``a b a b`` after ``a b`` drafts ``a b a b ...``).
    """
    return lookup_draft(tokens, tokens, k, max_ngram, min_ngram)


class PromptLookupDrafter:
    """One request's drafter inside the batch (:class:`~mlxr_core.engine.speculation.Drafter`):
    n-grams of its own prompt and output."""

    def __init__(self, config: PromptLookupConfig):
        self.config = config

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        return lookup_draft(history, history, k, self.config.max_ngram, self.config.min_ngram)


class PromptLookupDecoder:
    """See :mod:`mlxr_plugins.decoders.prompt_lookup` and :class:`~mlxr_core.engine.decoding.Decoder`."""

    #: Inside the batch it drafts for each row (:meth:`row_drafter`); :meth:`generate` serves
    #: one request alone (embedding the decoder from Python).
    batched = True

    def __init__(self) -> None:
        self.config = PromptLookupConfig()
        self.draft_stats: dict[str, DraftStats] = {}

    def prepare(self, model: LoadedModel, registries: Any, config: DecodersConfig | None) -> None:
        if config is not None:
            self.config = config.prompt_lookup
        # Inside the batch every cache kind undoes rejected tokens (or the batch drafts nothing);
        # serving a request alone (:meth:`generate`) needs caches that trim.
        self.draft_stats.setdefault(model.name, DraftStats())

    def row_drafter(self, model: LoadedModel, request: GenerationRequest) -> PromptLookupDrafter:
        return PromptLookupDrafter(self.config)

    def generate(
        self,
        model: LoadedModel,
        cache: list[Any],
        prompt_ids: list[int],
        sampler: RequestSampler,
        *,
        prefill_chunk: int,
    ) -> Iterator[int]:
        config = self.config
        check_trimmable(cache, "prompt_lookup", model.name)
        stats = self.draft_stats.setdefault(model.name, DraftStats())
        tokens = list(prompt_ids)
        prefill(model, cache, tokens, prefill_chunk)
        while True:
            room = model.context_length - cache[0].offset - 1
            proposal = find_draft(tokens, config.num_draft_tokens, config.max_ngram, config.min_ngram)
            proposal = proposal[: max(room, 0)]
            draft = mx.array(proposal, dtype=mx.int32)
            inputs = mx.array([tokens[-1], *proposal], dtype=mx.int32)
            logits = model.model(inputs[None], cache=cache)[0]
            accepted, emitted = verify(logits, draft, sampler)
            trim(cache, len(proposal) - accepted)
            if proposal:
                stats.add(len(proposal), accepted)
            for token in emitted:
                tokens.append(token)
                yield token
