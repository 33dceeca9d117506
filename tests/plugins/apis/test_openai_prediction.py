"""OpenAI Predicted Outputs on the real engine (tiny random model): the answer is the model's own
whatever the prediction says, and the usage reports the prediction's accepted and rejected tokens
as OpenAI does; ``speculative: false`` drafts nothing; a malformed prediction is a 400."""

from __future__ import annotations

from typing import Any


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "edit this"}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True, **fields}  # fmt: skip


def test_a_prediction_drafts_and_the_answer_is_the_models_own(tiny_app):
    plain = tiny_app.post("/v1/chat/completions", json=chat()).json()
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]
    right = tiny_app.post("/v1/chat/completions", json=chat(prediction={"type": "content", "content": text})).json()
    assert right["choices"][0]["message"]["content"] == text
    details = right["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert right["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    parts = [{"type": "text", "text": "something else entirely, "}, {"type": "text", "text": "nothing alike"}]
    wrong = tiny_app.post("/v1/chat/completions", json=chat(prediction={"type": "content", "content": parts})).json()
    assert wrong["choices"][0]["message"]["content"] == text
    assert wrong["usage"]["completion_tokens_details"]["rejected_prediction_tokens"] > 0
    streamed = tiny_app.post(
        "/v1/chat/completions",
        json=chat(prediction={"type": "content", "content": text}, stream=True, stream_options={"include_usage": True}),
    )
    assert '"accepted_prediction_tokens"' in streamed.text


def test_speculative_false_drafts_nothing(tiny_app):
    text = tiny_app.post("/v1/chat/completions", json=chat()).json()["choices"][0]["message"]["content"]
    body = chat(prediction={"type": "content", "content": text}, speculative=False)
    reply = tiny_app.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["message"]["content"] == text
    # A prediction was given: its counts are reported (zeros here), as OpenAI reports them.
    assert reply["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0,
                                                          "reasoning_tokens": 0}


def test_a_malformed_prediction_is_a_400(tiny_app):
    for prediction in ({"type": "file", "content": "x"}, {"type": "content"}, "x"):
        r = tiny_app.post("/v1/chat/completions", json=chat(prediction=prediction))
        assert r.status_code == 400, (prediction, r.text)
        assert "prediction" in r.text


def test_a_prediction_longer_than_the_context_is_a_400_naming_it(tiny_app):
    """A drafter scans its prediction as the output leaves it: one longer than the model can ever
    output is refused, found from a head of the text, before any row drafts from it."""
    context = tiny_app.get("/v1/models").json()["data"][0].get("context_length") or 512
    r = tiny_app.post("/v1/chat/completions", json=chat(prediction={"type": "content", "content": "ab " * (4 * context)}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prediction"
    assert tiny_app.post("/v1/chat/completions", json=chat()).status_code == 200
