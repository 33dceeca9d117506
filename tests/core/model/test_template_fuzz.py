"""The chat-template mutator's slice (:mod:`mlxr_core.testing.template_fuzz`): every hostile
fragment alone and spliced into the templates mlxr ships, each either rendered within its limits
or refused with a RequestError; none runs on past the render deadline (shortened here)."""

from __future__ import annotations

import pytest

from mlxr_core.testing import template_fuzz


def shipped_templates() -> list[str]:
    from mlxr_plugins.archs.gemma3 import Gemma3Architecture
    from mlxr_plugins.parsers.harmony_template import HARMONY_CHAT_TEMPLATE

    simple = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    gemma = Gemma3Architecture().default_chat_template({})
    return [t for t in (simple, gemma, HARMONY_CHAT_TEMPLATE) if t]


def test_mutated_templates_render_within_limits_or_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxr_core.model import chat_template

    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.3)
    cases = list(template_fuzz.template_cases(shipped_templates(), 80, seed=1))
    found = {case[:160]: problem for case in cases if (problem := template_fuzz.judge(case, slack=1.0))}
    assert found == {}
