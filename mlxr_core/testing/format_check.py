"""The conformance check of a checkpoint format plugin (see :func:`check_format`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxr_core.model.checkpoint import Checkpoint

if TYPE_CHECKING:
    from mlxr_core.model.checkpoint import Format
    from mlxr_core.model.stages import OpenCheckpoint
    from mlxr_core.plugins import Registries

#: ASCII text every byte-level or SentencePiece vocabulary encodes and decodes back unchanged.
ROUND_TRIP_TEXT = "the water is here"


def check_format(
    fmt: Format | str,
    path: str | Path,
    *,
    registries: Registries | None = None,
) -> Checkpoint:
    """Raise AssertionError naming the first broken property of a format on the model at ``path``.

    ``fmt`` is the format object or its registered name. The check: ``detect`` accepts ``path``
    and refuses (without raising) a missing path, an empty folder and a text file; ``load`` gives a
    :class:`Checkpoint` with a ``model_type``, finite float weights and consistent quantization;
    its tokenizer kind is registered, builds, and encodes then decodes text unchanged; when an
    architecture of its ``model_type`` is registered, the weights load strictly into that graph
    and give finite logits. A format with a ``save(checkpoint, path)`` method is also round-tripped:
    what it writes is detected and loads back to the same weights. Returns the checkpoint.
    """
    import mlx.core as mx

    from mlxr_core.model.stages import open_checkpoint
    from mlxr_core.plugins import load_plugins

    registries = registries if registries is not None else load_plugins().registries
    if isinstance(fmt, str):
        name = fmt
        found: Format = registries.formats.get(name)
        assert found.name == name, f"format registered as {name!r} calls itself {found.name!r}"
        fmt = found
    assert isinstance(fmt.name, str) and fmt.name, f"format name {fmt.name!r}"
    path = Path(path)

    assert fmt.detect(path), f"{fmt.name}: detect() refuses {path}"
    with tempfile.TemporaryDirectory(prefix="mlxr-format-check-") as scratch:
        text = Path(scratch) / "notes.txt"
        text.write_text("not a model\n")
        (Path(scratch) / "empty").mkdir()
        for other in (Path(scratch) / "missing", Path(scratch) / "empty", text):
            assert not fmt.detect(other), f"{fmt.name}: detect() accepts {other.name}"

        opened = open_checkpoint(path, registries, format=fmt, dtype="float32", mmproj="none")
        checkpoint = opened.checkpoint
        _check_checkpoint(fmt.name, checkpoint)
        _check_tokenizer(fmt.name, checkpoint, registries)
        if checkpoint.config["model_type"] in registries.archs:
            _check_builds(opened, registries)

        save = getattr(fmt, "save", None)
        if callable(save):
            copy = Path(scratch) / "copy"
            save(checkpoint, copy)
            assert fmt.detect(copy), f"{fmt.name}: detect() refuses what save() wrote"
            again = fmt.load(copy, dtype="float32")
            assert set(again.weights) == set(checkpoint.weights), f"{fmt.name}: save/load lost tensors"
            for key, value in checkpoint.weights.items():
                assert mx.array_equal(again.weights[key], value).item(), (
                    f"{fmt.name}: tensor {key} differs after save/load"
                )
            assert again.config["model_type"] == checkpoint.config["model_type"]
    return checkpoint


def _check_checkpoint(name: str, checkpoint: Any) -> None:
    import mlx.core as mx

    assert isinstance(checkpoint, Checkpoint), f"{name}: load() returned {type(checkpoint).__name__}"
    assert checkpoint.format == name, f"{name}: checkpoint.format is {checkpoint.format!r}"
    assert isinstance(checkpoint.config, dict), f"{name}: config is not a dict"
    assert isinstance(checkpoint.config.get("model_type"), str), f"{name}: config has no model_type"
    assert checkpoint.weights, f"{name}: no weights"
    for key, value in checkpoint.weights.items():
        assert isinstance(value, mx.array), f"{name}: weight {key} is {type(value).__name__}"
        if mx.issubdtype(value.dtype, mx.floating):
            assert mx.all(mx.isfinite(value)).item(), f"{name}: weight {key} is not finite"
    for module, spec in checkpoint.quantization.items():
        for part in ("weight", "scales"):
            assert f"{module}.{part}" in checkpoint.weights, (
                f"{name}: {module} is quantized ({spec.bits}-bit) but has no {part}"
            )


def _check_tokenizer(name: str, checkpoint: Checkpoint, registries: Registries) -> None:
    spec = checkpoint.tokenizer
    assert spec is not None, f"{name}: the checkpoint carries no tokenizer spec"
    assert spec.kind in registries.tokenizers, (
        f"{name}: tokenizer kind {spec.kind!r} is not registered "
        f"(registered: {', '.join(registries.tokenizers.names())})"
    )
    tokenizer = registries.tokenizers.get(spec.kind).build(
        spec.data, chat_template=checkpoint.chat_template
    )
    ids = tokenizer.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    assert ids and all(0 <= i < tokenizer.vocab_size for i in ids), f"{name}: encoded ids {ids}"
    decoded = tokenizer.decode(ids)
    assert decoded.strip() == ROUND_TRIP_TEXT, f"{name}: decode(encode(text)) gave {decoded!r}"
    assert all(0 <= i < tokenizer.vocab_size for i in tokenizer.eos_token_ids), (
        f"{name}: eos ids {sorted(tokenizer.eos_token_ids)} outside the vocabulary"
    )


def _check_builds(opened: OpenCheckpoint, registries: Registries) -> None:
    import mlx.core as mx

    from mlxr_core.model.loader import build_model
    from mlxr_core.model.stages import plan

    reference = {"attention": "reference", "rms_norm": "reference", "rope": "reference"}
    planned = plan(opened, registries, kernels=reference)
    model = build_model(planned.checkpoint, planned.arch, planned.kernels, "keep", "float32")
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.ndim == 3 and logits.shape[:2] == (1, 3), f"logits shape {logits.shape}"
    assert mx.all(mx.isfinite(logits)).item(), "the loaded model gives non-finite logits"
