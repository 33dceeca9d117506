"""``mlxr demo-vision OUT``: write a tiny Gemma 3 vision model with random weights, from numpy alone.

A way to try images on a fresh machine without downloading a model and without torch: OUT is a
Hugging Face folder in the layout transformers writes for ``Gemma3ForConditionalGeneration``
(``config.json``, ``model.safetensors``, a word-level ``tokenizer.json`` with a chat template that
marks each image). Its weights are seeded random numbers, so its answers are random words
(``t17 t40 ...``): it shows the path an image takes (decoding, the SigLIP tower, the projector,
the image tokens in the prompt, the batch), not an understanding of the picture.

The sizes: a 32x32-pixel SigLIP tower of 8x8 patches (2 layers), pooled to 4 tokens per image; a
3-layer text model of width 64 over 512 words. Any picture is resized to 32x32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from mlxr_core.cli.commands import Subparsers
from mlxr_core.errors import MlxrError

VOCAB = 512
#: The image marker, its start and end: ids 3-5, special tokens of the tokenizer (6 and 7 begin and
#: end a turn).
IMAGE, BEGIN, END = 3, 4, 5
IMAGE_TOKENS = {IMAGE: "<image_soft_token>", BEGIN: "<start_of_image>", END: "<end_of_image>"}
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "max_position_embeddings": 2048,
    "query_pre_attn_scalar": 16,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "model_type": "gemma3_text",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}
VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": 32,
    "patch_size": 8,
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
    "vision_use_head": False,
}
#: Gemma 3's way of writing a conversation, an image part as its start marker (the server puts the
#: image's tokens after it).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def add_parser(subparsers: Subparsers) -> None:
    """Add the ``demo-vision`` command to the ``mlxr`` command line."""
    parser = subparsers.add_parser(
        "demo-vision",
        help="write a tiny random Gemma 3 vision model (no download, no torch) to try images",
        description=(
            "Write OUT: a tiny Gemma 3 vision model with seeded random weights, in the Hugging Face "
            "layout, to serve with `MLXR_MODEL=OUT mlxr serve`. Its answers are random words."
        ),
    )
    parser.add_argument("out", metavar="OUT", help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Write the model; print where it is and how to serve it."""
    folder = write_demo_vision(args.out, seed=args.seed)
    print(f"wrote {folder} (random weights; answers are random words)")
    print(f"serve it: MLXR_MODEL={folder} mlxr serve")
    return 0


def write_demo_vision(out: str | Path, *, seed: int = 0) -> Path:
    """Write the model to the folder ``out`` (which appears only once complete); return it."""
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise MlxrError(f"{target} exists and is not an empty folder; choose a new one")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.partial"
    staging.mkdir()
    try:
        _write(staging, seed)
        if target.is_dir():
            target.rmdir()
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def config() -> dict[str, Any]:
    """The folder's ``config.json``."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": TEXT,
        "vision_config": VISION,
        "mm_tokens_per_image": 4,
        "image_token_index": IMAGE,
        "boi_token_index": BEGIN,
        "eoi_token_index": END,
        "tie_word_embeddings": False,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the model under transformers' names: matrices and embeddings drawn from
    N(0, 0.15^2), norm scales and biases near their neutral values."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.15) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    width, inner, heads, kv_heads, head = (int(TEXT[k]) for k in (  # type: ignore[call-overload]
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"))  # fmt: skip
    out: dict[str, np.ndarray] = {"language_model.model.embed_tokens.weight": normal(VOCAB, width, std=1.0)}
    for i in range(int(TEXT["num_hidden_layers"])):  # type: ignore[call-overload]
        layer = f"language_model.model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            out[f"{layer}{norm}.weight"] = normal(width, std=0.1)  # Gemma scales by 1 + w
        out[f"{layer}self_attn.q_proj.weight"] = normal(heads * head, width)
        out[f"{layer}self_attn.k_proj.weight"] = normal(kv_heads * head, width)
        out[f"{layer}self_attn.v_proj.weight"] = normal(kv_heads * head, width)
        out[f"{layer}self_attn.o_proj.weight"] = normal(width, heads * head)
        out[f"{layer}self_attn.q_norm.weight"] = normal(head, std=0.1)
        out[f"{layer}self_attn.k_norm.weight"] = normal(head, std=0.1)
        out[f"{layer}mlp.gate_proj.weight"] = normal(inner, width)
        out[f"{layer}mlp.up_proj.weight"] = normal(inner, width)
        out[f"{layer}mlp.down_proj.weight"] = normal(width, inner)
    out["language_model.model.norm.weight"] = normal(width, std=0.1)
    # An output matrix of its own: tied to random embeddings, the model repeats its last token.
    out["language_model.lm_head.weight"] = normal(VOCAB, width, std=1.0)

    vwidth, vinner, patch, size = (int(VISION[k])  # type: ignore[call-overload]
                                   for k in ("hidden_size", "intermediate_size", "patch_size", "image_size"))
    tower = "vision_tower.vision_model."
    out[f"{tower}embeddings.patch_embedding.weight"] = normal(vwidth, 3, patch, patch)
    out[f"{tower}embeddings.patch_embedding.bias"] = normal(vwidth)
    out[f"{tower}embeddings.position_embedding.weight"] = normal((size // patch) ** 2, vwidth)
    for i in range(int(VISION["num_hidden_layers"])):  # type: ignore[call-overload]
        layer = f"{tower}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            out[f"{layer}{norm}.weight"] = 1.0 + normal(vwidth, std=0.1)
            out[f"{layer}{norm}.bias"] = normal(vwidth)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{layer}self_attn.{proj}.weight"] = normal(vwidth, vwidth)
            out[f"{layer}self_attn.{proj}.bias"] = normal(vwidth)
        out[f"{layer}mlp.fc1.weight"] = normal(vinner, vwidth)
        out[f"{layer}mlp.fc1.bias"] = normal(vinner)
        out[f"{layer}mlp.fc2.weight"] = normal(vwidth, vinner)
        out[f"{layer}mlp.fc2.bias"] = normal(vwidth)
    out[f"{tower}post_layernorm.weight"] = 1.0 + normal(vwidth, std=0.1)
    out[f"{tower}post_layernorm.bias"] = normal(vwidth)
    out["multi_modal_projector.mm_input_projection_weight"] = normal(vwidth, width, std=0.2)
    out["multi_modal_projector.mm_soft_emb_norm.weight"] = normal(vwidth, std=0.1)
    return out


def _write(folder: Path, seed: int) -> None:
    from safetensors.numpy import save_file
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    save_file(weights(seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config(), indent=2) + "\n", encoding="utf-8")
    names = {0: "<bos>", 1: "<eos>", 2: "<pad>", **IMAGE_TOKENS, 6: "<start_of_turn>", 7: "<end_of_turn>"}
    vocab = {**{name: i for i, name in names.items()}, **{f"t{i}": i for i in range(len(names), VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in names.values()])
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    (folder / "README.md").write_text(
        "A tiny Gemma 3 vision model with seeded random weights, written by `mlxr demo-vision` "
        f"(seed {seed}). Its answers are random words: it exercises the image path, nothing more.\n",
        encoding="utf-8",
    )
