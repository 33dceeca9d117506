"""The architecture contract: turn a :class:`Checkpoint` config into an MLX module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

    from mlxr_core.kernels import KernelSet


class Architecture(Protocol):
    """One ``model_type`` (or a family), registered through ``mlxr_register_archs``.

    The built module is called as ``model(inputs, cache=cache)`` with ``inputs`` of shape ``[B, L]``
    (int32 token ids) and returns logits of shape ``[B, L, vocab]``; ``cache`` is the list
    :meth:`make_cache` returned, one entry per layer, advanced in place. :meth:`hidden_states` runs
    the same graph without its LM head (embeddings are pooled from it).

    Two optional capabilities of the built module, used where present: submodules with a
    ``fuse_projections()`` method join layers that read the same input after loading
    (:mod:`mlxr_core.model.fuse`), and a module with ``embed`` / ``final_norm`` / ``lm_logits`` and
    layers with ``attention_inputs`` / ``attention`` / ``after_attention`` decodes through a
    compiled step (:mod:`mlxr_core.model.compiled`). The built-in graphs offer both; the
    conformance check covers both. A multimodal family adds its vision side through
    :class:`mlxr_core.model.vision.ProvidesVision`.
    """

    def build(self, config: dict[str, Any], kernels: KernelSet) -> nn.Module:
        """Build the module from a tolerant config dict (unknown keys ignored)."""
        ...

    def sanitize(self, weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
        """Drop or reshape checkpoint tensors the module does not hold (e.g. rotary inv_freq)."""
        ...

    def make_cache(self, model: nn.Module) -> list[Any]:
        """Fresh per-layer KV caches for one sequence."""
        ...

    def context_length(self, config: dict[str, Any]) -> int:
        """Maximum positions the model supports (``max_position_embeddings``)."""
        ...

    def kernel_context(self, config: dict[str, Any]) -> dict[str, Any]:
        """Shape facts kernels need to decide support: head_dim, n_heads, n_kv_heads, masks."""
        ...

    def hidden_states(
        self, model: nn.Module, inputs: mx.array, cache: list[Any] | None = None
    ) -> mx.array:
        """The final hidden states, ``[B, L, hidden_size]``: after the last norm, before the LM head
        (and any logit soft-capping), under a causal mask, advancing ``cache`` like a forward pass.

        Positions attend only to earlier ones, so right-padding a row does not change its first
        positions' states; chunks fed through one cache give what one pass over the whole gives.
        """
        ...


@runtime_checkable
class DefaultChatTemplate(Protocol):
    """An optional capability of an :class:`Architecture`: the chat format of its model family,
    for checkpoints that carry no template (a GGUF converted without one). The loader uses it
    only when the checkpoint has none; the checkpoint's own template always wins."""

    def default_chat_template(self, config: dict[str, Any]) -> str | None:
        """A Jinja2 chat template (Hugging Face conventions), or None when there is none."""
        ...


@runtime_checkable
class RenamesModules(Protocol):
    """An optional capability of an :class:`Architecture` whose ``sanitize`` renames or splits
    modules a checkpoint may hold packed: ``Checkpoint.quantization`` names modules as the
    checkpoint does, and the loader moves each one's packing (and source type) to the modules
    ``sanitize`` makes of it."""

    def sanitized_modules(self, module: str) -> list[str]:
        """The module paths ``sanitize`` makes of checkpoint module ``module`` (``[module]`` when
        it keeps the name)."""
        ...


class ArchitectureFallback(Protocol):
    """A provider of architectures for model types no architecture plugin registers, through
    ``mlxr_register_arch_fallbacks`` (the mlx-lm bridge). The loader asks it only after every
    registered architecture name missed, so native architectures always win."""

    def resolve(self, config: dict[str, Any]) -> tuple[Architecture, str]:
        """The architecture serving ``config["model_type"]`` and a one-line note on the path it
        takes (what builds the graph, what of mlxr does not apply), for the startup log and
        ``mlxr info``. Raises :class:`~mlxr_core.errors.ArchitectureUnavailable` saying why when
        this fallback has no such model type or cannot run at all (a library not installed)."""
        ...


@runtime_checkable
class ChecksLoadedModel(Protocol):
    """An optional capability of an :class:`Architecture`: a check of the built module with its
    weights loaded, run once by the loader before the model serves (the mlx-lm bridge checks that
    a row of a left-padded batch decodes as it does alone, which a graph it did not write might
    not do)."""

    def check_loaded(self, model: nn.Module) -> None:
        """Raise :class:`~mlxr_core.errors.ModelLoadError` saying why ``model`` cannot serve."""
        ...


@runtime_checkable
class KeepsTablesStored(Protocol):
    """An optional capability of an :class:`Architecture`: large tables the model reads a few rows
    of per token (Qwen4-Exp's n-gram embeddings, tens of GiB), kept out of its parameters. The
    loader leaves the tensors :meth:`stored_table` accepts in the checkpoint's files where the
    format can (:class:`~mlxr_core.model.checkpoint.LeavesTensors`), so they are never read whole,
    and hands them to :meth:`attach_tables` once the other weights are loaded: their places
    (memory-mapped there) or, from a format that read them, the arrays. Not being parameters, they
    are not counted as the model's resident weights (:attr:`LoadedModel.nbytes`)."""

    def stored_table(self, config: dict[str, Any], name: str) -> bool:
        """Whether the checkpoint tensor ``name`` (the file's name) is part of such a table."""
        ...

    def attach_tables(
        self, model: nn.Module, config: dict[str, Any], parts: dict[str, Any], dtype: mx.Dtype
    ) -> None:
        """Give ``model`` its tables from ``parts`` (checkpoint name -> a
        :class:`~mlxr_core.model.checkpoint.StoredPart` or an ``mx.array``), rows read as ``dtype``.
        Raises :class:`~mlxr_core.errors.ModelLoadError` naming a tensor that does not fit."""
        ...
