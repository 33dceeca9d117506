"""A Jinja chat template that renders Harmony, gpt-oss's prompt format, as ``openai_harmony``
renders a conversation: the system message (identity, knowledge cutoff, date, reasoning effort,
channels), the instructions and the client's functions as a TypeScript namespace in a developer
message, earlier calls as ``commentary`` messages ``to=functions.NAME``, and tool results from
``functions.NAME to=assistant``.

:data:`HARMONY_CHAT_TEMPLATE` is the default for a gpt-oss checkpoint that carries no template.
Variables beyond ``messages``, ``tools`` and ``add_generation_prompt``: ``reasoning_effort``
(``low``, ``medium``, the default, or ``high``), ``model_identity`` and ``current_date``
(``YYYY-MM-DD``, today by default). An assistant turn's ``thinking`` (or ``reasoning_content``)
is shown again only before the calls of the turn in progress, as the format's guide says (the
library's ``auto_drop_analysis`` keeps more: every turn's reasoning when a chat ends on a tool
result, and that after the first ``final`` otherwise).
"""

from __future__ import annotations

#: Stands for a newline in the sources below, whose own line ends Jinja trims around tags.
_NL = '{{ "\\n" }}'

# A JSON Schema as a TypeScript type, ``level`` deep in nested objects (four spaces a level).
_MACROS = (
    """{%- macro ts_type(spec, level) -%}
{%- if spec.oneOf is defined and spec.oneOf -%}
{%- for variant in spec.oneOf -%}⏎ | {{ ts_type(variant, level) }}{%- endfor -%}⏎
{%- elif spec.type is defined and spec.type is not string and spec.type is iterable -%}
{%- for name in spec.type -%}{{ ts_type({"type": name}, level) }}{%- if not loop.last %} | {% endif -%}{%- endfor -%}
{%- elif spec.type == "string" and spec.enum is defined and spec.enum -%}
"{{ spec.enum | join('" | "') }}"
{%- elif spec.type in ("string", "boolean", "null") -%}{{ spec.type }}
{%- elif spec.type in ("number", "integer") -%}number
{%- elif spec.type == "array" -%}
{%- if spec["items"] is defined and spec["items"] -%}{{ ts_type(spec["items"], level) }}[]{%- else -%}Array<any>{%- endif -%}
{%- elif spec.type == "object" -%}
{{ "{" }}⏎{{- ts_properties(spec, level) -}}{{ "    " * level }}{{ "}" }}
{%- else -%}any
{%- endif -%}
{%- if spec.nullable is defined and spec.nullable %} | null{% endif -%}
{%- endmacro -%}
{%- macro ts_properties(spec, level) -%}
{%- set properties = spec.properties if spec.properties is defined and spec.properties else {} -%}
{%- set required = spec.required if spec.required is defined and spec.required else [] -%}
{%- for name, property in properties.items() -%}
{%- if property.description is defined and property.description -%}
{{ "    " * level }}// {{ property.description }}⏎
{%- endif -%}
{{ "    " * level }}{{ name }}{% if name not in required %}?{% endif %}: {{ ts_type(property, level + 1) }}
{%- if property.default is defined %}, // default: {{ property.default | tojson }}{% else %},{% endif -%}⏎
{%- endfor -%}
{%- endmacro -%}
{%- macro render_functions(tools) -%}
# Tools⏎⏎## functions⏎⏎namespace functions {{ "{" }}⏎⏎
{%- for tool in tools -%}
{%- set function = tool.function if tool.function is defined else tool -%}
{%- if function.description is defined and function.description -%}
{%- for line in function.description.split("\\n") -%}// {{ line }}⏎{%- endfor -%}
{%- endif -%}
type {{ function.name }} = (
{%- if function.parameters is defined and function.parameters is not none -%}
_: {{ "{" }}⏎{{- ts_properties(function.parameters, 0) -}}{{ "}" }}
{%- endif -%}
) => any;⏎⏎
{%- endfor -%}
{{ "}" }} // namespace functions
{%- endmacro -%}
"""
).replace("⏎", _NL)

_MAIN = (
    """{%- set identity = model_identity if model_identity is defined else "You are ChatGPT, a large language model trained by OpenAI." -%}
{%- set date = current_date if current_date is defined else strftime_now("%Y-%m-%d") -%}
<|start|>system<|message|>{{ identity }}⏎Knowledge cutoff: 2024-06⏎Current date: {{ date }}⏎⏎
{%- if reasoning_effort is defined and reasoning_effort -%}Reasoning: {{ reasoning_effort }}{%- else -%}Reasoning: medium{%- endif -%}⏎⏎
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}⏎Calls to these tools must go to the commentary channel: 'functions'.{%- endif -%}
<|end|>
{%- if messages and messages[0].role in ("system", "developer") -%}
{%- set instructions = messages[0].content or "" -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set instructions = "" -%}
{%- set turns = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
<|start|>developer<|message|>
{%- if instructions -%}# Instructions⏎⏎{{ instructions }}{%- if tools -%}⏎⏎{%- endif -%}{%- endif -%}
{%- if tools -%}{{ render_functions(tools) }}{%- endif -%}
<|end|>
{%- endif -%}
{%- set state = namespace(last_user=-1, last_call="") -%}
{%- for message in turns -%}
{%- if message.role == "user" -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in turns -%}
{%- if message.role == "user" -%}
<|start|>user<|message|>{{ message.content or "" }}<|end|>
{%- elif message.role == "assistant" -%}
{%- set thinking = message.thinking if message.thinking is defined and message.thinking else "" -%}
{%- if not thinking and message.reasoning_content is defined and message.reasoning_content -%}
{%- set thinking = message.reasoning_content -%}
{%- endif -%}
{%- if message.tool_calls is defined and message.tool_calls -%}
{%- if thinking and loop.index0 > state.last_user -%}
<|start|>assistant<|channel|>analysis<|message|>{{ thinking }}<|end|>
{%- endif -%}
{%- if message.content -%}
<|start|>assistant<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- endif -%}
{%- for call in message.tool_calls -%}
{%- set function = call.function if call.function is defined else call -%}
<|start|>assistant to=functions.{{ function.name }}<|channel|>commentary <|constrain|>json<|message|>
{%- if function.arguments is string -%}{{ function.arguments }}{%- else -%}{{ function.arguments | tojson }}{%- endif -%}
<|call|>
{%- set state.last_call = function.name -%}
{%- endfor -%}
{%- elif loop.last and not add_generation_prompt -%}
{%- if thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ thinking }}<|end|>{%- endif -%}
<|start|>assistant<|channel|>final<|message|>{{ message.content or "" }}<|return|>
{%- else -%}
<|start|>assistant<|channel|>final<|message|>{{ message.content or "" }}<|end|>
{%- endif -%}
{%- elif message.role == "tool" -%}
{%- set author = namespace(name=message.name if message.name is defined and message.name else "") -%}
{%- if not author.name and message.tool_call_id is defined -%}
{%- for earlier in turns[:loop.index0] if earlier.tool_calls is defined and earlier.tool_calls -%}
{%- for call in earlier.tool_calls if call.id is defined and call.id == message.tool_call_id -%}
{%- set author.name = (call.function if call.function is defined else call).name -%}
{%- endfor -%}
{%- endfor -%}
{%- endif -%}
<|start|>functions.{{ author.name or state.last_call }} to=assistant<|channel|>commentary<|message|>{{ message.content or "" }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""
).replace("⏎", _NL)

#: The Harmony chat template (gpt-oss's format).
HARMONY_CHAT_TEMPLATE = _MACROS + _MAIN
#: Renders only the ``# Tools`` section of the developer message, for ``tools``.
TOOLS_TEMPLATE = _MACROS + "{{- render_functions(tools) -}}"
