"""Predicted Outputs (OpenAI's ``prediction: {"type": "content", "content": ...}``): the text the
client expects the answer to be, tokenized, is the draft. Editing a file, the answer is mostly
the file again: while the output follows the prediction, the next ``k`` predicted tokens are the
draft; where the output leaves it (an edit), the draft comes from the latest place in the
prediction where the output's last n-gram occurs, so it picks the prediction up again after
the edit. Verified inside the batch like any draft (:mod:`mlxr_core.engine.speculation`): the
output is the model's own, and the usage counts the prediction's accepted and rejected tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxr_core.engine.request import GenerationRequest
from mlxr_core.engine.speculation import lookup_draft
from mlxr_core.model.loader import LoadedModel
from mlxr_plugins.decoders.plain import PlainDecoder

#: The longest and shortest n-gram of the output looked up in the prediction after an edit.
MAX_NGRAM = 4
MIN_NGRAM = 2


class PredictionDrafter:
    """One request's prediction as its drafter (:class:`~mlxr_core.engine.speculation.Drafter`)."""

    def __init__(self, prediction: Sequence[int], prompt_length: int):
        self.prediction = list(prediction)
        self.prompt_length = prompt_length
        #: Output tokens known to equal the prediction's first ones (checked once each).
        self.matched = 0
        self.followed = True

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        output = history[self.prompt_length :]
        if self.followed:
            while self.matched < len(output):
                if self.matched >= len(self.prediction) or output[self.matched] != self.prediction[self.matched]:
                    self.followed = False
                    break
                self.matched += 1
            if self.followed:
                return self.prediction[self.matched : self.matched + k]
        return lookup_draft(self.prediction, output, k, MAX_NGRAM, MIN_NGRAM)


class PredictionDecoder(PlainDecoder):
    """Plain decoding whose requests with a ``prediction`` draft from it inside the batch (the
    engine asks this decoder for any request that brings one, whatever the model's decoder)."""

    def row_drafter(self, model: LoadedModel, request: GenerationRequest) -> PredictionDrafter | None:
        if not request.prediction:
            return None
        return PredictionDrafter(request.prediction, len(request.prompt_ids))
