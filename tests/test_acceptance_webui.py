"""Acceptance: the web page in a real headless Chromium against ``mlxr serve`` on a tiny model, with
an API key set and ``apis:`` left to its default (the page is on because the server binds loopback).

The page asks for the key, a reply streams into it, the stop button ends a long generation on the
server too, the conversation survives a reload, the status view plots tokens/s and time to first
token after requests, and the markdown renderer shows model text without ever running it. The page
runs under its own Content-Security-Policy throughout, so a script or style it would load from
elsewhere, or inline, fails the test.

Needs Chromium (Debian's ``chromium``, or ``MLXR_CHROMIUM=/path``) and the ``playwright`` package
(no browser download: it drives that Chromium).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Iterator
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


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:
    """A fresh browser profile (empty localStorage) on the server; fails the test on a script
    error or a Content-Security-Policy violation."""
    context = browser.new_context(base_url=server, viewport={"width": 1280, "height": 860})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
    try:
        yield page
    finally:
        context.close()
    assert not problems, problems


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


def sign_in(page: Any) -> None:
    """Open the page; it asks for the key (its first /v1/models was a 401); give it."""
    from playwright.sync_api import expect

    page.goto("/")
    assert page.url.endswith("/ui/")
    expect(page.locator("#key-dialog")).to_be_visible(timeout=10_000)
    page.fill("#key-input", KEY)
    page.click("#key-save")
    expect(page.locator("#model option")).to_have_text(["tiny"], timeout=10_000)


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
