"""An adapter that is not resident is read off the engine thread: a running stream keeps
decoding while the file is read (the read held on an Event here), and the request that needs the
adapter runs once it is swapped in, in place of the least recently used one, as PEFT computes; an
engine job under an adapter (decisions' option scoring) waits for its read the same way and holds
its slot only while it runs."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from mlxr_core.config.schema import AdapterConfig, Config, EngineConfig, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.request import Delta, Finished, GenerationRequest, SamplingParams
from mlxr_core.plugins import load_plugins

pytest.importorskip("torch", reason="the reference needs torch (CPU)")
pytest.importorskip("transformers", reason="the reference needs transformers")
pytest.importorskip("peft", reason="the reference needs peft")

from mlxr_core.testing.lora_reference import LoraReference, lora_reference

PROMPT = [5, 9, 17, 33, 2, 71, 40, 8, 13]
#: One adapter each, smallest shapes: "qv" is resident from the start, "mlp" replaces it.
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=2, lora_alpha=4, target_modules=["down_proj"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> LoraReference:
    return lora_reference(tmp_path_factory.mktemp("lora"), [PROMPT], ADAPTERS)


def request(model: str, max_tokens: int) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra={"ignore_eos": True})
    return GenerationRequest(model=model, prompt_ids=list(PROMPT), params=params)


def start(reference: LoraReference) -> Engine:
    """The tiny model with both adapters and one slot (qv resident from the start)."""
    model = ModelConfig(path=str(reference.base), name="tiny", dtype="float32", context_length=128, max_adapters=1,
                        adapters=[AdapterConfig(name, str(reference.root / name)) for name in ADAPTERS])  # fmt: skip
    engine = Engine(Config(models=[model], engine=EngineConfig(max_batch_size=4)), load_plugins())
    engine.start()
    return engine


def test_a_stream_decodes_on_while_an_adapter_is_read(reference: LoraReference) -> None:
    import torch

    engine = start(reference)
    started, release = threading.Event(), threading.Event()
    #: Per read: its thread, and whether it was let go (not left to time out on a stalled engine).
    readers: list[tuple[str, bool]] = []
    try:
        adapters = engine._loaded["tiny"].adapters
        assert adapters is not None and list(adapters.resident) == ["qv"]
        read = adapters.read
        assert read is not None

        def held_read(path: Path) -> Any:
            started.set()
            # Let go once the stream has stepped on; a stalled engine never steps, the wait ends
            # unanswered (the only timeout here, a guard against a hang) and the test fails.
            readers.append((threading.current_thread().name, release.wait(30)))
            return read(path)

        adapters.read = held_read
        stream = iter(engine.submit(request("tiny", 60)))
        assert isinstance(next(stream), Delta)
        waiting = engine.submit(request("tiny:mlp", 6))
        assert started.wait(60)
        steps = engine.stats()["steps"]
        while engine.stats()["steps"] < steps + 3:  # the stream steps on while the file is read
            assert isinstance(next(stream), Delta)
        release.set()
        events = list(waiting)
        rest = list(stream)
    finally:
        release.set()
        engine.stop()
    assert len(readers) == 1 and readers[0][0] != "mlxr-engine" and readers[0][1]
    assert isinstance(events[-1], Finished) and isinstance(rest[-1], Finished)
    assert list(adapters.resident) == ["mlp"]  # in place of qv, which no request used
    with torch.no_grad():
        want = reference.merged("mlp").generate(torch.tensor([PROMPT]), max_new_tokens=6, min_new_tokens=6,
                                                do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == want[0, len(PROMPT) :].tolist()


def test_option_scoring_under_an_adapter_reads_it_then_lets_its_slot_go(reference: LoraReference) -> None:
    """Scores for mlp (not resident: read for the job) and then for qv (in mlp's place: the job
    let its slot go) equal the softmax over the options of PEFT's merged model's last logits."""
    import asyncio

    import torch

    options = [[5], [7], [11]]
    engine = start(reference)
    try:
        got = {name: asyncio.run(engine.option_scores_async(f"tiny:{name}", [PROMPT], [options])).scores[0] for name in ("mlp", "qv")}
        adapters = engine._loaded["tiny"].adapters
        assert adapters is not None and list(adapters.resident) == ["qv"] and not adapters.held
    finally:
        engine.stop()
    for name, scores in got.items():
        with torch.no_grad():
            logits = reference.merged(name)(torch.tensor([PROMPT])).logits[0, -1].double()
        want = torch.log_softmax(logits[[ids[0] for ids in options]], 0).tolist()
        assert scores == pytest.approx(want, abs=1e-4), name


def test_an_adapter_given_another_file_while_it_is_read_serves_the_new_one(reference: LoraReference) -> None:
    """A read that finishes after its adapter's name was given another file (Ollama's create
    over an existing name) is not swapped in: the new file is read, and served."""
    engine = start(reference)
    try:
        adapters = engine._loaded["tiny"].adapters
        assert adapters is not None and adapters.read is not None
        read, started, release = adapters.read, threading.Event(), threading.Event()

        def held_read(path: Path) -> Any:
            started.set()
            release.wait(30)
            return read(path)

        adapters.read = held_read
        waiting = engine.submit(request("tiny:mlp", 6))
        assert started.wait(30)
        adapters.configured["mlp"] = str(reference.root / "qv")  # as the engine thread would, between steps
        release.set()
        events = list(waiting)
        same = list(engine.submit(request("tiny:qv", 6)))
    finally:
        release.set()
        engine.stop()
    assert isinstance(events[-1], Finished) and isinstance(same[-1], Finished)
    tokens = [[t for e in run if isinstance(e, Delta) for t in e.token_ids] for run in (events, same)]
    assert tokens[0] == tokens[1]  # mlp's name now serves qv's file


def test_a_stream_decodes_on_while_a_created_adapters_file_is_read(reference: LoraReference) -> None:
    """Ollama's create (an engine job) reads the new adapter's file off the engine thread too: the
    job waits while the read is held and the running stream steps on; once let go, the name
    serves the file as PEFT's merge computes, in the slot of the adapter no request used."""
    import torch

    engine = start(reference)
    started, release = threading.Event(), threading.Event()
    readers: list[tuple[str, bool]] = []
    try:
        adapters = engine._loaded["tiny"].adapters
        assert adapters is not None and list(adapters.resident) == ["qv"]
        read = adapters.read
        assert read is not None

        def held_read(path: Path) -> Any:
            started.set()
            readers.append((threading.current_thread().name, release.wait(30)))  # see the first test
            return read(path)

        adapters.read = held_read
        stream = iter(engine.submit(request("tiny", 60)))
        assert isinstance(next(stream), Delta)
        created = engine.create_adapter("tiny", "pirate", str(reference.root / "mlp"))
        assert started.wait(60)
        steps = engine.stats()["steps"]
        while engine.stats()["steps"] < steps + 3:  # the stream steps on while the file is read
            assert isinstance(next(stream), Delta)
        assert not created.done()
        release.set()
        assert created.result(60) is True
        events = list(engine.submit(request("pirate", 6)))
        rest = list(stream)
    finally:
        release.set()
        engine.stop()
    assert len(readers) == 1 and readers[0][0] != "mlxr-engine" and readers[0][1]
    assert isinstance(events[-1], Finished) and isinstance(rest[-1], Finished)
    assert list(adapters.resident) == ["pirate"]  # in qv's slot: no request used qv
    with torch.no_grad():
        want = reference.merged("mlp").generate(torch.tensor([PROMPT]), max_new_tokens=6, min_new_tokens=6,
                                                do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == want[0, len(PROMPT) :].tolist()
