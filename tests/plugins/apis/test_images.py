"""Images through the APIs: the official clients send a PNG made here to a live server with a tiny
random Gemma 3 vision model, and hostile images get a clean 4xx in each API's error shape while
the server goes on serving."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from scripted import live_server

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, PrefixCacheConfig
from mlxr_core.errors import RequestError
from mlxr_core.testing.tiny_vision import gemma3_vision_model

Image = pytest.importorskip("PIL.Image", reason="image input needs Pillow")

#: The tiny model's image tokens per image.
TOKENS_PER_IMAGE = 4


def png(width: int = 40, height: int = 30) -> bytes:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_uri(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


@pytest.fixture(scope="module")
def vision_config(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Config:
    torch = pytest.importorskip("torch", reason="the tiny vision model is written by transformers")
    transformers = pytest.importorskip("transformers", reason="the tiny vision model is written by transformers")
    folder = tmp_path_factory.mktemp("vision-api")
    gemma3_vision_model(folder, torch, transformers)
    config = Config(
        models=[
            ModelConfig(path=str(folder), name="vision", dtype="float32", compile_decode=False),
            ModelConfig(path=str(tiny_model_path), name="tiny", context_length=256),
        ],
        engine=EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False)),
    )
    config.server.max_image_pixels = 1_000_000
    config.server.responses_store.path = str(folder / "responses.sqlite3")
    return config


@pytest.fixture(scope="module")
def server(vision_config: Config) -> Iterator[str]:
    with live_server(vision_config) as url:
        yield url


def text_prompt_tokens(url: str) -> int:
    """The prompt tokens of the same request with no image."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="vision", max_tokens=2, messages=[{"role": "user", "content": [{"type": "text", "text": "t5 t6"}]}]
    )
    assert reply.usage is not None
    return reply.usage.prompt_tokens


def test_the_openai_client_sends_an_image(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    content: Any = [{"type": "text", "text": "t5 t6"}, {"type": "image_url", "image_url": {"url": data_uri(png())}}]
    reply = client.chat.completions.create(
        model="vision", max_tokens=3, temperature=0, messages=[{"role": "user", "content": content}]
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    # The image's tokens: <start_of_image>, 4 soft tokens, <end_of_image> (the newlines are unknown words).
    assert reply.usage.prompt_tokens >= text_prompt_tokens(server) + TOKENS_PER_IMAGE + 1


def responses_input(image_url: str, text: str = "t5 t6") -> Any:
    content = [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": image_url, "detail": "auto"}]
    return [{"role": "user", "content": content}]


def test_the_openai_client_sends_an_image_to_the_responses_api(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    text_only = client.responses.create(model="vision", input="t5 t6", max_output_tokens=2, store=False)
    reply = client.responses.create(model="vision", input=responses_input(data_uri(png())), max_output_tokens=3, temperature=0)
    assert reply.status == "incomplete" and reply.usage is not None and reply.usage.output_tokens == 3
    assert text_only.usage is not None and reply.usage.input_tokens >= text_only.usage.input_tokens + TOKENS_PER_IMAGE + 1
    listed = client.responses.input_items.list(reply.id).data[0]
    assert [part.type for part in listed.content] == ["input_text", "input_image"]  # type: ignore[union-attr]
    # A follow-up renders the stored turn with its image again: that prompt and its reply, then more.
    follow = client.responses.create(model="vision", input="t7", previous_response_id=reply.id, max_output_tokens=2)
    assert follow.usage is not None and follow.usage.input_tokens > reply.usage.input_tokens + reply.usage.output_tokens


@pytest.mark.parametrize("case", ["truncated", "url"])
def test_hostile_images_are_a_400_in_the_responses_api(server: str, case: str) -> None:
    body = {"model": "vision", "max_output_tokens": 2, "input": responses_input(HOSTILE[case][0])}
    reply = httpx.post(f"{server}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert HOSTILE[case][1] in error["message"] and error["param"] == "input[0].content[1].image_url"
    body["input"] = [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]
    reply = httpx.post(f"{server}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input[0].content[0]"


def test_an_image_to_a_text_only_model_in_the_responses_api_is_a_400_naming_it(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="'tiny' takes no images"):
        client.responses.create(model="tiny", input=responses_input(data_uri(png())), max_output_tokens=2)


def bomb() -> bytes:
    """A PNG whose header claims 20000x20000 pixels (a few hundred bytes compressed)."""
    out = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(out, format="PNG")
    return out.getvalue()


def thin() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (100_000, 1)).save(out, format="PNG")
    return out.getvalue()


HOSTILE = {
    "truncated": (data_uri(png()[:200]), "cannot be read"),
    "bomb": (data_uri(bomb()), "max_image_pixels"),
    "thin": (data_uri(thin()), "more than 200 times"),
    "base64": ("data:image/png;base64,@@not base64@@", "not valid base64"),
    "url": ("https://example.com/cat.png", "not fetched"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_images_are_a_400_in_openai_shape(server: str, case: str) -> None:
    url, why = HOSTILE[case]
    content = [{"type": "text", "text": "t5"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": "vision", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert why in error["message"] and error["param"] == "messages[0].content[1].image_url"
    assert text_prompt_tokens(server) > 0  # still serving


def test_an_image_to_a_text_only_model_is_a_400_naming_it(server: str) -> None:
    content = [{"type": "image_url", "image_url": {"url": data_uri(png())}}]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "'tiny' takes no images" in reply.json()["error"]["message"]


def test_too_many_images_are_a_400(server: str) -> None:
    content = [{"type": "image_url", "image_url": {"url": data_uri(png())}}] * 9
    body = {"model": "vision", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "max_images_per_request" in reply.json()["error"]["message"]


def test_images_past_the_decoded_bytes_budget_are_a_429_or_400_in_each_api_shape(
    server: str, vision_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxr_core.http import images

    # png() is 40x30: 4,800 bytes decoded as Pillow keeps RGB, 9,600 with an RGB copy.
    monkeypatch.setattr(vision_config.server, "max_decoded_image_bytes", 10_000)
    monkeypatch.setattr(vision_config.server, "decoded_image_wait_s", 0.1)
    content = [{"type": "text", "text": "t5"}, {"type": "image_url", "image_url": {"url": data_uri(png())}}]
    body = {"model": "vision", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    ollama = {"model": "vision", "stream": False, "messages": [{"role": "user", "content": "t5", "images": [base64.b64encode(png()).decode()]}]}
    assert images.DECODE_BUDGET.try_take(5_000, 10_000)  # other requests' images being decoded
    try:
        reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1", reply.text
        error = reply.json()["error"]
        assert "max_decoded_image_bytes" in error["message"] and error["param"] == "messages[0].content[1].image_url"
        reply = httpx.post(f"{server}/api/chat", json=ollama, timeout=60)
        assert reply.status_code == 429 and "max_decoded_image_bytes" in reply.json()["error"]
    finally:
        images.DECODE_BUDGET.give_back(5_000)
    assert httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).status_code == 200
    monkeypatch.setattr(vision_config.server, "max_decoded_image_bytes", 9_000)  # less than one image
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "max_decoded_image_bytes (9000)" in reply.json()["error"]["message"]
    assert images.DECODE_BUDGET.in_flight == 0


def test_the_ollama_client_sends_an_image(server: str) -> None:
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server, timeout=60)
    message = {"role": "user", "content": "t5 t6", "images": [png()]}
    reply = client.chat(model="vision", messages=[message], options={"num_predict": 3, "temperature": 0})
    assert reply.eval_count == 3 and reply.prompt_eval_count >= TOKENS_PER_IMAGE + 3
    generated = client.generate(model="vision", prompt="t5 t6", images=[png()], options={"num_predict": 2, "temperature": 0})
    assert generated.eval_count == 2 and generated.prompt_eval_count >= TOKENS_PER_IMAGE + 3


@pytest.mark.parametrize("case", ["truncated", "bomb", "thin"])
def test_hostile_images_are_a_400_in_ollama_shape(server: str, case: str) -> None:
    data = HOSTILE[case][0].removeprefix("data:image/png;base64,")
    body = {"model": "vision", "stream": False, "messages": [{"role": "user", "content": "t5", "images": [data]}]}
    reply = httpx.post(f"{server}/api/chat", json=body, timeout=60)
    assert reply.status_code == 400 and HOSTILE[case][1] in reply.json()["error"], reply.text
    body = {"model": "tiny", "stream": False, "prompt": "t5", "images": [data]}
    reply = httpx.post(f"{server}/api/generate", json=body, timeout=60)
    assert reply.status_code == 400 and "'tiny' takes no images" in reply.json()["error"], reply.text


class ImageHost(http.server.BaseHTTPRequestHandler):
    """Image URLs on loopback: a PNG, bodies past the byte limit, slow answers, redirects."""

    protocol_version = "HTTP/1.0"  # a body without content-length runs until the connection closes

    def do_GET(self) -> None:
        name, _, arg = self.path.strip("/").partition("/")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client stopped reading
            getattr(self, f"serve_{name}")(arg)

    def head(self, status: int = 200, **headers: str) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key.replace("_", "-"), value)
        self.end_headers()

    def serve_cat(self, arg: str) -> None:
        raw = png()
        self.head(content_type="image/png", content_length=str(len(raw)))
        self.wfile.write(raw)

    def serve_declared(self, arg: str) -> None:  # says it is too large up front
        self.head(content_type="image/png", content_length=str(10**9))
        self.wfile.write(b"\0" * 65536)

    def serve_endless(self, arg: str) -> None:  # no length, never ends: only the byte cap stops it
        self.head(content_type="image/png")
        while True:
            self.wfile.write(b"\0" * 65536)

    def serve_slow(self, arg: str) -> None:
        time.sleep(3)
        self.serve_cat(arg)

    def serve_trickle(self, arg: str) -> None:  # a byte at a time, each read well within the limit
        self.head(content_type="image/png")
        for _ in range(200):
            self.wfile.write(b"\0")
            self.wfile.flush()
            time.sleep(0.02)

    def serve_hop(self, arg: str) -> None:
        left = int(arg)
        self.head(302, location=f"/hop/{left - 1}" if left > 1 else "/cat/")  # left redirects in all

    def serve_file(self, arg: str) -> None:
        self.head(302, location="file:///etc/passwd")

    def serve_missing(self, arg: str) -> None:
        self.head(404, content_length="0")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def remote_images(vision_config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vision_config.server, "allow_remote_images", True)
    monkeypatch.setattr(vision_config.server, "remote_image_private_hosts", True)  # the host is on loopback
    monkeypatch.setattr(vision_config.server, "remote_image_timeout_s", 1.0)
    monkeypatch.setattr(vision_config.server, "max_image_bytes", 100_000)


def image_url_request(url: str) -> dict[str, Any]:
    content = [{"type": "text", "text": "t5 t6"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "vision", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


@pytest.mark.usefixtures("remote_images")
@pytest.mark.parametrize("path", ["/cat/", "/hop/3"])
def test_remote_images_are_fetched_when_allowed(server: str, image_host: str, path: str) -> None:
    reply = httpx.post(f"{server}/v1/chat/completions", json=image_url_request(image_host + path), timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] >= text_prompt_tokens(server) + TOKENS_PER_IMAGE + 1


REMOTE_REFUSALS = {
    "/declared/": "max_image_bytes (100000 bytes)",
    "/endless/": "max_image_bytes (100000 bytes)",
    "/slow/": "remote_image_timeout_s (1.0 s)",
    "/trickle/": "remote_image_timeout_s (1.0 s)",
    "/hop/4": "redirects more than 3 times",
    "/file/": "only http and https",
    "/missing/": "HTTP 404",
}


@pytest.mark.usefixtures("remote_images")
@pytest.mark.parametrize("path", sorted(REMOTE_REFUSALS))
def test_remote_image_failures_are_a_400_naming_the_field(server: str, image_host: str, path: str) -> None:
    started = time.monotonic()
    reply = httpx.post(f"{server}/v1/chat/completions", json=image_url_request(image_host + path), timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert REMOTE_REFUSALS[path] in error["message"] and error["param"] == "messages[0].content[1].image_url"
    assert time.monotonic() - started < 2.5  # the slow answers are cut at the limit, not waited for


@pytest.mark.usefixtures("remote_images")
def test_only_http_urls_are_fetched(server: str) -> None:
    reply = httpx.post(f"{server}/v1/chat/completions", json=image_url_request("ftp://127.0.0.1/cat.png"), timeout=60)
    assert reply.status_code == 400 and "only http and https" in reply.json()["error"]["message"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.1.2.3", "[::ffff:127.0.0.1]"])
def test_private_hosts_are_refused_unless_allowed(
    server: str, image_host: str, vision_config: Config, monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    monkeypatch.setattr(vision_config.server, "allow_remote_images", True)
    monkeypatch.setattr(vision_config.server, "remote_image_timeout_s", 1.0)
    port = image_host.rpartition(":")[2]
    reply = httpx.post(f"{server}/v1/chat/completions", json=image_url_request(f"http://{host}:{port}/cat/"), timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "not a public address" in error["message"] and "remote_image_private_hosts" in error["message"]
    assert error["param"] == "messages[0].content[1].image_url"


def test_a_fetch_connects_to_the_address_it_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxr_core.http import images

    answers = {"cdn.example": "93.184.215.14", "inside.example": "192.168.1.7", "v6.example": "2606:4700::6810:84e5"}

    def resolve(host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        return [(None, None, None, "", (answers[host], port))]

    monkeypatch.setattr(images.socket, "getaddrinfo", resolve)
    assert images.pin_host("https://cdn.example/a.png?x=1", "f") == (
        "https://93.184.215.14:443/a.png?x=1", "cdn.example", "cdn.example")
    assert images.pin_host("http://v6.example:8080/a.png", "f") == (
        "http://[2606:4700::6810:84e5]:8080/a.png", "v6.example:8080", None)
    with pytest.raises(RequestError, match=r"192\.168\.1\.7, not a public address"):
        images.pin_host("http://inside.example/a.png", "f")
    assert images.pin_host("http://inside.example/a.png", "f", private_hosts=True)[0] == "http://192.168.1.7:80/a.png"


def anthropic_image(raw_b64: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": raw_b64}}


def test_the_anthropic_client_sends_an_image(server: str) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=60)
    image = anthropic_image(base64.b64encode(png()).decode())
    content: Any = [image, {"type": "text", "text": "t5 t6"}]
    # Greedy: sampling, the tiny random model may draw its end token before max_tokens.
    reply = client.messages.create(
        model="vision", max_tokens=3, messages=[{"role": "user", "content": content}], extra_body={"temperature": 0}
    )
    assert reply.usage.output_tokens == 3
    counted = client.messages.count_tokens(model="vision", messages=[{"role": "user", "content": content}]).input_tokens
    text_only = client.messages.count_tokens(model="vision", messages=[{"role": "user", "content": "t5 t6"}]).input_tokens
    assert counted >= text_only + TOKENS_PER_IMAGE + 1  # the image's tokens are in the prompt
    u = reply.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0) == counted


@pytest.mark.parametrize("case", ["truncated", "bomb", "thin", "base64", "url"])
def test_hostile_images_are_a_400_in_anthropic_shape(server: str, case: str) -> None:
    if case == "url":
        block: dict[str, Any] = {"type": "image", "source": {"type": "url", "url": HOSTILE["url"][0]}}
    else:
        block = anthropic_image(HOSTILE[case][0].removeprefix("data:image/png;base64,"))
    body = {"model": "vision", "max_tokens": 2, "messages": [{"role": "user", "content": [block, {"type": "text", "text": "t5"}]}]}
    reply = httpx.post(f"{server}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and HOSTILE[case][1] in error["error"]["message"], error
    body["model"] = "tiny"
    block = anthropic_image(base64.b64encode(png()).decode())
    body["messages"] = [{"role": "user", "content": [block]}]
    reply = httpx.post(f"{server}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 400 and "'tiny' takes no images" in reply.json()["error"]["message"]


def test_an_image_inside_an_anthropic_tool_result_reaches_a_vision_model(server: str) -> None:
    """Anthropic's API allows image blocks in a tool_result; they were refused as not text."""
    image = anthropic_image(base64.b64encode(png()).decode())
    call = {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}
    tools = [{"name": "screenshot", "input_schema": {"type": "object", "properties": {}}}]

    def turns(result: list[dict[str, Any]]) -> dict[str, Any]:
        return {"model": "vision", "max_tokens": 2, "tools": tools, "messages": [
            {"role": "user", "content": "t5"}, {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": result}]}]}  # fmt: skip

    with_image = turns([{"type": "text", "text": "t6"}, image])
    reply = httpx.post(f"{server}/v1/messages", json={**with_image, "temperature": 0}, timeout=60)
    assert reply.status_code == 200, reply.text
    counted = httpx.post(f"{server}/v1/messages/count_tokens", json=with_image, timeout=60).json()["input_tokens"]
    text_only = httpx.post(f"{server}/v1/messages/count_tokens", json=turns([{"type": "text", "text": "t6"}]),
                           timeout=60).json()["input_tokens"]  # fmt: skip
    assert counted >= text_only + TOKENS_PER_IMAGE
    bad = httpx.post(f"{server}/v1/messages", json=turns([{"type": "audio"}]), timeout=60)
    assert bad.status_code == 400 and "content[0]" in bad.text
