"""What fuzzing the OpenAPI document against the server may meet besides a schema mismatch: the
refusals of bodies the document allows for rules no JSON schema can state, shared by the test suite
(``tests/plugins/apis/test_fuzz_schema.py``) and the long run (``bench/schema_fuzz.py``)."""

from __future__ import annotations

import json
import re
from typing import Any

#: Why a body the document allows may still be a 400: rules that depend on the served model (its
#: context, vocabulary, chat template, whether it takes images, whether its tokenizer adds BOS) or
#: on a language inside a string (a grammar, a regex, JSON text), or that relate values no JSON
#: schema can relate (two lists' lengths, names unique across items, a name among those offered).
UNSTATABLE = re.compile("|".join([
    "context length", "the prompt is empty", "ids must be in", "takes no images", "chat template",
    "is not JSON", "does not parse", "cannot be enforced", "invalid JSON schema", "regex",
    "text_1 must be one text or as many as text_2", "distinct names", "not among tools",
    "outside this model's vocabulary",
    "an offered tool's name",
    # Decisions' and compaction's rules between items (distinct choices and levels, text to ask
    # about) and a compaction item's content, which only the server that wrote it can read.
    "must be unique", "must read differently", "distinct labels", "needs instructions",
    "decisions take text input", "not a compaction item this server made", "content is damaged",
    # MCP servers are the operator's: a label names one only where the config has it.
    "no MCP server", "offered by two servers", "mcp_approval_request",
    # An upload's content, and the languages a speech model knows, or whether a model takes audio;
    # word timestamps asked with a response_format other than verbose_json (two fields' values).
    "the audio", "does not transcribe audio", "does not know the language", "come with response_format verbose_json",
    # Rules between the grammar fields (mlxr_core.http.constraints), to state with the constraint limits.
    "send one output constraint per request", "structured_outputs needs one of",
    # What a stored response allows depends on how it was made (background or not), not on the body.
    "only a background response", "only background responses can be cancelled",
    # Ollama's create: the blobs uploaded, the names served, the files on the server, a Modelfile's text.
    "upload it first", "the body's digest is", "already names a served model", "is an adapter;",
    "Modelfile", "adapters created while serving", "served from the server's config",
    # ... and what those files hold: whether a blob is an adapter any format reads is its content's.
    "not a LoRA adapter any format reads", "adapter_config.json: invalid JSON",
    # LoRA scales: lora picks among the served model's adapters, lora_scale needs a model naming one.
    "model naming a LoRA adapter", "names a LoRA adapter already", "no adapter with id", "one adapter per request",
]))  # fmt: skip


def refusal(body: bytes | str) -> str:
    """The message of an error reply's body, in any API's shape (``{"error": "..."}``,
    ``{"error": {"message": ...}}``, Anthropic's ``{"type": "error", "error": {...}}``)."""
    try:
        decoded: Any = json.loads(body)
    except ValueError:
        return body.decode(errors="replace") if isinstance(body, bytes) else body
    error = decoded.get("error") if isinstance(decoded, dict) else None
    return str(error.get("message") if isinstance(error, dict) else error)
