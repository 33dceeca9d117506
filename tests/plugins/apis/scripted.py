"""A scripted engine and a threaded server for the API plugin tests (shared by test_openai,
test_ollama, test_anthropic and test_operations)."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import attrs

from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.admission import ModelInfo
from mlxr_core.engine.lifecycle import ModelSlot
from mlxr_core.engine.request import (
    ARRIVING,
    Arrivals,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    RequestHandle,
    Usage,
)
from mlxr_core.errors import ContextLengthExceeded, MlxrError, ModelNotFound
from mlxr_core.http.context import ServerContext
from mlxr_core.plugins import PluginHost, load_plugins


class FakeTokenizer:
    """Byte-level: id 1 is BOS, every other id is a byte."""

    vocab_size = 256
    eos_token_ids = frozenset({0})
    bos_token_id = 1
    add_bos = False
    chat_template = "{{ fake }}"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [b for b in text.encode()]

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """Each turn as ``<role>content``, then the template variables a request or the model
        set (``[enable_thinking=False]``), then ``<assistant>``."""
        variables = "".join(f"[{k}={v}]" for k, v in sorted(kwargs.items()) if k not in ("tools", "add_generation_prompt"))
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + variables + "<assistant>"


class FakeEngine:
    """Satisfies what the routes use of :class:`Engine`; replies ``REPLY`` one character per token."""

    REPLY = "Hello, world! How are you?"

    def __init__(self, context_length: int = 64):
        self.state = "ready"
        self.error: BaseException | None = None
        #: The server's config (make_ctx sets it), whose first model this engine's models load from.
        self.config: Config | None = None
        self.queue_depth = 0
        self.models = {
            "fake": ModelInfo(
                name="fake", context_length=context_length, created=1700000000,
                tokenizer=FakeTokenizer(), format="fake", model_type="fake", config_index=0,  # type: ignore[arg-type]
            )
        }
        #: LoRA adapters served as models of their own (none here).
        self.adapters: dict[str, tuple[str, str]] = {}
        self.requests: list[GenerationRequest] = []
        self.handles: list[RequestHandle] = []
        self.raise_on_submit: BaseException | None = None
        self.fail_after: int | None = None  # emit Failed after this many tokens
        self.endless = False  # emit tokens until cancelled
        self.token_delay_s = 0.0  # pause after each token
        self.running = 0
        self.arrivals = Arrivals()
        #: ``arrivals.pending`` as each request was submitted (itself still counted).
        self.arriving_at_submit: list[int] = []

    def stats(self) -> dict[str, Any]:
        return {"running": self.running, "queued": self.queue_depth, "kv_bytes": 1024 * self.running}

    def memory(self) -> dict[str, int]:
        from mlxr_core.engine.engine import mlx_memory

        return mlx_memory()

    def model(self, name: str) -> ModelInfo:
        if name not in self.models:
            raise ModelNotFound(name, self.models)
        # As the engine does when a model loads: its parsers chosen by its config (the context's
        # first model, set by make_ctx) against its chat template.
        info, registries = self.models[name], plugin_host().registries
        template = getattr(info.tokenizer, "chat_template", None)
        configured = self.config.models[0] if self.config is not None and self.config.models else None
        return attrs.evolve(
            info,
            tool_parser=registries.tool_parsers.choose(configured.tool_parser if configured else "auto", template),
            reasoning_parser=registries.reasoning_parsers.choose(
                configured.reasoning_parser if configured else "auto", template
            ),
        )

    # Every model is loaded, pinned and stays so (mlxr_core.engine.lifecycle is not scripted).
    lifecycle = None

    @property
    def served(self) -> list[str]:
        return sorted(self.models)

    def resolve(self, name: str) -> str:
        return self.model(name).name

    def ensure_loaded(self, name: str) -> Future[None]:
        self.resolve(name)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    set_keep_alive = unload_model = lambda self, name, *value: self.ensure_loaded(name)

    def loaded_models(self) -> list[tuple[ModelInfo, ModelSlot]]:
        pinned = ModelConfig(path="unused", pin=True)
        return [(info, ModelSlot(0, pinned, name, state="loaded")) for name, info in sorted(self.models.items())]

    def encode(self, model: str, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.model(model).tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, model: str, messages: list[dict[str, Any]], *, images: Any = ()) -> list[int]:
        tokenizer = self.model(model).tokenizer
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def submit(self, request: GenerationRequest, *, loop: Any = None) -> RequestHandle:
        if self.raise_on_submit is not None:
            raise self.raise_on_submit
        info = self.model(request.model)
        room = info.context_length - len(request.prompt_ids)
        params = request.params
        if params.max_tokens is None:
            params.max_tokens = min(16, room)
        if params.max_tokens > room or room < 1:
            raise ContextLengthExceeded.tokens(len(request.prompt_ids), params.max_tokens, info.context_length)
        self.requests.append(request)
        self.arriving_at_submit.append(self.arrivals.pending)
        arrival = ARRIVING.get()
        if arrival is not None:
            arrival.leave()
        handle = RequestHandle(request, loop=loop)
        self.handles.append(handle)
        threading.Thread(target=self._run, args=(handle,), daemon=True).start()
        return handle

    def _run(self, handle: RequestHandle) -> None:
        self.running += 1
        try:
            self._generate(handle)
        finally:
            self.running -= 1

    def _generate(self, handle: RequestHandle) -> None:
        params = handle.request.params
        assert params.max_tokens is not None
        text, reason, count, hit = "", "length", 0, None
        while self.endless or count < params.max_tokens:
            if handle.cancelled:
                reason = "cancelled"
                break
            if self.fail_after is not None and count == self.fail_after:
                handle._emit(Failed(MlxrError("generation failed: boom")))
                return
            char = self.REPLY[count % len(self.REPLY)]
            count += 1
            text += char
            hit = next((stop for stop in params.stop if stop in text), None)
            if hit:
                reason = "stop"
                break
            handle._emit(Delta(char, (ord(char),)))
            if self.endless or self.token_delay_s:
                time.sleep(self.token_delay_s or 0.005)
            elif count == len(self.REPLY):
                reason = "stop"
                break
        usage = Usage(prompt_tokens=len(handle.request.prompt_ids), completion_tokens=count)
        handle._emit(Finished(reason=reason, usage=usage, stop_sequence=hit))


def make_ctx(engine: Any, **config: Any) -> ServerContext:
    """A server context over ``engine`` with every built-in API mounted unless ``apis`` is given."""
    config.setdefault("apis", ["openai", "ollama", "anthropic"])
    cfg = Config(models=[ModelConfig(path="unused")], **config)
    if isinstance(engine, FakeEngine):
        engine.config = cfg
    return ServerContext(config=cfg, host=plugin_host(), engine=engine)


@functools.cache
def plugin_host() -> PluginHost:
    """The installed plugins, loaded once: loading takes most of a second and nothing here changes them."""
    return load_plugins()


class ThreadedServer:
    """uvicorn serving ``app`` from a thread, on a free loopback port."""

    def __init__(self, app: Any):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextlib.contextmanager
def live_server(config: Config) -> Iterator[str]:
    """A real engine serving ``config``'s models and APIs from a thread; yields the base URL."""
    from mlxr_core.engine.engine import Engine
    from mlxr_core.http.server import build_app

    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with ThreadedServer(build_app(ServerContext(config=config, host=host, engine=engine))) as url:
            yield url
    finally:
        engine.stop()


def wait_until(condition: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False
