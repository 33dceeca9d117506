"""A tiny random Llama and LoRA adapters for it made by PEFT, for tests of adapters served
unmerged (:mod:`mlxr_core.model.lora`) against PEFT merging them. torch, transformers and peft
are imported only when called: a test module skips where they are not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

SHAPE: dict[str, Any] = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip
#: Three adapters of different ranks, alphas and target modules (one rsLoRA, one with a per-module
#: rank and alpha), as ``peft.LoraConfig`` settings.
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=16, use_rslora=True,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp": dict(r=2, lora_alpha=4, rank_pattern={"down_proj": 6}, alpha_pattern={"down_proj": 3},
                target_modules=["down_proj", "up_proj", "o_proj"]),
}  # fmt: skip


@attrs.define
class LoraReference:
    """The base folder, each adapter's PEFT folder (``root / name``), and per adapter (None: the
    base) PEFT's merged model's logits for each of ``prompts``."""

    root: Path
    prompts: list[list[int]]
    logits: dict[str | None, list[np.ndarray]]

    @property
    def base(self) -> Path:
        return self.root / "base"

    def merged(self, name: str | None, scale: float = 1.0) -> Any:
        """transformers' model with adapter ``name`` merged by PEFT (the base for None), its
        update times ``scale`` (PEFT's ``LoraLayer.scale_layer``)."""
        import peft
        import transformers

        base = transformers.LlamaForCausalLM.from_pretrained(self.base).eval()
        if name is None:
            return base
        wrapped = peft.PeftModel.from_pretrained(base, self.root / name)
        for module in wrapped.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.scale_layer(scale)
        return wrapped.merge_and_unload()


def lora_reference(
    root: Path, prompts: list[list[int]], adapters: dict[str, dict[str, Any]] = ADAPTERS
) -> LoraReference:
    """Save a tiny Llama (float32, O(1) random weights) under ``root / "base"`` and each adapter
    of ``adapters`` made by PEFT (its A and B drawn O(1): PEFT's own B starts at zero) under
    ``root / name``; record the logits of each merged."""
    import peft
    import torch
    import transformers

    from mlxr_core.testing.hf_reference import o1_init, write_tokenizer

    torch.manual_seed(0)
    config_class: Any = transformers.LlamaConfig  # typed for transformers 5 keywords it takes
    config = config_class(**SHAPE, attn_implementation="eager")
    base = transformers.LlamaForCausalLM(config).eval()
    o1_init(base, torch)
    base.save_pretrained(root / "base")
    write_tokenizer(root / "base", SHAPE["vocab_size"])
    with torch.no_grad():
        logits: dict[str | None, list[np.ndarray]] = {
            None: [base(torch.tensor([p])).logits[0].numpy() for p in prompts]
        }
    for name, settings in adapters.items():
        wrapped = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **settings))
        with torch.no_grad():
            for key, parameter in wrapped.named_parameters():
                if "lora_" in key:
                    parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
        wrapped.save_pretrained(str(root / name))
        merged = wrapped.merge_and_unload()  # merges into base's modules: the base is read again
        with torch.no_grad():
            logits[name] = [merged(torch.tensor([p])).logits[0].numpy() for p in prompts]
        base = transformers.LlamaForCausalLM.from_pretrained(root / "base").eval()
    return LoraReference(root, prompts, logits)
