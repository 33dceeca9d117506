"""A mutator of chat templates: real templates with hostile fragments spliced in.

:func:`template_cases` takes the chat templates mlxr ships or meets (passed in) and, with a seed,
inserts fragments that loop, multiply, recurse, work inside filters and calls (widths, formats,
chains over millions of items, values doubled by shared references), reach for attributes the
sandbox forbids or read what the messages do not hold, at random points between the template's own
tags. :func:`judge` renders one through
:func:`~mlxr_core.model.chat_template.render_chat_template` and says what is wrong: an exception
other than a :class:`~mlxr_core.errors.RequestError`, an output past the cap, or a render that ran
well past the deadline. The CI runs a slice
(``tests/core/model/test_template_fuzz.py``); ``bench/fuzz_loaders.py --templates N`` the rest.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

#: Fragments that a hostile or broken template holds.
HOSTILE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(10**9) %}{{ i }}{% endfor %}",
    "{{ 'x' * 10**9 }}",
    "{{ messages * 10**8 }}",
    "{{ 2 ** 10**7 }}",
    "{% set s = namespace(v='ab') %}{% for i in range(64) %}{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v }}",
    "{% set s = namespace(v='ab') %}{% for i in range(64) %}{% set s.v = s.v + s.v %}{% endfor %}{{ s.v }}",
    "{% set s = namespace(v=[1]) %}{% for i in range(64) %}{% set s.v = s.v + s.v %}{% endfor %}{{ s.v | length }}",
    "{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}",
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ raise_exception('refused') }}",
    "{{ messages[10**6]['content'] }}",
    "{{ messages[0]['no_such_key'].upper() }}",
    "{{ none_defined + 1 }}",
    "{{ (messages | tojson) * 10**7 }}",
    "{{ range(10**8) | list | length }}",
    "{% set x = [0] %}{% for i in range(10**7) %}{% set _ = x.append(i) %}{% endfor %}",
    "{{ '%s' % ('x' * 10**8) }}",
    "{{ messages | map(attribute='content') | join('x' * 10**7) }}",
    "{% if %}",
    "{% for %}{% endfor %}",
    "{{ {}.update({'a': 1}) }}",
    "{{ [].extend(range(10**8)) }}",
    "{{ 'abc'.format(0) * 10**8 }}",
    # Work inside filters and calls, far from any loop (issue 42, N2), and its relatives.
    "{{ ((range(100000)|list)*160)|map('string')|map('length')|map('string')|map('length')|sum }}",
    "{{ ((range(100000)|list)*10)|map('string')|map('length')|map('string')|map('length')|sum }}",
    "{{ ((range(100000)|list)*10)|map('string')|sort|join(',')|length }}",
    "{{ lipsum(n=2000000) }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ '%1000000000s'|format('x') }}",
    "{{ '%1000000000s' % 'x' }}",
    "{{ 'x'.center(2000000000) }}",
    "{{ '{0:{1}}'.format('x', 10**9) }}",
    "{{ ('x' * 10**6)|replace('x', 'y' * 100) }}",
    "{{ ('x\n' * 10**5)|indent(10**5) }}",
    "{{ ('\t' * 10**6).expandtabs(1000) }}",
    "{{ ','.join(['x' * 10**6] * 100) }}",
    "{{ [1]|batch(10**8, 'x')|list }}",
    "{% set ns = namespace(v='x') %}{% for i in range(64) %}{% set ns.v = [ns.v, ns.v] %}{% endfor %}{{ ns.v }}",
    "{% set ns = namespace(v='x') %}{% for i in range(64) %}{% set ns.v = (ns.v, ns.v) %}{% endfor %}{{ ns.v == ns.v }}",
    "{% set s %}{% for i in range(10**5) %}{{ 'x' * 10**6 }}{% endfor %}{% endset %}{{ s|length }}",
)
_TAG = re.compile(r"({%.*?%}|{{.*?}})", re.S)


def template_cases(templates: list[str], count: int, seed: int = 0) -> Iterator[str]:
    """``count`` mutated templates: each fragment of :data:`HOSTILE` alone, then templates from
    ``templates`` with one to three fragments spliced between their tags."""
    rng = random.Random(seed)
    made = 0
    for fragment in HOSTILE:
        if made == count:
            return
        yield fragment
        made += 1
    while made < count:
        parts = _TAG.split(rng.choice(templates))
        for _ in range(rng.randint(1, 3)):
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(HOSTILE))
        yield "".join(parts)
        made += 1


#: Messages the mutated templates render: a system prompt, a user turn, a tool call and its answer.
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
    {"role": "tool", "content": "1"},
]


def judge(template: str, *, slack: float = 2.0) -> str | None:
    """What is wrong with rendering ``template`` (None when it rendered within its limits or was
    refused with a RequestError): another exception, an output past the cap, or a render that
    went on more than ``slack`` seconds past the deadline. The render runs on a daemon thread, left
    behind when it overruns, so one runaway cannot hold the fuzzer."""
    from mlxr_core.errors import RequestError
    from mlxr_core.model import chat_template

    outcome: list[BaseException | str] = []

    def render() -> None:
        try:
            outcome.append(chat_template.render_chat_template(template, MESSAGES, bos_token="<s>", eos_token="</s>"))
        except BaseException as exc:
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=render, name="template-fuzz", daemon=True)
    thread.start()
    thread.join(chat_template.MAX_RENDER_SECONDS + slack)
    took = time.monotonic() - started
    if not outcome:
        return f"still rendering after {took:.1f} s"
    result = outcome[0]
    if isinstance(result, RequestError):
        return None
    if isinstance(result, BaseException):
        return f"{type(result).__name__}: {result}"
    if len(result) > chat_template.MAX_RENDER_CHARS:
        return f"rendered {len(result)} characters"
    if took > chat_template.MAX_RENDER_SECONDS + slack:
        return f"rendered for {took:.1f} s"
    return None
