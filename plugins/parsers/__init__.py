"""Built-in tool-call and reasoning parsers.

Tool formats: ``hermes`` (``<tool_call>{...}</tool_call>``: Hermes, Qwen 2.5/3, and SmolLM2's
``<tool_call>[...]</tool_call>`` list form), ``llama3_json`` (Llama 3.x ``{"name", "parameters"}``,
optionally after ``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS][{...}]``) and ``pythonic``
(``[get_weather(city="Paris")]``, Gemma 3's documented format), ``lfm`` (the same calls between
``<|tool_call_start|>`` and ``<|tool_call_end|>``: LFM2, LFM2.5, LFM3), ``gemma4``
(``<|tool_call>call:f{...}<tool_call|>``). Reasoning: ``think`` (``<think>...</think>``),
``gemma4`` (``<|channel>thought ... <channel|>``). Both: ``harmony`` (gpt-oss's channels:
reasoning, answer and calls in one markup). See :mod:`mlxr_core.chat.parsing` for the contracts and
how ``auto`` chooses.
"""

from __future__ import annotations

from mlxr_core.plugin_api import RegisterName, hookimpl

TOOLS = "mlxr_plugins.parsers.tools"
HARMONY = "mlxr_plugins.parsers.harmony:HarmonyParser"


@hookimpl
def mlxr_register_tool_parsers(register: RegisterName) -> None:
    register("hermes", f"{TOOLS}:HermesParser")
    register("llama3_json", f"{TOOLS}:Llama3JsonParser")
    register("mistral", f"{TOOLS}:MistralParser")
    register("pythonic", f"{TOOLS}:PythonicParser")
    register("lfm", f"{TOOLS}:LfmParser")
    register("gemma4", "mlxr_plugins.parsers.gemma4:Gemma4ToolParser")
    register("harmony", HARMONY)


@hookimpl
def mlxr_register_reasoning_parsers(register: RegisterName) -> None:
    register("think", "mlxr_plugins.parsers.reasoning:ThinkParser")
    register("gemma4", "mlxr_plugins.parsers.gemma4:Gemma4ThinkingParser")
    register("harmony", HARMONY)
