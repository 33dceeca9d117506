"""Hugging Face folders: ``config.json`` + safetensors weights + tokenizer files.

The same format reads what mlx-lm writes (an MLX-quantized folder is a safetensors folder whose
``config.json`` carries a ``quantization`` block), so one detector owns every safetensors folder
and no second format has to carve mlx-lm folders out of it.

Tokenizer backends for the files such folders ship are registered here too: ``hf``
(``tokenizer.json``), ``sentencepiece`` (``tokenizer.model``) and ``tiktoken`` (BPE rank files).

Importing this module is cheap (no MLX, no tokenizer library): everything is registered as
``"module:attr"`` strings and imported when a model loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxr_core.plugin_api import hookimpl

if TYPE_CHECKING:
    from mlxr_core.plugin_api import RegisterName

PACKAGE = "mlxr_plugins.formats.safetensors"

#: tokenizer kind -> backend; the kind is chosen from the files a folder ships.
TOKENIZER_BACKENDS = {
    "hf": f"{PACKAGE}.hf_tokenizer:HFTokenizerBackend",
    "sentencepiece": f"{PACKAGE}.sentencepiece_tokenizer:SentencePieceTokenizerBackend",
    "tiktoken": f"{PACKAGE}.tiktoken_tokenizer:TiktokenTokenizerBackend",
}


@hookimpl
def mlxr_register_formats(register: RegisterName) -> None:
    """Register the ``safetensors`` checkpoint format (Hugging Face and mlx-lm folders)."""
    register("safetensors", f"{PACKAGE}.checkpoint:SafetensorsFormat")


@hookimpl
def mlxr_register_tokenizers(register: RegisterName) -> None:
    """Register the ``hf``, ``sentencepiece`` and ``tiktoken`` tokenizer backends."""
    for kind, target in TOKENIZER_BACKENDS.items():
        register(kind, target)
