"""The zoo check: every causal-LM model type the installed transformers defines, against mlxr.

For each name of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, :func:`claim` says whether
mlxr serves it natively, through an architecture fallback (the mlx-lm bridge) or not at all (the
loader's refusal, with its reason). :func:`check_type` writes a claimed type tiny with transformers
itself (its config class's defaults, sizes shrunk by :func:`tiny_keys`, O(1) random weights,
``save_pretrained``), loads the folder through mlxr's loader and compares greedy tokens with
transformers' ``generate``. :func:`counts` sums the outcomes; :func:`record` writes them to
:data:`RESULTS`, the file ``mlxr plugins`` reads (without importing MLX or transformers)::

    python -m mlxr_core.testing.zoo            # every type, writes mlxr_core/testing/zoo_results.json
    python -m mlxr_core.testing.zoo llama lfm2 # these types, printed only

Outcomes: ``native`` and ``bridge`` (claimed and equal to transformers), ``refused`` (not claimed,
or claimed and refused at load naming what it cannot compute), ``failing`` (claimed, and its
tokens differ or the load fails without a reason), ``unwritable`` (transformers itself cannot
write the tiny model here, e.g. a missing optional library).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from mlxr_core.plugins import Registries

#: The recorded zoo run ``mlxr plugins`` prints the counts of.
RESULTS = Path(__file__).with_name("zoo_results.json")
OUTCOMES = ("native", "bridge", "refused", "failing", "unwritable")
#: Greedy tokens compared per type.
TOKENS = 8
#: Shapes every config class spells one of these ways, shrunk (only keys its defaults carry are set).
SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), 64),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers"), 4),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"), 2),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_hidden_size", "encoder_ffn_dim", "decoder_ffn_dim"), 96),
    **dict.fromkeys(("encoder_layers", "decoder_layers"), 2),
    **dict.fromkeys(("encoder_attention_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"), 2),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_ffn_hidden_size"), 32),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "num_expert_group"), 2),
    **dict.fromkeys(("zero_expert_num", "num_kv_shared_layers"), 2),
    "vocab_size": 128, "vocab_size_per_layer_input": 128, "n_positions": 256, "head_dim": 16, "rotary_dim": 8,
    "first_k_dense_replace": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "qk_head_dim": 24,
    "v_head_dim": 16, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16,
    **dict.fromkeys(("mamba_num_heads", "mamba_n_heads"), 8),
    **dict.fromkeys(("mamba_head_dim", "mamba_d_head"), 16),
    **dict.fromkeys(("ssm_state_size", "mamba_d_state"), 16),
    **dict.fromkeys(("n_groups", "mamba_n_groups"), 2),
    **dict.fromkeys(("chunk_size", "mamba_chunk_size"), 16),
    **dict.fromkeys(("mamba_dt_rank", "time_step_rank"), 8),
    "mamba_d_ssm": 128, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
    "sliding_window": 8, "attention_chunk_size": 8,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
#: Keys whose None turns a part off (a window, the query's low-rank bottleneck) or derives it from
#: others (GPT-J's MLP of 4 x n_embd): left None.
SWITCHES = ("sliding_window", "attention_chunk_size", "q_lora_rank", "n_inner")
GEMMA4_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
QWEN4_EXP = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 32,
             "indexer_compress_ratio": 4, "ple_layer_ids": [1], "heads_per_ngram": 2, "ngram_vocab_size_base": 150}
#: Keys over the shrunk defaults for types whose defaults leave a tiny model without a layer kind.
OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba2": {"num_heads": 8},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "gpt_neox": {"intermediate_size": 4 * SIZES["hidden_size"]},  # its released models' (mlx-lm assumes it)
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1},
    "gemma3": {"mm_tokens_per_image": 49},
    # Gemma 4's last layers reuse the caches of earlier ones of their kind: both kinds come first.
    **{name: {"text_config": {"layer_types": GEMMA4_LAYERS}} for name in ("gemma4", "gemma4_unified")},
    "gemma4_text": {"layer_types": GEMMA4_LAYERS},
    # Gemma 3n's too (the multimodal type is written only where timm is installed).
    "gemma3n": {"text_config": {"layer_types": GEMMA4_LAYERS}},
    "gemma3n_text": {"layer_types": GEMMA4_LAYERS},
    # Qwen4-Exp's attention needs its indexer's keys; a PLE layer with a table of ~600 rows, not 160 M.
    **{name: QWEN4_EXP if name.endswith("_text") else {"text_config": QWEN4_EXP} for name in ("qwen4_exp", "qwen4_exp_text")},
}


def shrink(defaults: dict[str, Any]) -> dict[str, Any]:
    """The keys of :data:`SIZES` that ``defaults`` carries (a :data:`SWITCHES` off stays off), sub-configs shrunk alike, and each
    per-layer list cut to the new layer count keeping one layer of every kind it names."""
    keys: dict[str, Any] = {
        key: value for key, value in SIZES.items() if key in defaults and not (key in SWITCHES and defaults[key] is None)
    }
    if "qk_rope_head_dim" in defaults:  # MLA: head_dim names the rotary part
        keys["head_dim"] = SIZES["qk_rope_head_dim"]
    if "num_key_value_heads" in keys and defaults.get("num_key_value_heads") == defaults.get("num_attention_heads"):
        keys["num_key_value_heads"] = SIZES["num_attention_heads"]  # a family that may not group its heads
    for key, value in defaults.items():
        if isinstance(value, dict) and "model_type" in value:
            keys[key] = shrink(value)
    layers = next((defaults[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in defaults), None)
    if isinstance(layers, int):
        for key, value in defaults.items():
            if isinstance(value, list) and len(value) == layers > SIZES["num_hidden_layers"]:
                keys[key] = _one_of_each(value, SIZES["num_hidden_layers"])
    return keys


def _one_of_each(pattern: list[Any], count: int) -> list[Any]:
    firsts = {repr(value): index for index, value in reversed(list(enumerate(pattern)))}
    chosen = sorted(set(firsts.values()))[:count]
    chosen += [index for index in range(len(pattern)) if index not in chosen][: count - len(chosen)]
    return [pattern[index] for index in sorted(chosen)]


@attrs.define
class ZooResult:
    """One model type's outcome and why (the loader's reason, the refusal, or the difference)."""

    model_type: str
    #: ``native``, ``bridge`` or None (not claimed), as :func:`claim` says.
    claim: str | None
    outcome: str
    detail: str
    seconds: float = 0.0


def causal_lm_types() -> list[str]:
    """Every model type the installed transformers maps to a causal-LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def claim(model_type: str, registries: Registries) -> tuple[str | None, str]:
    """``("native", plugin)``, ``("bridge", label)`` or ``(None, the loader's refusal)``."""
    if model_type in registries.archs:
        return "native", registries.archs.entry(model_type).plugin
    for entry in registries.arch_fallbacks:
        if model_type in (entry.meta.get("model_types") or ()):
            return "bridge", str(entry.meta.get("label", entry.name))
    from mlxr_core.model.checkpoint import Checkpoint
    from mlxr_core.model.stages import choose_arch

    try:
        choose_arch(Checkpoint(Path(model_type), "zoo", {"model_type": model_type}, {}), registries)
    except Exception as exc:  # the refusal is the answer
        return None, str(exc).removeprefix(f"{model_type}: ")
    return "bridge", "an architecture fallback"


def tiny_keys(model_type: str) -> dict[str, Any]:
    """Keys over ``model_type``'s config defaults that make it tiny (:func:`shrink`, then
    :data:`OVERRIDES`)."""
    import transformers

    keys = shrink(transformers.AutoConfig.for_model(model_type).to_dict())
    for key, value in OVERRIDES.get(model_type, {}).items():
        keys[key] = {**keys.get(key, {}), **value} if isinstance(value, dict) else value
    return keys


def check_type(model_type: str, registries: Registries, folder: Path) -> ZooResult:
    """Claim, write, load and compare one model type (see the module's docstring)."""
    from mlxr_core.errors import MlxrError
    from mlxr_core.testing.hf_reference import greedy_reference, greedy_tokens, load_reference_model

    start = time.monotonic()
    kind, reason = claim(model_type, registries)
    if kind is None:
        return ZooResult(model_type, None, "refused", reason)

    def done(outcome: str, detail: str) -> ZooResult:
        detail = detail.replace(str(folder), "<folder>")  # the same record from every run
        return ZooResult(model_type, kind, outcome, detail, round(time.monotonic() - start, 2))

    try:
        written = greedy_reference(model_type, tiny_keys(model_type), folder, tokens=TOKENS)
    except Exception as exc:  # transformers' own failure, recorded
        return done("unwritable", f"transformers cannot write it: {type(exc).__name__}: {_line(exc)}")
    try:
        loaded = load_reference_model(written, registries)
        tokens = greedy_tokens(loaded, written.prompt, TOKENS)[0]
    except MlxrError as exc:
        return done("refused", _line(exc))
    except Exception as exc:  # a failure without a reason is what this finds
        return done("failing", f"{type(exc).__name__}: {_line(exc)}")
    if tokens != written.tokens:
        same = next((i for i, (a, b) in enumerate(zip(tokens, written.tokens, strict=True)) if a != b), TOKENS)
        return done("failing", f"greedy tokens agree with transformers' for {same} of {TOKENS}")
    return done(kind, f"{TOKENS} greedy tokens equal transformers' ({reason})")


def counts(results: Iterable[ZooResult]) -> dict[str, int]:
    """How many types had each outcome."""
    outcomes = [result.outcome for result in results]
    return {outcome: outcomes.count(outcome) for outcome in OUTCOMES}


def record(results: list[ZooResult], path: Path = RESULTS) -> None:
    """Write ``results`` with their counts and the transformers version they were checked against."""
    import transformers

    body = {
        "transformers": transformers.__version__,
        "command": "python -m mlxr_core.testing.zoo",
        "counts": counts(results),
        "types": {r.model_type: {"claim": r.claim, "outcome": r.outcome, "detail": r.detail} for r in results},
    }
    path.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")


def recorded(path: Path = RESULTS) -> dict[str, ZooResult]:
    """The recorded run, by model type (empty where nothing was recorded)."""
    try:
        types = json.loads(path.read_text(encoding="utf-8"))["types"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {name: ZooResult(name, row["claim"], row["outcome"], row["detail"]) for name, row in types.items()}


def recorded_summary(path: Path = RESULTS) -> str | None:
    """One line of the recorded counts (``zoo (transformers 5.25.0): 40 native, ...``), or None
    where nothing was recorded. Reads JSON only: cheap enough for ``mlxr plugins``."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        found = body["counts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    total = sum(found.values())
    parts = ", ".join(f"{found.get(outcome, 0)} {outcome}" for outcome in OUTCOMES if found.get(outcome))
    return f"zoo check of {total} transformers {body.get('transformers', '?')} causal-LM types: {parts}"


def _line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def main(argv: list[str]) -> int:
    """Run the zoo over ``argv``'s types (recording nothing) or every type (recorded).

    ``--update TYPE...`` runs only those types and writes their rows into the recorded run, keeping
    every other row: what registering one architecture needs.
    """
    from mlxr_core.plugins import load_plugins

    update = bool(argv) and argv[0] == "--update"
    names = argv[1:] if update else argv
    if update and not names:
        print("--update needs the model types to re-check", file=sys.stderr)
        return 2
    registries = load_plugins().registries
    results = []
    for model_type in names or causal_lm_types():
        with tempfile.TemporaryDirectory() as folder:
            result = check_type(model_type, registries, Path(folder))
        results.append(result)
        print(f"{result.model_type:28} {result.outcome:10} {result.seconds:6.1f}s  {result.detail}", flush=True)
    if update:
        rows = recorded() | {r.model_type: r for r in results}
        results = [rows[name] for name in causal_lm_types() if name in rows]
        record(results)
    elif not argv:
        record(results)
    print(json.dumps(counts(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
