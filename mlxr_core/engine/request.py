"""What callers hand the engine and what it streams back."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import attrs

from mlxr_core.errors import MlxrError


@attrs.frozen
class Constraint:
    """Structured output the sampler must enforce while decoding.

    ``kind`` is ``"json_object"`` (any JSON object; ``value`` unused), ``"json_schema"`` (``value``:
    the JSON Schema as a dict), ``"regex"`` (``value``: the pattern), ``"lark"`` (``value``: a
    Lark grammar as the constrained-decoding plugin documents it), ``"gbnf"`` (``value``: a
    llama.cpp GBNF grammar, or a Lark one) or ``"choice"`` (``value``: the strings the whole output
    must be one of). ``field`` is the request field it came from, named when it is refused.
    """

    kind: str
    value: Any = None
    field: str | None = attrs.field(default=None, eq=False)


@attrs.frozen
class TokenLogprob:
    """The log-probability of one emitted token under the model, and the most likely alternatives
    (``top``: ``(token_id, logprob)`` pairs, best first; empty unless ``top_logprobs`` was asked)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@attrs.define
class SamplingParams:
    """One request's decoding controls. Validated by the API layer; the engine trusts them."""

    #: None: up to ``engine.default_max_tokens``, clamped to the context left after the prompt.
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = attrs.field(factory=list)
    #: Penalties over tokens already seen: ``repetition_penalty`` (> 1 discourages, over prompt and
    #: output, divides positive logits and multiplies negative ones), OpenAI's ``frequency_penalty``
    #: (times the count in the output) and ``presence_penalty`` (once per token in the output).
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    #: Token id -> value added to its logit (OpenAI's ``logit_bias``, -100..100).
    logit_bias: dict[int, float] = attrs.field(factory=dict)
    #: None: no logprobs; 0: each emitted token's logprob; k > 0: and the k most likely alternatives.
    logprobs: int | None = None
    #: Structured output (``response_format``, forced tool calls); None: free text.
    constraint: Constraint | None = None
    #: Extra parameters owned by sampler plugins (``logit_bias`` ...), by name.
    extra: dict[str, Any] = attrs.field(factory=dict)
    #: Fields neither the request nor the server's ``sampling:`` set: the model's own defaults
    #: (its ``generation_config.json``) take them when it is admitted (:func:`model_defaults`).
    defaulted: tuple[str, ...] = ()


def model_defaults(params: SamplingParams, generation: dict[str, Any] | None) -> None:
    """Give ``params``' defaulted fields the model's sampling defaults (``generation``, what its
    ``generation_config.json`` says, as vLLM and SGLang serve them); ``do_sample: false`` there
    means greedy. A value out of range is ignored (a checkpoint's file is tolerated, not trusted)."""
    if not generation or not params.defaulted:
        return
    limits = {"temperature": (0.0, 2.0), "top_p": (1e-9, 1.0), "top_k": (0, 1 << 30), "min_p": (0.0, 1.0),
              "repetition_penalty": (1e-9, 100.0)}  # fmt: skip
    for key in params.defaulted:
        value = generation.get(key)
        low, high = limits.get(key, (0.0, 0.0))
        if isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high:
            setattr(params, key, int(value) if key == "top_k" else float(value))
    if generation.get("do_sample") is False and "temperature" in params.defaulted:
        params.temperature = 0.0


@attrs.frozen
class PromptImage:
    """One image of a prompt, preprocessed by the model's image processor off the engine thread:
    ``pixels`` ``[C, H, W]`` float32, and ``digest``, the SHA-256 (hex) of the image's bytes, which
    keys its tokens in the prefix cache."""

    pixels: Any = attrs.field(eq=False, repr=False)  # np.ndarray
    digest: str


@attrs.define
class GenerationRequest:
    """A prompt to continue. ``prompt_ids`` are final: chat templating and tokenization happen
    in the caller's thread (see :meth:`Engine.encode`) so the engine thread only runs MLX work."""

    model: str
    prompt_ids: list[int]
    params: SamplingParams = attrs.field(factory=SamplingParams)
    #: The decoder to use; None means the model's configured decoder.
    decoder: str | None = None
    #: Special tokens to keep in the streamed text (markup a reply parser reads, which it removes);
    #: every other special token is left out of the text.
    keep_special: frozenset[int] = frozenset()
    #: The images of the prompt, in the order of their image tokens (a vision model only).
    images: list[PromptImage] = attrs.field(factory=list)
    #: The model's LoRA adapter the request runs with (``models[].adapters``), or None; set at
    #: admission from a ``model`` naming one (``<model>:<adapter>``).
    adapter: str | None = None
    #: The strength of :attr:`adapter`: its update times this (1: as its file has it; 0: the
    #: base's output, with the adapter's cache keys).
    adapter_scale: float = 1.0
    #: The output the client expects (OpenAI's Predicted Outputs), as token ids: drafted from
    #: inside the batch (see :mod:`mlxr_core.engine.speculation`); None: no prediction.
    prediction: list[int] | None = None
    #: False: this request drafts nothing (``models[].speculative`` opted out of).
    speculative: bool = True


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens whose keys and values came from the prefix cache instead of a prefill.
    cached_tokens: int = 0
    #: Prompt tokens this request prefilled and left in the prefix cache for later ones.
    cache_written_tokens: int = 0
    #: Of a ``prediction``'s draft tokens, those the model emitted as drafted, and those it
    #: verified and rejected (OpenAI's ``completion_tokens_details``).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class Delta:
    """New text (possibly empty while a stop string or a UTF-8 sequence is pending)."""

    text: str
    token_ids: tuple[int, ...] = ()
    #: One entry per id in ``token_ids`` when the request asked for logprobs.
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Finished:
    """The last event of a successful request. ``reason`` is ``"stop"`` (EOS or stop string),
    ``"length"`` (``max_tokens``) or ``"cancelled"``."""

    reason: str
    usage: Usage
    #: Time to first token and total seconds, for metrics and benchmarks.
    ttft_s: float = 0.0
    total_s: float = 0.0
    #: The stop string that ended the request (reason ``"stop"``); None for EOS and other reasons.
    stop_sequence: str | None = None
    #: When the engine produced the first and the last token, on ``time.perf_counter``'s clock
    #: (benchmarks: whether requests overlapped, whatever their readers' delays).
    first_token_at: float = 0.0
    finished_at: float = 0.0


@attrs.frozen
class Failed:
    """The last event of a failed request."""

    error: MlxrError


Event = Delta | Finished | Failed


@attrs.frozen
class Tokens:
    """New tokens whose text the consumer works out (``detokenizer``, the request's own): what the
    engine emits instead of a :class:`Delta` for a request with no stop strings, so detokenizing
    runs on the consumer's thread, not on the engine's. ``flush``: the end of the stream (no
    tokens), the detokenizer's held-back text is due. :class:`RequestHandle` turns each into the
    :class:`Delta` its consumers read; they never see one."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    detokenizer: Any = attrs.field(eq=False, repr=False)  # a StreamingDetokenizer
    flush: bool = False

    def delta(self) -> Delta | None:
        if self.flush:
            tail = self.detokenizer.flush()
            return Delta(tail) if tail else None
        text = "".join(self.detokenizer.add(token) for token in self.token_ids)
        return Delta(text, self.token_ids, self.logprobs)


class Arrivals:
    """Requests a server has received and not yet submitted (their bodies read, their prompts
    tokenized or chat templates rendered): an idle engine whose first request has more behind it
    takes those in before its first step, so that they are prefilled and decode together instead
    of in waves as the server gets through them (:meth:`Scheduler._gather_burst`).

    The server counts each request in (:meth:`arrive`) and out when it submits, answers or ends
    (:meth:`Arrival.leave`); an engine in a process of its own gets the count with each submit.
    """

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()
        #: Called when the count falls to zero (an engine in another process is told).
        self.on_empty: Callable[[], None] | None = None

    @property
    def pending(self) -> int:
        return self._count

    def arrive(self) -> Arrival:
        with self._lock:
            self._count += 1
        return Arrival(self)

    def set(self, count: int) -> None:
        """The count as another process saw it (the server's, sent with a submit)."""
        with self._lock:
            self._count = max(0, count)

    def _leave(self) -> None:
        with self._lock:
            self._count = max(0, self._count - 1)
            empty = self._count == 0
        if empty and self.on_empty is not None:
            self.on_empty()


class Arrival:
    """One request counted in :class:`Arrivals`; :meth:`leave` counts it out, once."""

    __slots__ = ("_arrivals",)

    def __init__(self, arrivals: Arrivals):
        self._arrivals: Arrivals | None = arrivals

    @property
    def counted(self) -> bool:
        return self._arrivals is not None

    def leave(self) -> None:
        arrivals, self._arrivals = self._arrivals, None
        if arrivals is not None:
            arrivals._leave()


#: The request the current task serves, while it is counted as arriving (set by the server's
#: outermost middleware, read when the request is submitted).
ARRIVING: contextvars.ContextVar[Arrival | None] = contextvars.ContextVar("mlxr_arriving", default=None)


def handed_over() -> None:
    """The current task's request has reached the engine (queued, or sent to its process): count
    it out of its :class:`Arrivals`."""
    arrival = ARRIVING.get()
    if arrival is not None:
        arrival.leave()


class Outbox:
    """The async consumers' events one thread emits, handed to each consumer's event loop in one
    ``call_soon_threadsafe`` per loop instead of one per event.

    The scheduler owns the engine thread's outbox and passes it to its batch runners and its
    lockstep; the engine process's pipe reader has its own. Events are taken only on the thread
    that installed the outbox (:meth:`installed`); other threads' events go straight to their loop.
    Sync consumers are never held back, and events keep their order per request.
    """

    def __init__(self) -> None:
        self._owner: int | None = None
        #: The events held back, by loop; None: nothing is being collected.
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, Event | Tokens]]] | None = None
        #: Collecting from :meth:`hold` until :meth:`release`, not for a :meth:`together` block.
        self._holding = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Route the events the current thread emits, inside, through this outbox."""
        previous = _installed.outbox
        _installed.outbox, self._owner = self, threading.get_ident()
        try:
            yield
        finally:
            _installed.outbox = previous

    def _here(self) -> bool:
        return self._owner == threading.get_ident()

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Hand the events emitted inside over at the end, in one call per loop.

        A step of N streams then wakes the server's event loop once, not N times, each wake-up
        taking the GIL from the thread building the next step. Nested blocks deliver at the end of
        the outermost one; inside :meth:`hold`, at :meth:`deliver`.
        """
        if self._pending is not None or not self._here():
            yield
            return
        pending: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, Event | Tokens]]] = {}
        self._pending = pending
        try:
            yield
        finally:
            self._pending = None
            for loop, items in pending.items():
                _post(loop, items)

    def hold(self) -> None:
        """Hold back the events until :meth:`deliver` or :meth:`release`, across :meth:`together`
        blocks (which then deliver nothing themselves).

        The scheduler holds a decode step's tokens until the next step's graph is queued on the
        device (the batch runner's :meth:`deliver` there): the consumers' loops then turn them into
        HTTP chunks while the engine thread waits for the device, not while it builds the graph.
        """
        if self._pending is None and self._here():
            self._pending = {}
            self._holding = True

    def deliver(self) -> None:
        """Hand over the events held so far, and go on holding."""
        pending = self._pending
        if pending and self._holding and self._here():
            self._pending = {}
            for loop, items in pending.items():
                _post(loop, items)

    def release(self) -> None:
        """Hand over the events held so far and stop holding."""
        if self._holding and self._here():
            self.deliver()
            self._pending, self._holding = None, False

    def take(self, handle: RequestHandle, loop: asyncio.AbstractEventLoop, event: Event | Tokens) -> bool:
        """Keep ``event`` for ``loop`` if collecting on this thread; False: it goes out at once."""
        pending = self._pending
        if pending is None or not self._here():
            return False
        pending.setdefault(loop, []).append((handle, event))
        return True


class _Installed(threading.local):
    """Per thread: the outbox its events go through (:meth:`Outbox.installed`), if any."""

    outbox: Outbox | None = None


_installed = _Installed()


def _post(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestHandle, Event | Tokens]]) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the consumer's loop is closed: nobody is listening
        for handle, _ in items:
            handle.cancel()


def _deliver(items: list[tuple[RequestHandle, Event | Tokens]]) -> None:
    """On the consumer's loop: each event into its request's queue."""
    for handle, event in items:
        assert handle._async_queue is not None
        handle._async_queue.put_nowait(event)


class RequestHandle:
    """The caller's side of one request: iterate its events (sync or async), or cancel it.

    The engine thread calls :meth:`_emit`; events cross threads through a thread-safe queue and,
    for async consumers, are handed to the consumer's event loop with ``call_soon_threadsafe``, a
    step's events for one loop in one call (:class:`Outbox`). ``loop`` may be anything
    with an event loop's ``call_soon_threadsafe(callback, items)``: the engine process hands a
    step's events to its pipe that way (:mod:`mlxr_core.engine.remote`).
    """

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self.id = id(self)
        self._cancelled = threading.Event()
        self._loop = loop
        self._async_queue: asyncio.Queue[Event | Tokens] | None = asyncio.Queue() if loop else None
        self._sync_queue: queue.SimpleQueue[Event | Tokens] = queue.SimpleQueue()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the engine to stop this request; it frees the slot and cache within one step."""
        self._cancelled.set()

    def _emit(self, event: Event | Tokens) -> None:
        if self._loop is not None:
            outbox = _installed.outbox
            if outbox is None or not outbox.take(self, self._loop, event):
                _post(self._loop, [(self, event)])
        else:
            self._sync_queue.put(event)

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self._text(self._sync_queue.get())
            if event is None:
                continue
            yield event
            if not isinstance(event, Delta):
                return

    async def events(self) -> AsyncIterator[Event]:
        assert self._async_queue is not None, "submit with a loop to consume asynchronously"
        while True:
            event = self._text(await self._async_queue.get())
            if event is None:
                continue
            yield event
            if not isinstance(event, Delta):
                return

    def _text(self, event: Event | Tokens) -> Event | None:
        """``event`` as consumers read it: :class:`Tokens` detokenized here, on the consumer's
        thread. A detokenizing failure ends the request (cancelled at the engine) with an error."""
        if not isinstance(event, Tokens):
            return event
        try:
            return event.delta()
        except Exception as exc:
            self.cancel()
            return Failed(MlxrError(f"detokenizing failed: {type(exc).__name__}: {exc}"))
