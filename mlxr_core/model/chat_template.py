"""Chat templates: Jinja2 rendered the way Hugging Face renders them, in a sandbox.

A chat template comes from a model file, so it is untrusted code: it runs in
:class:`~mlxr_core.model.template_sandbox.BoundedEnvironment`, Jinja2's immutable sandbox (no
attribute access to Python internals, no mutation of the caller's messages) with every operation
bounded: each loop step, call, filter and test checks the render's deadline
(:data:`MAX_RENDER_SECONDS`), and no operation may build a string, a list or a value's text past
the sandbox's limits, so a render ends within its deadline or is refused. The output is capped
(:data:`MAX_RENDER_CHARS`), and :func:`interrupt_renders` (a server's shutdown) stops every render
in progress. The environment matches ``transformers``' ``apply_chat_template``:
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, a ``tojson``
filter that does not escape HTML, and the ``raise_exception`` and ``strftime_now`` globals.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import EngineStopped, MissingDependency, RequestError
from mlxr_core.model.template_budget import (
    RenderStopped,
    checked_iter,
    interrupt_renders,
    render_budget,
)

if TYPE_CHECKING:
    import jinja2

__all__ = ["MAX_RENDER_CHARS", "MAX_RENDER_SECONDS", "interrupt_renders", "render_chat_template"]

#: Seconds a render may take; real templates take milliseconds, nested loops could take years.
MAX_RENDER_SECONDS = 5.0
#: The longest prompt a template may render, in characters (the sandbox's longest string).
MAX_RENDER_CHARS = 1 << 24


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with the Jinja2 chat ``template`` and return the prompt text.

    ``kwargs`` reach the template as variables (``tools``, ``documents``, ``enable_thinking`` ...);
    ``tools`` and ``documents`` default to None as in ``transformers``. A token left as None is
    not defined at all, so ``{{ bos_token }}`` renders nothing rather than ``"None"``.

    Raises :class:`RequestError` (``field="messages"``) when the template does not compile, calls
    ``raise_exception``, fails on these messages, or attempts something the sandbox forbids.
    """
    variables: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "tools": None,
        "documents": None,
    }
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    variables.update(kwargs)

    from jinja2.exceptions import SecurityError, TemplateError

    from mlxr_core.model.template_sandbox import TooLarge

    _environment()  # built once, outside any render's time
    try:
        with render_budget(MAX_RENDER_SECONDS):  # compiling folds constants: it counts too
            compiled = _compile(template)
            parts, size = [], 0
            for part in compiled.generate(variables):
                size += len(part)
                if size > MAX_RENDER_CHARS:
                    raise RequestError(
                        f"the chat template rendered more than {MAX_RENDER_CHARS} characters",
                        field="messages",
                    )
                parts.append(part)
        return "".join(parts)
    except RenderStopped as exc:
        if str(exc) == "interrupted":
            raise EngineStopped("the server is shutting down") from None
        raise RequestError(
            f"the chat template took longer than {MAX_RENDER_SECONDS:g} s to render",
            field="messages",
        ) from None
    except (RequestError, EngineStopped, MissingDependency):
        raise
    except TooLarge as exc:
        raise RequestError(f"the chat template went past a size limit: {exc}", field="messages") from None
    except SecurityError as exc:
        raise RequestError(
            f"the chat template attempted an unsafe operation: {exc}", field="messages"
        ) from None
    except TemplateError as exc:
        raise RequestError(f"the chat template failed: {exc}", field="messages") from None
    except MemoryError:
        raise RequestError(
            "the chat template needs more memory than the server has to render", field="messages"
        ) from None
    except Exception as exc:  # a template indexing a missing key, adding None to a str ...
        raise RequestError(
            f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
            field="messages",
        ) from None


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compile ``template`` once; the cache is keyed by the template text."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateSyntaxError

    environment = _environment()
    try:
        source = environment.parse(template)
        for loop in source.find_all(nodes.For):  # every loop steps through checked_iter
            loop.iter = nodes.Filter(loop.iter, "mlxr_checked_iter", [], [], None, None, lineno=loop.lineno)
        return environment.from_string(source)
    except TemplateSyntaxError as exc:
        raise RequestError(
            f"the model's chat template is invalid (line {exc.lineno}): {exc.message}",
            field="messages",
        ) from None


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from packaging.version import Version

    if Version(jinja2.__version__) < Version("3.1.6"):
        # Earlier releases have known sandbox escapes, and these templates are untrusted.
        raise MissingDependency("Jinja2>=3.1.6", "rendering a model's chat template safely")

    class GenerationTag(Extension):
        """``{% generation %}`` marks assistant text for training masks; it renders its body."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    from mlxr_core.model.template_sandbox import BoundedEnvironment

    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.add_filter("tojson", _tojson)
    env.filters["mlxr_checked_iter"] = checked_iter  # checks the budget itself, unbounded in length
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: Jinja's own escapes <, >, & and ' for HTML, which would change prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: Any) -> None:
    from mlxr_core.model.template_sandbox import weigh

    weigh(message)  # its text becomes the error's
    raise RequestError(str(message), field="messages")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
