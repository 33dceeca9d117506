"""A strict cattrs converter for configs a person typed, and readable problems from its errors.

Strict means: unknown keys are errors, a string is never turned into a number (nor a number into a
string, nor ``1`` into ``True``), a list must be a list and a section must be a mapping. Every error
cattrs collects (it keeps going past the first) becomes a :class:`Problem` with the key path it
happened at, so a user sees ``engine.max_batch_size: must be >= 1, got 0`` rather than a traceback.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import cattrs
import cattrs.cols
import cattrs.gen
from cattrs.errors import (
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
)

from mlxr_core.errors import close_matches

#: A key path: attribute or mapping key names, and list indices.
KeyPath = tuple[str | int, ...]


@attrs.frozen
class Problem:
    """One thing wrong with a config, at ``path``."""

    path: KeyPath
    message: str

    def __str__(self) -> str:
        where = format_path(self.path)
        return f"{where}: {self.message}" if where else self.message


def format_path(path: KeyPath) -> str:
    """``("models", 0, "path")`` -> ``models[0].path``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][\w-]*", part):
            out += f".{part}" if out else part
        else:
            out += f"[{part!r}]"
    return out


def describe(value: Any) -> str:
    """A value as an error message shows it: ``str 'abc'``, ``bool True``, ``null``."""
    if value is None:
        return "null (an empty value)"
    kind = "mapping" if isinstance(value, Mapping) else type(value).__name__
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{kind} {text}"


class TypeMismatch(TypeError):
    """A value of the wrong type; the message is already readable."""


# -- the converter ---------------------------------------------------------------------------


def make_converter() -> cattrs.Converter:
    """A converter that structures attrs classes strictly (see the module docstring)."""
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    for kind in (int, float, str, bool):
        converter.register_structure_hook(kind, _scalar_hook(kind))
    converter.register_structure_hook_factory(
        lambda t: typing.get_origin(t) is list, lambda t: _list_hook(t, converter)
    )
    converter.register_structure_hook_factory(
        lambda t: typing.get_origin(t) is dict, lambda t: _dict_hook(t, converter)
    )
    converter.register_structure_hook_factory(attrs.has, lambda t: _class_hook(t, converter))
    return converter


def _scalar_hook(kind: type) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _: Any) -> Any:
        # `type(...) is` rather than isinstance: bool is an int subclass and must not pass as one.
        if kind is int and type(value) is int and not -(2**63) <= value < 2**63:
            raise TypeMismatch(f"{value} is out of range (a 64-bit integer)")
        if type(value) is kind:
            return value
        if kind is float and type(value) is int:
            return float(value)
        raise TypeMismatch(f"expected {kind.__name__}, got {describe(value)}")

    return structure


def _list_hook(t: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    inner = cattrs.cols.list_structure_factory(t, converter)

    def structure(value: Any, _: Any) -> Any:
        # cattrs would happily turn the string "ab" into ["a", "b"].
        if not isinstance(value, list | tuple):
            raise TypeMismatch(f"expected a list, got {describe(value)}")
        return inner(value, t)

    return structure


def _dict_hook(t: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    inner = cattrs.cols.mapping_structure_factory(t, converter)

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, Mapping):
            raise TypeMismatch(f"expected a mapping, got {describe(value)}")
        return inner(value, t)

    return structure


def _class_hook(cl: type, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    # Unknown keys are checked here rather than by cattrs, which would then skip the class's
    # validators: a typo and a bad value in one section are reported together.
    inner: Callable[[Any, Any], Any] = cattrs.gen.make_dict_structure_fn(
        cl, converter, _cattrs_forbid_extra_keys=False
    )
    known = {a.name for a in attrs.fields(cl)}

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, Mapping):
            raise TypeMismatch(f"expected a mapping, got {describe(value)}")
        unknown = {key for key in value if key not in known}
        if not unknown:
            return inner(value, cl)
        extra = ForbiddenExtraKeysError("", cl, unknown)
        try:
            inner({k: v for k, v in value.items() if k in known}, cl)
        except ClassValidationError as exc:
            raise ClassValidationError(exc.message, [*exc.exceptions, extra], cl) from None
        raise ClassValidationError(f"While structuring {cl.__name__}", [extra], cl)

    return structure


# -- errors -> problems ----------------------------------------------------------------------


def problems_of(exc: BaseException, path: KeyPath = ()) -> Iterator[Problem]:
    """Flatten a (detailed) cattrs structuring error into problems with key paths."""
    if isinstance(exc, IterableValidationError):
        items, item_errors = exc.group_exceptions()
        for sub, item in items:
            yield from problems_of(sub, (*path, item.index))
        for sub in item_errors:
            yield from problems_of(sub, path)
    elif isinstance(exc, ClassValidationError):
        attributes, class_errors = exc.group_exceptions()
        for sub, attribute in attributes:
            if isinstance(sub, KeyError):
                yield Problem((*path, attribute.name), "required key missing")
            else:
                yield from problems_of(sub, (*path, attribute.name))
        for sub in class_errors:
            if isinstance(sub, ForbiddenExtraKeysError):
                known = [a.name for a in attrs.fields(sub.cl)]
                for key in sorted(map(_key_text, sub.extra_fields)):
                    hint = close_matches(key, known) or f" (known keys: {', '.join(known)})"
                    yield Problem((*path, key), f"unknown key{hint}")
            else:
                yield from _validator_problems(sub, path)
    elif isinstance(exc, TypeMismatch):
        yield Problem(path, str(exc))
    else:
        yield Problem(path, f"{exc}" or type(exc).__name__)


def _key_text(key: Any) -> str:
    """A mapping key as YAML wrote it: keys may also be null, booleans or numbers."""
    if isinstance(key, str):
        return key
    if key is None:
        return "null"
    return str(key).lower() if isinstance(key, bool) else str(key)


def _validator_problems(exc: BaseException, path: KeyPath) -> Iterator[Problem]:
    """Problems from an exception raised in an attrs class's ``__init__`` (a validator or converter).

    cattrs cannot tell which attribute failed there, and attrs stops at the first failing
    validator. attrs assigns every attribute before validating and passes the failing ``Attribute``
    to the validator, so the validator's frame holds both: every validator of the instance is run
    again from there to report all bad values at once.
    """
    tb = exc.__traceback__
    while tb is not None:
        frame_locals = dict(tb.tb_frame.f_locals)
        attribute = next((v for v in frame_locals.values() if isinstance(v, attrs.Attribute)), None)
        if attribute is not None:
            instance = next((v for v in frame_locals.values() if _owns(v, attribute)), None)
            if instance is None:
                yield Problem((*path, attribute.name), _readable(exc, attribute.name, frame_locals.get("value")))
                return
            for field in attrs.fields(type(instance)):
                if field.validator is None:
                    continue
                value = getattr(instance, field.name, None)
                try:
                    field.validator(instance, field, value)
                except Exception as field_exc:
                    yield Problem((*path, field.name), _readable(field_exc, field.name, value))
            return
        tb = tb.tb_next
    yield Problem(path, f"{exc}")


def _owns(obj: Any, attribute: attrs.Attribute[Any]) -> bool:
    cls = type(obj)
    return attrs.has(cls) and getattr(attrs.fields(cls), attribute.name, None) is attribute


def _readable(exc: BaseException, name: str, value: Any) -> str:
    """attrs' ``'port' must be >= 0: -1`` -> ``must be >= 0, got -1``."""
    message = str(exc.args[0]) if exc.args else str(exc)
    quoted = re.escape(f"'{name}'")
    if match := re.fullmatch(rf"{quoted} must be ([<>=!]+ .+): .*", message):
        return f"must be {match[1]}, got {value!r}"
    if match := re.fullmatch(rf"Length of {quoted} must be ([<>]=) (\d+): \d+", message):
        if match[1] == ">=" and match[2] == "1":
            return "must not be empty"
        return f"length must be {match[1]} {match[2]}, got {len(value)}"
    if re.match(rf"{quoted} must be in ", message) and len(exc.args) >= 3:
        options = ", ".join(str(o) for o in exc.args[2])
        return f"must be one of {options}, got {value!r}"
    return re.sub(rf"^{quoted} ", "", message)


# -- schema navigation (for typed environment values) ----------------------------------------


def field_type(schema: type, path: KeyPath) -> Any:
    """The declared type at ``path`` inside ``schema``, or ``Any`` where it cannot be told."""
    current: Any = schema
    for part in path:
        current = _unwrap_optional(current)
        origin = typing.get_origin(current)
        if attrs.has(current) and isinstance(part, str):
            hints = typing.get_type_hints(current)
            if part not in hints:
                return Any
            current = hints[part]
        elif origin is list:
            current = typing.get_args(current)[0]
        elif origin is dict:
            current = typing.get_args(current)[1]
        else:
            return Any
    return _unwrap_optional(current)


def _unwrap_optional(t: Any) -> Any:
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return t
