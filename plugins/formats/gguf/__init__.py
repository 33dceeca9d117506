"""The GGUF format: llama.cpp's single-file checkpoints, with their embedded tokenizer.

Importing this module is cheap (neither MLX nor the ``gguf`` package): the format and tokenizer
backend are registered as ``"module:attr"`` strings and imported when a model loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxr_core.plugin_api import hookimpl

if TYPE_CHECKING:
    from mlxr_core.plugin_api import RegisterName


@hookimpl
def mlxr_register_formats(register: RegisterName) -> None:
    """Register the ``gguf`` checkpoint format."""
    register("gguf", "mlxr_plugins.formats.gguf.checkpoint:GGUFFormat")


@hookimpl
def mlxr_register_tokenizers(register: RegisterName) -> None:
    """Register the tokenizer built from a GGUF file's ``tokenizer.ggml.*`` metadata."""
    register("gguf", "mlxr_plugins.formats.gguf.tokenizer:GGUFTokenizerBackend")
