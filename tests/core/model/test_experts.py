"""The streamed experts' cache (byte capacity, LRU and LFU, pinned entries), their /metrics
families, and models[].experts refused where nothing streams."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxr_core.config.schema import ExpertsConfig, ModelConfig
from mlxr_core.errors import ConfigError
from mlxr_core.http.metrics import Metrics
from mlxr_core.model.experts.cache import ExpertCache, LeastFrequentlyUsed, LeastRecentlyUsed
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins
from mlxr_core.testing.tiny import write_tiny_llama_gguf


def entry(nbytes: int) -> dict[str, mx.array]:
    return {"gate_proj.weight": mx.zeros((nbytes // 4,), dtype=mx.float32)}


def test_the_lru_cache_keeps_its_bytes_and_evicts_the_least_recently_used():
    cache = ExpertCache(300, LeastRecentlyUsed())
    for expert in range(3):
        cache.put((0, expert), entry(100))
    assert cache.get((0, 0)) is not None  # (0, 1) is now the least recently used
    cache.put((1, 0), entry(100))
    assert (0, 1) not in cache and all(key in cache for key in [(0, 0), (0, 2), (1, 0)])
    assert cache.nbytes == 300 and cache.evictions == 1


def test_the_lfu_cache_evicts_the_least_often_used_and_pinned_entries_stay():
    cache = ExpertCache(200, LeastFrequentlyUsed())
    cache.put((0, 0), entry(100))
    cache.put((0, 1), entry(100))
    for _ in range(3):
        cache.get((0, 0))
    cache.put((0, 2), entry(100))
    assert (0, 1) not in cache and (0, 0) in cache and (0, 2) in cache
    # A step whose experts alone exceed the budget keeps them all while it runs.
    cache.put((0, 3), entry(100), pinned=[(0, 0), (0, 2), (0, 3)])
    assert len(cache) == 3 and cache.nbytes == 300
    cache.shrink(set())
    assert cache.nbytes <= 200


class Stub:
    """What the metrics collector reads of an engine."""

    state = "created"

    def __init__(self, experts: dict[str, Any]):
        self.experts = experts

    def stats(self) -> dict[str, Any]:
        return {"experts": self.experts}


def test_metrics_show_the_streamed_experts():
    stats = {"requests": 10, "hits": 6, "waits": 1, "misses": 3, "bytes_read": 4096, "tokens": 8, "read_ahead": 2,
             "evictions": 5, "failed_reads": 0, "hit_rate": 0.6, "bytes_per_token": 512.0, "cache_bytes": 1000,
             "cache_capacity": 2000, "read_p50_seconds": 0.001, "read_p99_seconds": 0.004}  # fmt: skip
    text = Metrics(Stub({"moe": stats})).render().decode()  # type: ignore[arg-type]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    model = (("model", "moe"),)
    assert samples[("mlxr_experts_requests_total", (("found", "miss"), ("model", "moe")))] == 3
    assert samples[("mlxr_experts_hit_rate", model)] == 0.6
    assert samples[("mlxr_experts_read_bytes_total", model)] == 4096
    assert samples[("mlxr_experts_read_bytes_per_token", model)] == 512
    assert samples[("mlxr_experts_cache_capacity_bytes", model)] == 2000
    assert samples[("mlxr_experts_read_seconds", (("model", "moe"), ("quantile", "0.99")))] == 0.004
    assert "mlxr_experts" not in Metrics(Stub({})).render().decode()  # type: ignore[arg-type]


def test_streaming_a_model_without_experts_is_refused_naming_the_key(tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "dense.gguf")
    with pytest.raises(ConfigError, match=r"no mixture of experts") as caught:
        load_model(ModelConfig(path=str(path), experts=ExpertsConfig(residency="stream")), load_plugins().registries)
    assert caught.value.field == "models[].experts"


def test_the_budget_estimate_of_a_streamed_model_counts_its_resident_tensors_and_cache(tmp_path):
    """Before its first load, a streamed model counts the files' tensors but the routed experts
    (headers only), and its cache; resident, the whole files."""
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    from mlxr_core.engine.lifecycle import estimated_footprint

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": np.zeros((10, 4), np.float32),
               "model.layers.0.mlp.experts.3.up_proj.weight": np.zeros((100, 4), np.float32),
               "model.layers.0.mlp.shared_experts.up_proj.weight": np.zeros((5, 4), np.float32)},
              folder / "model.safetensors")  # fmt: skip
    assert estimated_footprint(folder, stream_cache=1000) == (10 + 5) * 16 + 1000
    assert estimated_footprint(folder) == (folder / "model.safetensors").stat().st_size

    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_tensor("token_embd.weight", np.zeros((10, 4), np.float32))
    writer.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((8, 100, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert estimated_footprint(path, stream_cache=1000) == 10 * 16 + 1000
