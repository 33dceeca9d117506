"""mlxr_core.http.images without a server: the public address check for remote images, and
what an unreadable image's error says."""

from __future__ import annotations

import base64
import io
import ipaddress
from typing import Any

import anyio
import numpy as np
import pytest

from mlxr_core.config.schema import ServerConfig
from mlxr_core.errors import RequestError
from mlxr_core.http import images
from mlxr_core.http.images import ImageInput, is_public_address, load_images

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
