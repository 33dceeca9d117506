"""LoRA adapters served over one base model: low-rank updates gathered per row of a batch.

An adapter file (a PEFT folder, an mlx-lm adapter folder, a llama.cpp LoRA GGUF) is read by the
format plugin that recognizes it (:class:`ReadsAdapters`) into an :class:`AdapterCheckpoint`: per
linear module of the base, ``a [r, in]``, ``b [out, r]`` and the scale the file's alpha and rank
give (``alpha / r``, ``alpha / sqrt(r)`` for rsLoRA). :func:`fit_adapter` checks each update against
the loaded model (the module exists and is linear, the shapes fit) and refuses, naming the tensor,
what does not fit.

The base weights are never merged. Each targeted layer becomes a :class:`LowRankLinear` (its class
changes, its parameters stay) that adds, per row ``i`` of its input, ``scale * (x_i @ A^T) @ B^T``
for the adapter row ``i`` uses: the base matmul runs once for every row, and the updates are two
``mx.gather_mm`` over the resident adapters' stacked ``A`` and ``B`` (ranks padded to the layer's
largest). :class:`AdapterSet` holds those stacks (one slot per resident adapter) and, while a
forward pass is built (:meth:`AdapterSet.rows`), which slot each row uses and at which scale
(a request may ask for its adapter at another strength than the file's, as llama.cpp's ``lora``
scales: the update times that factor, per row); rows with slot 0 (no adapter) and a pass with no
adapter row at all add nothing.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxr_core.errors import ConfigError, ModelLoadError, UnsupportedFormat
from mlxr_core.model.quantize import KernelQuantizedLinear

if TYPE_CHECKING:
    from mlxr_core.model.arch import Architecture
    from mlxr_core.plugins import Registries


@attrs.frozen
class LowRank:
    """One linear module's update, ``y += scale * (x @ a.T) @ b.T``, as its file holds it: host
    arrays (numpy, float16 or float32; an adapter is read off the engine thread, which alone runs
    MLX), with the file's names for ``a`` and ``b`` (what a refusal names)."""

    a: np.ndarray  # [r, in]
    b: np.ndarray  # [out, r]
    scale: float
    names: tuple[str, str]

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@attrs.frozen
class FittedUpdate:
    """A :class:`LowRank` checked against its module and made MLX arrays in the model's dtype
    (:func:`fit_adapter`), laid out as an :class:`AdapterSet` stacks them: ``A`` transposed, and
    ``B`` transposed with the scale folded in (no multiply per step)."""

    a: mx.array  # [in, r]
    b: mx.array  # [r, out]

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


@attrs.define
class AdapterCheckpoint:
    """An adapter as its format read it: updates by module, in the checkpoint's module names (those
    of the base checkpoint's ``config.json`` layout)."""

    path: Path
    format: str
    updates: dict[str, LowRank]
    metadata: dict[str, Any] = attrs.field(factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(update.a.nbytes + update.b.nbytes for update in self.updates.values())


@runtime_checkable
class ReadsAdapters(Protocol):
    """A format plugin that also reads LoRA adapter files of its kind."""

    def detect_adapter(self, path: Path) -> bool:
        """Whether ``path`` is an adapter this format reads."""

    def load_adapter(self, path: Path, *, base_config: Mapping[str, Any]) -> AdapterCheckpoint:
        """Read the adapter at ``path`` for a base with ``base_config`` (its checkpoint config:
        head counts a format may need to put rows in the base's order) into host arrays. Runs
        off the engine thread: numpy only, no MLX. Raises ModelLoadError naming the field or
        tensor it cannot serve (DoRA, a bias, a module saved whole)."""


def read_adapter(
    path: Path, registries: Registries, base_config: Mapping[str, Any]
) -> AdapterCheckpoint:
    """The adapter at ``path``, read by the first format plugin that recognizes it."""
    if not path.exists():
        raise ConfigError(
            f"adapter {path}: no such file or folder", field="models[].adapters[].path"
        )
    for name in registries.formats.names():
        fmt = registries.formats.get(name)
        if isinstance(fmt, ReadsAdapters) and fmt.detect_adapter(path):
            return fmt.load_adapter(path, base_config=base_config)
    raise UnsupportedFormat(
        f"{path}: not a LoRA adapter any format reads (a PEFT or mlx-lm folder with adapter_config.json, "
        "or a llama.cpp LoRA GGUF)"
    )


def paired_tensors(
    names: Iterable[str], a_suffix: str, b_suffix: str, path: Path
) -> list[tuple[str, str]]:
    """Each ``...<a_suffix>`` tensor name with its ``...<b_suffix>`` partner; ModelLoadError naming
    a tensor that is neither, or one without its partner."""
    names = set(names)
    pairs = []
    for name in sorted(names):
        if name.endswith(b_suffix):
            if name.removesuffix(b_suffix) + a_suffix not in names:
                raise ModelLoadError(
                    f"{b_suffix} without its {a_suffix}", path=str(path), tensor=name
                )
        elif not name.endswith(a_suffix):
            raise ModelLoadError(f"not a LoRA matrix (only {a_suffix} and {b_suffix} are served)",
                                 path=str(path), tensor=name)  # fmt: skip
        elif name.removesuffix(a_suffix) + b_suffix not in names:
            raise ModelLoadError(f"{a_suffix} without its {b_suffix}", path=str(path), tensor=name)
        else:
            pairs.append((name, name.removesuffix(a_suffix) + b_suffix))
    return pairs


def lora_scale(alpha: float, rank: int, *, rslora: bool = False) -> float:
    """PEFT's scale: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (Kalajdzievski 2023)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(out, in)`` of a linear layer, dense or packed; None for any other module."""
    if isinstance(module, nn.QuantizedLinear):
        return int(module["weight"].shape[0]), int(module["scales"].shape[-1]) * module.group_size
    if isinstance(module, nn.Linear):
        out, inputs = module["weight"].shape
        return int(out), int(inputs)
    return None


def fit_adapter(
    model: nn.Module,
    arch: Architecture,
    adapter: AdapterCheckpoint,
    dtype: mx.Dtype,
    modules: Mapping[str, nn.Module] | None = None,
) -> dict[str, FittedUpdate]:
    """``adapter``'s updates under the loaded ``model``'s module names (``modules``: its
    ``named_modules``, when known), as MLX arrays in ``dtype``; refuses, naming the tensor, an
    update whose module the model lacks or is not linear, or whose shapes do not fit it. The
    transposes and the scale are applied on the host: an update becomes two MLX arrays."""
    from mlxr_core.model.loader import renamed_modules

    modules = modules if modules is not None else dict(model.named_modules())
    fitted: dict[str, FittedUpdate] = {}
    for module, update in renamed_modules(arch, adapter.updates).items():
        a_name, b_name = update.names
        target = modules.get(module)
        if target is None:
            raise ModelLoadError(f"the adapter targets {module}, which the base model does not have",
                                 path=str(adapter.path), tensor=a_name)  # fmt: skip
        shape = linear_shape(target)
        if shape is None or not (type(target) in LOW_RANK or isinstance(target, LowRankLinear)):
            raise ModelLoadError(f"the adapter targets {module}, a {type(target).__name__}: only linear "
                                 "layers take LoRA updates here", path=str(adapter.path), tensor=a_name)  # fmt: skip
        out, inputs = shape
        if update.a.ndim != 2 or update.a.shape[1] != inputs:
            raise ModelLoadError(f"shape {tuple(update.a.shape)} does not fit {module} ({inputs} inputs): "
                                 f"expected [rank, {inputs}]", path=str(adapter.path), tensor=a_name)  # fmt: skip
        if update.b.ndim != 2 or update.b.shape != (out, update.rank):
            raise ModelLoadError(f"shape {tuple(update.b.shape)} does not fit {module} ({out} outputs, rank "
                                 f"{update.rank}): expected [{out}, {update.rank}]",
                                 path=str(adapter.path), tensor=b_name)  # fmt: skip
        a, b = np.ascontiguousarray(update.a.T), np.ascontiguousarray(update.b.T) * update.scale
        fitted[module] = FittedUpdate(_in_dtype(mx.array(a), dtype), _in_dtype(mx.array(b), dtype))
    if not fitted:
        raise ModelLoadError("the adapter holds no LoRA update", path=str(adapter.path))
    return fitted


def _in_dtype(array: mx.array, dtype: mx.Dtype) -> mx.array:
    return array if array.dtype == dtype else array.astype(dtype)


class LayerUpdates:
    """One layer's resident updates: ``a [S, in, R]`` and ``b [S, R, out]`` scaled (``R`` the
    largest rank, smaller ones zero-padded), and :attr:`key`: per adapter slot (``capacity + 1``,
    slot 0 none) its index in them, -1 where the slot's adapter does not target this layer."""

    def __init__(self, adapters: AdapterSet):
        self.adapters = adapters
        self.a: mx.array | None = None
        self.b: mx.array | None = None
        #: Adapter slot -> (index in the stacks, rank).
        self.entries: dict[int, tuple[int, int]] = {}
        self.key: tuple[int, ...] = (-1,) * (adapters.capacity + 1)

    @property
    def nbytes(self) -> int:
        return (self.a.nbytes + self.b.nbytes) if self.a is not None and self.b is not None else 0

    def add(self, slot: int, update: FittedUpdate) -> None:
        r = update.rank
        width = max(r, self.a.shape[-1] if self.a is not None else 0)
        a, b = update.a[None], update.b[None]  # [1, in, r] and [1, r, out]
        if width > r:
            a = mx.pad(a, [(0, 0), (0, 0), (0, width - r)])
            b = mx.pad(b, [(0, 0), (0, width - r), (0, 0)])
        if self.a is None or self.b is None:
            self.a, self.b = a, b
        else:
            grow = width - self.a.shape[-1]
            old_a = mx.pad(self.a, [(0, 0), (0, 0), (0, grow)]) if grow else self.a
            old_b = mx.pad(self.b, [(0, 0), (0, grow), (0, 0)]) if grow else self.b
            self.a, self.b = mx.concatenate([old_a, a]), mx.concatenate([old_b, b])
        self.entries[slot] = (int(self.a.shape[0]) - 1, r)
        self._tables()

    def remove(self, slot: int) -> None:
        if slot not in self.entries or self.a is None or self.b is None:
            return
        index, _ = self.entries.pop(slot)
        if not self.entries:
            self.a = self.b = None
        else:
            keep = mx.array([i for i in range(self.a.shape[0]) if i != index])
            width = max(rank for _, rank in self.entries.values())  # the padding left
            self.a, self.b = self.a[keep][..., :width], self.b[keep][:, :width]
            self.entries = {s: (i - (i > index), rank) for s, (i, rank) in self.entries.items()}
        self._tables()

    def _tables(self) -> None:
        self.key = tuple(
            self.entries[s][0] if s in self.entries else -1
            for s in range(self.adapters.capacity + 1)
        )

    @property
    def arrays(self) -> list[mx.array]:
        return [self.a, self.b] if self.a is not None and self.b is not None else []

    def apply(self, x: mx.array, y: mx.array) -> mx.array:
        """``y`` (the base layer's output for ``x [B, L, in]``) plus each row's update."""
        rows = self.adapters.active()
        if rows is None or self.a is None or self.b is None:
            return y
        if rows.size != x.shape[0]:
            raise ValueError(f"{rows.size} adapter rows for a pass over {x.shape[0]} rows")
        index, factor = rows.lookup(self.key)
        if index is None:
            return y  # no row's adapter targets this layer
        low = mx.gather_mm(x, self.a, rows.every, index)  # [B, L, R]
        if factor is not None:  # each row's scale; 0 where its adapter does not target this layer
            low = low * factor.astype(low.dtype)
        update: mx.array = mx.gather_mm(low, self.b, rows.every, index)  # [B, L, out]
        return y + update


class StepRows:
    """The adapter slots of the rows of one forward pass and each row's scale of its adapter
    (1: the file's own), and per layer table (a :attr:`LayerUpdates.key`) the rows' indices into
    its stacks and their factors (the scale, 0 for a row it does not update; None when every row
    takes its update whole), made once per pass and table on the host (the layers of a model
    mostly share one)."""

    def __init__(self, slots: tuple[int, ...], scales: tuple[float, ...] | None = None):
        self.slots = slots
        self.size = len(slots)
        self.scales = scales if scales is not None else (1.0,) * self.size
        if len(self.scales) != self.size:
            raise ValueError(f"{len(self.scales)} adapter scales for {self.size} rows")
        self.every = mx.arange(self.size, dtype=mx.uint32)
        self._tables: dict[tuple[int, ...], tuple[mx.array | None, mx.array | None]] = {}

    def lookup(self, key: tuple[int, ...]) -> tuple[mx.array | None, mx.array | None]:
        found = self._tables.get(key)
        if found is None:
            where = [key[slot] for slot in self.slots]
            if all(i < 0 for i in where):
                found = (None, None)
            else:
                index = mx.array([max(i, 0) for i in where], dtype=mx.uint32)
                factors = [scale if i >= 0 else 0.0 for i, scale in zip(where, self.scales, strict=True)]
                factor = None if all(f == 1.0 for f in factors) else mx.array(factors)[:, None, None]
                found = (index, factor)
            self._tables[key] = found
        return found


class LowRankLinear:
    """A linear layer (dense or packed) plus its :class:`LayerUpdates`; what a targeted layer's
    class becomes (a subclass of its own class: :data:`LOW_RANK`)."""

    _updates: LayerUpdates

    def __call__(self, x: mx.array) -> mx.array:
        y: mx.array = super().__call__(x)  # type: ignore[misc]
        return self._updates.apply(x, y)


class LowRankDense(LowRankLinear, nn.Linear):
    pass


class LowRankPacked(LowRankLinear, nn.QuantizedLinear):
    pass


class LowRankKernelPacked(LowRankLinear, KernelQuantizedLinear):
    pass


#: Linear layer classes and the class each becomes when an adapter targets it.
LOW_RANK: dict[type, type] = {
    nn.Linear: LowRankDense,
    nn.QuantizedLinear: LowRankPacked,
    KernelQuantizedLinear: LowRankKernelPacked,
}


@attrs.define
class ResidentAdapter:
    name: str
    slot: int
    modules: tuple[str, ...]
    #: The adapter's own bytes (its A and B at their ranks).
    nbytes: int
    #: ``time.monotonic()`` of its last request.
    last_used: float


class AdapterSet:
    """A model's resident adapters, at most ``capacity`` (slots 1..capacity; 0 is no adapter), the
    configured ones it may load (name -> path), and which slot each row of a forward pass uses:
    those :meth:`rows` sets while a pass is built, else those of the running batch
    (:attr:`batch_slots`, the engine's: a decode step runs over its rows)."""

    def __init__(
        self,
        model: nn.Module,
        capacity: int,
        configured: Mapping[str, str] | None = None,
        read: Callable[[Path], AdapterCheckpoint] | None = None,
    ):
        self.model = model
        #: The model's modules by name (their classes change as adapters target them, not they).
        self.modules = dict(model.named_modules())
        self.capacity = capacity
        self.configured = dict(configured or {})
        #: Reads an adapter file for this model (:func:`read_adapter` with the model's registries).
        self.read = read
        self.resident: dict[str, ResidentAdapter] = {}
        self.layers: dict[str, LayerUpdates] = {}
        #: Each running row's slot, in batch order (set by the engine's batch), or None.
        self.batch_slots: Callable[[], Sequence[int]] | None = None
        #: Each running row's scale of its adapter, in batch order (set with :attr:`batch_slots`).
        self.batch_scales: Callable[[], Sequence[float]] | None = None
        #: The slots requests use now, running or prefilling (set by the engine's batch), or None.
        self.busy_slots: Callable[[], Collection[int]] | None = None
        #: Told the change in :attr:`nbytes` after each add and remove (the memory budget's count).
        self.on_change: Callable[[int], None] | None = None
        #: Told an adapter created while serving (its name and path) or deleted (its name, None):
        #: the engine serves it as a model of its own, or no longer (set by the engine).
        self.on_created: Callable[[str, str | None], None] | None = None
        #: Slots engine jobs hold (option scoring with an adapter): not replaced while held.
        self.held: Counter[int] = Counter()
        #: Adapters being read off the engine thread, or read and waiting for a slot: name -> the
        #: read (:mod:`mlxr_core.engine.adapters`).
        self.reading: dict[str, Future[AdapterCheckpoint]] = {}
        #: Called on the reading thread as a read ends (the engine's wake-up), or None.
        self.on_read: Callable[[], None] | None = None
        #: Whether adapters are read off the engine thread; False: it waits for each read (ranks
        #: serving together, ``distributed:``, swap an adapter in at the same step).
        self.background = True
        self._override = False
        self._current: StepRows | None = None
        self._steps: dict[tuple[tuple[int, ...], tuple[float, ...] | None], StepRows] = {}

    @property
    def nbytes(self) -> int:
        """Bytes the stacked updates hold (the adapters' own bytes plus rank padding)."""
        return sum(layer.nbytes for layer in self.layers.values())

    def slot(self, name: str) -> int | None:
        resident = self.resident.get(name)
        return resident.slot if resident is not None else None

    def add(self, name: str, updates: Mapping[str, FittedUpdate]) -> int:
        """Make ``updates`` (from :func:`fit_adapter`) resident as ``name``; its slot."""
        if name in self.resident:
            raise ValueError(f"adapter {name!r} is resident already")
        free = sorted(set(range(1, self.capacity + 1)) - {r.slot for r in self.resident.values()})
        if not free:
            raise ValueError(f"all {self.capacity} adapter slots are taken")
        slot = free[0]
        before = self.nbytes
        for path, update in updates.items():
            layer = self.layers.get(path)
            if layer is None:
                module = self.modules[path]
                layer = self.layers[path] = LayerUpdates(self)
                module.__class__ = LOW_RANK.get(type(module), type(module))
                object.__setattr__(module, "_updates", layer)
            layer.add(slot, update)
        mx.eval([array for path in updates for array in self.layers[path].arrays])  # one sync for all
        own = sum(update.a.nbytes + update.b.nbytes for update in updates.values())
        self.resident[name] = ResidentAdapter(name, slot, tuple(updates), own, time.monotonic())
        self._changed(before)
        return slot

    def remove(self, name: str) -> None:
        resident = self.resident.pop(name, None)
        if resident is None:
            return
        before = self.nbytes
        for path in resident.modules:
            self.layers[path].remove(resident.slot)
        mx.eval([array for path in resident.modules for array in self.layers[path].arrays])
        self._changed(before)

    def in_use(self) -> set[int]:
        """The slots running requests and engine jobs use now."""
        busy = set(self.busy_slots()) if self.busy_slots is not None else set()
        return busy | {slot for slot, holders in self.held.items() if holders}

    def unload(self, name: str) -> bool:
        """Remove ``name`` unless a request or job uses it now; whether it is gone."""
        slot = self.slot(name)
        if slot is not None and slot in self.in_use():
            return False
        self.remove(name)
        return True

    def _changed(self, before: int) -> None:
        self._steps.clear()  # the layers' tables changed
        if self.on_change is not None:
            self.on_change(self.nbytes - before)

    def active(self) -> StepRows | None:
        """The rows of the pass being built, or None when no row uses an adapter."""
        if self._override:
            return self._current
        if self.batch_slots is None:
            return None
        slots = tuple(self.batch_slots())
        if not any(slots):
            return None
        scales = tuple(self.batch_scales()) if self.batch_scales is not None else None
        if scales is not None and all(scale == 1.0 for scale in scales):
            scales = None
        rows = self._steps.get((slots, scales))
        if rows is None:
            if len(self._steps) > 64:
                self._steps.clear()
            rows = self._steps[slots, scales] = StepRows(slots, scales)
        return rows

    @contextmanager
    def rows(self, slots: Sequence[int], scales: Sequence[float] | None = None) -> Iterator[None]:
        """While a forward pass over rows using ``slots`` (one per row; 0: none) is built, each
        row's update times its ``scales`` entry (None: every update as its file has it)."""
        previous = self._override, self._current
        self._override = True
        self._current = StepRows(tuple(slots), tuple(scales) if scales is not None else None) if any(slots) else None
        try:
            yield
        finally:
            self._override, self._current = previous


def load_adapter(
    loaded: Any, name: str, path: str | Path, registries: Registries | None = None
) -> int:
    """Read the adapter at ``path`` (:func:`read_for`) and make it resident in ``loaded`` as
    ``name`` (:func:`swap_in`); its slot. Nothing changes when it is refused."""
    return swap_in(loaded, name, read_for(loaded, path, registries))


def read_for(loaded: Any, path: str | Path, registries: Registries | None = None) -> AdapterCheckpoint:
    """The adapter at ``path`` for ``loaded`` (a LoadedModel served with adapters), read through
    ``registries``' formats, else the model's own reader: host arrays, so any thread may read it."""
    from mlxr_core.model.paths import resolve_model_path

    adapters = served_adapters(loaded)
    where = resolve_model_path(str(path))
    if registries is not None:
        return read_adapter(where, registries, loaded.config)
    if adapters.read is not None:
        return adapters.read(where)
    raise ConfigError(f"model {loaded.name}: no format reads its adapters", field="models[].adapters")


def swap_in(loaded: Any, name: str, checkpoint: AdapterCheckpoint) -> int:
    """Fit ``checkpoint`` to ``loaded`` and stack it into a free slot as ``name`` (on the engine
    thread: the cheap part of a load); its slot. Nothing changes when it is refused."""
    from mlxr_core.model.loader import DTYPES

    adapters = served_adapters(loaded)
    updates = fit_adapter(loaded.model, loaded.arch, checkpoint, DTYPES[loaded.dtype], adapters.modules)
    return adapters.add(name, updates)


def served_adapters(loaded: Any) -> AdapterSet:
    """``loaded``'s adapters; ConfigError for a model served without any."""
    adapters: AdapterSet | None = loaded.adapters
    if adapters is None:
        raise ConfigError(
            f"model {loaded.name} serves no adapters (models[].adapters)", field="models[].adapters"
        )
    return adapters
