"""Chat templates: Jinja2 rendered the way Hugging Face renders them, in a sandbox.

A chat template comes from a model file, so it is untrusted code: it runs in Jinja2's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` (no attribute access to Python internals,
no mutation of the caller's messages), with bounds on string repetition and powers so a template
cannot exhaust memory, and on its work: every loop step and call checks the render's deadline
(:data:`MAX_RENDER_SECONDS`), the output is capped (:data:`MAX_RENDER_CHARS`), and
:func:`interrupt_renders` (a server's shutdown) stops every render in progress. The environment
matches ``transformers``' ``apply_chat_template``:
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, a ``tojson``
filter that does not escape HTML, and the ``raise_exception`` and ``strftime_now`` globals.
"""

from __future__ import annotations

import contextvars
import json
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from mlxr_core.errors import EngineStopped, MissingDependency, RequestError

if TYPE_CHECKING:
    import jinja2

#: The longest string or list a template may build with ``*``; far above any real prompt.
MAX_REPEAT = 1 << 24
#: The largest exponent a template may use with ``**``.
MAX_EXPONENT = 4096
#: The largest integer (in bits) a template may compute with ``**``: ``(10 ** 4000) ** 4000``
#: keeps each exponent small but would cost seconds of CPU.
MAX_POWER_BITS = 1 << 16
#: Seconds a render may take; real templates take milliseconds, nested loops could take years.
MAX_RENDER_SECONDS = 5.0
#: The longest prompt a template may render, in characters.
MAX_RENDER_CHARS = MAX_REPEAT


class _RenderStopped(Exception):
    """Raised inside a render that ran out of time or was interrupted."""


class _Budget:
    """One render's deadline, and the :func:`interrupt_renders` count it started under."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.epoch = _interrupts

    def check(self) -> None:
        if self.epoch != _interrupts:
            raise _RenderStopped("interrupted")
        if time.monotonic() > self.deadline:
            raise _RenderStopped("deadline")


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("mlxr_render", default=None)
_interrupts = 0


def interrupt_renders() -> None:
    """Stop every render in progress (they raise :class:`EngineStopped`); later ones run."""
    global _interrupts
    _interrupts += 1


def _check_budget() -> None:
    budget = _budget.get()
    if budget is not None:
        budget.check()


def _checked_iter(iterable: Iterable[Any]) -> Iterator[Any]:
    """What every ``{% for %}`` iterates: ``iterable``, checking the render's budget each step."""
    for item in iterable:
        _check_budget()
        yield item


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
    compiled = _compile(template)
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

    token = _budget.set(_Budget(MAX_RENDER_SECONDS))
    try:
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
    except _RenderStopped as exc:
        if str(exc) == "interrupted":
            raise EngineStopped("the server is shutting down") from None
        raise RequestError(
            f"the chat template took longer than {MAX_RENDER_SECONDS:g} s to render",
            field="messages",
        ) from None
    except (RequestError, EngineStopped):
        raise
    except SecurityError as exc:
        raise RequestError(
            f"the chat template attempted an unsafe operation: {exc}", field="messages"
        ) from None
    except TemplateError as exc:
        raise RequestError(f"the chat template failed: {exc}", field="messages") from None
    except Exception as exc:  # a template indexing a missing key, adding None to a str ...
        raise RequestError(
            f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
            field="messages",
        ) from None
    finally:
        _budget.reset(token)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compile ``template`` once; the cache is keyed by the template text."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateSyntaxError

    environment = _environment()
    try:
        source = environment.parse(template)
        for loop in source.find_all(nodes.For):  # every loop steps through _checked_iter
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
    from jinja2.sandbox import ImmutableSandboxedEnvironment
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

    from jinja2.compiler import CodeGenerator

    class BoundedConcat(CodeGenerator):
        """Every ``~`` concatenation checked by :meth:`ChatTemplateEnvironment.bounded` (a string
        doubled in a loop would reach gigabytes between two deadline checks)."""

        def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
            self.write("environment.bounded(")
            super().visit_Concat(node, frame)
            self.write(")")

    class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})
        code_generator_class = BoundedConcat

        @staticmethod
        def bounded(value: Any) -> Any:
            """``value`` (a concatenation's result), refused past :data:`MAX_REPEAT` characters."""
            if isinstance(value, str) and len(value) > MAX_REPEAT:
                raise jinja2.exceptions.SecurityError(f"a string longer than {MAX_REPEAT} characters")
            return value

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            _check_budget()  # macros calling macros loop without a {% for %}
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "+":
                if (
                    isinstance(left, (str, list, tuple))
                    and isinstance(right, (str, list, tuple))
                    and len(left) + len(right) > MAX_REPEAT
                ):
                    raise jinja2.exceptions.SecurityError(f"a sequence longer than {MAX_REPEAT} items")
            elif operator == "*":
                for sequence, count in ((left, right), (right, left)):
                    if (
                        isinstance(sequence, (str, list, tuple))
                        and isinstance(count, int)
                        and len(sequence) * count > MAX_REPEAT
                    ):
                        raise jinja2.exceptions.SecurityError(
                            f"a repetition longer than {MAX_REPEAT} items"
                        )
            elif isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
                raise jinja2.exceptions.SecurityError(f"an exponent above {MAX_EXPONENT}")
            elif (
                isinstance(left, int)
                and isinstance(right, int)
                and left.bit_length() * abs(right) > MAX_POWER_BITS
            ):
                raise jinja2.exceptions.SecurityError(
                    f"a power larger than {MAX_POWER_BITS} bits"
                )
            return super().call_binop(context, operator, left, right)

    env = ChatTemplateEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters["mlxr_checked_iter"] = _checked_iter
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


def _raise_exception(message: str) -> None:
    raise RequestError(str(message), field="messages")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
