"""The engine in a process of its own (``engine.core: process``, :mod:`mlxr_core.engine.remote`):
the same tokens and answers as the engine thread, cancellation and jobs across the pipe, and a
dead engine process failing its requests; through ``mlxr serve``: streams, a client that leaves,
SIGTERM's drain and a killed engine process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
from mlxr_core.engine.engine import Engine
from mlxr_core.engine.remote import RemoteEngine, decode_error, encode_error, make_engine
from mlxr_core.engine.request import (
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
)
from mlxr_core.errors import ContextLengthExceeded, EngineStopped, ModelNotFound, UnknownName
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.serving import serve_command, start

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [30]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxr_core.testing.tiny import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def tiny_config(path: Path, core: str, **models: object) -> Config:
    return Config(
        models=[ModelConfig(path=str(path), name="tiny", context_length=128, **models)],  # type: ignore[arg-type]
        engine=EngineConfig(core=core, prefill_chunk=4),
    )


@pytest.fixture(scope="module")
def remote(tiny_path: Path) -> RemoteEngine:
    engine = make_engine(tiny_config(tiny_path, "process"), load_plugins())
    assert isinstance(engine, RemoteEngine)
    engine.start()
    yield engine
    engine.stop()
    assert engine.state == "stopped" and not engine._process.is_alive()


def request(prompt: list[int], **params: object) -> GenerationRequest:
    params.setdefault("max_tokens", 10)
    params.setdefault("extra", {"ignore_eos": True})
    return GenerationRequest(model="tiny", prompt_ids=list(prompt), params=SamplingParams(**params))  # type: ignore[arg-type]


def run_together(
    engine: Engine, requests: list[GenerationRequest], logprobs: list[list[TokenLogprob]] | None = None
) -> list[tuple[list[int], str, Finished | Failed]]:
    """Submit every request at once, then read each to its end (sync consumers); each one's
    logprobs into ``logprobs``."""
    logprobs = [] if logprobs is None else logprobs
    handles = [engine.submit(r) for r in requests]
    results = []
    for handle in handles:
        events = list(handle)
        deltas = [e for e in events if isinstance(e, Delta)]
        results.append(([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), events[-1]))
        logprobs.append([lp for d in deltas for lp in d.logprobs])
    return results


def test_greedy_and_seeded_tokens_match_the_engine_thread(tiny_path: Path, remote: RemoteEngine) -> None:
    thread = Engine(tiny_config(tiny_path, "thread"), load_plugins())
    thread.start()
    try:
        batches = [
            [request(p, temperature=0.0) for p in PROMPTS],
            [request(p, temperature=0.9, top_p=0.9, seed=7 + i) for i, p in enumerate(PROMPTS)],
            [request(PROMPTS[0], temperature=0.0, stop=["a"], max_tokens=16)],  # text matched by the core
            [request(p, temperature=0.0, logprobs=2) for p in PROMPTS[:2]],
        ]
        for batch in batches:
            our_logprobs: list[list[TokenLogprob]] = []
            their_logprobs: list[list[TokenLogprob]] = []
            ours = run_together(remote, batch, our_logprobs)
            theirs = run_together(thread, [attrs_copy(r) for r in batch], their_logprobs)
            assert [(ids, text) for ids, text, _ in ours] == [(ids, text) for ids, text, _ in theirs]
            # The same tokens and alternatives; the values within float32 noise: the two engines
            # may admit a batch's requests over different steps, and a row's sums then run in
            # another order (differences of ~1e-6 seen).
            assert [[(lp.token, [t for t, _ in lp.top]) for lp in row] for row in our_logprobs] == [
                [(lp.token, [t for t, _ in lp.top]) for lp in row] for row in their_logprobs
            ]
            for ours_row, theirs_row in zip(our_logprobs, their_logprobs, strict=True):
                for mine, reference in zip(ours_row, theirs_row, strict=True):
                    values = [mine.logprob, *(v for _, v in mine.top)]
                    expected = [reference.logprob, *(v for _, v in reference.top)]
                    assert values == pytest.approx(expected, abs=1e-4)
            if batch[0].params.logprobs is not None:
                assert all(len(lps) == 10 and len(lps[0].top) == 2 for lps in our_logprobs)
            for (_, _, end), (_, _, reference) in zip(ours, theirs, strict=True):
                assert isinstance(end, Finished) and isinstance(reference, Finished)
                assert (end.reason, end.usage) == (reference.reason, reference.usage)
    finally:
        thread.stop()


def test_requests_still_arriving_at_the_server_reach_the_core_together(tiny_path: Path) -> None:
    """The server's count of requests received and not yet submitted crosses with each submit: the
    idle core waits for those still counted (here up to 1 s), and four submitted 20 ms apart start
    in one step, their prompts prefilled together."""
    from mlxr_core.engine.request import ARRIVING

    config = tiny_config(tiny_path, "process")
    config.engine.arrivals_wait_ms = 1000.0
    remote = make_engine(config, load_plugins())
    assert isinstance(remote, RemoteEngine)
    remote.start()
    try:
        tickets = [remote.arrivals.arrive() for _ in range(4)]
        handles = []
        for prompt, ticket in zip([[5, 6], [12, 13], [20, 21], [30, 31]], tickets, strict=True):  # one step's budget
            token = ARRIVING.set(ticket)
            try:
                handles.append(remote.submit(request(prompt, temperature=0.0, max_tokens=3)))
            finally:
                ARRIVING.reset(token)
            time.sleep(0.02)
        for handle in handles:
            assert isinstance(list(handle)[-1], Finished)
        assert remote.arrivals.pending == 0
        deadline = time.monotonic() + 10  # the counters come with the core's next snapshot
        while remote.stats()["prompts_prefilled_together"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert remote.stats()["prompts_prefilled_together"] == 4, str(remote.stats())
    finally:
        remote.stop()


def test_the_core_is_told_when_the_count_empties_without_a_submit(
    remote: RemoteEngine, tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request counted when another was submitted, that then ends without a submit (a 400, a
    /tokenize, a client that left), must not keep an idle core waiting: the server tells the core
    the count emptied, and the core sets it."""
    from mlxr_core.engine.remote import ArrivalsEmptied, Cancel, Core, Submit
    from mlxr_core.engine.request import ARRIVING

    sent: list[object] = []
    monkeypatch.setattr(remote, "_send", lambda message: sent.append(message) or True)

    def submit_counted() -> None:
        token = ARRIVING.set(first)
        try:
            remote.submit(request([5, 6], max_tokens=1)).cancel()  # the pipe is stubbed: never runs
        finally:
            ARRIVING.reset(token)

    first, second = remote.arrivals.arrive(), remote.arrivals.arrive()
    submit_counted()
    assert [type(m) for m in sent] == [Submit, Cancel] and sent[0].arriving == 1  # type: ignore[attr-defined]  # the second still counted
    second.leave()  # answered without a submit
    assert sent[2:] == [ArrivalsEmptied()]
    first, sent[:] = remote.arrivals.arrive(), []
    submit_counted()  # alone: the submit told the core 0 already
    assert [type(m) for m in sent] == [Submit, Cancel] and sent[0].arriving == 0  # type: ignore[attr-defined]

    class Pipe:
        def send(self, message: object) -> None:
            pass

    engine = Engine(tiny_config(tiny_path, "thread"), load_plugins())  # not started: only its count
    core = Core(engine, Pipe())  # type: ignore[arg-type]
    engine.arrivals.set(1)  # what a submit said while the other request was still being read
    core.handle(ArrivalsEmptied())
    assert engine.arrivals.pending == 0


def attrs_copy(r: GenerationRequest) -> GenerationRequest:
    return request(r.prompt_ids, **{k: getattr(r.params, k) for k in ("temperature", "top_p", "seed", "stop", "max_tokens", "logprobs")})


def test_requests_are_validated_in_the_server_process(remote: RemoteEngine) -> None:
    with pytest.raises(ModelNotFound):
        remote.submit(GenerationRequest(model="nope", prompt_ids=[1]))
    with pytest.raises(ContextLengthExceeded):
        remote.submit(request([1] * 100, max_tokens=100))
    assert remote.encode("tiny", "hello") == remote.model("tiny").tokenizer.encode("hello")


def test_async_streams_cancellation_and_jobs_cross_the_pipe(remote: RemoteEngine) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        long = remote.submit(request(PROMPTS[0], max_tokens=100), loop=loop)
        short = remote.submit(request(PROMPTS[1], max_tokens=5), loop=loop)
        seen = 0
        async for event in long.events():
            seen += 1
            if seen == 3:
                long.cancel()
            if not isinstance(event, Delta):
                assert isinstance(event, Finished) and event.reason == "cancelled"
                assert event.usage.completion_tokens < 100
        events = [event async for event in short.events()]
        assert isinstance(events[-1], Finished) and events[-1].usage.completion_tokens == 5
        embedded = await remote.embed_async("tiny", [[5, 6, 7], [8]])
        assert len(embedded.vectors) == 2

    asyncio.run(scenario())
    thread_sum = remote.embed("tiny", [[5, 6, 7]])
    assert len(thread_sum.vectors[0]) > 0
    deadline = time.monotonic() + 5
    while remote.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert remote.running == 0 and remote.stats()["kv_bytes"] == 0


def test_lazy_loading_and_unloading_go_through_the_core(tiny_path: Path) -> None:
    engine = make_engine(tiny_config(tiny_path, "process", load="lazy"), load_plugins())
    engine.start()
    try:
        assert engine.served == ["tiny"] and engine.loaded_models() == []
        engine.ensure_loaded("tiny").result(60)
        assert [info.name for info, _ in engine.loaded_models()] == ["tiny"]
        (ids, _, end), = run_together(engine, [request(PROMPTS[0])])
        assert isinstance(end, Finished) and len(ids) == 10
        engine.unload_model("tiny").result(30)
        assert engine.loaded_models() == []
        assert engine.stats()["lifecycle"]["unloads"]
    finally:
        engine.stop()


def test_a_dead_engine_process_fails_its_requests(tiny_path: Path) -> None:
    engine = make_engine(tiny_config(tiny_path, "process"), load_plugins())
    lost = threading.Event()
    engine.on_lost = lost.set
    engine.start()
    handle = engine.submit(request(PROMPTS[0], max_tokens=120))
    events = [next(iter(handle))]
    os.kill(engine._process.pid, signal.SIGKILL)
    events += list(handle)
    assert lost.wait(10)
    if isinstance(events[-1], Failed):  # or it had finished before the kill
        assert "ended unexpectedly (signal SIGKILL)" in events[-1].error.message
    assert engine.state == "failed" and isinstance(engine.error, EngineStopped)
    with pytest.raises(EngineStopped):
        engine.submit(request(PROMPTS[1]))
    engine.stop()


def test_errors_cross_whole_even_when_they_do_not_pickle() -> None:
    error = decode_error(encode_error(UnknownName("kernel", "fast", ["mlx_fast", "cpu_native"])))
    assert isinstance(error, UnknownName) and error.available == ["cpu_native", "mlx_fast"]
    assert str(error).startswith("unknown kernel 'fast'")
    plain = decode_error(encode_error(ValueError("boom")))
    assert type(plain).__name__ == "MlxrError" and "ValueError: boom" in str(plain)


# -- through mlxr serve -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_config(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tmp_path_factory.mktemp("serve") / "server.yaml"
    config.write_text(
        f"models:\n  - path: {tiny_path}\n    name: tiny\n    context_length: 4096\n"
        "engine:\n  max_batch_size: 8\n  core: process\n"
        "server:\n  shutdown_timeout: 1.0\n"
    )
    return config


def stream(url: str, body: dict[str, object], lines: list[str], first: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as reply:
        for line in reply.iter_lines():
            if line:
                lines.append(line)
                first.set()
    first.set()


def streaming(url: str, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    """One stream of ``max_tokens`` tokens read into a list by a thread, once its first chunk came."""
    lines: list[str] = []
    first = threading.Event()
    body = {"model": "tiny", "prompt": "the", "max_tokens": max_tokens, "ignore_eos": True}
    thread = threading.Thread(target=stream, args=(url, body, lines, first), daemon=True)
    thread.start()
    assert first.wait(30)
    return thread, lines


def engine_pid(server: subprocess.Popen[str]) -> int:
    children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    assert len(children) >= 1, "no engine process"
    return int(children[-1])


def test_serve_streams_cancels_a_client_that_leaves_and_drains_on_sigterm(serve_config: Path) -> None:
    server, url, output = start(serve_command(serve_config))
    try:
        reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 3})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
        health = httpx.get(f"{url}/health").json()
        assert health["state"] == "ready" and health["memory"]["active_bytes"] > 0
        time.sleep(0.5)  # the engine process reports its counters every 0.25 s
        counters = dict(line.split(" ") for line in httpx.get(f"{url}/metrics").text.splitlines()
                        if line.startswith("mlxr_engine_step"))  # fmt: skip
        # A prefill and at least two decode steps, timed.
        assert float(counters["mlxr_engine_steps_total"]) >= 3
        assert float(counters["mlxr_engine_step_seconds_total"]) > 0
        # A client that leaves mid-stream: the engine frees its row.
        with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
            "model": "tiny", "prompt": "the", "max_tokens": 4000, "ignore_eos": True, "stream": True,
        }) as leaving:  # fmt: skip
            next(leaving.iter_lines())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "mlxr_requests_running 0.0" not in httpx.get(f"{url}/metrics").text:
            time.sleep(0.1)
        assert "mlxr_requests_running 0.0" in httpx.get(f"{url}/metrics").text
        # SIGTERM during eight streams: each ends whole or with an error event; exit 0.
        lengths = [3, 3] + [4000] * 6
        streams: list[list[str]] = [[] for _ in lengths]
        first = [threading.Event() for _ in lengths]
        threads = [
            threading.Thread(target=stream, args=(url, {"model": "tiny", "prompt": "the", "max_tokens": n,
                                                         "ignore_eos": True}, streams[i], first[i]), daemon=True)
            for i, n in enumerate(lengths)
        ]  # fmt: skip
        for thread in threads:
            thread.start()
        assert all(event.wait(30) for event in first)
        core = engine_pid(server)
        server.send_signal(signal.SIGTERM)
        server.wait(40)
    finally:
        server.kill()
    for thread in threads:
        thread.join(5)
    assert server.returncode == 0, "".join(output)
    assert "Traceback" not in "".join(output) and not Path(f"/proc/{core}").exists()
    ends = [json.loads(lines[-2].removeprefix("data: ")) for lines in streams]
    assert all(lines[-1] == "data: [DONE]" for lines in streams)
    cut = [end for end in ends if "error" in end]
    assert all("shutting down" in end["error"]["message"] for end in cut)
    assert len(ends) - len(cut) >= 2 and len(cut) >= 1


def test_ctrl_c_to_the_process_group_drains_instead_of_killing_the_engine(serve_config: Path) -> None:
    """A terminal's Ctrl-C reaches the engine process too; it leaves the signal to the server,
    whose drain lets a short stream finish whole; both processes end, the server with 0."""
    server, url, output = start(serve_command(serve_config), new_session=True)
    try:
        thread, lines = streaming(url, 40)
        core = engine_pid(server)
        os.killpg(server.pid, signal.SIGINT)
        server.wait(30)
    finally:
        server.kill()
    thread.join(5)
    assert server.returncode == 0, "".join(output)
    assert not Path(f"/proc/{core}").exists()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_serve_exits_non_zero_when_its_engine_process_dies(serve_config: Path) -> None:
    server, url, output = start(serve_command(serve_config))
    try:
        thread, lines = streaming(url, 4000)
        os.kill(engine_pid(server), signal.SIGKILL)
        server.wait(30)
    finally:
        server.kill()
    thread.join(5)
    assert server.returncode == 1, "".join(output)
    assert "the engine process ended unexpectedly (signal SIGKILL)" in "".join(output)
    assert lines[-1] == "data: [DONE]"
    assert "ended unexpectedly" in json.loads(lines[-2].removeprefix("data: "))["error"]["message"]

