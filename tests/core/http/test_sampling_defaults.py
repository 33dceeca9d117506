"""Sampling a request leaves unset: the request's fields over ``sampling:`` over the model's own
defaults (its ``generation_config.json``, as vLLM and SGLang serve them) over the built-in ones."""

from __future__ import annotations

from typing import Any

import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig, SamplingConfig
from mlxr_core.engine.admission import ModelInfo, check_request
from mlxr_core.engine.request import GenerationRequest, SamplingParams
from mlxr_core.http.context import ServerContext
from mlxr_core.http.requests import sampling_params
from mlxr_core.plugins import load_plugins


class Tokenizer:
    vocab_size = 100


def admitted(params: SamplingParams, generation: dict[str, Any] | None) -> SamplingParams:
    info = ModelInfo(name="m", context_length=64, created=0, tokenizer=Tokenizer(), format="safetensors",  # type: ignore[arg-type]
                     model_type="llama", metadata={"generation_defaults": generation} if generation else {})  # fmt: skip
    request = GenerationRequest(model="m", prompt_ids=[1, 2, 3], params=params)
    check_request(info, request, config=EngineConfig(), samplers=load_plugins().registries.samplers,
                  kv_bytes_per_token=0, state_bytes=0, queue_depth=0)  # fmt: skip
    return request.params


def params(sampling: SamplingConfig | None = None, **request: Any) -> SamplingParams:
    config = Config(models=[ModelConfig(path="unused")], sampling=sampling or SamplingConfig())
    return sampling_params(ServerContext(config=config, host=None, engine=None), **request)  # type: ignore[arg-type]


QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}


def test_a_request_that_says_nothing_samples_as_the_model_says() -> None:
    got = admitted(params(), QWEN3)
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (0.6, 0.95, 20, 1.05)
    assert got.max_tokens == 64 - 3  # the context left, under engine.default_max_tokens


def test_the_request_and_the_servers_sampling_section_win_over_the_model() -> None:
    got = admitted(params(temperature=0.0, top_k=5), QWEN3)
    assert (got.temperature, got.top_k, got.top_p) == (0.0, 5, 0.95)
    got = admitted(params(SamplingConfig(temperature=0.2)), QWEN3)
    assert (got.temperature, got.top_p) == (0.2, 0.95)


def test_without_model_defaults_the_built_in_ones_hold_and_bad_file_values_are_ignored() -> None:
    got = admitted(params(), None)
    built_in = SamplingConfig()
    assert (got.temperature, got.top_p, got.top_k, got.min_p) == (
        built_in.temperature, built_in.top_p, built_in.top_k, built_in.min_p)  # fmt: skip
    got = admitted(params(), {"temperature": 7.0, "top_p": "high", "do_sample": False})
    assert got.temperature == 0.0 and got.top_p == built_in.top_p  # do_sample false: greedy


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "min_p"])
def test_only_fields_nothing_set_are_left_to_the_model(field: str) -> None:
    assert field in params().defaulted
    assert field not in params(None, **{field: 1}).defaulted
