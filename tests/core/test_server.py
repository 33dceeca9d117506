"""The server app (API mounting, /health, engine lifecycle) and ``mlxr serve``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from litestar import Response, Router, get, post
from litestar.params import FromQuery, JSONBody
from litestar.testing import TestClient

from mlxr_core.cli import serve
from mlxr_core.cli.main import main
from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.request import Arrivals
from mlxr_core.errors import ConfigError, MlxrError, PluginLoadError, RequestError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.errors import exception_handlers
from mlxr_core.http.server import build_app
from mlxr_core.plugins import hookimpl, load_plugins


class LifecycleEngine:
    """Just the engine surface the app itself uses: state, models, start, stop, memory."""

    def __init__(self, state: str = "created"):
        self.state = state
        self.models: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.queue_depth = 0
        self.calls: list[str] = []
        self.arrivals = Arrivals()

    @property
    def served(self) -> list[str]:
        return sorted(self.models)

    def start(self, *, wait: bool = True) -> None:
        self.calls.append(f"start(wait={wait})")
        self.state = "loading"

    def stop(self) -> None:
        self.calls.append("stop")
        self.state = "stopped"

    def memory(self) -> dict[str, int]:
        from mlxr_core.engine.engine import mlx_memory

        return mlx_memory()


class ToyApi:
    """A third-party API plugin with its own error format."""

    @hookimpl
    def mlxr_register_apis(self, register: Any) -> None:
        register("toy", make_toy_router)
        register("typed", make_typed_router)
        register("broken", lambda ctx: "not a router")
        register("raises", lambda ctx: 1 / 0)


@get("/toy/fail", sync_to_thread=False)
def toy_fail() -> dict[str, str]:
    raise RequestError("bad toy", field="x")


def make_toy_router(ctx: ServerContext) -> Router:
    def on_error(request: Any, exc: RequestError) -> Response[dict[str, str]]:
        return Response({"toy_error": exc.message}, status_code=exc.status)

    return Router(path="/", route_handlers=[toy_fail], exception_handlers={RequestError: on_error})


class ToyBody(msgspec.Struct, forbid_unknown_fields=True):
    count: int
    tags: list[str] = []


@post("/typed/echo", status_code=200, sync_to_thread=False)
def typed_echo(data: JSONBody[ToyBody]) -> dict[str, Any]:
    return {"count": data.count, "tags": data.tags}


@get("/typed/items", sync_to_thread=False)
def typed_items(limit: FromQuery[int]) -> dict[str, int]:
    return {"limit": limit}


def make_typed_router(ctx: ServerContext) -> Router:
    def body(exc: MlxrError) -> bytes:
        return msgspec.json.encode({"typed_error": exc.message, "field": exc.field})

    return Router(path="/", route_handlers=[typed_echo, typed_items], exception_handlers=exception_handlers(body))


def make_ctx(engine: Any, apis: list[str]) -> ServerContext:
    config = Config(models=[ModelConfig(path="unused")], apis=apis)
    return ServerContext(config=config, host=load_plugins(extra=[("toy", ToyApi())]), engine=engine)


def test_unknown_api_is_a_config_error_naming_apis() -> None:
    with pytest.raises(ConfigError, match=r"apis: unknown API 'opneai' .*did you mean openai\?"):
        build_app(make_ctx(LifecycleEngine(), ["opneai"]))
    with pytest.raises(ConfigError, match="apis"):
        build_app(make_ctx(LifecycleEngine(), []))
    with pytest.raises(ConfigError, match="more than once"):
        build_app(make_ctx(LifecycleEngine(), ["openai", "openai"]))


@pytest.mark.parametrize(("api", "message"), [("broken", "not a litestar.Router"), ("raises", "ZeroDivisionError")])
def test_a_broken_api_factory_names_its_plugin(api: str, message: str) -> None:
    with pytest.raises(PluginLoadError, match=f"plugin 'toy'.*{message}"):
        build_app(make_ctx(LifecycleEngine(), [api]))


def test_each_api_keeps_its_own_error_format() -> None:
    engine = LifecycleEngine("loading")
    with TestClient(build_app(make_ctx(engine, ["openai", "toy"]))) as client:
        toy = client.get("/toy/fail")
        assert toy.status_code == 400 and toy.json() == {"toy_error": "bad toy"}
        openai = client.get("/v1/models")
        assert openai.status_code == 503 and openai.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        (b'{"count": "5"}', "count", "Expected `int`, got `str`"),  # strict: no coercion
        (b'{"count": true}', "count", "Expected `int`, got `bool`"),
        (b'{"count": 1, "tags": [1]}', "tags[0]", "Expected `str`"),
        (b'{"count": 1, "extra": 2}', "extra", "unknown field"),
        (b'{"tags": []}', "count", "missing required field"),
        (b"", None, "empty"),
        (b"[1]", None, "Expected `object`"),
        (b'{"count": 1, "tags": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, "deeper than"),
        (b'{"count": ', None, "not valid JSON"),
    ],
)
def test_a_typed_body_is_decoded_strictly_and_refused_naming_its_field(body: bytes, field: str | None, message: str) -> None:
    """Any API's ``data: JSONBody[Struct]`` route: msgspec's strict rules, the depth bound before decoding,
    and a 400 in that API's error shape naming the field."""
    with TestClient(build_app(make_ctx(LifecycleEngine("ready"), ["typed"]))) as client:
        assert client.post("/typed/echo", json={"count": 2, "tags": ["a"]}).json() == {"count": 2, "tags": ["a"]}
        r = client.post("/typed/echo", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["field"] == field and message in r.json()["typed_error"], r.text
        # Litestar's own validation of a parameter, in the same shape.
        r = client.get("/typed/items", params={"limit": "many"})
        assert r.status_code == 400 and r.json()["field"] == "limit" and "query parameter" in r.json()["typed_error"], r.text


def test_an_unknown_path_under_an_api_answers_in_that_apis_shape() -> None:
    with TestClient(build_app(make_ctx(LifecycleEngine("ready"), ["openai", "typed"]))) as client:
        typed = client.get("/typed/nope")
        assert typed.status_code == 404 and typed.json() == {"typed_error": "no route GET /typed/nope", "field": None}
        wrong = client.put("/typed/echo", json={})
        assert wrong.status_code == 405 and "does not answer PUT; it answers" in wrong.json()["typed_error"]
        openai = client.get("/v1/nope")
        assert openai.status_code == 404 and openai.json()["error"]["message"] == "no route GET /v1/nope"


def test_lifespan_starts_the_engine_in_the_background_and_stops_it() -> None:
    engine = LifecycleEngine()
    with TestClient(build_app(make_ctx(engine, ["openai"]))) as client:
        assert engine.calls == ["start(wait=False)"]
        r = client.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert r.json()["state"] == "loading" and r.json()["models"] == []
    assert engine.calls == ["start(wait=False)", "stop"]


def test_an_engine_started_by_the_caller_is_left_running() -> None:
    engine = LifecycleEngine("ready")
    with TestClient(build_app(make_ctx(engine, ["openai"]))):
        pass
    assert engine.calls == []


def test_health_reports_models_and_mlx_memory_when_ready() -> None:
    engine = LifecycleEngine("ready")
    engine.models = {"b": object(), "a": object()}
    with TestClient(build_app(make_ctx(engine, ["openai"]))) as client:
        time.sleep(0.01)
        body = client.get("/health").json()
    assert body["status"] == "ok" and body["models"] == ["a", "b"] and body["uptime_s"] > 0
    assert set(body["memory"]) == {"active_bytes", "peak_bytes", "cache_bytes"}
    assert all(isinstance(v, int) and v >= 0 for v in body["memory"].values())


def test_health_reports_a_failed_load() -> None:
    engine = LifecycleEngine("failed")
    engine.error = FileNotFoundError("no such model: /x.gguf")
    with TestClient(build_app(make_ctx(engine, ["openai"]))) as client:
        r = client.get("/health")
    assert r.status_code == 503 and "retry-after" not in r.headers
    assert r.json()["status"] == "failed" and "/x.gguf" in r.json()["error"]


# -- mlxr serve -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def restore_logging() -> Any:
    """``mlxr serve`` configures mlxr's and uvicorn's loggers; give other tests theirs back."""
    import logging

    from mlxr_core.logs import LOGGERS

    saved = {name: (lg.level, lg.propagate, list(lg.handlers)) for name in LOGGERS for lg in [logging.getLogger(name)]}
    yield
    for name, (level, propagate, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.propagate = propagate
        logger.handlers[:] = handlers


def parse_serve(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mlxr")
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_log_level_accepts_any_case() -> None:
    assert parse_serve("--log-level", "DEBUG").log_level == "debug"
    with pytest.raises(SystemExit):
        parse_serve("--log-level", "loud")


def test_a_bad_config_exits_2_naming_the_key_before_loading_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mlxr_core.plugins.load_plugins", lambda **kw: pytest.fail("plugins loaded"))
    config = tmp_path / "server.yaml"
    config.write_text("models:\n  - path: /nowhere.gguf\nengine:\n  max_batch_size: 0\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "engine.max_batch_size" in capsys.readouterr().err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    config.write_text("models:\n  - path: /nowhere.gguf\n")
    assert main(["serve", "--config", str(config), "--port", "70000"]) == 2
    assert "server.port" in capsys.readouterr().err


def test_an_unknown_api_exits_2_before_loading_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mlxr_core.engine.engine.Engine.start", lambda *a, **kw: pytest.fail("engine started"))
    config = tmp_path / "server.yaml"
    config.write_text("models:\n  - path: /nowhere.gguf\napis: [openia]\n")
    assert main(["serve", "--config", str(config), "--port", "0"]) == 2
    assert "apis[0]: unknown API 'openia'" in capsys.readouterr().err


def test_a_misspelled_kernel_backend_exits_2_before_the_port_opens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mlxr_core.cli.serve.bind", lambda *a, **kw: pytest.fail("port bound"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {model}\n    kernels:\n      quantized_matmul: cpu_nativ\n")
    assert main(["serve", "--config", str(config), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert re.search(
        r":4: models\[0\]\.kernels\.quantized_matmul: unknown quantized_matmul kernel backend 'cpu_nativ' "
        r"\(available: [^)]*\bcpu_native\b[^)]*\); did you mean cpu_native\?",
        err,
    ), err


def test_a_model_that_fails_to_load_stops_the_server_with_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "broken.gguf"
    model.write_bytes(b"GGUF")  # there, so the config check passes; unreadable when it loads
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {model}\n")
    started = time.monotonic()
    assert main(["serve", "--config", str(config), "--port", "0", "--log-level", "WARNING"]) == 1
    assert time.monotonic() - started < 15
    assert "broken.gguf" in capsys.readouterr().err


def test_a_port_in_use_is_one_error_before_any_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mlxr_core.engine.remote.make_engine", lambda *a, **kw: pytest.fail("engine made"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    config = tmp_path / "server.yaml"
    config.write_text(f"models:\n  - path: {model}\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--config", str(config), "--port", str(port)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"mlxr: error: cannot listen on 127.0.0.1:{port}: ") and "--port" in line


@pytest.mark.slow
def test_the_serving_line_comes_when_the_server_answers(tiny_config: Path, tmp_path: Path) -> None:
    """No "startup complete" from uvicorn while the models load; "serving" once /health is 200."""
    config = tmp_path / "server.yaml"
    config.write_text(tiny_config.read_text() + "apis: [openai]\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not (serving := [line for line in lines if "mlxr: serving" in line]):
            assert reader.is_alive() and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
        before = lines[: lines.index(serving[0])]
        assert not [line for line in before if "startup complete" in line or "Uvicorn running" in line], before
        # The server's own check that preceded the line (its access-log line is written once the
        # reply is sent, so it may come just after "serving"), before this test asks /health itself.
        deadline = time.monotonic() + 10
        while not any("GET /health 200" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("GET /health 200" in line for line in lines), lines
        assert httpx.get(re.search(r"at (http://\S+)", serving[0])[1] + "/health").status_code == 200  # type: ignore[index]
    finally:
        process.kill()
        process.communicate()


# -- read deadlines on connections -------------------------------------------------------------------


@pytest.fixture
def deadline_server() -> Iterator[tuple[int, float]]:
    """uvicorn with ``mlxr serve``'s settings (0.5 s read deadlines) around a tiny app: ``/health``
    and a route that takes 1.5 s to answer; yields the port and the deadline."""
    import uvicorn
    from litestar import Litestar

    from mlxr_core.config.schema import ServerConfig

    @get("/health", sync_to_thread=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/slow")
    async def slow() -> dict[str, str]:
        await asyncio.sleep(1.5)
        return {"status": "done"}

    settings = ServerConfig(port=0, header_timeout=0.5, body_timeout=0.5)
    server = uvicorn.Server(serve.uvicorn_config(Litestar([health, slow]), settings, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1], 0.5
    finally:
        server.should_exit = True
        thread.join(10)


def closed_within(sock: socket.socket, seconds: float, dribble: bytes = b"") -> bool:
    """Whether the server closes ``sock`` within ``seconds`` while the client sends ``dribble`` a
    byte at a time."""
    sock.settimeout(0.05)
    deadline, sent = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        try:
            if not sock.recv(1024):
                return True
        except TimeoutError:
            pass
        except OSError:
            return True
        if dribble:
            try:
                sock.send(dribble[sent % len(dribble) : sent % len(dribble) + 1])
            except OSError:
                return True
            sent += 1
    return False


def test_idle_slow_loris_and_slow_body_connections_are_closed_and_health_keeps_answering(
    deadline_server: tuple[int, float],
) -> None:
    port, timeout = deadline_server
    connect = lambda: socket.create_connection(("127.0.0.1", port))  # noqa: E731
    idle = [connect() for _ in range(20)]
    loris, body = connect(), connect()
    loris.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    body.sendall(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        assert client.get("/health").status_code == 200
        assert closed_within(loris, 3 * timeout, dribble=b"X-Slow: 1\r\n")
        assert closed_within(body, 3 * timeout, dribble=b"x")
        assert all(closed_within(sock, timeout) for sock in idle)
        assert client.get("/health").status_code == 200
        # A response that takes longer than both deadlines is not cut: the request is all in.
        assert client.get("/slow", timeout=10).json() == {"status": "done"}
    for sock in [*idle, loris, body]:
        sock.close()


def test_past_the_connection_budget_the_longest_idle_connection_makes_room() -> None:
    """Twenty idle sockets against a budget of eight (deadlines far off): each new connection
    closes the one idle longest, so ``/health`` keeps answering and the newest idle ones stay."""
    import uvicorn
    from litestar import Litestar

    from mlxr_core.config.schema import ServerConfig

    @get("/health", sync_to_thread=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    settings = ServerConfig(port=0, header_timeout=60.0, body_timeout=60.0, max_connections=8)
    server = uvicorn.Server(serve.uvicorn_config(Litestar([health]), settings, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        idle = []
        for _ in range(20):
            idle.append(socket.create_connection(("127.0.0.1", port)))
            time.sleep(0.02)  # an order the server sees
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            assert client.get("/health").status_code == 200
        closed = [closed_within(sock, 0.5) for sock in idle]
        assert all(closed[:12]) and not any(closed[-6:]), closed
        for sock in idle:
            sock.close()
    finally:
        server.should_exit = True
        thread.join(10)


# -- a real server process on the tiny model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    folder = tmp_path_factory.mktemp("serve")
    model = write_tiny_llama_gguf(folder / "tiny.gguf")
    config = folder / "server.yaml"
    config.write_text(
        f"models:\n  - path: {model}\n    name: tiny\n    context_length: 4096\n"
        "engine:\n  max_batch_size: 8\n"
        "server:\n  shutdown_timeout: 1.0\n"
    )
    return config


def start_server(config: Path) -> tuple[subprocess.Popen[str], str]:
    """``mlxr serve`` on a free port; returns the process and its URL once it says it is ready."""
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxr_core.cli.main", "serve", "--config", str(config), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    lines = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(r"serving .* at (http://\S+)", line)
        if match:
            return process, match[1]
    process.kill()
    pytest.fail("mlxr serve did not become ready:\n" + "".join(lines))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_answers_then_shuts_down_gracefully_on_a_signal(tiny_config: Path, sig: int) -> None:
    process, url = start_server(tiny_config)
    try:
        assert httpx.get(f"{url}/health").json()["models"] == ["tiny"]
        reply = httpx.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 3, "temperature": 0},
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
        process.send_signal(sig)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, output
    assert "Traceback" not in output


@pytest.mark.slow
def test_sigterm_during_eight_streams_ends_each_one_and_exits_0(tiny_config: Path) -> None:
    """Each stream ends with its whole completion or a final error event; the process exits 0
    within server.shutdown_timeout (1 s) plus a margin."""
    process, url = start_server(tiny_config)
    lengths = [3, 3] + [4000] * 6  # two finish at once; six outlast the shutdown timeout
    streams: list[list[str]] = [[] for _ in lengths]
    first_chunk = [threading.Event() for _ in lengths]

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": "the", "max_tokens": lengths[i], "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line:
                    streams[i].append(line)
                    first_chunk[i].set()
        first_chunk[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(lengths))]
    try:
        for thread in threads:
            thread.start()
        assert all(event.wait(30) for event in first_chunk)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        process.kill()
    for thread in threads:
        thread.join(5)
    assert process.returncode == 0 and took < 1.0 + 5, (took, output)
    assert "Traceback" not in output
    finished = cut = 0
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2].removeprefix("data: "))
        if "error" in last:
            assert "shutting down" in last["error"]["message"]
            cut += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            finished += 1
    assert finished >= 2 and cut >= 1, (finished, cut)


@pytest.mark.slow
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_during_the_drain_ends_every_stream_with_an_error_and_exits_130(
    tiny_config: Path, tmp_path: Path, second: int
) -> None:
    """SIGTERM starts a drain that would wait 60 s; a second signal ends the streams at once, each
    with a final error event, and the exit status says the shutdown was forced."""
    config = tmp_path / "server.yaml"
    config.write_text(tiny_config.read_text().replace("shutdown_timeout: 1.0", "shutdown_timeout: 60.0"))
    process, url = start_server(config)
    streams: list[list[str]] = [[] for _ in range(6)]
    first_chunk = [threading.Event() for _ in streams]

    def stream(i: int) -> None:
        body = {"model": "tiny", "prompt": "the", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line:
                        streams[i].append(line)
                        first_chunk[i].set()
        except httpx.HTTPError as exc:
            streams[i].append(f"cut: {exc!r}")
        first_chunk[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(streams))]
    try:
        for thread in threads:
            thread.start()
        assert all(event.wait(30) for event in first_chunk)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        sent = time.monotonic()
        process.send_signal(second)
        output, _ = process.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        process.kill()
    for thread in threads:
        thread.join(5)
    assert process.returncode == 130 and took < 10, (process.returncode, took, output[-2000:])
    assert "Traceback" not in output, output[-5000:]
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert "shutting down" in json.loads(lines[-2].removeprefix("data: "))["error"]["message"]
