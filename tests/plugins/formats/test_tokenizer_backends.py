"""The ``hf``, ``sentencepiece`` and ``tiktoken`` backends, byte for byte against their references.

- ``hf``: transformers' ids for the corpus through the committed tiny folders' tokenizers
  (``tests/fixtures/tiny_hf/reference.json``, recorded by ``make_transformers_reference.py``), and,
  where transformers is installed, ``PreTrainedTokenizerFast`` live on tokenizers trained here;
- ``sentencepiece``: SentencePiece itself on models trained here with its trainer;
- ``tiktoken``: tiktoken itself on a rank file written here.
"""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from mlxr_core.errors import MissingDependency, ModelLoadError, RequestError
from mlxr_core.model.tokenizer import Tokenizer
from mlxr_plugins.formats.safetensors.hf_tokenizer import HFTokenizerBackend
from mlxr_plugins.formats.safetensors.sentencepiece_tokenizer import SentencePieceTokenizerBackend
from mlxr_plugins.formats.safetensors.tiktoken_tokenizer import (
    DEFAULT_PATTERN,
    TiktokenTokenizerBackend,
)
from mlxr_plugins.formats.safetensors.tokenizer import read_chat_template, tokenizer_spec

TESTS = Path(__file__).parents[2]
CORPUS = (TESTS / "data" / "tokenizer_corpus.txt").read_text(encoding="utf-8")
TEXTS = [*CORPUS.splitlines(), CORPUS, "", "trailing newline\n", " " * 17 + "x\t\t\n\n\n"]
TINY_HF = TESTS / "fixtures" / "tiny_hf"
REFERENCE = json.loads((TINY_HF / "reference.json").read_text(encoding="utf-8"))
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_from_folder(folder: Path) -> Any:
    """The folder's tokenizer as the safetensors format hands it to its backend."""
    spec = tokenizer_spec(folder, eos_token_ids=[], vocab_size=None)
    assert spec is not None
    backends = {
        "hf": HFTokenizerBackend(),
        "sentencepiece": SentencePieceTokenizerBackend(),
        "tiktoken": TiktokenTokenizerBackend(),
    }
    config = spec.data["tokenizer_config"]
    return backends[spec.kind].build(spec.data, chat_template=read_chat_template(folder, config))


# --- hf ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("folder", ["qwen2", "llama"])
def test_hf_matches_transformers_on_the_corpus(folder):
    tokenizer = build_from_folder(TINY_HF / folder)
    reference = REFERENCE[folder]["tokenizer"]
    texts = REFERENCE["tokenizer_texts"]
    assert len(texts) > 70
    for text, ids in zip(texts, reference["ids"], strict=True):
        assert tokenizer.encode(text) == ids, text
    for key, skip in (("decoded", False), ("decoded_skipping", True)):
        for text, ids, out in zip(texts, reference["ids"], reference[key], strict=True):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == (text if out is None else out)


@pytest.mark.parametrize("folder", ["qwen2", "llama"])
def test_hf_chat_prompt_renders_and_encodes_as_transformers_does(folder):
    tokenizer = build_from_folder(TINY_HF / folder)
    reference = REFERENCE[folder]
    prompt = tokenizer.apply_chat_template(reference["messages"])
    assert prompt == reference["texts"]["chat"]
    assert tokenizer.encode(prompt, add_special_tokens=False) == reference["prompts"]["chat"]
    assert tokenizer.encode(reference["texts"]["plain"]) == reference["prompts"]["plain"]


def test_hf_special_tokens_bos_and_end_ids():
    llama = build_from_folder(TINY_HF / "llama")
    assert isinstance(llama, Tokenizer)
    assert (llama.bos_token, llama.bos_token_id, llama.add_bos) == ("<|begin_of_text|>", 0, True)
    assert llama.eos_token == "<|eot_id|>" and {4, 1} <= llama.eos_token_ids
    assert llama.encode("hi", add_special_tokens=False)[0] != 0
    qwen = build_from_folder(TINY_HF / "qwen2")
    assert qwen.bos_token_id is None and not qwen.add_bos
    # <|im_end|> is the EOS; <|endoftext|> is a known end-of-text special token.
    assert qwen.eos_token_ids == {2, 0} and qwen.vocab_size == 384
    assert qwen.encode("<|im_start|>user") == [1, *qwen.encode("user")]
    assert qwen.decode([1, 5000, -1]) == ""  # special skipped, unknown ids dropped


def test_hf_incomplete_utf8_decodes_to_replacement():
    qwen = build_from_folder(TINY_HF / "qwen2")
    ids = qwen.encode("😀")
    assert len(ids) > 1 and qwen.decode(ids[:-1]).endswith("\ufffd")


def test_hf_unreadable_tokenizer_json_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: unreadable tokenizer\.json"):
        build_from_folder(tmp_path)


def train_byte_level_bpe() -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS.splitlines(), trainer)
    return backend


def train_metaspace_bpe() -> Any:
    """A Llama 2 / Mistral style tokenizer.json: ``▁`` for spaces, byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False, limit_alphabet=120)
    trained.train_from_iterator(CORPUS.splitlines(), trainer)
    model = json.loads(trained.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256))]
    pieces += [t for t in sorted(model["vocab"], key=model["vocab"].get) if t not in pieces]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    backend = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(pieces)},
            merges=merges,
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    backend.normalizer = trained.normalizer
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(specials)
    return backend


# transformers 5 ignores add_bos_token/add_eos_token when a tokenizer.json exists: the last two
# cases check that we do the same, in both directions.
HF_CASES = {
    "byte-level, no post-processor": (train_byte_level_bpe, {"eos_token": "<|im_end|>"}),
    "metaspace, post-processor adds bos": (
        train_metaspace_bpe,
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "post_processor": True},
    ),
    "byte-level, config flags without a post-processor": (
        train_byte_level_bpe,
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True},
    ),
    "metaspace, config flag against the post-processor": (
        train_metaspace_bpe,
        {"bos_token": "<s>", "add_bos_token": False, "post_processor": True},
    ),
}


def write_hf_case(folder: Path, case: str) -> None:
    from tokenizers import processors

    train, config = HF_CASES[case]
    backend = train()
    config = dict(config)
    if config.pop("post_processor", False):
        bos = backend.token_to_id("<s>")
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("case", "adds_bos"),
    [
        ("metaspace, post-processor adds bos", True),
        ("metaspace, config flag against the post-processor", True),
        ("byte-level, config flags without a post-processor", False),
    ],
)
def test_hf_bos_comes_from_the_post_processor(tmp_path, case, adds_bos):
    write_hf_case(tmp_path, case)
    ours = build_from_folder(tmp_path)
    assert ours.bos_token == "<s>" and ours.add_bos is adds_bos
    assert (ours.encode("hi")[0] == ours.bos_token_id) is adds_bos
    assert ours.encode("hi")[-1] != ours.encode("</s>", add_special_tokens=False)[0]


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_matches_pretrained_tokenizer_fast(tmp_path, case):
    transformers = pytest.importorskip("transformers")
    write_hf_case(tmp_path, case)
    ours = build_from_folder(tmp_path)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    for text in [*TEXTS, "<s>hello</s> <|im_start|>x<|im_end|>"]:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert (
            ours.encode(text, add_special_tokens=False)
            == theirs(text, add_special_tokens=False)["input_ids"]
        )
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.add_bos == (theirs("a")["input_ids"][0] == theirs.bos_token_id)


# --- sentencepiece ----------------------------------------------------------------------------

SPM_SPECIALS = ["<start_of_turn>", "<end_of_turn>"]


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def spm_folder(request, tmp_path_factory) -> Path:
    """A SentencePiece model trained on the corpus (byte fallback, two user-defined pieces) with a
    Gemma-like tokenizer_config.json; one added token lies beyond the SentencePiece vocab."""
    import sentencepiece

    folder = tmp_path_factory.mktemp(f"spm-{request.param}")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_prefix=str(folder / "tokenizer"),
        model_type=request.param,
        vocab_size=1000,
        hard_vocab_limit=False,
        character_coverage=0.98,
        byte_fallback=True,
        user_defined_symbols=SPM_SPECIALS,
        minloglevel=2,
        num_threads=1,
    )
    processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    size = processor.get_piece_size()
    added = {
        str(i): {"content": processor.id_to_piece(i), "special": True}
        for i in (0, 1, 2, *map(processor.piece_to_id, SPM_SPECIALS))
    }
    added[str(size)] = {"content": "<|extra|>", "special": False}
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "added_tokens_decoder": added,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def spm_processor(folder: Path) -> Any:
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


def expected_spm_ids(sp: Any, specials: dict[str, int], text: str) -> list[int]:
    """SentencePiece on each piece of text between special tokens (``legacy`` behaviour)."""
    ids: list[int] = []
    pattern = "(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")"
    for part in re.split(pattern, text):
        if part in specials:
            ids.append(specials[part])
        elif part:
            ids.extend(sp.encode(part))
    return ids


def test_sentencepiece_matches_sentencepiece_on_the_corpus(spm_folder):
    ours = build_from_folder(spm_folder)
    sp = spm_processor(spm_folder)
    assert isinstance(ours, Tokenizer) and ours.add_bos and ours.bos_token_id == sp.bos_id()
    specials = {"<s>": 1, "</s>": 2, "<unk>": 0, "<|extra|>": sp.get_piece_size()}
    specials |= {t: sp.piece_to_id(t) for t in SPM_SPECIALS}
    for text in TEXTS:
        ids = sp.encode(text)
        if not any(s in text for s in specials):
            assert ours.encode(text, add_special_tokens=False) == ids, text
            assert ours.decode(ids) == sp.decode(ids), text
        assert ours.encode(text) == [1, *expected_spm_ids(sp, specials, text)], text
        # Not skipping, user-defined pieces (<start_of_turn>) render as SentencePiece renders them.
        assert ours.decode(ids, skip_special_tokens=False) == sp.decode(ids), text


def test_sentencepiece_special_tokens(spm_folder):
    ours = build_from_folder(spm_folder)
    sp = spm_processor(spm_folder)
    start, end = (sp.piece_to_id(t) for t in SPM_SPECIALS)
    ids = ours.encode("<start_of_turn>user\nHi<end_of_turn><|extra|>")
    assert ids == [1, start, *sp.encode("user\nHi"), end, sp.get_piece_size()]
    assert ours.decode(ids) == sp.decode(sp.encode("user\nHi")) + "<|extra|>"
    assert ours.decode(ids, skip_special_tokens=False).startswith("<s><start_of_turn>")
    assert ours.eos_token_ids == {2, end}  # </s>, and <end_of_turn> ends a Gemma turn
    assert ours.vocab_size == sp.get_piece_size() + 1
    assert ours.decode([10**6, -5]) == ""


def test_sentencepiece_incomplete_utf8_decodes_to_replacement(spm_folder):
    ours = build_from_folder(spm_folder)
    ids = ours.encode("🦜", add_special_tokens=False)
    assert len(ids) > 1 and ours.decode(ids[:-1]).endswith("\ufffd")


def test_sentencepiece_bos_follows_the_config(spm_folder, tmp_path):
    for name in ("tokenizer.model",):
        (tmp_path / name).write_bytes((spm_folder / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": False, "add_eos_token": True})
    )
    ours = build_from_folder(tmp_path)
    assert ours.bos_token == "<s>" and not ours.add_bos
    assert ours.encode("hello") == [*spm_processor(spm_folder).encode("hello"), 2]


def test_sentencepiece_missing_library_names_the_extra(spm_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(MissingDependency, match=r"pip install 'mlxr\[sentencepiece\]'"):
        build_from_folder(spm_folder)


def test_sentencepiece_corrupt_model_is_named(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\x0a\x05broken protobuf")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.model: unreadable SentencePiece model"):
        build_from_folder(tmp_path)


# --- tiktoken ---------------------------------------------------------------------------------

TIKTOKEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_rank_file(path: Path) -> dict[bytes, int]:
    """Ranks from a byte-level BPE trained on the corpus: the 256 bytes, then merges in order."""
    from mlxr_core.testing.tiny import gpt2_byte_symbols

    byte_of = {symbol: byte for byte, symbol in enumerate(gpt2_byte_symbols())}
    backend = train_byte_level_bpe()
    specials = {token.content for token in backend.get_added_tokens_decoder().values()}
    vocab = {t: i for t, i in backend.get_vocab().items() if t not in specials}
    tokens = sorted(vocab, key=vocab.get)
    ranks = {bytes(byte_of[c] for c in token): rank for rank, token in enumerate(tokens)}
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


@pytest.fixture(scope="module")
def tiktoken_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiktoken")
    ranks = write_rank_file(folder / "tiny.tiktoken")
    added = {
        str(len(ranks) + i): {"content": text, "special": True}
        for i, text in enumerate(TIKTOKEN_SPECIALS)
    }
    config = {"added_tokens_decoder": added, "eos_token": "<|im_end|>", "pat_str": QWEN2_PATTERN}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def reference_encoding(folder: Path, pattern: str) -> Any:
    import tiktoken

    ranks = {}
    for line in (folder / "tiny.tiktoken").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    specials = {text: len(ranks) + i for i, text in enumerate(TIKTOKEN_SPECIALS)}
    return tiktoken.Encoding(
        "reference", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials
    )


def test_tiktoken_matches_tiktoken_on_the_corpus(tiktoken_folder):
    ours = build_from_folder(tiktoken_folder)
    theirs = reference_encoding(tiktoken_folder, QWEN2_PATTERN)
    assert isinstance(ours, Tokenizer) and not ours.add_bos
    for text in TEXTS:
        ids = theirs.encode(text, allowed_special="all")
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text


def test_tiktoken_special_tokens_and_end_ids(tiktoken_folder):
    ours = build_from_folder(tiktoken_folder)
    n = len(reference_encoding(tiktoken_folder, QWEN2_PATTERN)._mergeable_ranks)
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == n + 1 and ids[-1] == n + 2
    assert ours.decode(ids) == "user\nhi"
    assert ours.eos_token_ids == {n, n + 2} and ours.vocab_size == n + 3
    assert ours.decode([n + 50, -1]) == ""
    emoji = ours.encode("🦜")
    assert len(emoji) > 1 and ours.decode(emoji[:-1]).endswith("\ufffd")


def test_tiktoken_default_pattern_without_pat_str(tiktoken_folder, tmp_path):
    (tmp_path / "tiny.tiktoken").write_bytes((tiktoken_folder / "tiny.tiktoken").read_bytes())
    config = json.loads((tiktoken_folder / "tokenizer_config.json").read_text())
    del config["pat_str"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = reference_encoding(tmp_path, DEFAULT_PATTERN)
    ours = build_from_folder(tmp_path)
    assert ours.encode("12345 numbers") == theirs.encode("12345 numbers")


def test_tiktoken_rank_file_rewritten_in_place_is_reread(tmp_path):
    (tmp_path / "t.tiktoken").write_text("YQ== 0\nYg== 1\n")
    assert build_from_folder(tmp_path).encode("ab") == [0, 1]
    (tmp_path / "t.tiktoken").write_text("Yg== 0\nYQ== 1\nYWI= 2\n")
    assert build_from_folder(tmp_path).encode("ab") == [2]


def test_tiktoken_bad_rank_line_is_named(tmp_path):
    (tmp_path / "t.tiktoken").write_text("YQ== 0\nnot base64! x\n")
    with pytest.raises(ModelLoadError, match=r"t\.tiktoken: line 2 is not 'base64-token rank'"):
        TiktokenTokenizerBackend().build({"file": str(tmp_path / "t.tiktoken")}, chat_template=None)


def test_tiktoken_missing_library_names_the_extra(tiktoken_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(MissingDependency, match=r"pip install 'mlxr\[tiktoken\]'"):
        build_from_folder(tiktoken_folder)


def test_no_chat_template_is_a_request_error(tiktoken_folder):
    with pytest.raises(RequestError, match="no chat template"):
        build_from_folder(tiktoken_folder).apply_chat_template([{"role": "user", "content": "hi"}])


# --- token bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["qwen2", "llama", *HF_CASES])
def test_hf_token_bytes_match_llguidances_reading_of_tokenizer_json(tmp_path, case):
    llguidance = pytest.importorskip("llguidance")
    folder = TINY_HF / case if case in ("qwen2", "llama") else tmp_path
    if case not in ("qwen2", "llama"):
        write_hf_case(tmp_path, case)
    ours = build_from_folder(folder).token_bytes()
    theirs = llguidance.LLTokenizer(str(folder / "tokenizer.json"))
    assert len(ours.pieces) == theirs.vocab_size
    for i, piece in enumerate(ours.pieces):
        # llguidance spells no token with a leading 0xFF byte (its special-token marker).
        if i not in ours.special and not piece.startswith(b"\xff"):
            assert piece == theirs.decode_bytes([i]), i


def test_sentencepiece_token_bytes_spell_the_text(spm_folder):
    ours = build_from_folder(spm_folder)
    sp = spm_processor(spm_folder)
    pieces = ours.token_bytes().pieces
    for text in TEXTS:
        ids = sp.encode(text)
        joined = b"".join(pieces[i] for i in ids)
        assert joined.decode("utf-8").removeprefix(" ") == sp.decode(ids), text


def test_tiktoken_token_bytes_spell_the_text(tiktoken_folder):
    ours = build_from_folder(tiktoken_folder)
    vocab = ours.token_bytes()
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert b"".join(vocab.pieces[i] for i in ids) == text.encode(), text
    assert ours.eos_token_ids <= vocab.special
