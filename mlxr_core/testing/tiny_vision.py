"""A tiny random Gemma 3 vision model written by transformers (CPU, float32), for tests of the
vision side, the engine and the APIs: a 32x32-pixel SigLIP tower of 8x8 patches, 4 tokens per
image, and a word-level tokenizer whose ids 60, 61, 62 are ``<image_soft_token>``,
``<start_of_image>`` and ``<end_of_image>``, with a chat template that writes
``<start_of_image>`` for each image part of a message, as Gemma 3's does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB, IMAGE, BEGIN, END = 64, 60, 61, 62
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "sliding_window": 32,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 128,
    "query_pre_attn_scalar": 16,
}
VISION = {
    "hidden_size": 24,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 8,
    "vision_use_head": False,
}
#: Gemma 3's way of writing a message's parts (its template, trimmed to what the tests send).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}{% endfor %}{% endif %}{% endfor %}"
)


def gemma3_vision_model(folder: Path, torch: Any, transformers: Any) -> Any:
    """Write the tiny model and its tokenizer to ``folder``; returns transformers' model (eval)."""
    from mlxr_core.testing.hf_reference import o1_init, write_tokenizer

    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=TEXT,
        vision_config=VISION,
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=BEGIN,
        eoi_token_index=END,
        attn_implementation="eager",
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    o1_init(model, torch)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    _add_image_tokens(folder)
    return model


def _add_image_tokens(folder: Path) -> None:
    """Ids 60-62 become Gemma's image tokens (special, so a template's markup splits off them)."""
    from tokenizers import AddedToken, Tokenizer

    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    names = {IMAGE: "<image_soft_token>", BEGIN: "<start_of_image>", END: "<end_of_image>"}
    for token_id, name in names.items():
        del vocab[f"t{token_id}"]
        vocab[name] = token_id
    path.write_text(json.dumps(data), encoding="utf-8")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in names.values()])
    tokenizer.save(str(path))
    settings_path = folder / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text(encoding="utf-8"))
    settings["chat_template"] = CHAT_TEMPLATE
    settings_path.write_text(json.dumps(settings), encoding="utf-8")
