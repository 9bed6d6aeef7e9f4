"""Stop-string matching across token boundaries."""

from __future__ import annotations

import codecs

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippyd.http.shaping.stops import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """Feed pieces until a stop matches; return what was released and whether it stopped."""
    matcher = StopMatcher(stops)
    released = []
    for piece in pieces:
        step = matcher.push(piece)
        released.append(step.text)
        if step.stopped:
            return released, True
    released.append(matcher.flush())
    return released, False


def expected_output(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """Reference: after each piece, search the whole text so far; the first time any stop
    is complete, cut at the earliest complete occurrence (a stop completed earlier in time
    wins over a longer one that would have started earlier)."""
    text = ""
    for piece in pieces:
        text += piece
        positions = [text.find(stop) for stop in stops if stop in text]
        if positions:
            return text[: min(positions)], True
    return text, False


def test_stop_split_across_pieces_is_never_released() -> None:
    released, stopped = run(["<END>"], ["Hello <", "E", "N", "D> after"])
    assert stopped
    assert "".join(released) == "Hello "
    assert all("<" not in text for text in released)


def test_partial_prefix_is_held_then_released_when_refuted() -> None:
    matcher = StopMatcher(["STOP"])
    first = matcher.push("go ST")
    assert first.text == "go "
    assert matcher.held_text == "ST"
    second = matcher.push("ART")
    assert (second.text, second.stopped) == ("START", False)
    assert matcher.held_text == ""


def test_held_prefix_is_flushed_at_end_of_generation() -> None:
    matcher = StopMatcher(["###"])
    assert matcher.push("answer #").text == "answer "
    assert matcher.push("#").text == ""
    assert matcher.flush() == "##"
    assert not matcher.stopped


def test_stop_completed_first_wins_over_longer_earlier_one() -> None:
    # "a" completes before " aa" could; generation must not run on to find out.
    released, stopped = run(["a", " aa"], [" a", "a"])
    assert (released, stopped) == ([" "], True)


def test_earliest_of_several_stops_wins() -> None:
    released, stopped = run(["world", "lo w"], ["hel", "lo world"])
    assert stopped
    assert "".join(released) == "hel"


def test_overlapping_prefix_restarts_inside_held_text() -> None:
    # "aab": after "aa" is held, "ab" must still be found starting at the second "a".
    released, stopped = run(["ab"], ["a", "a", "b", "c"])
    assert stopped
    assert "".join(released) == "a"


def test_stop_inside_one_piece_drops_the_rest() -> None:
    released, stopped = run(["\n\n"], ["line one\n\nline two"])
    assert (released, stopped) == (["line one"], True)


def test_input_after_stop_is_ignored() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.push("ax").stopped
    assert matcher.push("more").text == ""
    assert matcher.flush() == ""


def test_no_stops_releases_everything_immediately() -> None:
    matcher = StopMatcher([])
    assert matcher.push("abc").text == "abc"
    assert matcher.held_text == ""


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])


def test_multibyte_characters_split_across_tokens() -> None:
    # One token per UTF-8 byte: the detokenizer holds incomplete characters, so the
    # matcher only ever sees whole characters and the stop "語る" is found intact.
    decoder = codecs.getincrementaldecoder("utf-8")()
    matcher = StopMatcher(["語る"])
    released, stopped = [], False
    for byte in "日本語る以降".encode():
        step = matcher.push(decoder.decode(bytes([byte])))
        released.append(step.text)
        if step.stopped:
            stopped = True
            break
    assert stopped
    assert "".join(released) == "日本"
    assert all("\ufffd" not in text for text in released)


@given(
    text=st.text(alphabet="abcé語\n ", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
    stops=st.lists(st.text(alphabet="abcé語\n ", min_size=1, max_size=4), max_size=3),
)
def test_streamed_result_equals_whole_text_cut(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    released, stopped = run(stops, pieces)
    output = "".join(released)
    assert (output, stopped) == expected_output(stops, pieces)
    for stop in stops:
        assert stop not in output
