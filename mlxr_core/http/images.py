"""Images in requests: each API hands over what its client sent (a data URI, base64 text), this
module checks the server's limits, decodes it with Pillow and runs the model's image processor, all
in a worker thread (never the event loop, never the engine thread).

A hostile image is a :class:`~mlxr_core.errors.RequestError` (400) naming its field: bytes past
``server.max_image_bytes``, more than ``server.max_image_pixels`` pixels (read from the header,
before decoding: a decompression bomb never expands), a side more than :data:`MAX_ASPECT` times
the other, text that is not base64, a file Pillow cannot read or that ends early.

Decoded pixels are the memory an image costs (a 131 KB PNG of 6300x6300 decodes to 159 MB), so
each image reserves its share of ``server.max_decoded_image_bytes`` (:data:`DECODE_BUDGET`,
reckoned from its header) before it is decoded, and gives it back once the processor has made
the model's pixels from it; the images of a request are decoded one at a time. A request that
finds the budget taken waits for it on the event loop (holding no worker thread) up to
``server.decoded_image_wait_s``, then is a 429; an image that alone needs more is a 400. A JPEG
is decoded at the smallest scale that keeps twice what the processor resizes it to, where the
processor says (:class:`~mlxr_core.model.vision.DraftsImages`).

An ``http(s)`` URL is refused unless ``server.allow_remote_images`` is on; then it is fetched in
the same worker thread (:func:`fetch_image`) under the same byte limit and
``server.remote_image_timeout_s``. A host that resolves to an address off the public internet
(loopback, private, link-local such as a cloud metadata service, carrier-grade NAT, reserved) is
refused unless ``server.remote_image_private_hosts`` is on, at every redirect; the connection goes
to the address that was checked (the URL's host kept for ``Host`` and TLS), so a name that
resolves again to another address between check and connect is not followed there.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import ipaddress
import re
import socket
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from mlxr_core.engine.request import PromptImage
from mlxr_core.errors import Overloaded, RequestError
from mlxr_core.model.vision import DraftsImages, pillow_installed

if TYPE_CHECKING:
    from PIL import Image

    from mlxr_core.config.schema import ServerConfig
    from mlxr_core.engine.admission import ModelInfo
    from mlxr_core.model.vision import ImageProcessor

#: The most one side of an image may exceed the other (Qwen2-VL's processor refuses beyond 200).
MAX_ASPECT = 200
#: Redirects followed at most when fetching an image URL.
MAX_REDIRECTS = 3
#: Seconds between looks at the budget while a request waits for its share.
BUDGET_POLL_S = 0.02
#: Decoded no smaller than this many times what the processor resizes to (``Image.thumbnail``'s
#: ``reducing_gap``: the resize still averages over several source pixels).
DRAFT_GAP = 2


class DecodeBudget:
    """Bytes of decoded pixels in flight in this process (one server per process: its memory),
    each take checked against the limit its caller names; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Bytes taken and not yet given back.
        self.in_flight = 0

    def try_take(self, nbytes: int, limit: int) -> bool:
        """Take ``nbytes`` if they fit under ``limit`` with those in flight; whether they did."""
        with self._lock:
            if self.in_flight + nbytes > limit:
                return False
            self.in_flight += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken before."""
        with self._lock:
            self.in_flight -= nbytes

    async def take(self, nbytes: int, server: ServerConfig, field: str) -> None:
        """Take ``nbytes`` of ``server.max_decoded_image_bytes``, waiting up to
        ``server.decoded_image_wait_s`` for others to give theirs back: Overloaded (429) then, a
        RequestError (400) where ``nbytes`` alone is more than the limit."""
        limit = server.max_decoded_image_bytes
        if nbytes > limit:
            raise RequestError(
                f"the image needs {nbytes} bytes decoded, more than server.max_decoded_image_bytes "
                f"({limit}); send it smaller", field=field,
            )  # fmt: skip
        deadline = time.monotonic() + server.decoded_image_wait_s
        while not self.try_take(nbytes, limit):
            if time.monotonic() >= deadline:
                raise Overloaded(
                    f"the server is decoding as many image bytes as server.max_decoded_image_bytes "
                    f"({limit}) allows; retry later", field=field,
                )  # fmt: skip
            await anyio.sleep(BUDGET_POLL_S)


#: The process's decoded pixels in flight.
DECODE_BUDGET = DecodeBudget()


@attrs.frozen
class ImageInput:
    """One image as a client sent it: ``data`` is base64 text (``url`` False) or a URL."""

    data: str
    field: str
    url: bool = False

    @classmethod
    def from_url(cls, url: str, field: str) -> ImageInput:
        """OpenAI's ``image_url.url``: a ``data:<type>;base64,<data>`` URI, or a remote URL."""
        if url.startswith("data:"):
            header, comma, data = url.partition(",")
            if not comma or not header.endswith(";base64"):
                raise RequestError("a data URI image must be base64: data:image/png;base64,...", field=field)
            return cls(data, field)
        return cls(url, field, url=True)


async def load_images(server: ServerConfig, info: ModelInfo, inputs: list[ImageInput]) -> list[PromptImage]:
    """The request's images decoded and preprocessed for ``info``'s model, in a worker thread;
    RequestError for a text-only model, too many images, or any image refused (see the module)."""
    if not inputs:
        return []
    check_takes_images(info, inputs)
    processor = info.image_processor
    assert processor is not None
    if not pillow_installed():
        raise RequestError(
            "this server cannot decode images: the package 'Pillow' is not installed; install the "
            "vision extra on the server (pip install 'mlxr[vision]') and restart it", field=inputs[0].field,
        )  # fmt: skip
    if len(inputs) > server.max_images_per_request:
        raise RequestError(
            f"the request holds {len(inputs)} images, more than server.max_images_per_request "
            f"({server.max_images_per_request})", field=inputs[server.max_images_per_request].field,
        )  # fmt: skip
    for image in inputs:
        if image.url and not server.allow_remote_images:
            raise RequestError(
                "image URLs are not fetched by this server (server.allow_remote_images is off); send "
                "the image inline as a data URI (data:image/png;base64,...)", field=image.field,
            )  # fmt: skip
    opened = await _in_thread(functools.partial(_open_all, inputs, processor, server), inputs[0].field)
    try:
        images = []
        for image in opened:
            await DECODE_BUDGET.take(image.nbytes, server, image.field)
            try:  # decode closes the image: its pixels are gone when the budget is given back
                images.append(await _in_thread(functools.partial(image.decode, processor), image.field))
            finally:
                DECODE_BUDGET.give_back(image.nbytes)
        return images
    finally:
        for image in opened:
            image.close()


async def _in_thread(work: functools.partial[Any], field: str) -> Any:
    """``work()`` in a worker thread; Overloaded (429) where the process cannot start one."""
    try:
        return await anyio.to_thread.run_sync(work)
    except RuntimeError as exc:
        if "can't start new thread" not in str(exc):
            raise
        raise Overloaded("the server cannot start a thread to decode images now; retry later", field=field) from None


def check_takes_images(info: ModelInfo, inputs: list[ImageInput]) -> None:
    """RequestError naming the model when images go to a model without a vision tower (before
    its chat template is asked to render them)."""
    if inputs and info.image_processor is None:
        raise RequestError(
            f"the model {info.name!r} takes no images (it has no vision tower); send text only, "
            "or the image to a vision model", field=inputs[0].field,
        )  # fmt: skip


def _open_all(inputs: list[ImageInput], processor: ImageProcessor, server: ServerConfig) -> list[OpenedImage]:
    opened: list[OpenedImage] = []
    try:
        for image in inputs:
            if image.url:
                raw = fetch_image(
                    image.data,
                    image.field,
                    server.max_image_bytes,
                    server.remote_image_timeout_s,
                    private_hosts=server.remote_image_private_hosts,
                )
            else:
                raw = decode_base64(image.data, image.field, server.max_image_bytes)
            opened.append(OpenedImage.open(raw, image.field, processor, server.max_image_pixels))
    except BaseException:
        for done in opened:
            done.close()
        raise
    return opened


def _too_large(max_bytes: int, field: str) -> RequestError:
    return RequestError(f"the image is larger than server.max_image_bytes ({max_bytes} bytes)", field=field)


def decode_base64(data: str, field: str, max_bytes: int) -> bytes:
    """The image's bytes from base64 ``data``, refused past ``max_bytes`` before decoding."""
    if len(data) * 3 // 4 > max_bytes + 3:
        raise _too_large(max_bytes, field)
    try:
        raw = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"the image is not valid base64 ({exc})", field=field) from None
    if len(raw) > max_bytes:
        raise _too_large(max_bytes, field)
    return raw


def fetch_image(url: str, field: str, max_bytes: int, timeout: float, *, private_hosts: bool = False) -> bytes:
    """The bytes at an ``http(s)`` ``url``: at most :data:`MAX_REDIRECTS` redirects (each to
    http or https, each host on a public address unless ``private_hosts``: :func:`pin_host`), a
    2xx answer, at most ``max_bytes`` read (a larger body is refused without
    reading the rest), and the fetch ended once ``timeout`` seconds have passed (checked between
    reads; one read waits at most what was left when its request was sent). Blocking: call it in a
    worker thread. Any failure is a RequestError naming ``field``."""
    import httpx

    deadline = time.monotonic() + timeout
    headers = {"accept": "image/*", "accept-encoding": "identity"}  # raw bytes: no decompression bomb
    try:
        with httpx.Client(headers=headers, follow_redirects=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                _check_scheme(url, field)
                pinned, host, sni = pin_host(url, field, private_hosts=private_hosts)
                left = max(deadline - time.monotonic(), 0.001)
                extensions = {"sni_hostname": sni} if sni else None
                with client.stream("GET", pinned, headers={"host": host}, timeout=left, extensions=extensions) as response:
                    if response.is_redirect:
                        url = urllib.parse.urljoin(url, response.headers["location"])
                        continue
                    if not response.is_success:
                        raise RequestError(f"fetching the image URL got HTTP {response.status_code}", field=field)
                    length = response.headers.get("content-length", "")
                    if length.isdigit() and int(length) > max_bytes:
                        raise _too_large(max_bytes, field)
                    body = bytearray()
                    # Each read's bytes as they come (no chunk_size), so a trickling body meets the deadline.
                    for chunk in response.iter_raw():
                        body += chunk
                        if len(body) > max_bytes:
                            raise _too_large(max_bytes, field)
                        if time.monotonic() > deadline:
                            raise httpx.ReadTimeout("the body did not arrive in time")
                    return bytes(body)
    except httpx.TimeoutException:
        raise RequestError(
            f"fetching the image URL took longer than server.remote_image_timeout_s ({timeout} s)", field=field
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise RequestError(f"fetching the image URL failed: {exc}", field=field) from None
    raise RequestError(f"the image URL redirects more than {MAX_REDIRECTS} times", field=field)


def pin_host(url: str, field: str, *, private_hosts: bool = False) -> tuple[str, str, str | None]:
    """``url`` with its host replaced by the address it resolves to, the ``Host`` header to send,
    and the TLS server name (https only). The host's addresses must all be public
    (:func:`is_public_address`) unless ``private_hosts``; otherwise a RequestError naming
    ``field``."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname
    if not host:
        raise RequestError(f"the image URL names no host: {url[:100]!r}", field=field)
    https = parts.scheme.lower() == "https"
    try:
        port = parts.port or (443 if https else 80)
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        raise RequestError(f"the image URL's host {host!r} does not resolve: {exc}", field=field) from None
    addresses = [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in found]
    if not private_hosts:
        for address in addresses:
            if not is_public_address(address):
                raise RequestError(
                    f"the image URL's host {host!r} is at {address}, not a public address; this server "
                    "fetches images from public addresses only (server.remote_image_private_hosts is off)",
                    field=field,
                )
    first = addresses[0]
    literal = f"[{first}]" if first.version == 6 else str(first)
    netloc = f"{literal}:{port}"
    pinned = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    header = host if parts.port is None else f"{host}:{parts.port}"
    if ":" in host:
        header = f"[{host}]" if parts.port is None else f"[{host}]:{parts.port}"
    return pinned, header, host if https else None


#: IPv6 prefixes whose last 32 bits are an IPv4 address the packets reach: IPv4-compatible,
#: IPv4-mapped, IPv4-translated (SIIT) and NAT64's well-known prefix.
IPV4_IN_LOW_BITS = [ipaddress.IPv6Network(net) for net in ("::/96", "::ffff:0:0/96", "::ffff:0:0:0/96", "64:ff9b::/96")]
#: IPv6 prefixes refused whatever they embed: local-use NAT64 (the IPv4 address may sit at any of
#: RFC 6052's offsets) and Teredo (a relay on to a client behind NAT).
NEVER_PUBLIC = [ipaddress.IPv6Network(net) for net in ("64:ff9b:1::/48", "2001::/32")]


def is_public_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``address`` is on the public internet (``is_global``); an IPv6 address that
    carries an IPv4 one (:data:`IPV4_IN_LOW_BITS`, 6to4's ``2002::/16``) is judged by that IPv4
    address, since the packets end there, and :data:`NEVER_PUBLIC` prefixes never are."""
    if isinstance(address, ipaddress.IPv6Address):
        if any(address in net for net in NEVER_PUBLIC):
            return False
        if address.sixtofour is not None:
            return address.sixtofour.is_global
        if any(address in net for net in IPV4_IN_LOW_BITS):
            return ipaddress.IPv4Address(address.packed[12:]).is_global
    return address.is_global


def _check_scheme(url: str, field: str) -> None:
    if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
        raise RequestError(f"only http and https image URLs are fetched, not {url[:100]!r}", field=field)


#: Bytes Pillow keeps per pixel, by mode: 4 for RGB (padded) and every mode not named here.
PIXEL_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}
#: A Python object's repr in a library's message (``<_io.BytesIO object at 0x7f...>``).
OBJECT_REPR = re.compile(r"\s*<[^<>]*\bat 0x[0-9a-fA-F]+>")


@attrs.define
class OpenedImage:
    """An image whose header is read and checked but whose pixels are not decoded yet, with
    ``nbytes``, what decoding it takes: its pixels as Pillow keeps them, and an RGB copy (image
    processors convert to RGB)."""

    raw: bytes
    image: Image.Image
    field: str
    nbytes: int

    @classmethod
    def open(cls, raw: bytes, field: str, processor: ImageProcessor, max_pixels: int) -> OpenedImage:
        """The image in ``raw``, refused (RequestError) past ``max_pixels`` or :data:`MAX_ASPECT`,
        set to decode at a smaller scale where the format can and ``processor`` allows."""
        from PIL import Image

        # Pillow refuses a header claiming more than twice this many pixels itself (before decoding).
        Image.MAX_IMAGE_PIXELS = max_pixels
        try:
            image = Image.open(io.BytesIO(raw))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise RequestError(
                f"the image claims more than server.max_image_pixels ({max_pixels}) pixels", field=field
            ) from None
        except MemoryError:
            raise _out_of_memory(field) from None
        except (OSError, SyntaxError, ValueError) as exc:
            raise _unreadable(exc, field) from None
        try:
            width, height = image.size
            if width * height > max_pixels:
                raise RequestError(
                    f"the image is {width}x{height} pixels, more than server.max_image_pixels ({max_pixels})",
                    field=field,
                )  # fmt: skip
            if max(width, height) > MAX_ASPECT * min(width, height):
                raise RequestError(
                    f"the image is {width}x{height} pixels: one side is more than {MAX_ASPECT} times the other",
                    field=field,
                )  # fmt: skip
            if isinstance(processor, DraftsImages):
                draft_width, draft_height = processor.draft_size()
                image.draft(None, (draft_width * DRAFT_GAP, draft_height * DRAFT_GAP))  # JPEG only
        except BaseException:
            image.close()
            raise
        width, height = image.size
        return cls(raw, image, field, width * height * (PIXEL_BYTES.get(image.mode, 4) + 4))

    def decode(self, processor: ImageProcessor) -> PromptImage:
        """The processor's pixels and the SHA-256 of the bytes; the decoded image closed after.
        A MemoryError is an Overloaded (429), a broken image a RequestError."""
        try:
            self.image.load()
            pixels = processor(self.image)
        except MemoryError:
            raise _out_of_memory(self.field) from None
        except (OSError, SyntaxError, ValueError) as exc:  # truncated, a broken stream
            raise _unreadable(exc, self.field) from None
        finally:
            self.close()
        return PromptImage(pixels, hashlib.sha256(self.raw).hexdigest())

    def close(self) -> None:
        self.image.close()


def _out_of_memory(field: str) -> Overloaded:
    return Overloaded("the server ran out of memory decoding the image; retry later, or send it smaller", field=field)


def _unreadable(exc: BaseException, field: str) -> RequestError:
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        why = "it is in no format Pillow reads (PNG, JPEG, WebP, GIF, BMP ...)"
    else:
        why = OBJECT_REPR.sub("", str(exc)) or type(exc).__name__
    return RequestError(f"the image cannot be read: {why}", field=field)
