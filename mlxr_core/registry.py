"""Name -> lazily imported implementation, attributed to the plugin that provided it."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import attrs

from mlxr_core.errors import RegistryError, UnknownName


def resolve(target: Any) -> Any:
    """Import a ``"package.module:attr"`` string; return any other object as it is."""
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


@attrs.define
class Entry:
    """One registered item."""

    name: str
    target: Any  # "pkg.mod:attr" or the object itself
    plugin: str
    override: bool = False
    meta: dict[str, Any] = attrs.field(factory=dict)
    #: Entries this one replaced through an explicit override (for ``mlxr plugins``).
    replaced: list[Entry] = attrs.field(factory=list)
    _loaded: Any = attrs.field(default=None, alias="_loaded", repr=False)

    def load(self) -> Any:
        """Import the target (once) and, if it is a class, instantiate it with no arguments."""
        if self._loaded is None:
            obj = resolve(self.target)
            self._loaded = obj() if isinstance(obj, type) else obj
        return self._loaded


@attrs.define
class Registry:
    """A registry of one kind of item (formats, archs, kernels ...)."""

    kind: str
    _entries: dict[str, Entry] = attrs.field(factory=dict, alias="_entries")

    def add(
        self, name: str, target: Any, *, plugin: str, override: bool = False, **meta: Any
    ) -> Entry:
        """Register ``name``; a second plugin claiming it must say ``override=True``.

        Plugins load in entry-point order, which the installer decides, so an override may come
        first: a plain registration arriving after it slots in underneath, as what it replaced.
        """
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{plugin}: a {self.kind} name must be a non-empty string, got {name!r}")
        entry = Entry(name=name, target=target, plugin=plugin, override=override, meta=meta)
        existing = self._entries.get(name)
        if existing is None:
            self._entries[name] = entry
            return entry
        if override:
            entry.replaced = [*existing.replaced, existing]
            self._entries[name] = entry
            return entry
        base = existing.replaced[0] if existing.replaced else existing
        if not base.override:
            raise RegistryError(
                f"{self.kind} {name!r} is registered by both {base.plugin!r} and {plugin!r}; "
                f"the second must register with override=True to replace it"
            )
        # Only overrides so far: this plain registration is what they replace.
        existing.replaced.insert(0, entry)
        return entry

    def remove_plugin(self, plugin: str) -> None:
        """Forget everything ``plugin`` registered, restoring what it overrode."""
        for name, entry in list(self._entries.items()):
            entry.replaced = [old for old in entry.replaced if old.plugin != plugin]
            if entry.plugin == plugin:
                if entry.replaced:
                    restored = entry.replaced[-1]
                    restored.replaced = entry.replaced[:-1]
                    self._entries[name] = restored
                else:
                    del self._entries[name]

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownName(self.kind, name, self._entries) from None

    def get(self, name: str) -> Any:
        """The loaded implementation of ``name``."""
        return self.entry(name).load()

    def names(self) -> list[str]:
        return sorted(self._entries)

    def choose(self, choice: str, template: str | None) -> str | None:
        """The name ``choice`` selects for a model whose chat template is ``template``: the name
        itself, None for ``none``, and for ``auto`` the entry whose ``detect(template)`` scores
        highest (None when none scores above 0). Parsers are chosen this way."""
        if choice == "none":
            return None
        if choice != "auto":
            return choice
        if not template:
            return None
        best, best_score = None, 0
        for name in self.names():
            score = int(self.get(name).detect(template))
            if score > best_score:
                best, best_score = name, score
        return best

    def by_plugin(self, plugin: str) -> list[str]:
        return [name for name, entry in sorted(self._entries.items()) if entry.plugin == plugin]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
