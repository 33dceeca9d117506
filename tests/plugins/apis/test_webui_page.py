"""The web page's script in node (``webui_page.js``: a small stand-in for the browser): the stored
conversation is rendered on load whatever a reply holds. Block quotes and lists nest only so deep
(5,000 nested ``>`` exhausted the renderer's stack, and the page broke again on every reload), and a
message that cannot be rendered shows as escaped text while the others render as markdown.

The page in a real Chromium is ``tests/test_acceptance_webui.py``'s."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import mlxr_plugins.apis.webui as webui

NODE = shutil.which("node")
APP_JS = Path(webui.__file__).parent / "static" / "app.js"
PAGE_JS = Path(__file__).with_name("webui_page.js")

pytestmark = pytest.mark.skipif(NODE is None, reason="needs node")


def load_page(messages: list[Any], quota: int | None = None) -> dict[str, Any]:
    """The page loaded with ``messages`` as its stored conversation: the error it threw, if any,
    each message's classes and body, and what it left in storage (refusing values longer than
    ``quota`` characters, as a full storage does)."""
    state: dict[str, Any] = {"chat": messages} if quota is None else {"chat": messages, "quota": quota}
    done = subprocess.run(
        [str(NODE), str(PAGE_JS), str(APP_JS)], input=json.dumps(state),
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    page: dict[str, Any] = json.loads(done.stdout)
    return page


def reply(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "model": "tiny", "content": content}


def test_five_thousand_nested_quotes_render_and_the_page_loads() -> None:
    page = load_page([{"role": "user", "content": "quote"}, reply(">" * 5000 + " x"), reply("**after**")])
    assert page["error"] is None, page["error"]
    deep, after = page["messages"][1]["html"], page["messages"][2]["html"]
    assert 1 <= deep.count("<blockquote>") <= 16
    assert deep.endswith("&gt;" * (5000 - deep.count("<blockquote>")) + " x</p>" + "</blockquote>" * deep.count("<blockquote>"))
    assert after == "<p><strong>after</strong></p>"
    assert page["ms"] < 5000


def test_quotes_and_lists_alternating_deeply_render() -> None:
    """Each ``- >`` is a list item holding a quote: both nest by recursion."""
    page = load_page([reply("- > " * 2500 + "x"), reply("1. a\n   - b\n     > c")])
    assert page["error"] is None, page["error"]
    deep, shallow = (message["html"] for message in page["messages"])
    assert 1 <= deep.count("<li>") + deep.count("<blockquote>") <= 16
    assert "x" in re.sub("<[^>]+>", "", deep)
    assert shallow == '<ol><li>a<ul><li>b<blockquote><p>c</p></blockquote></li></ul></li></ol>'


def test_quotes_within_the_depth_nest_as_before() -> None:
    page = load_page([reply("> " * 10 + "deep\n\nplain *text*")])
    assert page["error"] is None
    assert page["messages"][0]["html"] == "<blockquote>" * 10 + "<p>deep</p>" + "</blockquote>" * 10 + "<p>plain <em>text</em></p>"


@pytest.mark.parametrize("content", [12345, None, {"text": "<b>"}, ["a"]])
def test_a_stored_message_that_cannot_be_rendered_is_shown_as_escaped_text(content: Any) -> None:
    """A stored reply whose content is not text (a page of another version, an edited storage):
    that message shows as escaped text; the conversation around it still renders."""
    page = load_page([reply("# title"), reply(content), reply("`code`")])
    assert page["error"] is None, page["error"]
    first, broken, last = (message["html"] for message in page["messages"])
    assert first == "<h1>title</h1>" and last == "<p><code>code</code></p>"
    assert "<b>" not in broken and broken.startswith("<p>") and broken.endswith("</p>")


def test_the_single_conversation_of_earlier_pages_joins_the_list() -> None:
    """Pages before the list kept one conversation under ``mlxr.chat``: it becomes a listed one,
    titled by its first question, and opens."""
    page = load_page([{"role": "user", "content": "  What is\n MLX?  "}, reply("A framework.")])
    assert page["error"] is None, page["error"]
    storage = {key: json.loads(value) for key, value in page["storage"].items()}
    assert "mlxr.chat" not in storage
    (listed,) = storage["mlxr.conversations"]
    assert listed["title"] == "What is MLX?" and storage["mlxr.current"] == listed["id"]
    assert [m["content"] for m in storage[f"mlxr.conversation.{listed['id']}"]] == ["  What is\n MLX?  ", "A framework."]
    assert [m["className"] for m in page["messages"]] == ["message user", "message assistant"]


def test_a_conversation_too_big_for_the_storage_is_kept_without_its_images() -> None:
    image = "data:image/png;base64," + "A" * 20_000
    messages = [{"role": "user", "content": "look", "images": [image, image]}, reply("a picture")]
    page = load_page(messages, quota=10_000)
    assert page["error"] is None, page["error"]
    storage = {key: json.loads(value) for key, value in page["storage"].items()}
    (listed,) = storage["mlxr.conversations"]
    kept = storage[f"mlxr.conversation.{listed['id']}"]
    assert kept == [{"role": "user", "content": "look", "images_dropped": 2}, reply("a picture")]
