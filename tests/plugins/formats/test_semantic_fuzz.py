"""The loaders' semantic fuzzer, its deterministic slice: 200 valid files (GGUF and ``config.json``
folders) holding absurd values in the keys the loaders read, loaded through the whole pipeline in
one child process (:mod:`mlxr_core.testing.loader_fuzz`): no internal error, no signal, no model
that loads and gives non-finite logits, every error naming its file and a key or tensor, peak
memory within twice the file. The long run is ``python bench/fuzz_loaders.py --cases 2000``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from mlxr_core.testing import loader_fuzz as fuzz
from mlxr_core.testing.tiny import write_tiny_llama_gguf

HF_LLAMA = Path(__file__).parents[2] / "fixtures" / "tiny_hf" / "llama"
#: Cases in the CI's slice, spread over the 2,000 of the long run.
SLICE = 200


def test_a_slice_of_the_semantic_fuzzer_finds_nothing(tmp_path: Path) -> None:
    good = write_tiny_llama_gguf(tmp_path / "good.gguf")
    cases = fuzz.spread(fuzz.all_cases(2000), SLICE)
    paths = {fuzz.write_case(case, good, HF_LLAMA, tmp_path / f"case{i}"): case for i, case in enumerate(cases)}
    outcomes, death = fuzz.load_in_child(fuzz.warmups(good, HF_LLAMA, tmp_path), list(paths), forward=True)
    assert death is None, death
    assert fuzz.problems(paths, outcomes) == []
    kinds = Counter(case.kind for case in cases)
    results = Counter(outcome["result"] for outcome in outcomes.values())
    assert kinds["gguf"] > 50 and kinds["config"] > 50, kinds
    assert results["error"] > SLICE // 2, results  # the slice is absurd, not merely unusual
