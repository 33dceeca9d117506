"""A tiny Whisper folder written by transformers, for tests: ``WhisperForConditionalGeneration``
with O(1) random weights (tiny widths, a window of ``chunk_length`` seconds), the
``WhisperFeatureExtractor``'s ``preprocessor_config.json``, a ``generation_config.json`` with
Whisper's special tokens and a byte-level BPE ``tokenizer.json`` laid out as Whisper's vocabulary
is: the 256 bytes, ``<|endoftext|>``, ``<|startoftranscript|>``, the languages, the tasks,
``<|startoflm|>``, ``<|startofprev|>``, ``<|nospeech|>``, ``<|notimestamps|>``, then a timestamp
token every 0.02 s of the window. transformers and torch are imported only here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxr_core.testing.tiny import gpt2_byte_symbols

LANGUAGES = ("en", "de", "fr")
SHAPE = {
    "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_mel_bins": 80,
}  # fmt: skip


def special_tokens(chunk_length: int) -> list[str]:
    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(round(chunk_length / 0.02) + 1)]
    return [
        "<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>",
        "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>", *stamps,
    ]  # fmt: skip


def write_tokenizer(folder: Path, chunk_length: int) -> dict[str, int]:
    """The byte-level ``tokenizer.json``; returns the special tokens' ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {symbol: i for i, symbol in enumerate(gpt2_byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab, [], ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    names = special_tokens(chunk_length)
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return {name: len(vocab) + i for i, name in enumerate(names)}


def tiny_whisper(folder: Path, *, chunk_length: int = 2, seed: int = 0, **shape: Any) -> Any:
    """Write the folder and return the transformers model (float32, eval)."""
    import torch
    import transformers

    from mlxr_core.testing.hf_reference import o1_init

    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, chunk_length)
    frames = chunk_length * 100
    config = transformers.WhisperConfig(
        **{**SHAPE, **shape}, vocab_size=len(ids) + 256, max_source_positions=frames // 2, max_target_positions=64,
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"], suppress_tokens=[],
        begin_suppress_tokens=[ids["<|endoftext|>"]], attn_implementation="eager",
    )  # type: ignore[call-arg]  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(config).eval()
    o1_init(model, torch)
    generation = model.generation_config
    generation.lang_to_id = {f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES}
    generation.task_to_id = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
    generation.no_timestamps_token_id = ids["<|notimestamps|>"]
    generation.prev_sot_token_id = ids["<|startofprev|>"]
    generation.is_multilingual = True
    generation.max_initial_timestamp_index = 25
    generation.suppress_tokens = [ids["<|startoflm|>"]]
    generation.begin_suppress_tokens = [ids["<|endoftext|>"]]
    generation.forced_decoder_ids = None
    model.save_pretrained(folder)
    transformers.WhisperFeatureExtractor(chunk_length=chunk_length).save_pretrained(folder)
    return model
