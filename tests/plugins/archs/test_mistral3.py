"""``mistral3`` folders (Mistral Small 3.x, and Mistral Small 4 as released) served as text, against
transformers' ``Mistral3ForConditionalGeneration`` on tiny random weights it writes: the text model
of ``text_config`` (``mistral``, ``mistral4``) compared on logits, cached decoding, a left-padded
batch and a prefix-cache hit; the vision tower is not loaded, and a text model with no native graph
is refused naming ``text_config.model_type``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.hf_reference import (
    Reference,
    check_reference,
    load_reference_model,
    o1_init,
    write_tokenizer,
)

VOCAB = 97
VISION = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "head_dim": 16, "image_size": 32, "patch_size": 8}  # fmt: skip
TEXT: dict[str, dict[str, Any]] = {
    "mistral": {"model_type": "mistral", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "max_position_embeddings": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    # Mistral Small 4's design: MLA with a query bottleneck, YaRN, grouped routing, a dense first layer
    "mistral4": {"model_type": "mistral4", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
                 "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12,
                 "v_head_dim": 10, "q_lora_rank": 24, "n_routed_experts": 8, "n_shared_experts": 1,
                 "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                 "routed_scaling_factor": 2.0, "max_position_embeddings": 256,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.8,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.5}},
}  # fmt: skip


def mistral3_reference(text: dict[str, Any], folder: Path, tie: bool) -> Reference:
    torch = pytest.importorskip("torch", reason="the reference needs torch (CPU)")
    transformers = pytest.importorskip("transformers", reason="the reference needs transformers")
    torch.manual_seed(0)
    config = transformers.Mistral3Config(
        text_config=text, vision_config=VISION, tie_word_embeddings=tie, attn_implementation="eager"
    )
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    o1_init(model, torch)
    model.save_pretrained(folder)
    write_tokenizer(folder, VOCAB)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (21, 14)]
    with torch.no_grad():
        logits = [model(torch.tensor([ids])).logits[0].float().numpy() for ids in prompts]
    return Reference(folder, prompts, logits, config.to_dict())


@pytest.fixture(scope="module")
def registries():
    return load_plugins().registries


@pytest.mark.parametrize(("text", "tie"), [("mistral", False), ("mistral", True), ("mistral4", False)])
def test_text_model_matches_transformers(text: str, tie: bool, registries, tmp_path: Path) -> None:
    reference = mistral3_reference(TEXT[text], tmp_path / "m", tie)
    check_reference(reference, registries)
    loaded = load_reference_model(reference, registries)
    assert loaded.vision is None  # the Pixtral tower is not loaded: images get a text model's 400
    assert type(loaded.arch).__name__ == "Mistral3Architecture"


def test_text_model_without_native_graph_is_refused_naming_the_key(registries, tmp_path: Path) -> None:
    reference = mistral3_reference(TEXT["mistral"], tmp_path / "m", False)
    config = json.loads((reference.folder / "config.json").read_text())
    config["text_config"]["model_type"] = "mistral_large4_text"
    (reference.folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"text_config\.model_type"):
        load_reference_model(reference, registries)
