"""MTP (or EAGLE-3, or DFlash) drafting inside the batch against plain decoding, at a controlled acceptance rate.

    python bench/mtp_acceptance.py [--shape qwen3.5-35b-a3b-8l] [--weights q4] [--acceptance 0.5 0.7 0.9]
                                   [--k 1 2 3 4] [--streams 1 8 32] [--prompt-tokens 128]
                                   [--gen-tokens 128] [--rounds 2] [--method mtp|eagle3|dflash] [--out PREFIX]
    python bench/mtp_acceptance.py --smoke     # a tiny shape, to check the script on a CPU

Writes a Qwen3.5-shaped random-weight folder (:mod:`gpu_decode`'s shapes, mlx-lm's writer) and
adds a random MTP layer to it under Qwen's names (``mtp.fc``, ``mtp.pre_fc_norm_*``, ``mtp.norm``,
``mtp.layers.0.*``). One engine serves it with ``models[].speculative: {method: mtp}`` (``k``
fixed, not adaptive). A random head agrees with its target by chance only, so each draft token is
replaced by the target's own (from a plain run of the same prompt) with probability ``a``
(:func:`mlxr_core.testing.drafting.control_acceptance`): the head still runs in full (its pass
over the accepted span, its chain, its cache), only its tokens are chosen. For each stream count,
``N`` different prompts decode together, greedy, exactly ``--gen-tokens`` tokens each; per round,
plain decoding (the requests opt out) and every (a, k) run back to back; the speedup is aggregate
decode tokens/s over plain's in the same round, the median over rounds reported, with the
acceptance the engine counted and whether every row gave plain decoding's tokens.

``--method eagle3`` drafts with a random EAGLE-3 head instead (a separate folder beside the model:
one Llama layer of the model's width and heads, a draft vocabulary of at most 32,000 ids with a
``d2t`` map; ``models[].speculative.path``), reading the model's layers 2, n // 2 and n - 3.
``--method dflash`` drafts with a random DFlash block drafter (z-lab's layout beside the model: up
to 5 Qwen3 layers of the model's width and heads, block size 16, reading z-lab's default layers);
each step's ``k`` tokens come from one pass over the row's next input and ``k`` mask tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

import mlxr_core  # noqa: F401  (before mlx: preloads a fast BLAS on Linux CPUs)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode import SHAPES, consume_together, write_folders

#: ``--smoke``: the Qwen3.5 MoE design at a size a CPU decodes in a blink.
SMOKE_TEXT = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32, "vocab_size": 512}  # fmt: skip
#: :class:`~mlxr_core.model.layers.mtp.MtpHead`'s names -> Qwen's (``mtp.`` + these).
QWEN_NAMES = (("proj.", "fc."), ("embed_norm.", "pre_fc_norm_embedding."),
              ("hidden_norm.", "pre_fc_norm_hidden."), ("norm.", "norm."), ("block.", "layers.0."))  # fmt: skip


def add_mtp_layer(folder: Path) -> int:
    """A random MTP layer in ``folder`` (``mtp.safetensors``, listed in the index) as Qwen3.5's
    checkpoints store it (experts as one ``gate_up_proj`` and one ``down_proj``); its bytes."""
    from mlx.utils import tree_flatten

    from mlxr_core.kernels import bind_kernels
    from mlxr_core.plugins import load_plugins

    config = json.loads((folder / "config.json").read_text())
    registries = load_plugins().registries
    arch = registries.archs.get(config["model_type"])
    kernels = bind_kernels(registries.kernels, dtype="float32", shapes=arch.kernel_context(config))
    mx.random.seed(1)
    head = arch.build_mtp(config, kernels)
    tensors: dict[str, mx.array] = {}
    for name, array in tree_flatten(head.parameters()):
        theirs = next(q + name[len(o) :] for o, q in QWEN_NAMES if name.startswith(o))
        tensors["mtp." + theirs] = array.astype(mx.bfloat16)
    stem = "mtp.layers.0.mlp.switch_mlp."
    if stem + "gate_proj.weight" in tensors:
        gate, up = tensors.pop(stem + "gate_proj.weight"), tensors.pop(stem + "up_proj.weight")
        tensors["mtp.layers.0.mlp.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        tensors["mtp.layers.0.mlp.experts.down_proj"] = tensors.pop(stem + "down_proj.weight")
    mx.save_safetensors(str(folder / "mtp.safetensors"), tensors, metadata={"format": "mlx"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        listing = json.loads(index.read_text())
    else:  # one file: list it too, so that the reader takes both
        listing = {"weight_map": dict.fromkeys(mx.load(str(folder / "model.safetensors")), "model.safetensors")}
    listing["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    index.write_text(json.dumps(listing))
    return sum(array.nbytes for array in tensors.values())


def write_eagle3_draft(folder: Path, text: dict[str, Any]) -> int:
    """A random EAGLE-3 draft for a model of ``text`` config in ``folder`` (the released layout:
    ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``); its bytes."""
    from mlx.utils import tree_flatten

    from mlxr_core.kernels import bind_kernels
    from mlxr_core.model.layers.eagle3 import Eagle3Args, Eagle3Head
    from mlxr_core.plugins import load_plugins

    vocab = int(text["vocab_size"])
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_act": "silu", "vocab_size": vocab, "draft_vocab_size": min(vocab, 32000),
              "intermediate_size": 4 * int(text["hidden_size"]), "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              **{key: text[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")}}  # fmt: skip
    layers = int(text["num_hidden_layers"])
    if len({2, layers // 2, layers - 3}) < 3:  # too few layers for the default three
        config["eagle_aux_hidden_state_layer_ids"] = [0, layers // 2, layers - 1]
    args = Eagle3Args.from_config(config)
    kernels = bind_kernels(load_plugins().registries.kernels, dtype="float32", shapes=args.kernel_shapes())
    mx.random.seed(2)
    head = Eagle3Head(args, kernels, own_embedding=False)
    tensors = {name: array.astype(mx.bfloat16) for name, array in tree_flatten(head.parameters())}
    targets = mx.sort(mx.random.permutation(vocab)[: config["draft_vocab_size"]])
    tensors["d2t"] = (targets - mx.arange(config["draft_vocab_size"])).astype(mx.int64)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return sum(array.nbytes for array in tensors.values())


def write_dflash_draft(folder: Path, text: dict[str, Any]) -> int:
    """A random DFlash draft for a model of ``text`` config in ``folder`` (z-lab's layout:
    ``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``); its bytes."""
    from mlx.utils import tree_flatten

    from mlxr_core.kernels import bind_kernels
    from mlxr_core.model.layers.dflash import DFlashArgs, DFlashHead
    from mlxr_core.plugins import load_plugins

    vocab, layers = int(text["vocab_size"]), int(text["num_hidden_layers"])
    draft_layers = 5 if layers >= 8 else 1
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": draft_layers,
              "hidden_act": "silu", "vocab_size": vocab, "intermediate_size": 3 * int(text["hidden_size"]),
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "block_size": 16, "num_target_layers": layers,
              "dflash_config": {"mask_token_id": vocab - 1},
              **{key: text[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")}}  # fmt: skip
    args = DFlashArgs.from_config(config)
    kernels = bind_kernels(load_plugins().registries.kernels, dtype="float32", shapes=args.kernel_shapes())
    mx.random.seed(3)
    head = DFlashHead(args, kernels, len(args.target_layers(layers)) * args.hidden_size)
    tensors = {name: array.astype(mx.bfloat16) for name, array in tree_flatten(head.parameters())}
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return sum(array.nbytes for array in tensors.values())


def decode(engine: Any, prompts: list[list[int]], gen: int, speculative: bool) -> tuple[float, list[list[int]]]:
    """Every prompt at once, greedy, ``gen`` tokens each: aggregate decode tokens/s (from the
    last first token to the last token) and each row's tokens."""
    from mlxr_core.engine.request import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=gen, temperature=0.0, extra={"ignore_eos": True})
    requests = [GenerationRequest(model="bench", prompt_ids=p, params=params, speculative=speculative) for p in prompts]
    firsts, ends, tokens, _ = consume_together(engine, requests)
    return len(prompts) * (gen - 1) / (max(ends) - max(firsts)), tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3.5-35b-a3b-8l", choices=[s for s in SHAPES if s.startswith("qwen3.5")])
    parser.add_argument("--weights", default="q4", choices=("bf16", "q4"))
    parser.add_argument("--acceptance", nargs="+", type=float, default=[0.5, 0.7, 0.9])
    parser.add_argument("--k", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--method", default="mtp", choices=("mtp", "eagle3", "dflash"))
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, float32 (checks the script on a CPU)")
    parser.add_argument("--out", default=None, help="write PREFIX.json")
    args = parser.parse_args()

    from mlxr_core.config.schema import (
        Config,
        EngineConfig,
        ModelConfig,
        PrefixCacheConfig,
        SpeculationConfig,
    )
    from mlxr_core.engine.engine import Engine
    from mlxr_core.plugins import load_plugins
    from mlxr_core.testing.drafting import control_acceptance

    shape = SHAPES[args.shape]
    if args.smoke:
        shape = {**shape, "text_config": {**shape["text_config"], **SMOKE_TEXT}}
    root = Path(tempfile.mkdtemp(prefix="mtp_bench_"))
    folder = write_folders(root, shape, (args.weights,))[args.weights]
    method, draft = args.method, root / args.method
    writers = {"eagle3": write_eagle3_draft, "dflash": write_dflash_draft}
    head_bytes = add_mtp_layer(folder) if method == "mtp" else writers[method](draft, shape["text_config"])
    # k is the model's setting, read when a request is admitted: the runs below set it in place.
    speculative = SpeculationConfig(method=method, k=max(args.k), max_k=max(args.k), adaptive=False,
                                    max_batch=max(args.streams), path=str(draft) if method != "mtp" else None)  # fmt: skip
    model = ModelConfig(path=str(folder), name="bench", dtype="float32" if args.smoke else "bfloat16",
                        context_length=args.prompt_tokens + args.gen_tokens + 64, speculative=speculative)  # fmt: skip
    engine_config = EngineConfig(max_batch_size=max(args.streams), prefix_cache=PrefixCacheConfig(enabled=False))
    engine = Engine(Config(models=[model], engine=engine_config), load_plugins())
    engine.start()
    decoder = engine.host.registries.decoders.get(method)
    vocab = min(int(shape["text_config"]["vocab_size"]), 256)  # within the copied tokenizer's ids
    rows: list[dict[str, Any]] = []
    try:
        for streams in args.streams:
            rng = mx.random.key(streams)
            prompts = mx.random.randint(2, vocab, (streams, args.prompt_tokens), key=rng).tolist()
            decode(engine, prompts, 16, speculative=False)  # warm up: the shapes of both kinds of step
            decode(engine, prompts, 16, speculative=True)
            speedups: dict[tuple[float, int], list[float]] = {}
            found: dict[tuple[float, int], dict[str, Any]] = {}
            for _ in range(args.rounds):
                plain_tps, plain = decode(engine, prompts, args.gen_tokens, speculative=False)
                references = {tuple(p): out for p, out in zip(prompts, plain, strict=True)}
                for a in args.acceptance:
                    for k in args.k:
                        speculative.k = k
                        control_acceptance(decoder, references, a, seed=k)
                        before = dict(engine.stats()["decoders"].get("bench", {}).get(method, {}))
                        tps, tokens = decode(engine, prompts, args.gen_tokens, speculative=True)
                        after = dict(engine.stats()["decoders"]["bench"][method])
                        drafted = after["drafted"] - before.get("drafted", 0)
                        accepted = after["accepted"] - before.get("accepted", 0)
                        speedups.setdefault((a, k), []).append(tps / plain_tps)
                        found[(a, k)] = {"plain_tps": plain_tps, f"{method}_tps": tps, "exact": tokens == plain,
                                         "acceptance_measured": accepted / drafted if drafted else None}  # fmt: skip
            for (a, k), ratios in speedups.items():
                row = {"streams": streams, "a": a, "k": k, "speedup": statistics.median(ratios), **found[(a, k)]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        engine.stop()
    report = {"command": " ".join(sys.argv), "shape": args.shape, "weights": args.weights, "smoke": args.smoke, "method": method,
              "device": str(mx.default_device()), "mtp_head_bytes": head_bytes, "rows": rows}  # fmt: skip
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=1))
    return 0 if all(row["exact"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
