"""Speculative decoding: a draft model proposes ``k`` tokens, the served model verifies them in one
forward pass (see :mod:`mlxr_plugins.decoders.drafting` for the acceptance rule, which keeps the
served model's output: its greedy output exactly at temperature 0, its distribution otherwise).

The draft model is any model mlxr can load with the same vocabulary (``plugins.config.decoders.
speculative.draft``), loaded when the engine starts, with its own cache per request. ``k`` adapts
to the acceptance: one more after a pass that accepted every draft token, one fewer after a pass
that rejected in the first half, within ``[min_draft_tokens, max_draft_tokens]``.

Inside the batch (:mod:`mlxr_core.engine.speculation`) each request has its own draft cache and
the draft model proposes its greedy choices row by row (its passes are not batched across rows);
``k`` is then ``models[].speculative``'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from mlxr_core.config.schema import ModelConfig
from mlxr_core.engine.decoding import DraftStats, RequestSampler
from mlxr_core.engine.request import GenerationRequest
from mlxr_core.engine.speculation import draft_choice
from mlxr_core.errors import ConfigError, MlxrError
from mlxr_core.model.loader import LoadedModel, load_model
from mlxr_plugins.decoders.config import DecodersConfig, SpeculativeConfig
from mlxr_plugins.decoders.drafting import check_trimmable, logits_width, trim, verify
from mlxr_plugins.decoders.plain import prefill

DRAFT_KEY = "plugins.config.decoders.speculative.draft"
#: Token ids compared between the two vocabularies (spread over the whole range), besides the
#: special ones.
VOCAB_SAMPLE = 256


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise a :class:`ConfigError` naming what differs between the two models' vocabularies:
    size, BOS/EOS ids, or the text of sampled token ids."""
    a, b = target.tokenizer, draft.tokenizer
    problems = []
    if a.vocab_size != b.vocab_size:
        problems.append(f"vocabulary size {a.vocab_size} vs {b.vocab_size}")
    if a.bos_token_id != b.bos_token_id:
        problems.append(f"BOS id {a.bos_token_id} vs {b.bos_token_id}")
    if a.eos_token_ids != b.eos_token_ids:
        problems.append(f"EOS ids {sorted(a.eos_token_ids)} vs {sorted(b.eos_token_ids)}")
    size = min(a.vocab_size, b.vocab_size)
    sample = sorted({*range(0, size, max(1, size // VOCAB_SAMPLE)), size - 1})
    differing = [
        (i, text_a, text_b)
        for i in sample
        if (text_a := a.decode([i], skip_special_tokens=False))
        != (text_b := b.decode([i], skip_special_tokens=False))
    ]
    if differing:
        shown = ", ".join(f"{i}: {ta!r} vs {tb!r}" for i, ta, tb in differing[:3])
        problems.append(f"{len(differing)} of {len(sample)} sampled token ids differ ({shown})")
    if problems:
        raise ConfigError(
            f"speculative decoding for model {target.name}: the draft model {draft.path} does not "
            f"share its vocabulary: {'; '.join(problems)}",
            field=DRAFT_KEY,
        )


class _Draft:
    """A served model's draft model and the logits width both share."""

    def __init__(self, model: LoadedModel, width: int, config: SpeculativeConfig):
        self.model = model
        self.width = width
        self.config = config


class DraftModelDrafter:
    """One request's draft model inside the batch (:class:`~mlxr_core.engine.speculation.Drafter`):
    its own cache of the draft model, which keeps the part of the request's tokens both agree on,
    catches up on the rest, and proposes the draft model's greedy choices for a greedy request;
    for a sampled one, draws from the draft model's distribution at the request's temperature and
    says so (:attr:`draft_logits`), which verification needs to keep the target's distribution
    (:mod:`mlxr_core.engine.speculation`)."""

    def __init__(self, draft: _Draft, temperature: float = 0.0, seed: int | None = None, prefill_chunk: int = 512):
        self.draft = draft
        self.cache = draft.model.make_cache()
        #: The tokens the draft's cache holds, in order.
        self.fed: list[int] = []
        self.prefill_chunk = prefill_chunk
        self.temperature = temperature
        self._key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
        #: The logits the last proposal was drawn from (``[k, V]``), or None (greedy).
        self.draft_logits: mx.array | None = None

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        model, width = self.draft.model, self.draft.width
        same = 0
        for mine, theirs in zip(self.fed, history, strict=False):
            if mine != theirs:
                break
            same += 1
        same = min(same, len(history) - 1)  # the last token is fed again for its logits
        trim(self.cache, len(self.fed) - same)
        del self.fed[same:]
        last = prefill(model, self.cache, list(history[same:]), self.prefill_chunk)
        self.fed = list(history[:-1])
        logits = model.model(last[None], cache=self.cache)[:, -1, :width]
        self.fed.append(history[-1])
        proposed: list[mx.array] = []
        drawn: list[mx.array] = []
        for i in range(k):
            token, self._key, scaled = draft_choice(logits, self.temperature, self._key)
            drawn.extend([] if scaled is None else [scaled])
            proposed.append(token)
            if i + 1 < k:
                logits = model.model(token[None], cache=self.cache)[:, -1, :width]
        self.draft_logits = mx.concatenate(drawn) if drawn else None
        if not proposed:
            return []
        tokens: list[int] = mx.concatenate(proposed).tolist()  # type: ignore[assignment]
        self.fed.extend(tokens[:-1])
        return tokens


class SpeculativeDecoder:
    """See :mod:`mlxr_plugins.decoders.speculative` and :class:`~mlxr_core.engine.decoding.Decoder`.
    Inside the batch it drafts for each row (:meth:`row_drafter`); :meth:`generate` serves one
    request alone (embedding the decoder from Python)."""

    batched = True

    def __init__(self) -> None:
        self.drafts: dict[str, _Draft] = {}
        self.draft_stats: dict[str, DraftStats] = {}

    def prepare(self, model: LoadedModel, registries: Any, config: DecodersConfig | None) -> None:
        """Load the draft model for ``model`` and check both models' vocabularies and caches."""
        section = config.speculative if config is not None else SpeculativeConfig()
        if not section.draft:
            raise ConfigError(
                f"model {model.name} uses decoder speculative but {DRAFT_KEY} names no draft "
                "model; set it to a model path sharing this model's vocabulary",
                field=DRAFT_KEY,
            )
        try:
            draft = load_model(
                ModelConfig(
                    path=section.draft,
                    name=f"{model.name}:draft",
                    quantization=section.draft_quantization,
                    context_length=model.context_length,
                    dtype=model.dtype,
                ),
                registries,
            )
        except MlxrError as exc:
            raise ConfigError(
                f"speculative decoding for model {model.name}: the draft model did not load: {exc}",
                field=DRAFT_KEY,
            ) from exc
        check_same_vocabulary(model, draft)
        check_trimmable(draft.make_cache(), "speculative", f"{model.name}'s draft {draft.path}")
        width = min(logits_width(model), logits_width(draft))
        self.drafts[model.name] = _Draft(draft, width, section)
        self.draft_stats.setdefault(model.name, DraftStats())

    def release(self, model_name: str) -> None:
        self.drafts.pop(model_name, None)

    def row_drafter(self, model: LoadedModel, request: GenerationRequest) -> DraftModelDrafter:
        prepared = self.drafts.get(model.name)
        if prepared is None:
            raise MlxrError(f"speculative decoding: no draft model was prepared for model {model.name}")
        params = request.params
        return DraftModelDrafter(prepared, temperature=params.temperature, seed=params.seed)

    def generate(
        self,
        model: LoadedModel,
        cache: list[Any],
        prompt_ids: list[int],
        sampler: RequestSampler,
        *,
        prefill_chunk: int,
    ) -> Iterator[int]:
        prepared = self.drafts.get(model.name)
        if prepared is None:
            raise MlxrError(f"speculative decoding: no draft model was prepared for model {model.name}")
        draft, width, config = prepared.model, prepared.width, prepared.config
        stats = self.draft_stats.setdefault(model.name, DraftStats())
        check_trimmable(cache, "speculative", model.name)
        draft_cache = draft.make_cache()
        tokens = list(prompt_ids)
        prefill(model, cache, tokens, prefill_chunk)
        prefill(draft, draft_cache, tokens, prefill_chunk)
        k = min(max(config.num_draft_tokens, config.min_draft_tokens), config.max_draft_tokens)
        while True:
            # The draft's cache holds a prefix of ``tokens``; it catches up on the rest first.
            steps = max(0, min(k, model.context_length - cache[0].offset - 1))
            inputs = mx.array(tokens[draft_cache[0].offset :], dtype=mx.int32)
            proposed: list[mx.array] = []
            rows: list[mx.array] = []
            for _ in range(steps):
                processed = sampler.process(draft.model(inputs[None], cache=draft_cache)[:, -1, :width])
                inputs = sampler.draw(processed).astype(mx.int32)
                mx.async_eval(inputs)
                proposed.append(inputs)
                rows.append(processed)
            drafted = mx.concatenate(proposed) if proposed else mx.zeros((0,), dtype=mx.int32)
            before = len(tokens)
            verify_inputs = mx.concatenate([mx.array([tokens[-1]], dtype=mx.int32), drafted])
            logits = model.model(verify_inputs[None], cache=cache)[0, :, :width]
            draft_logits = mx.concatenate(rows) if rows and not sampler.greedy else None
            accepted, emitted = verify(logits, drafted, sampler, draft_logits)
            trim(cache, steps - accepted)
            # Keep what the draft saw of the agreed tokens; it feeds the rest next pass.
            trim(draft_cache, draft_cache[0].offset - min(draft_cache[0].offset, before + accepted))
            if steps:
                stats.add(steps, accepted)
                if accepted == steps and steps == k:
                    k = min(k + 1, config.max_draft_tokens)
                elif accepted < (steps + 1) // 2:
                    k = max(k - 1, config.min_draft_tokens)
            for token in emitted:
                tokens.append(token)
                yield token
