"""The one error tree of mlxr.

Every error a user can cause or meet derives from :class:`MlxrError`. An error says what went wrong
(its class and message), the HTTP status it answers with and, for a bad request, the field it is
about; it carries no API's wire vocabulary. Each API plugin writes errors in its own shape (OpenAI's
``type``/``code``/``param``, Anthropic's error types, Ollama's one string) from those; the CLI prints
them without a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MlxrError(Exception):
    """Base of every error mlxr raises on purpose."""

    #: HTTP status an API plugin should answer with.
    status: int = 500

    def __init__(self, message: str, *, field: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        #: The request field (or config key) the error is about, as a path: ``messages[0].role``.
        #: ``param`` is its former name, still accepted.
        self.field = field if field is not None else param


class ConfigError(MlxrError):
    """A server config (YAML, environment or flag) is invalid; names the key path."""

    status = 400


class PluginLoadError(MlxrError):
    """A plugin could not be imported, registered, or a required plugin is missing."""


class RegistryError(MlxrError):
    """Two plugins claim one name without an explicit override, or a name is unknown."""


def close_matches(name: str, available: Iterable[str]) -> str:
    """Return a "did you mean ...?" suffix, or an empty string."""
    matches = difflib.get_close_matches(name, list(available), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(matches)}?" if matches else ""


class UnknownName(RegistryError):
    """A name asked of a registry is not registered; lists what is."""

    def __init__(self, what: str, name: str, available: Iterable[str]):
        available = sorted(available)
        listing = ", ".join(available) if available else "none"
        super().__init__(
            f"unknown {what} {name!r} (available: {listing}){close_matches(name, available)}"
        )
        self.name = name
        self.available = available


class UnknownArchitecture(UnknownName):
    """No architecture plugin names a model type, and no architecture fallback serves it: lists the
    architectures and each fallback's reason (``mlx-lm bridge: mlx-lm 0.32.2 has no model type
    'foo'``, ``mlx-lm bridge: not installed (pip install 'mlxr[mlx-lm]')``)."""

    def __init__(
        self, name: str, available: Iterable[str], fallbacks: Iterable[str] = (), path: str | None = None
    ):
        super().__init__("architecture", name, available)
        self.fallbacks = list(fallbacks)
        if self.fallbacks:
            self.message = f"{self.message}; {'; '.join(self.fallbacks)}"
        if path:  # the checkpoint that names the model type
            self.message = f"{path}: {self.message}"
        self.args = (self.message,)


class ArchitectureUnavailable(MlxrError):
    """An architecture fallback cannot serve a model type; the message says why (the library has
    no such model type, or is not installed)."""


class UnsupportedFormat(MlxrError):
    """No format plugin recognizes a model path."""


class MissingDependency(MlxrError):
    """An optional package is needed; the message names the pip command."""

    def __init__(self, package: str, purpose: str, extra: str | None = None):
        install = f"pip install 'mlxr[{extra}]'" if extra else f"pip install {package}"
        super().__init__(f"{purpose} needs the package {package!r}: {install}")


class ModelLoadError(MlxrError):
    """A model file is corrupt or inconsistent; names the file and, where known, the tensor or
    the metadata key (as the file spells it: ``llama.block_count``, ``num_hidden_layers``)."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        tensor: str | None = None,
        key: str | None = None,
    ):
        where = ""
        if path:
            where += f"{path}: "
        if tensor:
            where += f"tensor {tensor!r}: "
        if key:
            where += f"key {key!r}: "
        super().__init__(where + message)
        #: The message without the file, tensor and key.
        self.detail = message
        self.path = path
        self.tensor = tensor
        self.key = key


class ExpertReadError(ModelLoadError):
    """Streamed expert weights could not be read from their checkpoint file while serving (the
    file unreadable, truncated or corrupt there); names the file and tensor. The requests that
    needed them fail with it; the others go on."""


class KernelUnavailable(MlxrError):
    """An explicitly chosen kernel backend cannot run here; lists the reasons."""


class RequestError(MlxrError):
    """A request is invalid; ``field`` names the offending field."""

    status = 400


class ModelNotFound(RequestError):
    """A request names a model that is not served; lists those that are."""

    status = 404

    def __init__(self, model: str, available: Iterable[str]):
        available = sorted(available)
        super().__init__(
            f"the model {model!r} does not exist (served: {', '.join(available) or 'none'})",
            field="model",
        )


class ContextLengthExceeded(RequestError):
    """A prompt (with the tokens asked for) does not fit the model's context."""

    @classmethod
    def tokens(cls, prompt_tokens: int, max_tokens: int, context_length: int) -> ContextLengthExceeded:
        """The prompt's tokens and ``max_tokens`` more exceed ``context_length``."""
        return cls(
            f"this model's maximum context length is {context_length} tokens; the prompt has "
            f"{prompt_tokens} tokens and {max_tokens} more were requested",
            field="messages",
        )


class KvBudgetExceeded(RequestError):
    """A request would need more KV cache than ``engine.max_kv_bytes`` allows."""


class Overloaded(MlxrError):
    """The engine's queue is full; retry later."""

    status = 429


class EngineStopped(MlxrError):
    """The engine is shutting down or has stopped."""

    status = 503


class RequestCancelled(MlxrError):
    """An operator cancelled the request (``POST /v1/requests/{id}/cancel``). 410: the clients'
    retries (on 409, 429 and 5xx) would run again what the operator stopped."""

    status = 410


class Unsupported(MlxrError):
    """The server cannot do this in its configuration; the message says which setting keeps it."""

    status = 501


class RankLost(EngineStopped):
    """A server running across processes (``distributed:``) lost one of them; it is going down."""


class ModelUnavailable(MlxrError):
    """A model could not be loaded, in time or at all; the message names the model and why."""

    status = 503
