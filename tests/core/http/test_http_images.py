"""mlxr_core.http.images without a server: the budget of decoded pixels in flight, the public
address check for remote images, and what an unreadable image's error says."""

from __future__ import annotations

import base64
import io
import ipaddress
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

from mlxr_core.config.schema import ServerConfig
from mlxr_core.errors import Overloaded, RequestError
from mlxr_core.http import images
from mlxr_core.http.images import ImageInput, is_public_address, load_images
from mlxr_core.model.vision import ResizeNormalize

Image = pytest.importorskip("PIL.Image", reason="image input needs Pillow")


# N5: remote image hosts whose IPv6 address embeds an IPv4 one are judged by that IPv4 address.

EMBEDDING_PRIVATE_IPV4 = [
    "::127.0.0.1", "::7f00:1", "::a9fe:a9fe", "::a00:1",  # IPv4-compatible ::/96
    "::ffff:127.0.0.1", "::ffff:a9fe:a9fe",  # IPv4-mapped
    "::ffff:0:a00:1",  # IPv4-translated (SIIT)
    "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "64:ff9b::a00:5",  # NAT64
    "64:ff9b:1::a00:5", "64:ff9b:1:5db8:d70e::",  # local-use NAT64: refused whatever it embeds
    "2002:7f00:1::", "2002:a9fe:a9fe::1", "2002:a00:5::1",  # 6to4
    "2001:0:4136:e378:8000:63bf:f5ff:fffe", "2001:0:5db8:d70e::1",  # Teredo: refused
]  # fmt: skip


@pytest.mark.parametrize("address", EMBEDDING_PRIVATE_IPV4)
def test_ipv6_addresses_embedding_a_private_ipv4_address_are_not_public(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "address", ["93.184.215.14", "2606:4700::6810:84e5", "64:ff9b::5db8:d70e", "2002:5db8:d70e::1", "::ffff:5db8:d70e"]
)
def test_public_addresses_stay_public(address: str) -> None:
    assert is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", EMBEDDING_PRIVATE_IPV4)
def test_urls_at_them_are_refused_before_any_connection(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    def connect(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("connected")

    monkeypatch.setattr(httpx.Client, "stream", connect)
    with pytest.raises(RequestError, match="not a public address") as caught:
        images.fetch_image(f"http://[{address}]:8000/x.png", "image_url", 10_000, 1.0)
    assert caught.value.field == "image_url"
    # And a name resolving to it (an AAAA record) is refused the same way.
    monkeypatch.setattr(images.socket, "getaddrinfo", lambda host, port, **_: [(None, None, None, "", (address, port))])
    with pytest.raises(RequestError, match="not a public address"):
        images.fetch_image("https://cdn.example/x.png", "image_url", 10_000, 1.0)


def encoded(width: int, height: int, kind: str = "PNG") -> str:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=kind)
    return base64.b64encode(out.getvalue()).decode()


class Model:
    """What :func:`load_images` reads of a served model."""

    def __init__(self, processor: Any):
        self.name = "vision"
        self.image_processor = processor


class Recording:
    """A processor that keeps the size of each image it was given (and can fail)."""

    def __init__(self, fail: BaseException | None = None):
        self.sizes: list[tuple[int, int]] = []
        self.fail = fail

    def __call__(self, image: Any) -> np.ndarray:
        self.sizes.append(image.size)
        if self.fail is not None:
            raise self.fail
        return np.zeros((3, 4, 4), np.float32)


def load(server: ServerConfig, processor: Any, *data: str) -> list[Any]:
    inputs = [ImageInput(item, f"images[{k}]") for k, item in enumerate(data)]
    return anyio.run(load_images, server, Model(processor), inputs)  # type: ignore[arg-type]


def server_config(**changes: Any) -> ServerConfig:
    config = ServerConfig()
    for key, value in changes.items():
        setattr(config, key, value)
    return config


# N12: an unreadable image's error names no heap address.


def test_an_unreadable_image_error_holds_no_object_repr() -> None:
    with pytest.raises(RequestError, match="cannot be read") as caught:
        load(server_config(), Recording(), base64.b64encode(b"not an image at all").decode())
    assert "0x" not in caught.value.message and "BytesIO" not in caught.value.message
    assert caught.value.field == "images[0]"


# N3: decoded pixels count against a server-wide budget.


def test_an_image_larger_than_the_whole_budget_is_a_400_naming_the_key() -> None:
    # 64x64 RGB: 16 KB decoded (Pillow keeps 4 bytes a pixel) and as much again for an RGB copy.
    server = server_config(max_decoded_image_bytes=20_000)
    with pytest.raises(RequestError, match="max_decoded_image_bytes") as caught:
        load(server, Recording(), encoded(64, 64))
    assert caught.value.status == 400 and caught.value.field == "images[0]"
    assert images.DECODE_BUDGET.in_flight == 0


def test_images_within_the_budget_are_decoded_one_after_another_and_give_it_back() -> None:
    server = server_config(max_decoded_image_bytes=40_000)  # one 64x64 at a time, not two
    processor = Recording()
    assert len(load(server, processor, encoded(64, 64), encoded(64, 64), encoded(64, 64))) == 3
    assert processor.sizes == [(64, 64)] * 3
    assert images.DECODE_BUDGET.in_flight == 0


def test_a_request_over_a_budget_others_hold_waits_then_is_a_429() -> None:
    server = server_config(max_decoded_image_bytes=40_000, decoded_image_wait_s=0.2)
    assert images.DECODE_BUDGET.try_take(30_000, 40_000)
    try:
        started = time.monotonic()
        with pytest.raises(Overloaded, match="max_decoded_image_bytes") as caught:
            load(server, Recording(), encoded(64, 64))
        assert 0.2 <= time.monotonic() - started < 2
        assert caught.value.status == 429 and caught.value.field == "images[0]"
    finally:
        images.DECODE_BUDGET.give_back(30_000)
    assert images.DECODE_BUDGET.in_flight == 0


def test_a_request_waiting_for_the_budget_goes_on_once_it_is_given_back() -> None:
    server = server_config(max_decoded_image_bytes=40_000, decoded_image_wait_s=5.0)
    assert images.DECODE_BUDGET.try_take(30_000, 40_000)
    threading.Timer(0.2, images.DECODE_BUDGET.give_back, (30_000,)).start()
    assert len(load(server, Recording(), encoded(64, 64))) == 1
    assert images.DECODE_BUDGET.in_flight == 0


@pytest.mark.parametrize("fail", [MemoryError(), OSError("broken data stream")])
def test_a_failed_decode_is_a_clean_error_and_gives_the_budget_back(fail: BaseException) -> None:
    with pytest.raises((RequestError, Overloaded)) as caught:
        load(server_config(), Recording(fail), encoded(64, 64))
    assert caught.value.status in (400, 429) and caught.value.field == "images[0]"
    if isinstance(fail, MemoryError):
        assert caught.value.status == 429 and "memory" in caught.value.message
    assert images.DECODE_BUDGET.in_flight == 0


def test_no_thread_to_decode_in_is_a_429(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_thread(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(images.anyio.to_thread, "run_sync", no_thread)
    with pytest.raises(Overloaded, match="thread") as caught:
        load(server_config(), Recording(), encoded(64, 64))
    assert caught.value.status == 429


def test_a_truncated_image_gives_the_budget_back() -> None:
    raw = base64.b64decode(encoded(64, 64))
    with pytest.raises(RequestError, match="cannot be read"):
        load(server_config(), Recording(), base64.b64encode(raw[: len(raw) // 2]).decode())
    assert images.DECODE_BUDGET.in_flight == 0


def test_a_large_jpeg_is_decoded_no_larger_than_the_processor_needs() -> None:
    # A 1024x1024 JPEG for a 16x16 tower: decoded at 1/8 (128x128, at least twice 16 a side).
    resize = ResizeNormalize((16, 16))

    class Drafting(Recording):
        def draft_size(self) -> tuple[int, int]:
            return resize.draft_size()

    processor = Drafting()
    server = server_config(max_decoded_image_bytes=1024 * 1024 * 4)  # the full decode would not fit
    load(server, processor, encoded(1024, 1024, "JPEG"))
    assert processor.sizes == [(128, 128)]
    assert load(server_config(), resize, encoded(1024, 1024, "JPEG"))[0].pixels.shape == (3, 16, 16)


# Issue 48, item 1: an image on an install without Pillow is a 400 naming the extra, never a 500.


def test_an_image_without_pillow_installed_is_a_400_naming_the_vision_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    image = encoded(8, 8)
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL raises ImportError
    with pytest.raises(RequestError, match=r"pip install 'mlxr\[vision\]'") as caught:
        load(server_config(), Recording(), image)
    assert caught.value.status == 400 and caught.value.field == "images[0]"


def test_loading_a_vision_model_without_pillow_warns(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import sys

    from mlxr_core.model.vision import warn_without_pillow

    assert not warn_without_pillow("model.gguf")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with caplog.at_level("WARNING", logger="mlxr_core.model.vision"):
        assert warn_without_pillow("model.gguf")
    assert "mlxr[vision]" in caplog.text and "model.gguf" in caplog.text
