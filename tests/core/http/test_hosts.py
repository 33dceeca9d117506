"""DNS rebinding: which ``Host`` headers a server answers (``mlxr_core.http.hosts``), on a real uvicorn
with ``mlxr serve``'s settings."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from litestar import Litestar, get

from mlxr_core.cli import serve
from mlxr_core.config.schema import ServerConfig
from mlxr_core.http.hosts import AllowedHosts, host_name


@get("/health", sync_to_thread=False)
def health() -> dict[str, str]:
    return {"status": "ok"}


@contextmanager
def running(settings: ServerConfig) -> Iterator[int]:
    """uvicorn with ``mlxr serve``'s settings around ``/health``; yields the port."""
    import uvicorn

    app = Litestar([health], logging_config=None)
    server = uvicorn.Server(serve.uvicorn_config(app, settings, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def statuses(port: int, hosts: list[str]) -> dict[str, int]:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        return {host: client.get("/health", headers={"Host": host.format(port=port)}).status_code for host in hosts}


def test_a_loopback_server_answers_only_hosts_that_name_it() -> None:
    with running(ServerConfig(port=0)) as port:
        answered = statuses(port, [
            "localhost", "localhost:{port}", "LocalHost.:{port}", "127.0.0.1", "127.0.0.1:{port}",
            "[::1]:{port}", "[::1]", "127.0.0.2:{port}", "app.localhost:{port}",
        ])
        assert set(answered.values()) == {200}, answered
        refused = statuses(port, ["evil.example:{port}", "evil.example", "localhost.evil.example", "127.0.0.1.nip.io"])
        assert set(refused.values()) == {403}, refused
        reply = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Host": f"evil.example:{port}"})
        assert reply.headers["content-type"] == "application/json"
        message = reply.json()["error"]
        assert "evil.example" in message and "server.allowed_hosts" in message and "DNS rebinding" in message


def test_names_in_allowed_hosts_are_answered_too() -> None:
    settings = ServerConfig(port=0, allowed_hosts=["mlxr.lan", ".corp.example"])
    with running(settings) as port:
        answered = statuses(port, ["mlxr.lan:{port}", "MLXR.LAN", "corp.example", "api.corp.example:{port}", "localhost"])
        assert set(answered.values()) == {200}, answered
        refused = statuses(port, ["evil.example:{port}", "mlxr.lan.evil.example", "evilcorp.example"])
        assert set(refused.values()) == {403}, refused


def test_a_server_bound_elsewhere_checks_hosts_only_when_told_to() -> None:
    everywhere = AllowedHosts("0.0.0.0")
    assert not everywhere.enabled and everywhere.allows("evil.example:8000")
    assert not AllowedHosts("192.168.1.5").enabled
    named = AllowedHosts("0.0.0.0", ["api.example"])
    assert named.allows("api.example:8000") and named.allows("192.168.1.5:8000") and named.allows("localhost")
    assert not named.allows("evil.example:8000")
    lan = AllowedHosts("192.168.1.5", ["api.example"])
    assert lan.allows("192.168.1.5:8000") and not lan.allows("10.0.0.1:8000") and not lan.allows("evil.example")
    assert not AllowedHosts("127.0.0.1", ["*"]).enabled
    ipv6 = AllowedHosts("::1")
    assert ipv6.enabled and ipv6.allows("[::1]:8000") and ipv6.allows("localhost") and not ipv6.allows("evil.example")
    assert AllowedHosts("localhost").enabled
    # HTTP/1.0 without a Host comes from no browser, so from no rebinding page.
    assert AllowedHosts("127.0.0.1").allows(None)


@pytest.mark.parametrize(
    ("header", "name"),
    [("localhost:8000", "localhost"), ("[::1]:8000", "::1"), ("::1", "::1"), ("EVIL.Example.:80", "evil.example")],
)
def test_host_name_drops_the_port_brackets_and_case(header: str, name: str) -> None:
    assert host_name(header) == name
