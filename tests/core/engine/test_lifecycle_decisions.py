"""The lifecycle's decisions alone (mlxr_core.engine.lifecycle), over a loader that only records:
which model the budget evicts, busy models kept, pins, idle expiry, unloads that wait."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxr_core.config.schema import Config, EngineConfig, ModelConfig
from mlxr_core.engine.lifecycle import ModelLifecycle, ModelSlot, estimated_footprint
from mlxr_core.errors import ConfigError, MlxrError, ModelUnavailable

SIZE = 100


class RecordingLoader:
    """Loads in no time; every model counts for SIZE bytes."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.running: set[str] = set()
        self.failed: dict[str, MlxrError] = {}

    def load(self, slot: ModelSlot) -> int:
        self.events.append(f"load {slot.name}")
        return SIZE

    def unload(self, slot: ModelSlot) -> None:
        self.events.append(f"unload {slot.name}")

    def busy(self, name: str) -> bool:
        return name in self.running

    def wanted(self, name: str) -> bool:
        return False

    def load_failed(self, slot: ModelSlot, error: MlxrError) -> None:
        self.failed[slot.name] = error


def lifecycle(budget: int | None, *pinned: str, names: str = "abcd") -> ModelLifecycle:
    models = [ModelConfig(path=f"/models/{name}.gguf", name=name, pin=name in pinned) for name in names]
    config = Config(models=models, engine=EngineConfig(memory_budget_bytes=budget))
    return ModelLifecycle(config, list(names), [Path(m.path) for m in models])


def loaded(life: ModelLifecycle, loader: RecordingLoader, *names: str) -> None:
    """Load ``names`` in order, each used a moment after the one before."""
    for tick, name in enumerate(names):
        life.slots[name].footprint = SIZE
        life.load_now(life.slots[name], loader)
        life.slots[name].last_used = float(tick)
    loader.events.clear()


def test_the_least_recently_used_idle_model_makes_room() -> None:
    life, loader = lifecycle(3 * SIZE), RecordingLoader()
    loaded(life, loader, "a", "b", "c")
    life.slots["d"].footprint = SIZE
    life.post("load", "d")
    life.tick(loader)
    assert loader.events == ["unload a", "load d"]
    assert life.unloads == {("a", "budget"): 1}


def test_a_busy_model_is_passed_over_and_an_all_busy_server_makes_the_load_wait() -> None:
    life, loader = lifecycle(2 * SIZE), RecordingLoader()
    loaded(life, loader, "a", "b")
    loader.running = {"a"}
    life.slots["c"].footprint = SIZE
    done = life.post("load", "c")
    life.tick(loader)
    assert loader.events == ["unload b", "load c"] and done.done()
    loader.events.clear()
    loader.running = {"a", "c"}
    waiting = life.post("load", "b")
    life.tick(loader)
    assert loader.events == [] and not waiting.done()
    loader.running = {"a"}
    life.tick(loader)
    assert loader.events == ["unload c", "load b"] and waiting.done()


def test_pinned_models_stay_and_one_that_cannot_fit_beside_them_is_refused() -> None:
    life, loader = lifecycle(2 * SIZE, "a"), RecordingLoader()
    loaded(life, loader, "a", "b")
    life.slots["c"].footprint = SIZE
    life.post("load", "c")
    life.tick(loader)
    assert loader.events == ["unload b", "load c"]  # a was used least recently, but is pinned
    life.slots["d"].footprint = 2 * SIZE
    refused = life.post("load", "d")
    life.tick(loader)
    with pytest.raises(ModelUnavailable, match=r"model 'd' needs 200 bytes.*pinned models hold 100"):
        refused.result(0)
    assert isinstance(loader.failed["d"], ModelUnavailable)
    with pytest.raises(ConfigError, match=r"engine\.memory_budget_bytes: model 'd' needs"):
        life.load_now(life.slots["d"], loader)


def test_idle_keep_alive_and_an_unload_that_waits_for_its_requests() -> None:
    life, loader = lifecycle(None, names="ab"), RecordingLoader()
    loaded(life, loader, "a", "b")
    life.post("keep_alive", "a", 0.0)
    life.tick(loader)
    assert loader.events == ["unload a"] and life.unloads == {("a", "idle"): 1}
    loader.running = {"b"}
    unloaded = life.post("unload", "b")
    life.tick(loader)
    assert not unloaded.done() and life.slots["b"].state == "loaded"
    loader.running = set()
    life.tick(loader)
    assert unloaded.done() and life.slots["b"].state == "unloaded"
    assert life.slots["b"].keep_alive is None  # its configured keep-alive again


def test_the_estimate_before_a_load_counts_the_projector_file(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"m" * 300)
    assert estimated_footprint(model) == 300
    (tmp_path / "mmproj-model.gguf").write_bytes(b"p" * 50)  # picked up beside it, as the load does
    assert estimated_footprint(model) == 350
    assert estimated_footprint(model, "none") == 300
    elsewhere = tmp_path / "other" / "mmproj.gguf"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"p" * 70)
    assert estimated_footprint(model, str(elsewhere)) == 370
    (tmp_path / "mmproj-second.gguf").write_bytes(b"p")  # two beside it: the load refuses, the estimate leaves them out
    assert estimated_footprint(model) == 300
