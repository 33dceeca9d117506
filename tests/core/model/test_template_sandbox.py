"""The chat-template sandbox bounds every operation, inside filters and calls too: each hostile
expression is refused with a RequestError within the render deadline (shortened here), and ordinary
templates render exactly as in Jinja's own sandbox."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxr_core.errors import RequestError
from mlxr_core.model import chat_template, template_sandbox
from mlxr_core.model.template_sandbox import BoundedEnvironment, TooLarge

USER = [{"role": "user", "content": "Hi"}]
DEADLINE = 0.3
#: What a refusal may take past the deadline: one bounded operation, and a loaded machine.
SLACK = 1.5

MAPS = "|map('string')|map('length')" * 3
#: Issue 42's reproductions (N2): each ran from 16 s to past a minute before it failed, if it did.
N2 = {
    "map_chain_over_16m_items": "{{ ((range(100000)|list)*160)" + MAPS + "|sum }}",
    "lipsum_of_2m_paragraphs": "{{ lipsum(n=2000000) }}",
    "center_filter_1e9": "{{ 'x'|center(1000000000) }}",
    "format_filter_width_1e9": "{{ '%1000000000s'|format('x') }}",
    "sort_16m_strings": "{{ ((range(100000)|list)*160)|map('string')|sort|length }}",
    "center_method_2e9": "{{ 'x'.center(2000000000) }}",
}
#: Work within every size limit that only the deadline stops: each item a filter takes checks it.
UNTIL_THE_DEADLINE = {
    "map_chain_over_1m_items": "{{ ((range(100000)|list)*10)" + MAPS * 4 + "|sum }}",
    "sort_1m_strings": "{{ ((range(100000)|list)*10)|map('string')|map('string')|sort|length }}",
    "join_1m_strings": "{{ ((range(100000)|list)*10)|map('string')|map('string')|join(',')|length }}",
    "unique_1m": "{{ ((range(100000)|list)*10)|map('string')|unique|list|length }}",
    "filter_per_item_forever": "{% for i in range(100000) %}{{ range(100000)|select('odd')|list|length }}{% endfor %}",
}
#: Operations refused before they start: each would build a string, a list or a text past a limit.
PAST_A_LIMIT = {
    "str_format_width": "{{ '{:>1000000000}'.format('x') }}",
    "str_format_nested_width": "{{ '{0:{1}}'.format('x', 1000000000) }}",
    "str_format_repeated_field": "{{ ('{0}' * 1000).format('x' * 1000000) }}",
    "format_map": "{{ '{a:>1000000000}'.format_map({'a': 'x'}) }}",
    "percent_width": "{{ '%1000000000s' % 'x' }}",
    "percent_star": "{{ '%*s' % (1000000000, 'x') }}",
    "percent_precision": "{{ '%.1000000000f' % 1.0 }}",
    "indent_many_lines": "{{ ('x\n' * 100000)|indent(100000) }}",
    "wordwrap_long_text": "{{ ('ab ' * 1000000)|wordwrap(1) }}",
    "replace_filter": "{{ ('x' * 1000000)|replace('x', 'y' * 100) }}",
    "replace_method_empty_old": "{{ ('x' * 1000000).replace('', 'y' * 100) }}",
    "ljust": "{{ 'x'.ljust(1000000000) }}",
    "rjust": "{{ 'x'.rjust(1000000000) }}",
    "markup_center": "{{ ('x'|safe).center(1000000000) }}",
    "markup_join": "{{ ('x'|safe).join(['x' * 1000000] * 100) }}",
    "zfill": "{{ '1'.zfill(1000000000) }}",
    "expandtabs": "{{ ('\t' * 1000000).expandtabs(1000) }}",
    "translate": "{{ ('x' * 1000000).translate({120: 'y' * 1000}) }}",
    "join_method": "{{ ','.join(['x' * 1000000] * 100) }}",
    "split_16m_parts": "{{ (' ' * 16000000).split(' ')|length }}",
    "list_repetition": "{{ [0] * 100000000 }}",
    "heavy_list_repetition": "{{ ['x' * 1000000] * 1000 }}",
    "batch_fill": "{{ [1]|batch(100000000, 'x')|list }}",
    "slice_fill": "{{ range(100000)|slice(100000, 'x' * 1000)|list }}",
    "tojson_indent": "{{ range(1000)|list|tojson(indent=100000) }}",
    "pprint": "{{ (range(100000)|list)|pprint }}",
    "lipsum_long_paragraphs": "{{ lipsum(n=1, max=10000000) }}",
    # Doubling by shared references: 64 small lists, 2**64 copies of 'x' once written out.
    "shared_list": "{% set ns = namespace(v='x') %}{% for i in range(64) %}{% set ns.v = [ns.v, ns.v] %}{% endfor %}{{ ns.v }}",
    "shared_dict": "{% set ns = namespace(v='x') %}{% for i in range(64) %}{% set ns.v = dict(a=ns.v, b=ns.v) %}{% endfor %}{{ ns.v|length }}",
    "shared_tuple_compared": "{% set ns = namespace(v='x') %}{% for i in range(64) %}{% set ns.v = (ns.v, ns.v) %}{% endfor %}{{ ns.v == ns.v }}",
    "shared_tuple_hashed": "{% set ns = namespace(v='x') %}{% for i in range(40) %}{% set ns.v = (ns.v, ns.v) %}{% endfor %}{{ ns.v in {} }}",
    "shared_in_a_message": "{% set ns = namespace(v='x') %}{% for i in range(64) %}{% set ns.v = [ns.v, ns.v] %}{% endfor %}{{ raise_exception(ns.v) }}",
    "namespace_of_big_strings": "{% set ns = namespace(a='x' * 16000000) %}{% set ns.b = ns.a %}{{ ns }}",
    "fromkeys": "{{ {}.fromkeys(range(100000), 'x' * 1000000) }}",
    # A loop inside a block or a macro keeps every piece it writes until the block ends.
    "set_block_of_big_pieces": "{% set s %}{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}{% endset %}{{ s|length }}",
    "macro_of_big_pieces": "{% macro m() %}{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}{% endmacro %}{{ m()|length }}",
}


def render_on_a_thread(template: str, limit: float) -> tuple[BaseException | str | None, float]:
    """Render ``template`` on a daemon thread; its outcome (None if still running after ``limit``
    seconds, when the thread is left behind) and how long it took."""
    outcome: list[BaseException | str] = []

    def render() -> None:
        try:
            outcome.append(chat_template.render_chat_template(template, USER))
        except BaseException as exc:
            outcome.append(exc)

    chat_template.render_chat_template("{{ 1 }}", [])  # the environment is built once, untimed
    started = time.monotonic()
    thread = threading.Thread(target=render, daemon=True)
    thread.start()
    thread.join(limit)
    return (outcome[0] if outcome else None), time.monotonic() - started


@pytest.fixture
def short_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", DEADLINE)


@pytest.mark.usefixtures("short_deadline")
@pytest.mark.parametrize("name", list(N2) + list(UNTIL_THE_DEADLINE) + list(PAST_A_LIMIT))
def test_hostile_expressions_are_refused_within_the_deadline(name: str) -> None:
    template = {**N2, **UNTIL_THE_DEADLINE, **PAST_A_LIMIT}[name]
    outcome, took = render_on_a_thread(template, DEADLINE + SLACK)
    assert outcome is not None, f"still rendering after {took:.1f} s"
    assert isinstance(outcome, RequestError), repr(outcome)[:300]
    assert outcome.field == "messages"
    if name in UNTIL_THE_DEADLINE:
        assert "longer than 0.3 s" in str(outcome)
    elif name in PAST_A_LIMIT:
        assert "size limit" in str(outcome) and "past the limit of" in str(outcome), str(outcome)


@pytest.mark.usefixtures("short_deadline")
def test_a_memory_error_while_rendering_is_a_request_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def exhausted(format: str) -> str:
        raise MemoryError

    monkeypatch.setitem(chat_template._environment().globals, "strftime_now", exhausted)
    with pytest.raises(RequestError, match="more memory") as info:
        chat_template.render_chat_template("{{ strftime_now('%Y') }}", USER)
    assert info.value.field == "messages"


# -- ordinary templates render as in Jinja's sandbox ---------------------------------------------

ORDINARY = [
    "{{ messages|map(attribute='content')|join(', ') }}",
    "{{ messages|selectattr('role', 'equalto', 'user')|list|length }}",
    "{{ messages|rejectattr('role', 'in', ['system'])|map(attribute='role')|list }}",
    "{{ messages|groupby('role')|map(attribute='grouper')|join }}",
    "{{ [3, 1, 2]|sort|join }}|{{ [3, 1, 2]|sort(reverse=true)|first }}|{{ [1, 5, 3]|max }}{{ [1, 5, 3]|min }}",
    "{{ range(5)|sum }}|{{ [[1], [2]]|sum(start=[]) }}|{{ [1, 2, 2]|unique|list }}",
    "{{ [1, 2, 3, 4, 5]|batch(2, 0)|list }}|{{ [1, 2, 3, 4, 5]|slice(2)|list }}|{{ [1, 2]|reverse|list }}",
    "{{ 'abc'|reverse }}|{{ {'b': 1, 'a': 2}|dictsort }}|{{ {'a': 1}|items|list }}|{{ 'ab'|list }}",
    "{{ 'ab'|center(6) }}|{{ 'x'.rjust(3, '-') }}|{{ 'x'.ljust(2) }}|{{ '7'.zfill(3) }}",
    "{{ '%s-%05d'|format('a', 7) }}|{{ '%s=%s' % ('a', 1) }}|{{ '%(a)s' % {'a': 2} }}|{{ 5 % 3 }}",
    "{{ '{}:{:>4}'.format('a', 'b') }}|{{ '{a}'.format_map({'a': 1}) }}|{{ '{0}{0}'.format('z') }}",
    "{{ 'a\nb'|indent(2, true) }}|{{ 'a b c d'|wordwrap(3) }}|{{ 'aaa'|replace('a', 'bb', 2) }}",
    "{{ 'a,b,c'.split(',') }}|{{ ' x '.strip() ~ 'y' }}|{{ 'a\nb'.splitlines() }}|{{ 'a b'.split() }}",
    "{{ '\t'.expandtabs(4) }}|{{ '-'.join(['a', 'b']) }}|{{ 'ab'.translate({97: 'c'}) }}|{{ 'aa'.replace('a', 'b') }}",
    "{{ [1] + [2] }}{{ 'a' * 3 }}{{ [0] * 2 }}{{ 2 ** 10 }}{{ 'a' + 'b' }}{{ (1,) * 2 }}",
    "{{ 1 in [1, 2] }}{{ 'a' == 'a' }}{{ (1, 2) }}{{ {'a': [1]} }}{{ 1 is eq 1 }}{{ 1 is in [1] }}",
    "{{ ['a', 'b']|select('in', 'abc')|list }}|{{ [1, 2]|first }}{{ [1, 2]|last }}|{{ messages|length }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{{ ns }}",
    "{% macro f(x) %}<{{ x }}>{% endmacro %}{{ f(1) }}{% set s %}{{ f(2) }}{% endset %}{{ s }}",
    "{{ dict(a=1)|tojson }}|{{ 'x'|pprint }}|{{ lipsum(2, false, 5, 10)|length > 0 }}|{{ 'a' ~ 1 ~ [2] }}",
    "{{ messages[0].content|upper|trim|truncate(10) }}|{{ 'a b'|title }}|{{ 3.7|int }}|{{ '<b>'|striptags }}",
]


@pytest.mark.parametrize("template", ORDINARY)
def test_ordinary_templates_render_as_in_jinjas_sandbox(template: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER, {"role": "assistant", "content": "Hello there"}]
    ours = BoundedEnvironment().from_string(template).render(messages=messages)
    theirs = ImmutableSandboxedEnvironment().from_string(template).render(messages=messages)
    assert ours == theirs


def test_the_chat_environments_own_filters_are_bounded() -> None:
    environment = chat_template._environment()
    with pytest.raises(TooLarge, match="indent"):
        environment.from_string("{{ [1]|tojson(indent=1000) }}").render()


# -- weight ----------------------------------------------------------------------------------


def test_weight_is_the_length_of_the_text_and_shared_references_are_walked_once() -> None:
    value: Any = ["ab", 1, None, {"k": (2.5, True)}]
    for _ in range(16):
        value = [value, value]
    assert len(str(value)) <= template_sandbox.weigh(value) <= 4 * len(str(value))
    for _ in range(48):
        value = [value, value]
    started = time.monotonic()
    with pytest.raises(TooLarge, match="text length"):
        template_sandbox.weigh(value)  # 2**64 copies, 65 lists
    assert time.monotonic() - started < 0.5
