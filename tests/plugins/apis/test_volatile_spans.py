"""Volatile system prompt spans (``engine.prefix_cache.volatile_spans``): Claude Code's
``cch=<hash>`` removed before tokenizing, so consecutive requests share their cached prefix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from scripted import FakeEngine, make_ctx

from mlxr_core.config.schema import Config, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.http.context import ServerContext
from mlxr_core.http.server import build_app
from mlxr_core.plugins import load_plugins

MESSAGES = "/v1/messages"


def claude_code(cch: str, model: str = "fake", question: str = "hi") -> dict[str, Any]:
    """A request shaped as Claude Code sends it: the billing header as the first system block."""
    header = f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={cch};"
    return {
        "model": model,
        "max_tokens": 2,
        "system": [
            {"type": "text", "text": header},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": question}],
    }


def text_of(ids: list[int]) -> str:
    """The scripted tokenizer's ids (a text's bytes) as text."""
    return bytes(ids).decode()


def prompts(spans: list[str] | None) -> list[list[int]]:
    fake = FakeEngine(context_length=1024)
    ctx = make_ctx(fake)
    if spans is not None:
        ctx.config.engine.prefix_cache.volatile_spans = spans
    with TestClient(build_app(ctx)) as client:
        for cch in ("fa690", "0b1c2"):
            assert client.post(MESSAGES, json=claude_code(cch)).status_code == 200
    return [request.prompt_ids for request in fake.requests]


def test_the_hash_is_removed_by_default_and_the_rest_of_the_header_kept() -> None:
    first, second = prompts(None)
    assert first == second
    text = text_of(first)
    assert "cch=" not in text and "cc_version=2.1.37.0d9; cc_entrypoint=cli;" in text


def test_no_spans_leaves_the_prompt_as_sent() -> None:
    first, second = prompts([])
    assert first != second and "cch=fa690;" in text_of(first)


def test_a_pattern_without_groups_removes_its_whole_match_and_user_text_is_untouched() -> None:
    fake = FakeEngine(context_length=1024)
    ctx = make_ctx(fake)
    ctx.config.engine.prefix_cache.volatile_spans = [r"request-id: \d+\n"]
    with TestClient(build_app(ctx)) as client:
        body = {"model": "fake", "max_tokens": 2, "system": "request-id: 42\nbe brief",
                "messages": [{"role": "user", "content": "request-id: 7\n"}]}  # fmt: skip
        assert client.post(MESSAGES, json=body).status_code == 200
        chat = {"model": "fake", "max_tokens": 2, "messages": [
            {"role": "system", "content": "request-id: 42\nbe brief"}, {"role": "user", "content": "hi"}]}  # fmt: skip
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
    anthropic_text, chat_text = (text_of(r.prompt_ids) for r in fake.requests)
    assert anthropic_text == "<system>be brief<user>request-id: 7\n<assistant>"
    assert chat_text == "<system>be brief<user>hi<assistant>"


@pytest.mark.parametrize("spans", [["("], ["ok", "[a-"]])
def test_a_bad_pattern_is_a_config_error_naming_the_key(tmp_path, spans: list[str]) -> None:
    import yaml

    from mlxr_core.config.loader import load_config
    from mlxr_core.errors import ConfigError

    path = tmp_path / "server.yaml"
    path.write_text(
        yaml.safe_dump(
            {"models": [{"path": "x"}], "engine": {"prefix_cache": {"volatile_spans": spans}}}
        )
    )
    with pytest.raises(
        ConfigError, match=r"engine\.prefix_cache\.volatile_spans.*not a regular expression"
    ):
        load_config(path, environ={})


@pytest.fixture(scope="module")
def tiny_client(tiny_model_path: Path) -> Iterator[TestClient]:
    """The real engine serving the tiny model as ``tiny`` with its whole context (512)."""
    config = Config(
        models=[ModelConfig(path=str(tiny_model_path), name="tiny")], apis=["anthropic"]
    )
    host = load_plugins()
    engine = Engine(config, host)
    engine.start()
    try:
        with TestClient(
            build_app(ServerContext(config=config, host=host, engine=engine))
        ) as client:
            yield client
    finally:
        engine.stop()


def test_the_second_request_reads_the_shared_prefix_from_the_cache(tiny_client: TestClient) -> None:
    """The real engine on the tiny model: the second request, differing only in ``cch``, reads
    the whole prompt but the tokens its answer starts after from the prefix cache."""
    first = tiny_client.post(MESSAGES, json=claude_code("fa690", model="tiny")).json()["usage"]
    second = tiny_client.post(MESSAGES, json=claude_code("0b1c2", model="tiny")).json()["usage"]
    prompt = sum(
        first[key]
        for key in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    )
    assert first["cache_read_input_tokens"] == 0 and first["cache_creation_input_tokens"] >= 16
    assert (
        sum(
            second[key]
            for key in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        )
        == prompt
    )
    # What the first request stored (its whole prompt) is read back; only the rest is prefilled.
    assert second["cache_read_input_tokens"] == first["cache_creation_input_tokens"]
    assert second["input_tokens"] + second["cache_creation_input_tokens"] < 2


def test_without_a_cache_control_breakpoint_cache_writes_count_as_input(tiny_client: TestClient) -> None:
    """Anthropic reports cache writes only where a request marks a breakpoint; mlxr's own
    caching of an unmarked prompt is input_tokens (it said input_tokens 1, cache_creation 25)."""
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "an unmarked question"}]}
    usage = tiny_client.post(MESSAGES, json=body).json()["usage"]
    counted = tiny_client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    assert usage["cache_creation_input_tokens"] == 0 and usage["cache_read_input_tokens"] == 0
    assert usage["input_tokens"] == counted
    body["messages"][0]["content"] = [{"type": "text", "text": "a marked question", "cache_control": {"type": "ephemeral"}}]
    usage = tiny_client.post(MESSAGES, json=body).json()["usage"]
    assert usage["cache_creation_input_tokens"] > 0


def test_the_default_pattern_matches_a_header_only_where_a_line_starts() -> None:
    """Anchored: the text of a prompt that only mentions the header mid-line is kept, and a prompt
    of the header repeated on one line is scanned once, not once per occurrence to the line's end."""
    import re

    from mlxr_core.chat.prompt import remove_spans
    from mlxr_core.config.schema import DEFAULT_VOLATILE_SPANS

    patterns = [re.compile(p) for p in DEFAULT_VOLATILE_SPANS]
    mid_line = "say x-anthropic-billing-header: cch=fa690;"
    assert remove_spans(mid_line, patterns) == mid_line
    one_line = "x-anthropic-billing-header: cc_version=1; " * 2000 + "cch=fa690;"
    assert remove_spans(one_line, patterns) == one_line  # the hash is past the header's 256 characters


def test_every_match_of_many_is_removed() -> None:
    import re

    from mlxr_core.chat.prompt import remove_spans
    from mlxr_core.config.schema import DEFAULT_VOLATILE_SPANS

    patterns = [re.compile(p) for p in DEFAULT_VOLATILE_SPANS]
    text = "".join(f"x-anthropic-billing-header: cc_entrypoint=cli; cch={i:05x};\nline {i}\n" for i in range(5000))
    out = remove_spans(text, patterns)
    assert "cch=" not in out
    assert out.count("x-anthropic-billing-header: cc_entrypoint=cli;\n") == 5000 and "line 4999\n" in out
    assert remove_spans("a-b-c", [re.compile(r"(-)b"), re.compile("c")]) == "ab-"
