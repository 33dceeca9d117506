"""The server config schema (``configs/server.yaml``), as attrs classes with validators.

Strict: the loader (:mod:`mlxr_core.config.loader`) rejects unknown keys, wrong types and bad values,
naming the key path. Every field has a default except a model's ``path``.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import attrs
from attrs import validators as v

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATION_POLICIES = (
    "auto", "keep", "dequantize", "q8", "q4", "q4_g64", "nvfp4", "mxfp8", "mxfp4", "f16", "bf16",
)
#: When a model's weights load: at startup, or on its first request.
LOAD_MODES = ("eager", "lazy")
#: The wire APIs mounted when ``apis:`` is not set; the web page (``webui``) joins them on loopback.
DEFAULT_APIS = ("openai", "ollama", "anthropic", "rerank")


def _lower(value: str) -> str:
    return value.lower() if isinstance(value, str) else value


def _no_empty_key(instance: Any, attribute: attrs.Attribute[Any], keys: list[str]) -> None:
    if any(not key for key in keys):
        raise ValueError(f"'{attribute.name}' must not hold an empty key")


def _not_api_keys(instance: Any, attribute: attrs.Attribute[Any], keys: list[str]) -> None:
    # A key in both lists would be an admin key handed out as a client's.
    if set(keys) & set(instance.api_keys):
        raise ValueError(f"'{attribute.name}' holds a key that is also in 'api_keys': list each key in one of them")


def _no_empty_name(instance: Any, attribute: attrs.Attribute[Any], names: list[str]) -> None:
    if any(not name for name in names):
        raise ValueError(f"'{attribute.name}' must not hold an empty name")


def _patterns(instance: Any, attribute: attrs.Attribute[Any], patterns: list[str]) -> None:
    for i, pattern in enumerate(patterns):
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"'{attribute.name}[{i}]' is not a regular expression: {error}") from None


def _absolute_paths(instance: Any, attribute: attrs.Attribute[Any], paths: list[str]) -> None:
    bad = [path for path in paths if not path.startswith("/")]
    if bad:
        raise ValueError(f"'{attribute.name}' must hold paths starting with '/', got {bad[0]!r}")


@attrs.define
class ResponsesStoreConfig:
    """Where the Responses API keeps responses created with ``store: true`` (the default), for
    ``previous_response_id`` and ``GET /v1/responses/{id}``: one SQLite file, bounded."""

    enabled: bool = True
    #: The SQLite file; None: ``responses.sqlite3`` in the data folder
    #: (:func:`mlxr_core.model.paths.data_dir`).
    path: str | None = attrs.field(default=None, validator=v.optional(v.min_len(1)))
    #: Bytes of stored JSON, oldest responses evicted first beyond it.
    max_bytes: int = attrs.field(default=256 * 2**20, validator=v.ge(1))
    #: Seconds a response is kept.
    max_age_s: float = attrs.field(default=30 * 86400.0, validator=v.gt(0.0))
    #: Responses kept at most.
    max_items: int = attrs.field(default=10_000, validator=v.ge(1))


@attrs.define
class ConstraintLimits:
    """Bounds on a request's output constraint (JSON schema, grammar, regular expression, choices),
    measured before the grammar library sees it (:mod:`mlxr_core.engine.constraint_limits`): one
    past a bound is a 400 naming it. Each is capped below what the library survives."""

    #: Bytes of the constraint: a schema as compact JSON, a grammar or pattern as UTF-8, choices'.
    max_bytes: int = attrs.field(default=128 * 2**10, validator=[v.ge(1), v.le(256 * 2**10)])
    #: Levels of nesting: a schema's objects and arrays, each ``$ref`` followed as one; a grammar's
    #: rules reached through one another, and its parentheses; a pattern's groups.
    max_depth: int = attrs.field(default=256, validator=[v.ge(1), v.le(1024)])
    #: Rules of a Lark or GBNF grammar.
    max_rules: int = attrs.field(default=1000, validator=[v.ge(1), v.le(10_000)])
    #: Alternatives: choices, ``|`` in a grammar or pattern, a schema's ``enum``, ``anyOf`` and
    #: ``oneOf`` entries.
    max_alternatives: int = attrs.field(default=10_000, validator=[v.ge(1), v.le(20_000)])
    #: Items one counted repetition (``{n}``, ``{n,m}``, ``~n``) stands for, those nested in it
    #: multiplied: ``(a{100}){100}`` repeats 10,000. Regular expressions, a schema's ``pattern``s,
    #: a grammar's rules and ``/regex/``.
    max_repetition: int = attrs.field(default=10_000, validator=[v.ge(1), v.le(100_000)])
    #: Seconds a new constraint may take to be converted and checked (in a child process, killed
    #: past it); a 400 beyond it.
    compile_timeout_s: float = attrs.field(default=10.0, validator=[v.gt(0.0), v.le(600.0)])


@attrs.define
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=[v.ge(0), v.le(65535)])
    log_level: str = attrs.field(default="info", converter=_lower, validator=v.in_(LOG_LEVELS))
    #: Origins allowed by CORS; empty keeps CORS off.
    cors_origins: list[str] = attrs.field(factory=list)
    #: Keys clients must send (``Authorization: Bearer KEY`` or ``x-api-key: KEY``); empty: no
    #: authentication. ``MLXR_API_KEY`` adds one.
    api_keys: list[str] = attrs.field(factory=list, validator=_no_empty_key, repr=False)
    #: Keys that may also change what the server serves (load and unload models and LoRA adapters,
    #: :class:`mlxr_core.http.access.AdminAccess`); any other route takes them as ``api_keys``.
    #: Empty: a loopback server lets any caller with a valid key (or any caller, without keys)
    #: administer, a server reachable from other machines lets none. ``MLXR_ADMIN_API_KEY`` adds one.
    admin_api_keys: list[str] = attrs.field(factory=list, validator=[_no_empty_key, _not_api_keys], repr=False)
    #: Paths served without a key even when ``api_keys`` is set (probes and scrapers).
    auth_exempt: list[str] = attrs.field(factory=lambda: ["/health", "/metrics"], validator=_absolute_paths)
    #: Seconds running requests get to finish after SIGTERM/SIGINT before they are ended with an
    #: error event.
    shutdown_timeout: float = attrs.field(default=30.0, validator=v.ge(0.0))
    #: Largest request body accepted, in bytes (413 beyond).
    max_body_bytes: int = attrs.field(default=10_000_000, validator=v.ge(1))
    #: Seconds a connection has to send a request's head, from connecting or from its previous
    #: response; an idle or slow-loris connection is closed then
    #: (:mod:`mlxr_core.http.connections`).
    header_timeout: float = attrs.field(default=10.0, validator=v.gt(0.0))
    #: Seconds a request has to send its whole body once its head is in; then it is closed.
    body_timeout: float = attrs.field(default=60.0, validator=v.gt(0.0))
    #: Bytes per second a request body must keep up after a grace of ``header_timeout`` (a body of
    #: n bytes so far is closed, answered 408, after ``header_timeout + n / body_min_rate`` s); 0: none.
    body_min_rate: float = attrs.field(default=500.0, validator=v.ge(0.0))
    #: Open connections at most; beyond it the one idle longest, else the slowest upload, is closed
    #: so new clients get in, and uploads may hold all but an eighth of it
    #: (:mod:`mlxr_core.http.connections`). None: the process's file limit less 64.
    max_connections: int | None = attrs.field(default=None, validator=v.optional(v.ge(1)))
    #: ``Host`` names answered besides localhost and the server's addresses (``.example.com``: it
    #: and its subdomains; ``*``: any). A loopback-bound server refuses other names with a 403 (DNS
    #: rebinding, :mod:`mlxr_core.http.hosts`); another bind checks only when this is set.
    allowed_hosts: list[str] = attrs.field(factory=list, validator=_no_empty_name)
    #: Upper bound on any request's ``max_tokens`` (larger asks are lowered to it); None: no cap.
    max_tokens_cap: int | None = attrs.field(default=None, validator=v.optional(v.ge(1)))
    #: One log line per request (method, path, status, duration, request id) on ``mlxr.access``.
    access_log: bool = True
    #: The model a request without ``model`` goes to (clients written for single-model servers,
    #: as llama.cpp's); None: such a request is a 400, unless ``model_optional`` applies.
    default_model: str | None = attrs.field(default=None, validator=v.optional(v.min_len(1)))
    #: With exactly one model served, a request without ``model`` goes to it.
    model_optional: bool = False
    #: Images one request may hold, the bytes of one (decoded), and its pixels (read from the
    #: header before decoding, so a decompression bomb is refused unexpanded); 400 beyond them.
    max_images_per_request: int = attrs.field(default=8, validator=v.ge(1))
    max_image_bytes: int = attrs.field(default=10_000_000, validator=v.ge(1))
    max_image_pixels: int = attrs.field(default=40_000_000, validator=v.ge(1))
    #: Bytes of decoded pixels all requests may hold at once (the decoded image and one RGB copy,
    #: reckoned from its header before decoding, until the model's processor is done with it). A
    #: request past it waits up to ``decoded_image_wait_s``, then gets a 429; one image needing
    #: more than all of it is a 400. 1 GiB: three images of ``max_image_pixels`` at once.
    max_decoded_image_bytes: int = attrs.field(default=2**30, validator=v.ge(1))
    decoded_image_wait_s: float = attrs.field(default=5.0, validator=v.ge(0.0))
    #: Fetch ``http(s)`` image URLs (under ``max_image_bytes``, ``remote_image_timeout_s`` for the
    #: whole fetch, at most 3 redirects); off, an image URL is a 400 asking for the image inline.
    allow_remote_images: bool = False
    remote_image_timeout_s: float = attrs.field(default=10.0, validator=v.gt(0.0))
    #: With remote images on, also fetch from hosts at loopback, private, link-local and other
    #: non-public addresses (a trusted network); off, such a host is a 400 at every redirect.
    remote_image_private_hosts: bool = False
    #: Audio in requests (``/v1/audio/transcriptions``): the bytes of one upload, the seconds it
    #: may last and the channels it may have (read from the header before decoding, and the
    #: samples read stop at the limit, so a compressed hour of silence never expands); 400 beyond.
    max_audio_bytes: int = attrs.field(default=25_000_000, validator=v.ge(1))
    max_audio_seconds: float = attrs.field(default=1800.0, validator=v.gt(0.0))
    max_audio_channels: int = attrs.field(default=8, validator=v.ge(1))
    responses_store: ResponsesStoreConfig = attrs.field(factory=ResponsesStoreConfig)
    #: The secret compaction items (``/v1/responses/compact``) are signed with (HMAC-SHA256), at
    #: least 32 characters; None: a random one at each start, so items made before a restart are
    #: refused after it. ``MLXR_SERVER__COMPACTION_SECRET`` sets it without writing it here.
    compaction_secret: str | None = attrs.field(default=None, validator=v.optional(v.min_len(32)), repr=False)


@attrs.define
class VisionConfig:
    """How a vision model's images are prepared (``models[].vision``)."""

    #: Gemma 3's pan-and-scan (transformers' ``do_pan_and_scan``): an image whose long side is at
    #: least ``pan_and_scan_min_ratio_to_activate`` times its short side also goes in as crops
    #: along the long side, 256 tokens each, for detail in wide or tall images.
    pan_and_scan: bool = False
    #: The smallest crop side in pixels; an image that would give smaller crops is not cut.
    pan_and_scan_min_crop_size: int = attrs.field(default=256, validator=v.ge(1))
    #: At most this many crops (at least 2 are made).
    pan_and_scan_max_num_crops: int = attrs.field(default=4, validator=v.ge(2))
    #: Cut only images at least this much longer than wide (or wider than long).
    pan_and_scan_min_ratio_to_activate: float = attrs.field(default=1.2, validator=v.ge(1.0))

    def processor_settings(self) -> dict[str, Any]:
        """These settings under the names of a ``preprocessor_config.json``."""
        if not self.pan_and_scan:
            return {"do_pan_and_scan": False}
        return {
            "do_pan_and_scan": True,
            "pan_and_scan_min_crop_size": self.pan_and_scan_min_crop_size,
            "pan_and_scan_max_num_crops": self.pan_and_scan_max_num_crops,
            "pan_and_scan_min_ratio_to_activate": self.pan_and_scan_min_ratio_to_activate,
        }


@attrs.define
class KVCacheConfig:
    """How keys and values are stored (:mod:`mlxr_core.model.kv_storage`): a KV cache method's
    name and its settings; each method checks the keys it takes before any model loads."""

    #: Bits per stored element: ``affine`` 8 (close to full precision) or 4; ``turboquant`` 4, 3
    #: or 2 (keys: bits - 1 per element and a 1-bit sign sketch).
    bits: int = attrs.field(validator=v.in_((8, 4, 3, 2)))
    #: A KV cache method's name: ``affine`` (:mod:`mlxr_core.model.quantized_cache`),
    #: ``turboquant`` or ``turboquant_mse`` (:mod:`mlxr_plugins.kv_caches.turboquant`), or one a
    #: plugin registers.
    method: str = attrs.field(default="affine", validator=v.min_len(1))
    #: ``affine``: elements of a head sharing one scale and bias; the head size must be a multiple.
    group_size: int = attrs.field(default=64, validator=v.in_((32, 64, 128)))
    #: ``affine``: a sequence stays full precision until it holds this many tokens.
    start_after: int = attrs.field(default=0, validator=v.ge(0))
    #: ``turboquant``: each query sees its most recent ``window`` positions in full precision.
    window: int = attrs.field(default=0, validator=v.ge(0))


def _at_least_min_k(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < instance.min_k:
        raise ValueError(f"must be >= min_k ({instance.min_k}), got {value}")


@attrs.define
class SpeculationConfig:
    """Drafting inside the batch (``models[].speculative``; see :mod:`mlxr_core.engine.speculation`
    and docs/speculation.md): each row's drafter proposes up to ``k`` tokens, the model verifies
    every row's draft in one forward pass. A request opts out with ``speculative: false``."""

    #: The drafter: a decoder that drafts in the batch (``prompt_lookup``, ``speculative`` with
    #: its draft model); ``none``: only requests that bring a ``prediction`` draft.
    method: str = attrs.field(default="none", validator=v.min_len(1))
    #: Draft tokens a row proposes first; then, when ``adaptive``, one more after a draft
    #: accepted whole and one fewer after one rejected in its first half, within [min_k, max_k].
    k: int = attrs.field(default=4, validator=[v.ge(1), v.le(32)])
    min_k: int = attrs.field(default=1, validator=v.ge(1))
    max_k: int = attrs.field(default=8, validator=[v.le(32), _at_least_min_k])
    adaptive: bool = True
    #: Rows in the batch above which the batch decodes plainly: a large batch is bound by its
    #: weights' reads no longer, and verifying drafts costs more than it saves.
    max_batch: int = attrs.field(default=8, validator=v.ge(1))
    #: The drafter's own checkpoint, where its method reads one (``eagle3``: the EAGLE-3 draft
    #: folder); a file, a folder or ``pkg:DISTRIBUTION``, as ``models[].path``.
    path: str | None = attrs.field(default=None, validator=v.optional(v.min_len(1)))


#: Where a mixture of experts' expert weights live (``models[].experts.residency``).
EXPERT_RESIDENCIES = ("resident", "stream")
#: Cache policies of streamed experts (:data:`mlxr_core.model.experts.cache.POLICIES`).
EXPERT_CACHE_POLICIES = ("lru", "lfu")
#: What streamed experts read ahead of the layer that needs them (``models[].experts.prefetch``).
EXPERT_PREFETCH = ("none", "previous", "router")


@attrs.define
class ExpertsConfig:
    """Where a mixture of experts' expert weights live (:mod:`mlxr_core.model.experts`):
    ``resident`` (all in memory, the default) or ``stream``: every other weight resident, the
    experts read from the checkpoint files on demand into a cache of ``cache_bytes``."""

    residency: str = attrs.field(default="resident", converter=_lower, validator=v.in_(EXPERT_RESIDENCIES))
    #: ``stream``: bytes of experts kept in memory; the experts of one layer's step always fit
    #: (the cache holds them while they are used, then evicts down to this).
    cache_bytes: int = attrs.field(default=2**30, validator=v.ge(1))
    #: ``stream``: which cached expert goes first when the cache is full: ``lru`` (least recently
    #: used) or ``lfu`` (least often used, ties by age).
    policy: str = attrs.field(default="lru", converter=_lower, validator=v.in_(EXPERT_CACHE_POLICIES))
    #: ``stream``: while layer l computes, read the experts layer l+1 will likely need:
    #: ``previous`` (its choices at the previous step), ``router`` (its router applied to layer
    #: l's input), or ``none``.
    prefetch: str = attrs.field(default="previous", converter=_lower, validator=v.in_(EXPERT_PREFETCH))
    #: ``stream``: reads in flight at once (a pool of threads over ``pread``).
    read_threads: int = attrs.field(default=4, validator=[v.ge(1), v.le(64)])


@attrs.define
class AdapterConfig:
    """A LoRA adapter served over its model (``models[].adapters``)."""

    #: Served as ``<model name>:<name>``.
    name: str = attrs.field(validator=v.min_len(1))
    #: A PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``), an mlx-lm adapter
    #: folder (``adapters.safetensors``) or a llama.cpp LoRA GGUF.
    path: str = attrs.field(validator=v.min_len(1))


def _unique_adapters(instance: Any, attribute: attrs.Attribute[Any], adapters: list[AdapterConfig]) -> None:
    names = [adapter.name for adapter in adapters]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"'{attribute.name}[{i}].name' {name!r} names two adapters of the model")


@attrs.define
class ModelConfig:
    #: A file, a folder, or ``pkg:DISTRIBUTION[/relative/path]``.
    path: str = attrs.field(validator=v.min_len(1))
    #: The name clients ask for; defaults to the file's stem (a folder's name) in lowercase, less a
    #: quantization tag (:func:`mlxr_core.model.paths.default_model_name`), however ``path`` is spelled.
    name: str | None = attrs.field(default=None, validator=v.optional(v.min_len(1)))
    #: Other names clients may ask for (``model`` of a request); unique across all models.
    aliases: list[str] = attrs.field(factory=list, validator=_no_empty_name)
    #: A format plugin's name, or ``auto`` to detect.
    format: str = "auto"
    #: An architecture plugin's name, or ``auto`` for the checkpoint's ``model_type``.
    arch: str = "auto"
    #: llama.cpp's vision projector file (``mmproj*.gguf``: the vision tower and projector) served
    #: with a GGUF text model; ``none``: text only. Unset: the one ``mmproj*.gguf`` beside the
    #: model file, if any. See :func:`mlxr_core.model.paths.resolve_projector`.
    mmproj: str | None = attrs.field(default=None, validator=v.optional(v.min_len(1)))
    #: How images are prepared for a vision model (Gemma 3's pan-and-scan, off by default).
    vision: VisionConfig = attrs.field(factory=VisionConfig)
    #: Activation / unquantized-weight dtype; ``auto`` is float32 on CPU, bfloat16 on GPU.
    dtype: str = attrs.field(default="auto", validator=v.in_(DTYPES))
    #: What to do with quantized checkpoint weights: ``keep`` them packed (blocks with no exact MLX
    #: layout requantized to the nearest MLX format), ``dequantize`` them to ``dtype``, ``auto``:
    #: keep on a GPU and on a CPU where the bound quantized matmul reads packed weights fast
    #: (``cpu_native``), else dequantize (MLX's own CPU quantized matmul is ~20x slower than a dense
    #: one through OpenBLAS; exact in float32, costs memory); ``q8``/``q4``/``q4_g64``: every weight
    #: as MLX 8/4-bit (group 32/32/64); ``nvfp4``/``mxfp8``/``mxfp4``: every weight in that MLX
    #: float mode (group 16/32/32); ``f16``/``bf16``: every weight dense in that dtype.
    #: See :mod:`mlxr_core.model.quantize`.
    quantization: str = attrs.field(default="auto", validator=v.in_(QUANTIZATION_POLICIES))
    #: Overrides the checkpoint's context length (must be >= 16 when set).
    context_length: int | None = attrs.field(default=None, validator=v.optional(v.ge(16)))
    decoder: str = "plain"
    #: Tool-call format of the model's output: a tool parser plugin's name, ``auto`` (chosen from
    #: the chat template's markers) or ``none``. Checked against the loaded plugins at startup.
    tool_parser: str = attrs.field(default="auto", validator=v.min_len(1))
    #: Thinking format (``think``: ``<think>...</think>``), ``auto`` or ``none``.
    reasoning_parser: str = attrs.field(default="auto", validator=v.min_len(1))
    #: Variables every chat of this model renders its template with (``enable_thinking: false``
    #: for Qwen3-style templates); a request's ``chat_template_kwargs`` override them.
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    #: The prompt rerank and score ask with: ``judge`` (Qwen3-Reranker's, for a reranker model) or
    #: ``examples`` (the question after worked examples, for a chat model not trained to rerank).
    rerank_prompt: str = attrs.field(default="judge", validator=v.in_(("judge", "examples")))
    #: Per-model kernel choices (op -> backend), over the global ``kernels:``.
    kernels: dict[str, str] = attrs.field(factory=dict)
    #: Join the layers that read the same input (query/key/value, gate/up projections) into one
    #: matmul each after loading: fewer kernel launches (GPU) or BLAS calls (CPU) per token, same
    #: outputs. See :mod:`mlxr_core.model.fuse`.
    fuse_projections: bool = True
    #: Run each one-token decode step as compiled graphs (``mx.compile``) cut at the attention
    #: layers' caches: less Python and fewer kernel launches per token, same logits. Architectures
    #: that do not offer the cut points decode eagerly. See :mod:`mlxr_core.model.compiled`.
    compile_decode: bool = True
    #: Quantized keys and values (``{method: affine, bits: 8 | 4, group_size, start_after}`` or
    #: ``{method: turboquant, bits: 4 | 3 | 2, window}``); None: full precision.
    kv_cache: KVCacheConfig | None = None
    #: Drafting inside the batch (:class:`SpeculationConfig`); None: only requests with a
    #: ``prediction`` draft (with :class:`SpeculationConfig`'s defaults).
    speculative: SpeculationConfig | None = None
    #: Where the expert weights of a mixture of experts live: ``{residency: stream, cache_bytes:
    #: N}`` reads them from the checkpoint files on demand (:mod:`mlxr_core.model.experts`).
    experts: ExpertsConfig = attrs.field(factory=ExpertsConfig)
    #: ``eager``: loaded at startup; ``lazy``: loaded by its first request (or ``POST
    #: /v1/models/{id}/load``), which waits for it. See :mod:`mlxr_core.engine.lifecycle`.
    load: str = attrs.field(default="eager", converter=_lower, validator=v.in_(LOAD_MODES))
    #: Seconds without a request after which the model is unloaded (0: as soon as it is idle);
    #: None: it stays loaded. An Ollama request's ``keep_alive`` replaces it for that model.
    idle_unload_seconds: float | None = attrs.field(default=None, validator=v.optional(v.ge(0.0)))
    #: Never unloaded to make room (``engine.memory_budget_bytes``) nor for idleness; only an
    #: explicit unload (``POST /v1/models/{id}/unload``) unloads it.
    pin: bool = False
    #: Reasoning tokens a reply may spend inside the model's thinking markers when its request
    #: sets no budget (``reasoning.effort``, ``reasoning_effort``, ``thinking.budget_tokens``);
    #: then the end-of-thinking marker is forced (docs/agents.md). None: unbounded.
    thinking_budget: int | None = attrs.field(default=None, validator=v.optional(v.ge(0)))
    #: LoRA adapters over this model, each served as a model of its own, ``<name>:<adapter>``
    #: (:mod:`mlxr_core.model.lora`); rows of one batch may use different adapters.
    adapters: list[AdapterConfig] = attrs.field(factory=list, validator=_unique_adapters)
    #: Adapters resident at once; a request for another loads it in place of the least recently
    #: used one no running request uses.
    max_adapters: int = attrs.field(default=4, validator=v.ge(1))
    #: Accept adapters created while serving (Ollama's ``/api/create`` with ``adapters``), even
    #: with none configured: the model is served as one with adapters (projections kept apart).
    runtime_adapters: bool = False


#: Claude Code's first system block, ``x-anthropic-billing-header: cc_version=2.1.37.0d9;
#: cc_entrypoint=cli; cch=fa690;``: the hash differs on every request. Anchored at a line's start
#: and bounded, so that a prompt of the header repeated costs time linear in its length (unanchored,
#: every occurrence scanned to the end of its line: 30 s for 100 KB on one line, the GIL held).
DEFAULT_VOLATILE_SPANS = (r"(?m)^x-anthropic-billing-header:[^\n]{0,256}?(\s?\bcch=[0-9A-Za-z]{0,64};?)",)


@attrs.define
class PrefixDiskConfig:
    """The prefix cache's disk tier (:mod:`mlxr_core.engine.prefix_disk`): entries evicted from
    memory (or held at shutdown) are kept here and found again after a restart."""

    #: The folder (made if missing): one safetensors file per entry and an SQLite index.
    path: str = attrs.field(validator=v.min_len(1))
    #: Bytes of entries in the folder, least recently used removed first.
    max_bytes: int = attrs.field(default=8 * 2**30, validator=v.ge(1))


@attrs.define
class PrefixCacheConfig:
    """Reuse of prompt KV state across requests sharing a token prefix."""

    enabled: bool = True
    #: Bytes of stored KV state, least recently used evicted first.
    max_bytes: int = attrs.field(default=256 * 2**20, validator=v.ge(0))
    #: Keep evicted entries on disk across restarts (``{path, max_bytes}``); None: memory only.
    disk: PrefixDiskConfig | None = None
    #: Regular expressions for spans of system prompts that change on every request and mean
    #: nothing to the model; each is removed before the prompt is tokenized, so consecutive
    #: requests share their prefix (docs/agents.md). A pattern with groups removes only its
    #: groups. The default removes the ``cch=<hash>;`` of Claude Code's billing header.
    volatile_spans: list[str] = attrs.field(factory=lambda: list(DEFAULT_VOLATILE_SPANS), validator=_patterns)


#: Where ``engine.core`` runs the engine.
ENGINE_CORES = ("thread", "process")


@attrs.define
class EngineConfig:
    #: Requests waiting beyond this many are refused with 429.
    max_queue: int = attrs.field(default=64, validator=v.ge(1))
    #: Transcriptions and translations (``/v1/audio/...``) at once, from decoding the upload to
    #: the transcript; one more is refused with 429 (each holds its decoded audio and features,
    #: and each running one takes a decoder step between every two batch steps).
    max_transcriptions: int = attrs.field(default=4, validator=v.ge(1))
    #: Prompt tokens per prefill step; long prompts are prefilled in chunks of this size,
    #: interleaved with the decode steps of running requests.
    prefill_chunk: int = attrs.field(default=512, validator=v.ge(1))
    #: Requests decoded together in one forward pass (continuous batching).
    max_batch_size: int = attrs.field(default=8, validator=v.ge(1))
    #: Tokens one forward pass may carry (decode rows + a prefill chunk).
    max_batch_tokens: int = attrs.field(default=2048, validator=v.ge(1))
    #: ``max_tokens`` when a request gives none.
    default_max_tokens: int = attrs.field(default=512, validator=v.ge(1))
    #: KV-cache bytes all running requests may reserve (prompt + max_tokens each); 0: no limit.
    max_kv_bytes: int = attrs.field(default=0, validator=v.ge(0))
    #: Bounds on a request's output constraint (``response_format``, ``format``, grammars).
    constraint_limits: ConstraintLimits = attrs.field(factory=ConstraintLimits)
    prefix_cache: PrefixCacheConfig = attrs.field(factory=PrefixCacheConfig)
    #: MLX's buffer cache limit (``mx.set_cache_limit``); None keeps MLX's default.
    mlx_cache_limit_bytes: int | None = attrs.field(default=None, validator=v.optional(v.ge(0)))
    #: MLX's memory limit (``mx.set_memory_limit``); None keeps MLX's default.
    mlx_memory_limit_bytes: int | None = attrs.field(default=None, validator=v.optional(v.ge(0)))
    #: Bytes the loaded models may hold together (each: weights + KV reserve + prefix cache); a
    #: model that does not fit unloads the least recently used idle, unpinned ones first. None: no
    #: limit. See :mod:`mlxr_core.engine.lifecycle`.
    memory_budget_bytes: int | None = attrs.field(default=None, validator=v.optional(v.ge(1)))
    #: Seconds a request waits for its model to load (queued behind other loads, or for memory to
    #: free) before it is answered 503.
    model_load_wait_s: float = attrs.field(default=300.0, validator=v.gt(0.0))
    #: Where the engine runs: ``thread`` (a thread of the server process) or ``process`` (a
    #: process of its own, so the server's per-token work never waits on the GIL with the step
    #: being built: :mod:`mlxr_core.engine.remote`; not under ``distributed:``).
    core: str = attrs.field(default="thread", converter=_lower, validator=v.in_(ENGINE_CORES))
    #: Milliseconds an idle engine waits for the next request of a burst: requests arriving
    #: within this of each other (for at most :data:`~mlxr_core.engine.scheduler.BURST_LIMIT`
    #: times it in all) start together, their prompts prefilled in one pass, instead of in waves
    #: as the server parses them. A request alone waits this much longer for its first token.
    #: 0 (the default): an idle engine starts on the first request at once. Not under
    #: ``distributed:`` (rank 0 takes requests in step by step with the other ranks).
    burst_gap_ms: float = attrs.field(default=0.0, validator=[v.ge(0.0), v.le(100.0)])
    #: Milliseconds at most an idle engine waits, before its first step, for the requests the
    #: server has received and is still getting through (reading, tokenizing, rendering a chat
    #: template): a burst then starts together. A request with none behind it does not wait; one
    #: arriving while another still uploads a large body waits at most this. 0 turns it off. Not
    #: under ``distributed:``.
    arrivals_wait_ms: float = attrs.field(default=100.0, validator=[v.ge(0.0), v.le(1000.0)])


#: ``mx.distributed`` backends ``mlx.launch`` starts; ``auto``: NCCL with CUDA, else ring.
DISTRIBUTED_BACKENDS = ("auto", "ring", "mpi", "nccl", "jaccl")


def _one_host_source(instance: Any, attribute: attrs.Attribute[Any], hostfile: str | None) -> None:
    if hostfile is not None and instance.hosts:
        raise ValueError("set 'hosts' or 'hostfile', not both")


@attrs.define
class DistributedConfig:
    """Serving one model across processes on ``mx.distributed`` (see :mod:`mlxr_core.distributed`):
    ``mlxr launch`` starts ``tensor_parallel`` x ``pipeline_parallel`` ranks through ``mlx.launch``;
    rank 0 serves HTTP, every rank runs the engine in lockstep. Both sizes 1: one process."""

    backend: str = attrs.field(default="auto", converter=_lower, validator=v.in_(DISTRIBUTED_BACKENDS))
    #: Hosts (IP addresses for the ring backend), one rank each in order, rank 0 first; empty:
    #: every rank on 127.0.0.1. Passed to ``mlx.launch --hosts``.
    hosts: list[str] = attrs.field(factory=list, validator=_no_empty_name)
    #: An ``mlx.launch`` hostfile (JSON, see ``mlx.distributed_config``) instead of ``hosts``.
    hostfile: str | None = attrs.field(default=None, validator=[v.optional(v.min_len(1)), _one_host_source])
    #: Ranks each layer's attention heads and MLP columns are split across (one all-reduce per
    #: attention and per MLP).
    tensor_parallel: int = attrs.field(default=1, validator=[v.ge(1), v.le(64)])
    #: Ranks the layers are split across in order (activations passed on with send/recv; not
    #: on NCCL, which has no send/recv in MLX).
    pipeline_parallel: int = attrs.field(default=1, validator=[v.ge(1), v.le(64)])
    #: Seconds one engine step (its collectives included) may take on any rank before that rank
    #: declares a peer dead: rank 0 ends its requests with an error and every rank exits non-zero.
    step_timeout_s: float = attrs.field(default=30.0, validator=v.gt(0.0))
    #: First TCP port of the ring backend (one per rank; ``mlx.launch --starting-port``).
    port: int = attrs.field(default=32323, validator=[v.ge(1), v.le(65535)])

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel


@attrs.define
class SamplingConfig:
    """Defaults for requests that leave a parameter out."""

    temperature: float = attrs.field(default=1.0, validator=[v.ge(0.0), v.le(2.0)])
    top_p: float = attrs.field(default=1.0, validator=[v.gt(0.0), v.le(1.0)])
    top_k: int = attrs.field(default=0, validator=v.ge(0))
    min_p: float = attrs.field(default=0.0, validator=[v.ge(0.0), v.le(1.0)])


@attrs.define
class PluginsConfig:
    #: Plugin names not to load (essential plugins refuse).
    disable: list[str] = attrs.field(factory=list)
    #: Requirement strings that must be installed, e.g. ``"mlxr-foo>=0.3"``.
    require: list[str] = attrs.field(factory=list)
    #: Abort when any plugin fails to load (also ``MLXR_STRICT_PLUGINS=1``).
    strict: bool = False
    #: ``plugins.config.<plugin name>``: each validated by that plugin's own schema.
    config: dict[str, dict[str, Any]] = attrs.field(factory=dict)


@attrs.define
class Config:
    models: list[ModelConfig] = attrs.field(validator=v.min_len(1))
    server: ServerConfig = attrs.field(factory=ServerConfig)
    engine: EngineConfig = attrs.field(factory=EngineConfig)
    sampling: SamplingConfig = attrs.field(factory=SamplingConfig)
    #: Global kernel choices: op -> backend name or ``auto``.
    kernels: dict[str, str] = attrs.field(factory=dict)
    #: API plugins to mount; unset: :data:`DEFAULT_APIS`, and ``webui`` on a loopback address.
    apis: list[str] = attrs.field(
        default=attrs.Factory(lambda self: default_apis(self.server.host), takes_self=True)
    )
    plugins: PluginsConfig = attrs.field(factory=PluginsConfig)
    #: Several processes serving each model together (tensor / pipeline parallel); see ``mlxr launch``.
    distributed: DistributedConfig = attrs.field(factory=DistributedConfig)
    #: MCP servers whose tools the server runs for the model (docs/agents.md).
    mcp: McpConfig = attrs.field(factory=lambda: McpConfig())


def _one_transport(instance: Any, attribute: attrs.Attribute[Any], url: str | None) -> None:
    if (url is None) == (not instance.command):
        raise ValueError("give one of command (a stdio server) and url (a streamable-HTTP server)")


@attrs.define
class McpServerConfig:
    """One MCP server: a command started for stdio, or a streamable-HTTP URL."""

    #: The label requests name it by (a Responses ``mcp`` tool's ``server_label``).
    name: str = attrs.field(validator=v.matches_re(r"[A-Za-z0-9_.\-]+"))
    #: The command and its arguments (stdio).
    command: list[str] = attrs.field(factory=list, validator=_no_empty_name)
    #: The server's URL (streamable HTTP, e.g. ``http://127.0.0.1:9000/mcp``).
    url: str | None = attrs.field(default=None, validator=_one_transport)
    #: Environment variables for the command (stdio).
    env: dict[str, str] = attrs.field(factory=dict)
    #: The tools offered to the model (None: all the server lists).
    allowed_tools: list[str] | None = None
    #: Seconds a list or a call may take; past it the call is an error item.
    timeout_s: float = attrs.field(default=30.0, validator=v.gt(0.0))
    #: Offer its tools to every chat completion (``/v1/chat/completions``) too, run without asking
    #: for approval (docs/agents.md); else only the Responses API's ``mcp`` tools name it.
    chat: bool = False


def _unique_servers(instance: Any, attribute: attrs.Attribute[Any], servers: list[McpServerConfig]) -> None:
    names = [server.name for server in servers]
    if len(set(names)) != len(names):
        raise ValueError("servers must have distinct names")


@attrs.define
class McpConfig:
    """MCP servers whose tools the server runs between generation turns (``mcp`` tools of the
    Responses API; chat completions, for a server with ``chat: true``), and the loop's bounds."""

    servers: list[McpServerConfig] = attrs.field(factory=list, validator=_unique_servers)
    #: Generation turns one request may take with tool calls between them.
    max_turns: int = attrs.field(default=8, validator=v.ge(1))
    #: Seconds one request's tool loop may take, generation included; past it the loop stops.
    max_seconds: float = attrs.field(default=300.0, validator=v.gt(0.0))
    #: Seconds the tools of the servers with ``chat: true`` stay listed (a failed listing too),
    #: so chat completions do not start every server on every request; 0 lists on each request.
    chat_list_ttl_s: float = attrs.field(default=60.0, validator=v.ge(0.0))


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` answers this machine only (``127.0.0.0/8``, ``::1``,
    ``localhost``); ``0.0.0.0``, ``::`` and other names do not count."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_apis(host: str) -> list[str]:
    """``apis:`` when the config does not set it, for a server bound to ``host``: the wire APIs,
    and the web page when only this machine can reach it (elsewhere, list ``webui`` to serve it)."""
    return [*DEFAULT_APIS, "webui"] if is_loopback(host) else list(DEFAULT_APIS)
