"""Built-in model architectures, one module per ``model_type`` family.

Importing this module is cheap: architectures are registered as ``"module:attr"`` strings and
their MLX graphs are imported only when a model of that type loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxr_core.plugin_api import hookimpl

if TYPE_CHECKING:
    from mlxr_core.plugin_api import RegisterName

#: model_type -> implementation. Mistral (with or without a sliding window) and Ministral (a window in
#: some layers) are the Llama graph.
ARCHITECTURES = {
    "llama": "mlxr_plugins.archs.llama:LlamaArchitecture",
    "mistral": "mlxr_plugins.archs.llama:LlamaArchitecture",
    "ministral": "mlxr_plugins.archs.llama:MinistralArchitecture",
    "qwen2": "mlxr_plugins.archs.qwen2:Qwen2Architecture",
    "qwen2_5_vl": "mlxr_plugins.archs.qwen2_5_vl:Qwen25VLArchitecture",
    "qwen3": "mlxr_plugins.archs.qwen3:Qwen3Architecture",
    "qwen3_vl": "mlxr_plugins.archs.qwen3_vl:Qwen3VLArchitecture",
    "idefics3": "mlxr_plugins.archs.idefics3:Idefics3Architecture",
    "smolvlm": "mlxr_plugins.archs.idefics3:Idefics3Architecture",
    "gemma3": "mlxr_plugins.archs.gemma3:Gemma3Architecture",
    "gemma3_text": "mlxr_plugins.archs.gemma3:Gemma3Architecture",
    "phi3": "mlxr_plugins.archs.phi3:Phi3Architecture",
    "qwen3_moe": "mlxr_plugins.archs.qwen3_moe:Qwen3MoeArchitecture",
    "qwen2_moe": "mlxr_plugins.archs.qwen2_moe:Qwen2MoeArchitecture",
    "mixtral": "mlxr_plugins.archs.mixtral:MixtralArchitecture",
    "cohere2_moe": "mlxr_plugins.archs.cohere2_moe:Cohere2MoeArchitecture",
    "gpt_oss": "mlxr_plugins.archs.gpt_oss:GptOssArchitecture",
    "gemma4": "mlxr_plugins.archs.gemma4:Gemma4Architecture",
    "gemma4_text": "mlxr_plugins.archs.gemma4:Gemma4Architecture",
    "gemma3n": "mlxr_plugins.archs.gemma3n:Gemma3nArchitecture",
    "gemma3n_text": "mlxr_plugins.archs.gemma3n:Gemma3nArchitecture",
    "qwen3_next": "mlxr_plugins.archs.qwen3_next:Qwen3NextArchitecture",
    "qwen3_5": "mlxr_plugins.archs.qwen3_5:Qwen35Architecture",
    "qwen3_5_text": "mlxr_plugins.archs.qwen3_5:Qwen35Architecture",
    "qwen3_5_moe": "mlxr_plugins.archs.qwen3_5:Qwen35MoeArchitecture",
    "qwen3_5_moe_text": "mlxr_plugins.archs.qwen3_5:Qwen35MoeArchitecture",
    "qwen4_exp": "mlxr_plugins.archs.qwen4_exp:Qwen4ExpArchitecture",
    "qwen4_exp_text": "mlxr_plugins.archs.qwen4_exp:Qwen4ExpArchitecture",
    "deepseek_v3": "mlxr_plugins.archs.deepseek_v3:DeepseekV3Architecture",
    "deepseek_v32": "mlxr_plugins.archs.deepseek_v32:DeepseekV32Architecture",
    "kimi_linear": "mlxr_plugins.archs.kimi_linear:KimiLinearArchitecture",
    "glm5_next": "mlxr_plugins.archs.glm5_next:Glm5NextArchitecture",
    "glm5_next_text": "mlxr_plugins.archs.glm5_next:Glm5NextArchitecture",
    "deepseek_v4": "mlxr_plugins.archs.deepseek_v4:DeepseekV4Architecture",
    "mistral4": "mlxr_plugins.archs.mistral4:Mistral4Architecture",
    "mistral3": "mlxr_plugins.archs.mistral3:Mistral3Architecture",
    "whisper": "mlxr_plugins.archs.whisper:WhisperArchitecture",
    "lfm2": "mlxr_plugins.archs.lfm2:Lfm2Architecture",
    "lfm2_moe": "mlxr_plugins.archs.lfm2_moe:Lfm2MoeArchitecture",
    "lfm3": "mlxr_plugins.archs.lfm3:Lfm3Architecture",
    "nemotron_h": "mlxr_plugins.archs.nemotron_h:NemotronHArchitecture",
    # llama.cpp's names for the same families, as GGUF files carry them.
    "qwen3moe": "mlxr_plugins.archs.qwen3_moe:Qwen3MoeArchitecture",
    "qwen2moe": "mlxr_plugins.archs.qwen2_moe:Qwen2MoeArchitecture",
}


@hookimpl
def mlxr_register_archs(register: RegisterName) -> None:
    """Register the built-in architectures."""
    for model_type, target in ARCHITECTURES.items():
        register(model_type, target)
