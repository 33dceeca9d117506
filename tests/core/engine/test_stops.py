"""Stop strings over streamed text: never emit from a stop string on, hold back only what might
start one, whatever the chunking."""

from __future__ import annotations

import random

import pytest

from mlxr_core.engine.stops import StopMatcher


def stream(stops: list[str], chunks: list[str]) -> tuple[str, bool]:
    """Feed ``chunks`` as the engine does and return (all emitted text, hit)."""
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def expected(stops: list[str], text: str) -> tuple[str, bool]:
    """Brute force: cut at the first stop string to complete (the longest if several end there)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            return text[: end - max(map(len, ending))], True
    return text, False


def test_no_stops_passes_text_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("hello") == ("hello", False)
    assert matcher.feed("") == ("", False)
    assert matcher.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    assert StopMatcher(["", ""]).feed("text") == ("text", False)


def test_stop_inside_one_feed() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("Hello STOP world") == ("Hello ", True)
    assert matcher.hit
    # Once hit, nothing more comes out.
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_split_across_many_feeds() -> None:
    matcher = StopMatcher(["<|end|>"])
    assert matcher.feed("answer <") == ("answer ", False)
    assert matcher.feed("|") == ("", False)
    assert matcher.feed("en") == ("", False)
    assert matcher.feed("d|> trailing") == ("", True)


def test_a_prefix_that_turns_out_not_to_be_a_stop_is_released() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.feed("ST") == ("", False)
    assert matcher.flush() == "ST"


def test_overlapping_candidates() -> None:
    # "aab" after "aa": the automaton must fall back to "a" + "ab", not restart.
    assert stream(["aab"], ["a", "a", "a", "b"]) == ("a", True)
    # The first stop string to complete wins, even if a longer one started earlier.
    assert stream(["abcd", "bc"], ["abcd"]) == ("a", True)
    # Two ending at the same character: the longer one, which started earlier, is cut whole.
    assert stream(["b", "ab"], ["xa", "b"]) == ("x", True)
    assert stream(["</s>", "<|end|>", "<|endoftext|>"], ["x<|end", "oftext|>"]) == ("x", True)


def test_held_back_text_is_only_a_possible_stop_prefix() -> None:
    matcher = StopMatcher(["\n\nUser:", "###"])
    assert matcher.feed("one\n") == ("one", False)
    assert matcher.feed("\nUs") == ("", False)
    assert matcher.feed("ually #") == ("\n\nUsually ", False)
    assert matcher.feed("#") == ("", False)
    assert matcher.feed("!") == ("##!", False)


@pytest.mark.parametrize("seed", range(200))
def test_any_chunking_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab<|>é😀"
    stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 10))))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert stream(stops, chunks) == expected(stops, text), (stops, chunks)


def test_a_long_stop_string_on_a_long_output_stays_linear() -> None:
    # Every "a" keeps the whole stop prefix alive: a naive suffix check would cost O(len(stop)^2)
    # per character here, and copying the held text O(len(stop)) per character.
    stop = "a" * 9_999 + "b"
    matcher = StopMatcher([stop])
    emitted = 0
    for _ in range(200_000):
        text, hit = matcher.feed("a")
        assert not hit
        emitted += len(text)
    assert emitted == 200_000 - 9_999
    text, hit = matcher.feed("b")
    assert hit and text == ""  # the held "a"s were the stop string's start


def test_a_long_stop_string_found_in_big_feeds() -> None:
    stop = "".join(random.Random(0).choices("xyz", k=10_000))
    body = "".join(random.Random(1).choices("xyz", k=50_000))
    text = body + stop + "after"
    chunks = [text[i : i + 997] for i in range(0, len(text), 997)]
    assert stream([stop], chunks) == expected([stop], text) == (text[: text.index(stop)], True)
