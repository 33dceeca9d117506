"""Models loaded and unloaded on demand (mlxr_core.engine.lifecycle) through the HTTP APIs: lazy
loading, a memory budget that fits one model of two, idle unloading that frees MLX memory, pins,
Ollama's keep_alive and empty requests, /api/ps, /metrics, the admin load/unload routes, a
request waiting for a slow load, a model that fails to load, and the config keys' errors."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from litestar.testing import TestClient

from mlxr_core.config.loader import ConfigProblems, load_config
from mlxr_core.config.schema import (
    Config,
    EngineConfig,
    ModelConfig,
    PrefixCacheConfig,
    ServerConfig,
)
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.lifecycle import parse_keep_alive
from mlxr_core.errors import ConfigError
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.model import loader
from mlxr_core.plugins import load_plugins
from mlxr_plugins.apis.ollama.models import NEVER

KEY = "admin-key"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three tiny random models of ~2 MB of float32 weights each."""
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    folder = tmp_path_factory.mktemp("lifecycle")
    return {
        name: write_tiny_llama_gguf(folder / f"{name}.gguf", seed=seed, hidden=128, intermediate=512, context_length=64)
        for seed, name in enumerate(("a", "b", "c"))
    }


@contextmanager
def serving(models: list[ModelConfig], *, keys: tuple[str, ...] = (), host: str = "127.0.0.1",
            admin_keys: tuple[str, ...] = (), **engine: Any) -> Iterator[tuple[TestClient, Engine]]:  # fmt: skip
    """The OpenAI and Ollama APIs over a real engine; no prefix cache, so a model's memory is its
    weights and KV cache only."""
    config = Config(
        models=models,
        server=ServerConfig(host=host, api_keys=list(keys), admin_api_keys=list(admin_keys)),
        engine=EngineConfig(max_batch_size=2, prefix_cache=PrefixCacheConfig(enabled=False), **engine),
        apis=["openai", "ollama"],
    )
    host_plugins = load_plugins()
    engine_ = Engine(config, host_plugins)
    engine_.start()
    try:
        app = build_app(ServerContext(config=config, host=host_plugins, engine=engine_))
        with TestClient(app) as client:
            if keys:
                client.headers["authorization"] = f"Bearer {KEY}"
            yield client, engine_
    finally:
        engine_.stop()


def one_budget(files: dict[str, Path]) -> int:
    """Room for one model's weights and KV reserve, not two."""
    return int(1.5 * files["a"].stat().st_size)


def ps(client: TestClient) -> list[str]:
    return [m["name"] for m in client.get("/api/ps").json()["models"]]


def generate(client: TestClient, model: str, **extra: Any) -> Any:
    body = {"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 3}, **extra}
    return client.post("/api/generate", json=body)


def metric(client: TestClient, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    text = client.get("/metrics").text
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match and ",".join(sorted((match[1] or "").split(","))) == wanted:
            return float(match[2])
    return 0.0


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_two_models_under_a_budget_for_one_take_turns(files: dict[str, Path]) -> None:
    models = [ModelConfig(path=str(files["a"]), name="a"), ModelConfig(path=str(files["b"]), name="b", load="lazy")]
    with serving(models, memory_budget_bytes=one_budget(files)) as (client, engine):
        assert ps(client) == ["a"]  # b is lazy: known, not loaded
        cards = client.get("/v1/models").json()["data"]
        assert [m["id"] for m in cards] == ["a", "b"]
        # What b takes is known once it loads.
        assert cards[0]["capabilities"][0] == "completion" and "capabilities" not in cards[1]
        assert [m["name"] for m in client.get("/api/tags").json()["models"]] == ["a", "b"]
        for _ in range(2):
            r = generate(client, "b")
            assert r.status_code == 200 and r.json()["done"], r.text
            assert ps(client) == ["b"]
            r = client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert ps(client) == ["a"]
        assert metric(client, "mlxr_model_loads_total", model="a") == 3  # at startup, then twice back
        assert metric(client, "mlxr_model_loads_total", model="b") == 2
        assert metric(client, "mlxr_model_unloads_total", model="a", reason="budget") == 2
        assert metric(client, "mlxr_model_unloads_total", model="b", reason="budget") == 2
        assert metric(client, "mlxr_models_loaded") == 1
        # /api/ps: the weights' bytes; the budget counts them with the KV and prefix reserve.
        held = client.get("/api/ps").json()["models"][0]["size"]
        assert held == engine.models["a"].nbytes
        assert held < metric(client, "mlxr_model_loaded_bytes", model="a") <= one_budget(files)


def test_concurrent_requests_for_two_models_under_a_budget_for_one_all_succeed(files: dict[str, Path]) -> None:
    models = [ModelConfig(path=str(files["a"]), name="a"), ModelConfig(path=str(files["b"]), name="b", load="lazy")]
    with serving(models, memory_budget_bytes=one_budget(files)) as (client, _):
        statuses: list[int] = []

        def alternate(first: int) -> None:
            for turn in range(3):
                statuses.append(generate(client, "ab"[(first + turn) % 2]).status_code)

        threads = [threading.Thread(target=alternate, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert statuses == [200] * 12
        assert len(ps(client)) == 1 and metric(client, "mlxr_models_loaded") == 1


def test_embeddings_of_a_lazy_model_wait_for_its_load(files: dict[str, Path]) -> None:
    models = [ModelConfig(path=str(files["a"]), name="a", load="lazy")]
    with serving(models) as (client, _):
        r = client.post("/v1/embeddings", json={"model": "a", "input": ["the cat", "a dog"]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2, r.text
        assert ps(client) == ["a"]
        assert client.post("/v1/models/a/unload", json={}).json()["loaded"] is False
        r = client.post("/api/embed", json={"model": "a", "input": "the cat"})
        assert r.status_code == 200 and len(r.json()["embeddings"]) == 1 and ps(client) == ["a"]


def test_an_idle_model_unloads_after_its_timeout_and_its_memory_returns(files: dict[str, Path]) -> None:
    models = [ModelConfig(path=str(files["a"]), name="a", idle_unload_seconds=2.0)]
    with serving(models) as (client, engine):
        weights = engine.models["a"].nbytes
        assert generate(client, "a").status_code == 200
        loaded = mx.get_active_memory()  # well inside the 2 s it stays
        assert client.get("/api/ps").json()["models"][0]["expires_at"] != NEVER
        assert eventually(lambda: ps(client) == [])
        assert loaded - mx.get_active_memory() >= 0.9 * weights
        assert metric(client, "mlxr_model_unloads_total", model="a", reason="idle") == 1
        # The next request loads it again.
        assert generate(client, "a").status_code == 200 and ps(client) == ["a"]


def test_a_pinned_model_stays_while_the_others_take_turns(files: dict[str, Path]) -> None:
    budget = files["a"].stat().st_size + one_budget(files)
    models = [
        ModelConfig(path=str(files["a"]), name="a", pin=True),
        ModelConfig(path=str(files["b"]), name="b", load="lazy"),
        ModelConfig(path=str(files["c"]), name="c", load="lazy"),
    ]
    with serving(models, memory_budget_bytes=budget) as (client, _):
        # a is the least recently used when c needs room: b goes, as a is pinned.
        for model in ("b", "c", "b"):
            assert generate(client, model).status_code == 200
            assert ps(client) == ["a", model]
        assert client.get("/api/ps").json()["models"][0]["expires_at"] == NEVER
        # keep_alive 0 does not unload a pinned model.
        r = client.post("/api/generate", json={"model": "a", "keep_alive": 0})
        assert r.status_code == 200 and r.json()["done_reason"] == "load"
        assert generate(client, "a", keep_alive=0).status_code == 200
        time.sleep(0.3)
        assert "a" in ps(client)


def test_keep_alive_as_ollama_reads_it(files: dict[str, Path]) -> None:
    models = [ModelConfig(path=str(files["a"]), name="a"), ModelConfig(path=str(files["b"]), name="b", load="lazy")]
    with serving(models) as (client, _):
        # An empty request loads; with keep_alive 0 it unloads.
        r = client.post("/api/chat", json={"model": "b", "messages": []})
        assert r.status_code == 200 and r.json()["done_reason"] == "load" and ps(client) == ["a", "b"]
        r = client.post("/api/generate", json={"model": "b", "keep_alive": 0})
        assert r.status_code == 200 and r.json()["done_reason"] == "unload" and ps(client) == ["a"]
        # A duration from now; negative: forever; 0 after a reply: unloaded once it is sent.
        assert generate(client, "b", keep_alive="5m").status_code == 200
        expires = client.get("/api/ps").json()["models"][1]["expires_at"]
        left = time.mktime(time.strptime(expires[:19], "%Y-%m-%dT%H:%M:%S")) - time.mktime(time.gmtime())
        assert 240 < left <= 301
        assert generate(client, "b", keep_alive=-1).status_code == 200
        assert client.get("/api/ps").json()["models"][1]["expires_at"] == NEVER
        # past year 9999 (the fuzzer's pick): never too, not a date that overflows into a 500
        for far in (1e300, 1e12):
            assert generate(client, "b", keep_alive=far).status_code == 200
            r = client.get("/api/ps")
            assert r.status_code == 200 and r.json()["models"][1]["expires_at"] == NEVER, r.text
        assert generate(client, "b", keep_alive=0).status_code == 200
        assert eventually(lambda: ps(client) == ["a"])
        r = client.post("/api/embed", json={"model": "b", "input": "the cat", "keep_alive": "0s"})
        assert r.status_code == 200 and eventually(lambda: ps(client) == ["a"])
        r = generate(client, "a", keep_alive="5 minutes")
        assert r.status_code == 400 and "keep_alive" in r.json()["error"]


@pytest.mark.parametrize(("value", "seconds"), [
    (30, 30.0), (2.5, 2.5), ("0", 0.0), ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5), ("300ms", 0.3),
    (-1, None), ("-1m", None),
])  # fmt: skip
def test_keep_alive_values(value: Any, seconds: float | None) -> None:
    assert parse_keep_alive(value) == pytest.approx(seconds) if seconds is not None else parse_keep_alive(value) is None


@pytest.mark.parametrize("value", ["", "5", "m", "5 m", "1d", "5mm", "nan"])
def test_keep_alive_refuses_what_go_refuses(value: str) -> None:
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def test_admin_load_and_unload_need_a_key(files: dict[str, Path]) -> None:
    models = [ModelConfig(path=str(files["a"]), name="a"), ModelConfig(path=str(files["b"]), name="b", load="lazy")]
    with serving(models, keys=(KEY,)) as (client, _):
        assert client.post("/v1/models/b/load", json={}, headers={"authorization": ""}).status_code == 401
        r = client.post("/v1/models/b/load", json={}, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
        assert ps(client) == ["a"]
        r = client.post("/v1/models/b/load", json={})
        assert r.status_code == 200 and r.json() == {"id": "b", "loaded": True, "object": "model"}
        assert ps(client) == ["a", "b"]
        r = client.post("/v1/models/a/unload", json={})
        assert r.status_code == 200 and r.json()["loaded"] is False and ps(client) == ["b"]
        assert client.post("/v1/models/nope/load", json={}).status_code == 404
        assert client.post("/v1/models/b/reload", json={}).status_code == 404
        # A body not declared as JSON (a form a web page could post across sites) is refused.
        assert client.post("/v1/models/a/unload", headers={"origin": "http://evil.example"}).status_code == 415
        assert metric(client, "mlxr_model_unloads_total", model="a", reason="request") == 1
    # No admin key on a server others can reach: refused, with or without client keys.
    with serving(models, host="0.0.0.0") as (client, _):
        r = client.post("/v1/models/b/load", json={})
        assert r.status_code == 403 and "server.admin_api_keys" in r.json()["error"]["message"]
    with serving(models, keys=(KEY,), host="0.0.0.0") as (client, _):
        r = client.post("/v1/models/b/load", json={})
        assert r.status_code == 403 and "server.admin_api_keys" in r.json()["error"]["message"]
        r = client.post("/api/generate", json={"model": "a", "keep_alive": 0})
        assert r.status_code == 403 and "server.admin_api_keys" in r.json()["error"] and ps(client) == ["a"]


ADMIN = "operator-key"


def test_with_admin_keys_only_an_admin_key_loads_and_unloads(files: dict[str, Path]) -> None:
    models = [ModelConfig(path=str(files["a"]), name="a"), ModelConfig(path=str(files["b"]), name="b", load="lazy")]
    admin = {"authorization": f"Bearer {ADMIN}"}
    with serving(models, keys=(KEY,), admin_keys=(ADMIN,)) as (client, _):
        # A client key: served, but not allowed to change what is served (each API's own shape).
        assert client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2}).status_code == 200
        for action in ("b/load", "a/unload"):
            r = client.post(f"/v1/models/{action}", json={})
            assert r.status_code == 403 and "server.admin_api_keys" in r.json()["error"]["message"], r.text
        r = client.post("/api/chat", json={"model": "a", "messages": [], "keep_alive": 0})
        assert r.status_code == 403 and "server.admin_api_keys" in r.json()["error"]
        assert ps(client) == ["a"]
        r = client.post("/v1/models/b/load", json={}, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        # The admin key administers, and serves as a client key too.
        r = client.post("/v1/models/b/load", json={}, headers=admin)
        assert r.status_code == 200 and r.json()["loaded"] is True and ps(client) == ["a", "b"]
        r = client.post("/api/generate", json={"model": "b", "keep_alive": 0}, headers=admin)
        assert r.status_code == 200 and r.json()["done_reason"] == "unload" and ps(client) == ["a"]
        r = client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2}, headers=admin)
        assert r.status_code == 200
    # Admin keys without client keys on a server others reach: the API is open, administration is not.
    with serving(models, admin_keys=(ADMIN,), host="0.0.0.0") as (client, _):
        assert client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert client.post("/v1/models/b/load", json={}).status_code == 401
        assert client.post("/v1/models/b/load", json={}, headers={"x-api-key": "wrong"}).status_code == 401
        assert client.post("/v1/models/b/load", json={}, headers=admin).status_code == 200 and ps(client) == ["a", "b"]


@pytest.fixture
def slow_loads(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], threading.Event]:
    """Make every load take ``seconds`` longer; the event is set once one started."""

    def slow(seconds: float) -> threading.Event:
        started = threading.Event()
        load_model = loader.load_model

        def slowly(*args: Any, **kwargs: Any) -> Any:
            started.set()
            time.sleep(seconds)
            return load_model(*args, **kwargs)

        monkeypatch.setattr(loader, "load_model", slowly)
        return started

    return slow


def test_a_request_during_a_slow_load_waits_for_it(files: dict[str, Path], slow_loads: Any) -> None:
    models = [ModelConfig(path=str(files["a"]), name="a", load="lazy")]
    with serving(models) as (client, _):
        started = slow_loads(1.0)
        r = client.post("/v1/chat/completions", json={"model": "a", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 3})  # fmt: skip
        assert r.status_code == 200, r.text
        assert started.is_set() and metric(client, "mlxr_model_loads_total", model="a") == 1


def test_past_the_wait_bound_a_request_gets_a_503_in_its_api_shape(files: dict[str, Path], slow_loads: Any) -> None:
    models = [ModelConfig(path=str(files["a"]), name="a", load="lazy")]
    with serving(models, model_load_wait_s=0.2) as (client, _):
        slow_loads(3.0)
        r = client.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 503 and r.headers["retry-after"]
        message = r.json()["error"]["message"]
        assert "'a'" in message and "engine.model_load_wait_s" in message
        r = generate(client, "a")
        assert r.status_code == 503 and "engine.model_load_wait_s" in r.json()["error"]
        assert eventually(lambda: ps(client) == ["a"])  # the load went on
        assert generate(client, "a").status_code == 200


def test_a_model_that_fails_to_load_is_named_and_the_others_serve_on(files: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    models = [ModelConfig(path=str(files["a"]), name="a"), ModelConfig(path=str(broken), name="broken", load="lazy")]
    with serving(models) as (client, _):
        r = client.post("/v1/completions", json={"model": "broken", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "model 'broken' failed to load" in message and "broken.gguf" in message
        assert generate(client, "a").status_code == 200 and ps(client) == ["a"]


def test_a_model_larger_than_the_budget_once_measured_is_refused(files: dict[str, Path]) -> None:
    # Its files fit (the estimate before a first load); weights and KV reserve, measured, do not.
    budget = files["b"].stat().st_size + 1000
    models = [ModelConfig(path=str(files["b"]), name="b", load="lazy")]
    with serving(models, memory_budget_bytes=budget) as (client, engine):
        r = generate(client, "b")
        assert r.status_code == 503, r.text
        assert re.search(r"model 'b' needs \d+ bytes, more than engine.memory_budget_bytes", r.json()["error"])
        assert ps(client) == [] and engine.running == 0
    eager = Engine(Config(models=[ModelConfig(path=str(files["b"]), name="b")],
                          engine=EngineConfig(memory_budget_bytes=budget)), load_plugins())  # fmt: skip
    with pytest.raises(ConfigError, match=r"engine\.memory_budget_bytes: model 'b' needs"):
        eager.start()
    eager.stop()


def test_bad_lifecycle_settings_name_their_key(tmp_path: Path, files: dict[str, Path]) -> None:
    def problems(text: str) -> list[str]:
        path = tmp_path / "server.yaml"
        path.write_text(text)
        with pytest.raises(ConfigProblems) as caught:
            load_config(path, environ={})
        return caught.value.problems

    model = "models:\n  - path: /models/a.gguf\n"
    assert any("models[0].idle_unload_seconds" in p for p in problems(model + "    idle_unload_seconds: -1\n"))
    assert any("models[0].load" in p for p in problems(model + "    load: sometimes\n"))
    assert any("engine.memory_budget_bytes" in p for p in problems(model + "engine:\n  memory_budget_bytes: 0\n"))
    assert any("engine.model_load_wait_s" in p for p in problems(model + "engine:\n  model_load_wait_s: 0\n"))
    assert any("server.admin_api_keys" in p for p in problems(model + "server:\n  admin_api_keys: ['']\n"))
    shared = problems(model + "server:\n  api_keys: [k1]\n  admin_api_keys: [k2, k1]\n")
    assert any("server.admin_api_keys" in p and "api_keys" in p for p in shared)
    both = problems(model + "    pin: true\n    idle_unload_seconds: 60\n")
    assert any("models[0].idle_unload_seconds" in p and "pinned" in p for p in both)
    # Across processes every rank holds every model: nothing loads or unloads on demand.
    ranks = problems(model + "    load: lazy\nengine:\n  memory_budget_bytes: 1000\ndistributed:\n  tensor_parallel: 2\n")
    assert any("models[0].load" in p and "distributed" in p for p in ranks)
    assert any("engine.memory_budget_bytes" in p and "distributed" in p for p in ranks)
    # A pinned model larger than the budget: found when its size is known, before serving.
    config = Config(models=[ModelConfig(path=str(files["a"]), name="a", pin=True)],
                    engine=EngineConfig(memory_budget_bytes=1000))  # fmt: skip
    engine = Engine(config, load_plugins())
    with pytest.raises(ConfigError, match=r"models\[0\]\.pin: model 'a' needs \d+ bytes"):
        engine.start()
    engine.stop()


@pytest.mark.slow
def test_mlxr_serve_from_a_config_file_swaps_two_models_and_unloads_an_idle_one(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """The lifecycle keys as an operator writes them, in a real ``mlxr serve`` process: two models
    under a budget for one take turns (/api/ps and /metrics show each swap), then the one left
    idle unloads after its timeout and its MLX memory goes back."""
    import httpx

    from mlxr_core.testing.serving import serve_command, start

    config = tmp_path / "server.yaml"
    config.write_text(
        "models:\n"
        f"  - {{path: {files['a']}, name: a, idle_unload_seconds: 3}}\n"
        f"  - {{path: {files['b']}, name: b, load: lazy, idle_unload_seconds: 3}}\n"
        f"engine:\n  max_batch_size: 2\n  memory_budget_bytes: {one_budget(files)}\n"
        "  prefix_cache: {enabled: false}\n"
        "apis: [openai, ollama]\n"
    )
    process, url, lines = start(serve_command(config))
    try:
        with httpx.Client(base_url=url, timeout=60) as client:

            def loaded() -> list[str]:
                return [m["name"] for m in client.get("/api/ps").json()["models"]]

            def sample(prefix: str, *labels: str) -> float:
                return sum(
                    float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
                    if line.startswith(prefix) and all(label in line for label in labels)
                )  # fmt: skip

            for model in ["b", "a", "b"]:
                body = {"model": model, "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
                r = client.post("/api/generate", json=body)
                assert r.status_code == 200 and r.json()["done"], r.text
                assert loaded() == [model]
            budget_unloads = [sample("mlxr_model_unloads_total{", f'model="{m}"', 'reason="budget"') for m in "ab"]
            assert budget_unloads == [2, 1]
            held = sample('mlxr_mlx_memory_bytes{kind="active"}')
            assert held > 0
            assert eventually(lambda: loaded() == [], timeout=20)
            assert sample("mlxr_model_unloads_total{", 'model="b"', 'reason="idle"') == 1
            assert sample('mlxr_mlx_memory_bytes{kind="active"}') < held / 10
    finally:
        process.terminate()
        process.wait(30)
    assert "Traceback" not in "".join(lines)
