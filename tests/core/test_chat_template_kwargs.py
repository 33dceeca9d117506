"""Template variables: a model's ``chat_template_kwargs`` reach every chat's template, a
request's override them, and the names the rendering sets itself are refused."""

from __future__ import annotations

from typing import Any

import pytest

from mlxr_core.chat.tools import ModelParsers, prepare_chat
from mlxr_core.engine.admission import ModelInfo
from mlxr_core.errors import RequestError
from mlxr_core.model.chat_template import render_chat_template

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)


class Tokenizer:
    chat_template = TEMPLATE
    bos_token_id = None
    add_bos = False

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return render_chat_template(TEMPLATE, messages, **kwargs)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


def prompt(model: dict[str, Any], request: dict[str, Any] | None) -> str:
    info = ModelInfo("m", 1 << 16, 0, Tokenizer(), "test", "test")
    parsers = ModelParsers(template_kwargs=model)
    messages = [{"role": "user", "content": "hi"}]
    return prepare_chat(info, parsers, messages, template_kwargs=request).prompt  # type: ignore[arg-type]


def test_the_models_variables_and_the_requests_over_them() -> None:
    assert prompt({}, None) == "<user>hi<assistant>"
    assert prompt({"enable_thinking": False}, None) == "<user>hi<assistant><think></think>"
    assert prompt({"enable_thinking": False}, {"enable_thinking": True}) == "<user>hi<assistant>"
    assert prompt({}, {"enable_thinking": False}) == "<user>hi<assistant><think></think>"


@pytest.mark.parametrize("name", ["messages", "tools", "add_generation_prompt"])
def test_the_renderings_own_names_are_refused(name: str) -> None:
    with pytest.raises(RequestError, match=f"must not set '{name}'") as error:
        prompt({}, {name: 1})
    assert error.value.field == "chat_template_kwargs"
