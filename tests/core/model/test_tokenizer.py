"""encode_within: a text's ids when it fits a limit, or proof that it does not from a head of it,
on real byte-level BPE vocabularies (the tiny Qwen2 and Gemma 3 fixtures' and a GGUF's), with the
characters the tokenizer was given counted."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import tokenizers

from mlxr_core.model.tokenizer import HEAD_MARGIN, encode_within
from mlxr_core.testing.tiny import write_tiny_llama_gguf

FIXTURES = Path(__file__).parents[2] / "fixtures" / "tiny_hf"


class Counting:
    """A tokenizer's ``encode``, counting the characters it is given."""

    def __init__(self, encode: object) -> None:
        self._encode = encode
        self.characters = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.characters += len(text)
        return self._encode(text, add_special_tokens)  # type: ignore[operator,no-any-return]


def hf(name: str) -> Counting:
    backend = tokenizers.Tokenizer.from_file(str(FIXTURES / name / "tokenizer.json"))
    return Counting(lambda text, special: backend.encode(text, add_special_tokens=special).ids)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Counting:
    import gguf as gguf_lib

    from mlxr_plugins.formats.gguf.tokenizer import GGUFTokenizerBackend, tokenizer_data_from_reader

    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf")
    built = GGUFTokenizerBackend().build(tokenizer_data_from_reader(gguf_lib.GGUFReader(path)), chat_template=None)
    return Counting(lambda text, special: built.encode(text, add_special_tokens=special))


@pytest.fixture(params=["qwen2", "gemma3", "gguf"])
def tokenizer(request: pytest.FixtureRequest, gguf: Counting) -> Counting:
    return gguf if request.param == "gguf" else hf(request.param)


def cjk(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(n))


PIECES = ["\u4e2d", "a", " ", "\n", "1", "é", "😀", "<|im_end|>", "the", "  ", "\t", "hello", " world"]


def mixed(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(PIECES) for _ in range(n))


def test_a_text_that_fits_gets_its_own_ids(tokenizer: Counting) -> None:
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    texts = ["", "hi", readme[:3000], " " * 5000, "a" * 3000, mixed(400, 1)]
    for text in texts:
        whole = tokenizer.encode(text)
        limit = max(len(whole), 1)
        for special in (True, False):
            assert encode_within(tokenizer, text, limit, add_special_tokens=special) == tokenizer.encode(
                text, add_special_tokens=special
            ), text[:40]


@pytest.mark.parametrize("seed", range(6))
def test_a_text_that_does_not_fit_gets_more_ids_than_the_limit_the_first_of_them_its_own(
    tokenizer: Counting, seed: int
) -> None:
    """Whatever the text and the limit, more than ``limit`` ids come back exactly when the whole
    text has more than ``limit`` tokens, and the first ``limit`` of them are the whole text's."""
    rng = random.Random(seed)
    text = mixed(rng.randint(300, 3000), seed)
    whole = tokenizer.encode(text, add_special_tokens=False)
    for limit in (1, 7, len(whole) // 5, len(whole) // 2, len(whole) - 1, len(whole), len(whole) + 3):
        ids = encode_within(tokenizer, text, max(limit, 1), add_special_tokens=False)
        limit = max(limit, 1)
        if len(whole) <= limit:
            assert ids == whole
        else:
            assert len(ids) == limit + 1 and ids == whole[: limit + 1], (seed, limit)


def test_one_token_a_character_stops_near_the_limit(tokenizer: Counting) -> None:
    """Random CJK, a token or more a character: 50 times the limit in characters, refused after
    tokenizing about the limit's worth of it (SmolLM2 took 1.78M tokens for 663K characters)."""
    limit = 256
    text = cjk(50 * limit)
    tokenizer.characters = 0
    ids = encode_within(tokenizer, text, limit)
    read = tokenizer.characters
    assert read <= 3 * (limit + HEAD_MARGIN), read
    assert ids == tokenizer.encode(text)[: limit + 1]


def test_a_long_text_that_fits_costs_at_most_about_twice_tokenizing_it(tokenizer: Counting) -> None:
    """Compressible text (runs of spaces: many characters a token) that fits: every head read on
    the way is shorter than the whole, each at least twice the one before."""
    text = ("word " * 40 + " " * 500 + "\n") * 30
    whole = tokenizer.encode(text)
    tokenizer.characters = 0
    assert encode_within(tokenizer, text, len(whole)) == whole
    assert tokenizer.characters <= 3 * len(text)
