"""The conformance checks of mlxr_core.testing: every built-in plugin passes them, and each check
catches a plugin that breaks its contract."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mlxr_core.plugins import hookimpl, load_plugins
from mlxr_core.testing.conformance import check_api, check_format, check_kernel_parity

HOST = load_plugins()
TINY_HF = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_hf"


# -- formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", sorted(p.name for p in TINY_HF.iterdir() if p.is_dir()))
def test_safetensors_format_conforms(folder):
    checkpoint = check_format("safetensors", TINY_HF / folder, registries=HOST.registries)
    assert checkpoint.format == "safetensors"


@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_1"])
def test_gguf_format_conforms(quant, tmp_path):
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(tmp_path / f"tiny-{quant}.gguf", quant=quant)
    checkpoint = check_format("gguf", path, registries=HOST.registries)
    assert checkpoint.config["model_type"] == "llama"


def test_every_registered_format_is_covered():
    assert set(HOST.registries.formats.names()) <= {"gguf", "safetensors"}


def test_a_format_that_detects_everything_is_caught(tiny_gguf):
    fmt = HOST.registries.formats.get("gguf")

    class Greedy:
        name = "gguf"

        def detect(self, path):
            return True

        def load(self, path, *, dtype="float32"):
            return fmt.load(path, dtype=dtype)

    with pytest.raises(AssertionError, match=r"detect\(\) accepts missing"):
        check_format(Greedy(), tiny_gguf, registries=HOST.registries)


def test_a_format_that_loses_a_tensor_is_caught(tiny_gguf):
    fmt = HOST.registries.formats.get("gguf")

    class Lossy:
        name = "gguf"
        detect = staticmethod(fmt.detect)

        def load(self, path, *, dtype="float32"):
            checkpoint = fmt.load(path, dtype=dtype)
            checkpoint.weights.pop("model.layers.0.mlp.up_proj.weight")
            return checkpoint

    with pytest.raises(Exception, match="up_proj"):
        check_format(Lossy(), tiny_gguf, registries=HOST.registries)


def test_a_writable_format_is_round_tripped(tiny_gguf):
    """A format with ``save`` must read back what it wrote; one that drops a tensor fails."""
    import json

    import attrs
    import mlx.core as mx

    from mlxr_core.model.checkpoint import Checkpoint

    gguf = HOST.registries.formats.get("gguf")

    class Folder:
        """Reads a GGUF file, or a folder of ``weights.safetensors`` + ``meta.json`` it wrote."""

        name = "folder-test"

        def __init__(self, drop: str | None = None):
            self.drop = drop

        def detect(self, path):
            path = Path(path)
            return (path.suffix == ".gguf" and path.is_file()) or (path / "meta.json").is_file()

        def load(self, path, *, dtype="float32"):
            path = Path(path)
            if path.suffix == ".gguf":
                return attrs.evolve(gguf.load(path, dtype=dtype), format=self.name)
            meta = json.loads((path / "meta.json").read_text())
            source = gguf.load(Path(meta["source"]), dtype=dtype)
            return Checkpoint(
                path=path, format=self.name, config=meta["config"],
                weights=mx.load(str(path / "weights.safetensors")),
                tokenizer=source.tokenizer, chat_template=source.chat_template,
            )

        def save(self, checkpoint, path):
            path = Path(path)
            path.mkdir()
            weights = {k: v for k, v in checkpoint.weights.items() if k != self.drop}
            mx.save_safetensors(str(path / "weights.safetensors"), weights)
            (path / "meta.json").write_text(json.dumps({"config": checkpoint.config, "source": str(tiny_gguf)}))

    check_format(Folder(), tiny_gguf, registries=HOST.registries)
    with pytest.raises(AssertionError, match="save/load lost tensors"):
        check_format(Folder(drop="model.norm.weight"), tiny_gguf, registries=HOST.registries)


# -- kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HOST.registries.kernels.names())
def test_kernel_backend_matches_the_reference(name):
    from mlxr_core.testing.kernel_check import PARITY_OPS

    op, _, backend = name.partition(":")
    if op not in PARITY_OPS:
        pytest.skip(f"check_kernel_parity has no cases for the {op} op yet")
    report = check_kernel_parity(HOST.registries.kernels, op, backend)
    if not report.ran:
        pytest.skip(f"{name} runs nowhere here: {next(iter(report.skipped.values()))}")


def test_a_kernel_that_drifts_from_the_reference_is_caught():
    import mlx.core as mx

    from mlxr_plugins.kernels import KernelImpl

    class Off:
        @hookimpl
        def mlxr_register_kernels(self, register):
            register("rms_norm", "off", KernelImpl(lambda x, w, eps: mx.fast.rms_norm(x, w, eps * 1e4)))

    host = load_plugins(extra=[("off", Off())])
    with pytest.raises(AssertionError, match=r"rms_norm:off D=\d+ float32: differs from the reference"):
        check_kernel_parity(host.registries.kernels, "rms_norm", "off")


def test_declined_cases_are_reported_not_failed():
    import mlx.core as mx

    from mlxr_plugins.kernels import KernelImpl

    class Float32Only:
        @hookimpl
        def mlxr_register_kernels(self, register):
            register(
                "rms_norm", "f32", KernelImpl(
                    mx.fast.rms_norm, lambda ctx: [] if ctx.dtype == "float32" else ["float32 only"]
                ),
            )

    host = load_plugins(extra=[("f32", Float32Only())])
    report = check_kernel_parity(host.registries.kernels, "rms_norm", "f32")
    assert report.ran and all(label.endswith("float32") for label in report.ran)
    assert report.skipped and all(reasons == ["float32 only"] for reasons in report.skipped.values())


# -- APIs ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", HOST.registries.apis.names())
def test_api_conforms(name, tiny_gguf):
    checked = check_api(name, tiny_gguf, host=HOST)
    assert checked


class Echo(msgspec.Struct):
    text: str


@pytest.mark.slow
def test_an_api_answering_errors_in_litestar_shape_is_caught(tiny_gguf):
    """The app decodes typed bodies itself, but a route that raises Litestar's own exceptions
    (reading its body by hand) answers in Litestar's default shape unless its API maps them."""
    from litestar import Request, Router, post
    from litestar.exceptions import ClientException

    def make(ctx):
        @post("/echo")
        async def echo(request: Request) -> dict:
            try:
                return dict(json.loads(await request.body()))
            except ValueError:
                raise ClientException("not JSON") from None

        return Router(path="/x", route_handlers=[echo])

    class Bare:
        @hookimpl
        def mlxr_register_apis(self, register):
            register("bare", make)

    host = load_plugins(extra=[("bare", Bare())])
    with pytest.raises(AssertionError, match="Litestar's default"):
        check_api("bare", tiny_gguf, host=host)


# -- samplers and decoders ------------------------------------------------------------------------


SAMPLER_PARAMS = {
    "logit_bias": {"logit_bias": {3: 5.0, 10: -100.0}},
    "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "temperature": {"temperature": 0.7},
    "top_k": {"temperature": 1.0, "top_k": 5},
    "top_p": {"temperature": 1.0, "top_p": 0.5},
    "min_p": {"temperature": 1.0, "min_p": 0.1},
}


@pytest.mark.parametrize("name", HOST.registries.samplers.names())
def test_builtin_samplers_conform(name, toy_tokenizer):
    from mlxr_core.engine.request import Constraint, SamplingParams
    from mlxr_core.testing.decoding_check import check_sampler

    if name == "structured":
        params = SamplingParams(constraint=Constraint(kind="json_object"))
        check_sampler(name, params, host=HOST, tokenizer=toy_tokenizer, vocab_size=toy_tokenizer.vocab_size)
        return
    if name == "thinking_budget":
        budget = {"tokens": 2, "start": "<think>", "end": "</think>", "opened": True}
        params = SamplingParams(extra={name: budget})
        check_sampler(name, params, host=HOST, tokenizer=toy_tokenizer, vocab_size=toy_tokenizer.vocab_size)
        return
    check_sampler(name, SamplingParams(**SAMPLER_PARAMS[name]), host=HOST)


def test_a_sampler_that_breaks_the_contract_is_caught():
    from mlxr_core.engine.request import SamplingParams
    from mlxr_core.plugins import hookimpl, load_plugins
    from mlxr_core.testing.decoding_check import check_sampler

    class Broken:
        @hookimpl
        def mlxr_register_samplers(self, register):
            register("halves", "test_conformance_checks:halve_the_vocabulary", order=50)

    host = load_plugins(extra=[("broken", Broken())])
    with pytest.raises(AssertionError, match=r"sampler halves: logits of shape \(1, 97\) became \(1, 48\)"):
        check_sampler("halves", SamplingParams(), host=host)


def halve_the_vocabulary(params, context):
    return lambda logits: logits[:, : logits.shape[-1] // 2]


@pytest.mark.parametrize("name", ["plain", "prompt_lookup", "speculative"])
def test_builtin_decoders_conform(name, tiny_gguf):
    from mlxr_core.testing.decoding_check import check_decoder

    config = {"decoders": {"speculative": {"draft": str(tiny_gguf)}}} if name == "speculative" else None
    check_decoder(name, tiny_gguf, host=HOST, plugin_config=config)


def test_a_decoder_that_diverges_from_plain_is_caught(tiny_gguf):
    from mlxr_core.plugins import hookimpl, load_plugins
    from mlxr_core.testing.decoding_check import check_decoder

    class Skewed:
        @hookimpl
        def mlxr_register_decoders(self, register):
            register("skewed", "test_conformance_checks:SkewedDecoder")

    host = load_plugins(extra=[("skewed", Skewed())])
    with pytest.raises(AssertionError, match="decoder skewed: greedy tokens differ from plain decoding"):
        check_decoder("skewed", tiny_gguf, host=host)


class SkewedDecoder:
    """Plain decoding that emits token 0 after every tenth token: a subtle bug."""

    batched = False

    def generate(self, model, cache, prompt_ids, sampler, *, prefill_chunk):
        from mlxr_plugins.decoders.plain import PlainDecoder

        for i, token in enumerate(PlainDecoder().generate(model, cache, prompt_ids, sampler, prefill_chunk=prefill_chunk)):
            yield 0 if i % 10 == 9 else token
