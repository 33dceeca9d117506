"""Acceptance: the web page in a real headless Chromium against ``mlxr serve`` on a tiny model, with
an API key set and ``apis:`` left to its default (the page is on because the server binds loopback).

The page asks for the key, a reply streams into it, the stop button ends a long generation on the
server too, the conversation survives a reload, the status view plots tokens/s and time to first
token after requests, and the markdown renderer shows model text without ever running it. Several
conversations are listed, switched, renamed and deleted; an answer is regenerated and a question
edited and sent again; reasoning shows folded and tool calls shown; images are attached (file,
paste, drop) for a tiny random vision model only, as ``/v1/models``' capabilities say. The page runs under
its own Content-Security-Policy throughout, so a script or style it would load from elsewhere, or
inline, fails the test.

Needs Chromium (Debian's ``chromium``, or ``MLXR_CHROMIUM=/path``) and the ``playwright`` package
(no browser download: it drives that Chromium).
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from test_acceptance_openai import serving

CHROMIUM = os.environ.get("MLXR_CHROMIUM") or shutil.which("chromium")
#: A headless browser that talks to nothing but the server under test.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
KEY = "sk-webui-browser-test"
AUTH = {"authorization": f"Bearer {KEY}"}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright (pip install playwright)"),
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium, or MLXR_CHROMIUM=/path)"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    folder = tmp_path_factory.mktemp("webui")
    model = write_tiny_llama_gguf(folder / "tiny.gguf")
    config = folder / "server.yaml"
    config.write_text(json.dumps({
        "models": [{"path": str(model), "name": "tiny", "context_length": 8192}],
        "server": {"api_keys": [KEY]},
    }))
    with serving(config) as process:
        yield process.url()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``mlxr demo-vision``'s tiny random Gemma 3 vision model beside the tiny text model."""
    pytest.importorskip("PIL", reason="images need the vision extra (pip install 'mlxr[vision]')")
    from mlxr_core.cli.demo_vision import write_demo_vision
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    folder = tmp_path_factory.mktemp("webui-vision")
    config = folder / "server.yaml"
    config.write_text(json.dumps({
        "models": [
            {"path": str(write_demo_vision(folder / "vision")), "name": "vision", "compile_decode": False},
            {"path": str(write_tiny_llama_gguf(folder / "tiny.gguf")), "name": "tiny", "context_length": 256},
        ],
        "server": {"api_keys": [KEY], "max_image_pixels": 1_000_000},
    }))
    with serving(config) as process:
        yield process.url()


@contextmanager
def fresh_page(browser: Any, url: str) -> Iterator[Any]:
    """A fresh browser profile (empty localStorage) on the server at ``url``; fails the test on a
    script error or a Content-Security-Policy violation."""
    context = browser.new_context(base_url=url, viewport={"width": 1280, "height": 860})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
    try:
        yield page
    finally:
        context.close()
    assert not problems, problems


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:
    with fresh_page(browser, server) as page:
        yield page


@pytest.fixture
def vision_page(browser: Any, vision_server: str) -> Iterator[Any]:
    with fresh_page(browser, vision_server) as page:
        yield page


def until(page: Any, expression: str, timeout: float = 30.0) -> Any:
    """Poll a JavaScript expression until it is truthy (Playwright's own wait_for_function
    evaluates strings with eval, which the page's policy rightly forbids)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = page.evaluate(expression)
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"still false after {timeout}s: {expression}")


def sign_in(page: Any, models: tuple[str, ...] = ("tiny",)) -> None:
    """Open the page; it asks for the key (its first /v1/models was a 401); give it."""
    from playwright.sync_api import expect

    page.goto("/")
    assert page.url.endswith("/ui/")
    expect(page.locator("#key-dialog")).to_be_visible(timeout=10_000)
    page.fill("#key-input", KEY)
    page.click("#key-save")
    expect(page.locator("#model option")).to_have_text(list(models), timeout=10_000)


def without_eos(page: Any, sent: list[dict[str, Any]] | None = None) -> None:
    """Make the page's chat requests run to max_tokens (a random model may end at once): add the
    API's ``ignore_eos`` on the way out, and keep each body the page sent."""

    def extend(route: Any) -> None:
        body = json.loads(route.request.post_data)
        if sent is not None:
            sent.append(dict(body))
        route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))

    page.route("**/v1/chat/completions", extend)


def metrics(server: str) -> dict[str, float]:
    """The server's metrics samples, summed over their labels but ``reason``."""
    found: dict[str, float] = {}
    for line in httpx.get(f"{server}/metrics", headers=AUTH).text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{")[0]
        if name == "mlxr_requests_finished_total":
            name += "/" + name_labels.split('reason="')[1].split('"')[0]
        found[name] = found.get(name, 0.0) + float(value)
    return found


def test_a_reply_streams_in_and_the_conversation_survives_a_reload(page: Any, server: str) -> None:
    sign_in(page)
    sent: list[dict[str, Any]] = []
    without_eos(page, sent)
    page.fill("#system", "Answer briefly.")
    page.fill("#max-tokens", "1500")
    page.fill("#prompt", "Tell me a <b>story</b>.")
    with page.expect_response("**/v1/chat/completions") as response:
        page.press("#prompt", "Enter")
        # Text shows up while the reply is still streaming.
        partial = until(page, "(() => { const m = document.querySelector('.message.assistant.streaming .body');"
                              " return m && m.textContent.length > 0 && m.textContent.length; })()")
    assert response.value.headers["content-type"].startswith("text/event-stream")
    until(page, "!document.querySelector('.message.assistant.streaming')")
    final = page.inner_text(".message.assistant .body")
    assert 0 < partial < len(final)  # seen part-way
    meta = page.inner_text(".message.assistant .meta")
    assert "1500 tokens" in meta and "cut at max_tokens" in meta and "tokens/s" in meta, meta
    (body,) = sent
    assert body["stream"] is True and body["model"] == "tiny" and body["max_tokens"] == 1500
    assert body["messages"] == [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": "Tell me a <b>story</b>."}]
    assert body["temperature"] == 0.7 and body["top_p"] == 1
    assert page.inner_text(".message.user .body") == "Tell me a <b>story</b>."  # text, not markup

    page.reload()
    until(page, "document.querySelectorAll('#messages .message').length === 2")
    assert page.inner_text(".message.assistant .body") == final
    assert page.input_value("#system") == "Answer briefly." and page.input_value("#max-tokens") == "1500"
    page.click("#new-chat")
    assert page.locator("#messages .message").count() == 0


def test_the_stop_button_ends_a_long_generation_on_the_server_too(page: Any, server: str) -> None:
    sign_in(page)
    without_eos(page)
    page.fill("#max-tokens", "8000")
    cancelled = metrics(server).get("mlxr_requests_finished_total/cancelled", 0.0)
    page.fill("#prompt", "Go on forever.")
    page.press("#prompt", "Enter")
    until(page, "document.querySelector('.message.assistant.streaming .body')?.textContent.length > 0")
    assert page.is_visible("#stop") and not page.is_visible("#send")
    page.click("#stop")
    until(page, "!document.querySelector('.message.assistant.streaming')", timeout=10)
    assert "stopped" in page.inner_text(".message.assistant .meta")
    assert page.is_visible("#send") and not page.is_visible("#stop")
    text = page.inner_text(".message.assistant .body")
    time.sleep(0.5)
    assert page.inner_text(".message.assistant .body") == text  # nothing more arrives
    # The server saw the client leave and ended the generation (well before 8000 tokens).
    deadline = time.monotonic() + 10
    while metrics(server).get("mlxr_requests_finished_total/cancelled", 0.0) <= cancelled:
        assert time.monotonic() < deadline, "the server did not cancel the stopped generation"
        time.sleep(0.1)
    assert metrics(server)["mlxr_requests_running"] == 0


#: Pixels of a canvas in a series colour (saturated, unlike the grey grid and labels) above the
#: zero line: a line was drawn and it is not flat at zero.
PLOTTED = """(id) => {
  const canvas = document.getElementById(id);
  const { data, width, height } = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
  const bottom = Math.floor(height * 0.8);
  let count = 0;
  for (let y = 0; y < bottom; y += 1) {
    for (let x = 0; x < width; x += 1) {
      const i = (y * width + x) * 4;
      const [r, g, b, a] = [data[i], data[i + 1], data[i + 2], data[i + 3]];
      if (a > 128 && Math.max(r, g, b) - Math.min(r, g, b) > 80) count += 1;
    }
  }
  return count;
}"""


def test_the_status_view_plots_tokens_per_second_and_time_to_first_token_after_requests(
    page: Any, server: str
) -> None:
    sign_in(page)
    page.goto("/ui/#status")
    page.wait_for_selector("#status-view:not([hidden])")
    until(page, "document.querySelector('#engine-state').textContent === 'ready'")
    assert page.inner_text("#models tbody").startswith("tiny\t8192")
    assert page.evaluate(PLOTTED, "plot-tps") == 0  # nothing generated since the page opened
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "ignore_eos": True}
    for _ in range(3):
        r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    until(page, "Number(document.querySelector('#plot-ttft').dataset.points) >= 1")
    until(page, "Number(document.querySelector('#plot-tps').dataset.points) >= 2")
    until(page, "document.querySelector('#legend-tps').textContent !== ''")
    assert page.evaluate(PLOTTED, "plot-tps") > 20
    assert page.evaluate(PLOTTED, "plot-ttft") > 0
    assert page.evaluate(PLOTTED, "plot-memory") > 0
    assert page.inner_text("#legend-ttft").startswith("last ")
    assert int(page.inner_text("#stat-finished")) >= 3 and int(page.inner_text("#stat-generated")) >= 900
    assert page.inner_text("#stat-active").endswith("B")  # a size, not the placeholder


HOSTILE = "\n".join([
    "# Title",
    "",
    "Some **bold**, *italic*, `code <b>`, ~~gone~~, [a link](https://example.com/?a=1&b=2) and "
    "[bad](javascript:window.pwned=1).",
    "",
    "- one",
    "- two",
    "  - nested",
    "",
    "1. first",
    "2. second",
    "",
    "> quoted",
    "",
    "| a | b |",
    "|---|---|",
    "| 1 | <i>2</i> |",
    "",
    "```python",
    "print('<script>window.pwned=1</script>')",
    "```",
    "",
    '<img src=x onerror="window.pwned=1"> <script>window.pwned=1</script> <a href="javascript:x">y</a>',
])


def test_markdown_is_rendered_and_model_text_never_becomes_markup(page: Any) -> None:
    sign_in(page)
    conversation = [{"role": "user", "content": "<img src=x onerror=\"window.pwned=1\">"},
                    {"role": "assistant", "model": "tiny", "content": HOSTILE, "reasoning": ""}]
    page.evaluate("(c) => localStorage.setItem('mlxr.chat', JSON.stringify(c))", conversation)
    page.reload()
    until(page, "document.querySelectorAll('#messages .message').length === 2")
    reply = page.locator(".message.assistant .body")
    assert reply.locator("h1").inner_text() == "Title"
    assert reply.locator("strong").inner_text() == "bold" and reply.locator("em").inner_text() == "italic"
    assert reply.locator("p code").inner_text() == "code <b>" and reply.locator("del").inner_text() == "gone"
    link = reply.locator("a")
    assert link.count() == 1 and link.get_attribute("href") == "https://example.com/?a=1&b=2"
    assert link.get_attribute("rel") == "noopener noreferrer"
    assert "[bad](javascript:window.pwned=1)" in reply.inner_text()
    assert reply.locator(":scope > ul > li").count() == 2 and reply.locator("ul ul > li").inner_text() == "nested"
    assert reply.locator("ol > li").all_inner_texts() == ["first", "second"]
    assert reply.locator("blockquote").inner_text() == "quoted"
    assert reply.locator("table th").all_inner_texts() == ["a", "b"]
    assert reply.locator("table td").all_inner_texts() == ["1", "<i>2</i>"]
    assert reply.locator(".code .code-head span").inner_text() == "python"
    assert reply.locator(".code pre code").inner_text() == "print('<script>window.pwned=1</script>')"
    assert '<img src=x onerror="window.pwned=1">' in reply.inner_text()
    assert page.inner_text(".message.user .body") == '<img src=x onerror="window.pwned=1">'
    assert page.locator("#messages img, #messages script, #messages i, #messages [onerror]").count() == 0
    assert page.evaluate("window.pwned") is None


def finished(page: Any, count: int) -> None:
    """Until the conversation shows ``count`` messages and none is streaming."""
    until(page, f"document.querySelectorAll('#messages .message').length === {count}"
                " && !document.querySelector('.message.streaming')")


def titles(page: Any) -> list[str]:
    return [title.strip() for title in page.locator("#conversations .open").all_inner_texts()]


def test_conversations_are_listed_switched_renamed_deleted_and_kept_across_reloads(page: Any) -> None:
    sign_in(page)
    without_eos(page)
    page.fill("#max-tokens", "4")
    page.fill("#prompt", "first question")
    page.press("#prompt", "Enter")
    finished(page, 2)
    page.click("#new-chat")
    assert page.locator("#messages .message").count() == 0 and titles(page) == ["first question"]
    page.fill("#prompt", "second <b>question</b>")
    page.press("#prompt", "Enter")
    finished(page, 2)
    assert titles(page) == ["second <b>question</b>", "first question"]  # newest first, as text
    assert page.inner_text("#conversations li.current .open") == "second <b>question</b>"

    page.click("#conversations li:nth-child(2) .open")
    assert page.inner_text(".message.user .body") == "first question"
    page.hover("#conversations li:nth-child(2)")
    page.click("#conversations li:nth-child(2) .rename")
    page.fill("#conversations .rename-input", "Renamed")
    page.press("#conversations .rename-input", "Enter")
    assert titles(page) == ["second <b>question</b>", "Renamed"]

    page.reload()
    until(page, "document.querySelectorAll('#conversations li').length === 2")
    assert titles(page) == ["second <b>question</b>", "Renamed"]
    assert page.inner_text("#conversations li.current .open") == "Renamed"  # the one left open
    assert page.inner_text(".message.user .body") == "first question"

    # Delete asks first (a second click); the open conversation goes to the next one.
    page.click("#conversations li.current .delete")
    assert page.locator("#conversations li").count() == 2
    page.click("#conversations li.current .delete")
    assert titles(page) == ["second <b>question</b>"]
    assert page.inner_text(".message.user .body") == "second <b>question</b>"
    kept = page.evaluate("Object.keys(localStorage).filter((k) => k.startsWith('mlxr.conversation.')).length")
    assert kept == 1
    page.reload()
    until(page, "document.querySelectorAll('#conversations li').length === 1")
    assert titles(page) == ["second <b>question</b>"]


def test_two_tabs_add_to_one_list(page: Any) -> None:
    """Each tab reads the list again before changing it, and shows the other's changes."""
    sign_in(page)
    other = page.context.new_page()
    other.goto("/ui/")
    for tab, prompt in ((page, "asked in the first tab"), (other, "asked in the second tab")):
        without_eos(tab)
        tab.fill("#max-tokens", "2")
        tab.fill("#prompt", prompt)
        tab.press("#prompt", "Enter")
        finished(tab, 2)
    both = ["asked in the second tab", "asked in the first tab"]
    until(page, "document.querySelectorAll('#conversations li').length === 2")
    assert titles(page) == titles(other) == both
    page.reload()
    until(page, "document.querySelectorAll('#conversations li').length === 2")
    assert titles(page) == both


def test_regenerate_and_edit_and_resend_drop_what_came_after(page: Any) -> None:
    sign_in(page)
    sent: list[dict[str, Any]] = []
    without_eos(page, sent)
    page.fill("#max-tokens", "3")
    for prompt in ("one", "two"):
        page.fill("#prompt", prompt)
        page.press("#prompt", "Enter")
        finished(page, 2 if prompt == "one" else 4)
    first_reply = page.locator(".message.assistant .body").nth(0).inner_text()

    # Regenerate the last answer: the same conversation is sent again, and one answer stays.
    page.hover(".message.assistant >> nth=1")
    page.click(".message.assistant >> nth=1 >> .regenerate")
    finished(page, 4)
    assert sent[2]["messages"] == sent[1]["messages"]
    assert [m["role"] for m in sent[2]["messages"]] == ["user", "assistant", "user"]

    # Edit the first question: what came after it goes, the edited text is sent.
    page.hover(".message.user >> nth=0")
    page.click(".message.user >> nth=0 >> .edit")
    assert page.input_value(".message.user .edit-text") == "one"
    page.fill(".message.user .edit-text", "one, edited")
    page.click(".message.user .save-edit")
    finished(page, 2)
    assert sent[3]["messages"] == [{"role": "user", "content": "one, edited"}]
    assert page.inner_text(".message.user .body") == "one, edited"
    assert page.locator(".message.assistant").count() == 1

    # Regenerating the first answer of a longer conversation drops the turns after it.
    page.fill("#prompt", "three")
    page.press("#prompt", "Enter")
    finished(page, 4)
    page.hover(".message.assistant >> nth=0")
    page.click(".message.assistant >> nth=0 >> .regenerate")
    finished(page, 2)
    assert sent[-1]["messages"] == [{"role": "user", "content": "one, edited"}]
    assert first_reply  # a reply was there to regenerate
    # From the keyboard: the edit button takes focus; an edit cancelled with Escape changes nothing.
    page.focus(".message.user .edit")
    page.keyboard.press("Enter")
    page.fill(".message.user .edit-text", "never sent")
    page.press(".message.user .edit-text", "Escape")
    assert page.inner_text(".message.user .body") == "one, edited" and len(sent) == 6


def sse(*chunks: dict[str, Any]) -> str:
    """A chat completion stream of ``chunks`` as the server writes it."""
    return "".join(f"data: {json.dumps({'object': 'chat.completion.chunk', 'choices': [], **c})}\n\n"
                   for c in chunks) + "data: [DONE]\n\n"


def delta(finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}


TOOL_STREAM = sse(
    delta(role="assistant", reasoning_content="The user wants the weather; "),
    delta(reasoning_content="I should call <b>get_weather</b>."),
    delta(content="Let me check."),
    delta(tool_calls=[{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]),
    delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city": "<img src=x onerror=window.pwned=1>",'}}]),
    delta(tool_calls=[{"index": 0, "function": {"arguments": ' "unit": "C"}'}}]),
    delta("tool_calls"),
    {"usage": {"prompt_tokens": 9, "completion_tokens": 21, "total_tokens": 30}},
)
TOOL_ALONE = sse(
    delta(role="assistant"),
    delta(tool_calls=[{"index": 0, "id": "call_2", "type": "function", "function": {"name": "get_weather"}}]),
    delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]),
    delta("tool_calls"),
    {"usage": {"prompt_tokens": 9, "completion_tokens": 16, "total_tokens": 25}},
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_reasoning_is_folded_and_tool_calls_are_shown(page: Any) -> None:
    """The server's stream of reasoning, text and a tool call (the tiny model writes none, so the
    stream is played back to the page in the server's format)."""
    sign_in(page)
    sent: list[dict[str, Any]] = []
    streams = [TOOL_STREAM, TOOL_ALONE]

    def play(route: Any) -> None:
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=200, content_type="text/event-stream", body=streams[len(sent) - 1])

    page.route("**/v1/chat/completions", play)
    page.click(".tools-setting summary")
    page.fill("#tools", "[not json")
    page.fill("#prompt", "Weather in Paris?")
    page.press("#prompt", "Enter")
    until(page, "document.querySelector('.message.assistant.failed')")
    assert "Tools: not JSON" in page.inner_text(".message.assistant .meta") and not sent

    page.click("#new-chat")
    page.fill("#tools", json.dumps(TOOLS))
    page.select_option("#tool-choice", "required")
    page.fill("#prompt", "Weather in Paris?")
    page.press("#prompt", "Enter")
    finished(page, 2)
    assert sent[0]["tools"] == TOOLS and sent[0]["tool_choice"] == "required"
    reply = page.locator(".message.assistant")
    thinking = reply.locator("details.thinking")
    assert thinking.is_visible() and thinking.get_attribute("open") is None  # folded
    assert thinking.locator("summary").inner_text() == "Reasoning"
    assert not thinking.locator(".thinking-text").is_visible()
    thinking.locator("summary").click()
    thinking_text = "The user wants the weather; I should call <b>get_weather</b>."
    assert thinking.locator(".thinking-text").inner_text() == thinking_text
    assert reply.locator(".body").inner_text() == "Let me check."
    assert reply.locator(".tool-call .tool-name").inner_text() == "get_weather"
    arguments = reply.locator(".tool-call .tool-arguments").inner_text()
    assert json.loads(arguments) == {"city": "<img src=x onerror=window.pwned=1>", "unit": "C"} and "\n  " in arguments
    meta = reply.locator(".meta").inner_text()
    assert "21 tokens" in meta and "called a tool" in meta and "tokens/s" in meta
    page.reload()
    finished(page, 2)
    assert page.inner_text(".tool-call .tool-name") == "get_weather"
    assert page.text_content(".thinking-text") == thinking_text and page.get_attribute("details.thinking", "open") is None
    assert page.locator("#messages img").count() == 0 and page.evaluate("window.pwned") is None

    # A reply of a tool call alone (it comes whole, at the end): no rate from the moment it came.
    page.click("#new-chat")
    page.fill("#prompt", "Weather in Oslo?")
    page.press("#prompt", "Enter")
    finished(page, 2)
    meta = page.inner_text(".message.assistant .meta")
    assert meta.startswith("16 tokens · ") and meta.endswith(" s · called a tool") and "tokens/s" not in meta, meta
    assert page.inner_text(".tool-call .tool-arguments") == '{\n  "city": "Oslo"\n}'


def test_a_stored_conversation_never_becomes_markup_and_deep_quotes_reload(page: Any) -> None:
    """What the page stored, or someone edited in its storage, renders as text: titles, image
    addresses other than the data: images the page itself reads, tool calls; 5,000 nested ``>``
    render and the conversation still loads on every reload."""
    sign_in(page)
    hostile = "<img src=x onerror=\"window.pwned=1\">"
    messages = [
        {"role": "user", "content": "look", "images": [
            "javascript:window.pwned=1", "data:image/svg+xml;base64,PHN2ZyBvbmxvYWQ9J3dpbmRvdy5wd25lZD0xJz4=",
            "data:text/html;base64,PHNjcmlwdD53aW5kb3cucHduZWQ9MTwvc2NyaXB0Pg==", f"data:image/png;base64,{hostile}",
        ]},
        {"role": "assistant", "model": "tiny", "content": ">" * 5000 + " deep",
         "tool_calls": [{"id": "c", "name": hostile, "arguments": hostile}]},
        {"role": "assistant", "model": "tiny", "content": "**after**"},
    ]
    page.evaluate("""([messages, title]) => {
      localStorage.setItem('mlxr.conversations', JSON.stringify([{id: 'x', title, titled: true, updated: 1}]));
      localStorage.setItem('mlxr.conversation.x', JSON.stringify(messages));
      localStorage.setItem('mlxr.current', JSON.stringify('x'));
    }""", [messages, hostile])
    for _ in range(2):
        page.reload()
        until(page, "document.querySelectorAll('#messages .message').length === 3")
        assert titles(page) == [hostile]
        assert page.inner_text(".message.assistant >> nth=0 >> .tool-name") == hostile
        assert page.inner_text(".message.assistant >> nth=0 >> .tool-arguments") == hostile
        assert page.locator(".message.assistant >> nth=0 >> blockquote").count() >= 1
        assert page.inner_text(".message.assistant >> nth=1 >> .body strong") == "after"
        assert page.locator("#messages img, #conversations img, [onerror]").count() == 0
        assert page.evaluate("window.pwned") is None


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = bytes(random.Random(seed).randrange(256) for _ in range(width * height * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(out, format="PNG")
    return out.getvalue()


def hand_over(page: Any, how: str, raw: bytes, name: str = "image.png", kind: str = "image/png") -> None:
    """Paste a file into the prompt, or drag it over the conversation and drop it there."""
    page.evaluate("""([how, encoded, name, type]) => {
      const bytes = Uint8Array.from(atob(encoded), (c) => c.charCodeAt(0));
      const data = new DataTransfer();
      data.items.add(new File([bytes], name, { type }));
      const options = { bubbles: true, cancelable: true };
      if (how === "paste") {
        document.getElementById("prompt").dispatchEvent(new ClipboardEvent("paste", { ...options, clipboardData: data }));
      } else {
        const zone = document.getElementById("conversation");
        zone.dispatchEvent(new DragEvent("dragover", { ...options, dataTransfer: data }));
        zone.dispatchEvent(new DragEvent("drop", { ...options, dataTransfer: data }));
      }
    }""", [how, base64.b64encode(raw).decode(), name, kind])


def attached(page: Any, count: int) -> None:
    until(page, f"document.querySelectorAll('#attachments .attachment').length === {count}")


def test_images_are_attached_by_file_paste_and_drop_only_for_a_model_that_takes_them(vision_page: Any) -> None:
    page = vision_page
    sign_in(page, ("tiny", "vision"))
    sent: list[dict[str, Any]] = []
    without_eos(page, sent)
    assert page.locator("#status-view #models tbody tr").count() == 2  # capabilities read from /v1/models
    page.select_option("#model", "tiny")
    assert "vision" not in page.locator("#model-capabilities .badge").all_inner_texts()
    assert not page.is_visible("#attach")
    hand_over(page, "paste", png(8, 8, 0))
    until(page, "document.querySelector('#composer-note').textContent.includes('takes no images')")
    assert page.locator("#attachments .attachment").count() == 0

    page.select_option("#model", "vision")
    assert "vision" in page.locator("#model-capabilities .badge").all_inner_texts()
    assert page.is_visible("#attach")
    images = [png(40, 30, seed) for seed in range(3)]
    page.set_input_files("#attach-input", files=[{"name": "a.png", "mimeType": "image/png", "buffer": images[0]}])
    attached(page, 1)
    hand_over(page, "paste", images[1])
    attached(page, 2)
    hand_over(page, "drop", images[2])
    attached(page, 3)
    hand_over(page, "drop", b"not an image", name="notes.txt", kind="text/plain")  # not taken
    hand_over(page, "paste", b"<svg onload='window.pwned=1'/>", name="x.svg", kind="image/svg+xml")
    until(page, "document.querySelector('#composer-note').textContent.includes('x.svg')")
    page.click("#attachments .attachment:nth-child(2) .remove")
    attached(page, 2)

    page.fill("#max-tokens", "3")
    page.fill("#prompt", "t5 t6")
    page.press("#prompt", "Enter")
    finished(page, 2)
    (body,) = sent
    assert body["model"] == "vision"
    parts = body["messages"][-1]["content"]
    assert parts == [
        *({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(raw).decode()}}
          for raw in (images[0], images[2])),
        {"type": "text", "text": "t5 t6"},
    ]
    assert "3 tokens" in page.inner_text(".message.assistant .meta")  # the server took the images
    assert page.locator(".message.assistant.failed").count() == 0
    assert page.locator(".message.user .images img").count() == 2 and not page.is_visible("#attachments")
    page.reload()
    finished(page, 2)
    assert page.locator(".message.user .images img").count() == 2
    assert page.evaluate("window.pwned") is None

    # A text model later in the same conversation is sent the text alone.
    page.select_option("#model", "tiny")
    page.fill("#prompt", "and now?")
    page.press("#prompt", "Enter")
    finished(page, 4)
    assert [m["content"] for m in sent[1]["messages"] if m["role"] == "user"] == ["t5 t6", "and now?"]
    assert page.locator(".message.assistant.failed").count() == 0
