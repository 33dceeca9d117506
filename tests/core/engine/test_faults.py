"""Faults inside the engine stay where they happen: a request whose own generation raises fails
alone while the rest of its batch completes, and a plugin that raises or hangs in a lifecycle hook
neither stops the engine from serving nor from stopping."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import mlx.core as mx
import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Failed, Finished, GenerationRequest, SamplingParams
from mlxr_core.plugins import hookimpl, load_plugins

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 17, 23, 99, 3, 8, 61]]
FAULTY_PROMPT = [12, 13, 14, 15]


class InjectedFault(RuntimeError):
    pass


class FaultyProcessor:
    """Passes logits through until ``after`` tokens, then raises in ``__call__`` or ``accept``."""

    def __init__(self, where: str, after: int):
        self.where, self.after, self.seen = where, after, 0
        if where == "accept":
            self.accept = self._accept

    def __call__(self, logits: mx.array) -> mx.array:
        if self.where == "process":
            self.seen += 1
            if self.seen > self.after:
                raise InjectedFault("injected fault in a logits processor")
        return logits

    def _accept(self, token: int) -> None:
        self.seen += 1
        if self.seen >= self.after:
            raise InjectedFault("injected fault in a processor's accept")


def faulty_factory(params: SamplingParams, context: Any) -> FaultyProcessor | None:
    fault = params.extra.get("fault")
    return None if fault is None else FaultyProcessor(fault, int(params.extra["fault_after"]))


class FaultySamplers:
    """A sampler plugin that injects a fault into the requests that ask for one."""

    @hookimpl
    def mlxr_register_samplers(self, register: Any) -> None:
        register("faulty", faulty_factory, order=99)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def make_engine(tiny_path: Any, plugins: list[tuple[str, object]], **engine: Any) -> Engine:
    config = Config(
        models=[ModelConfig(path=str(tiny_path), name="tiny", context_length=256)],
        engine=EngineConfig(**engine),
    )
    return Engine(config, load_plugins(extra=plugins))


def request(prompt: list[int], max_tokens: int = 10, **extra: Any) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, extra={"ignore_eos": True, **extra})
    return GenerationRequest(model="tiny", prompt_ids=list(prompt), params=params)


def tokens_of(events: list[Any]) -> list[int]:
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def wait_idle(engine: Engine, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    stats = engine.stats()
    while (stats["running"] or stats["kv_bytes"] or stats["kv_bytes_reserved"]) and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = engine.stats()
    return stats


@pytest.mark.parametrize("where", ["process", "accept"])
def test_a_request_whose_sampler_raises_fails_alone_and_its_batch_completes(
    tiny_path: Any, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(tiny_path, [("faulty", FaultySamplers())], max_batch_size=4, prefill_chunk=64)
    engine.start()
    try:
        solo = [tokens_of(list(engine.submit(request(p)))) for p in PROMPTS]
        with caplog.at_level(logging.ERROR, logger="mlxr_core.engine"):
            handles = [engine.submit(request(p)) for p in PROMPTS]
            faulty = engine.submit(request(FAULTY_PROMPT, fault=where, fault_after=3))
            results = [list(h) for h in handles]
            faulty_events = list(faulty)
        # The faulty request ends with its own error, after the tokens it produced before the fault.
        assert isinstance(faulty_events[-1], Failed), faulty_events[-1]
        assert "InjectedFault" in faulty_events[-1].error.message
        assert 0 < len(tokens_of(faulty_events)) < 10
        assert any("failed" in r.message and r.exc_info for r in caplog.records)
        # Its batch-mates finish whole, with the tokens they get when running alone.
        for events, expected in zip(results, solo, strict=True):
            assert isinstance(events[-1], Finished) and events[-1].reason == "length"
            assert tokens_of(events) == expected
        stats = wait_idle(engine)
        assert stats["running"] == 0 and stats["kv_bytes"] == 0 and stats["kv_bytes_reserved"] == 0
        # Later requests are unaffected.
        assert tokens_of(list(engine.submit(request(PROMPTS[0])))) == solo[0]
    finally:
        engine.stop()


class MisbehavingLifecycle:
    """Raises in one lifecycle hook and hangs in the two others until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []

    @hookimpl
    def mlxr_model_loaded(self, name: str, model: Any) -> None:
        self.calls.append("model_loaded")
        raise RuntimeError("a plugin bug in mlxr_model_loaded")

    @hookimpl
    def mlxr_engine_started(self, engine: Any) -> None:
        self.calls.append("engine_started")
        self.release.wait()

    @hookimpl
    def mlxr_engine_stopping(self, engine: Any) -> None:
        self.calls.append("engine_stopping")
        self.release.wait()


def test_a_plugin_raising_or_hanging_in_lifecycle_hooks_does_not_stop_the_engine(
    tiny_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = MisbehavingLifecycle()
    engine = make_engine(tiny_path, [("misbehaving", plugin)])
    engine.host.hook_timeout = 0.5
    try:
        with caplog.at_level(logging.ERROR, logger="mlxr_core.plugins"):
            engine.start(timeout=60)
            events = list(engine.submit(request(PROMPTS[0], max_tokens=4)))
            assert engine.state == "ready"
            assert isinstance(events[-1], Finished) and len(tokens_of(events)) == 4
            stopping = time.monotonic()
            engine.stop()
            stopped_in = time.monotonic() - stopping
        assert engine.state == "stopped" and stopped_in < 30
        assert plugin.calls == ["model_loaded", "engine_started", "engine_stopping"]
        messages = [r.getMessage() for r in caplog.records]
        assert any("misbehaving raised in mlxr_model_loaded" in m for m in messages), messages
        for hook in ("mlxr_engine_started", "mlxr_engine_stopping"):
            assert any(f"misbehaving did not return from {hook}" in m for m in messages), messages
    finally:
        plugin.release.set()
        engine.stop()
