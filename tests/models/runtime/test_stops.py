"""Stop sequences matched across text deltas."""

from __future__ import annotations

from models.runtime.stops import StopMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    """Feed deltas until a stop; return (all emitted text incl. flush, stopped, per-delta emissions)."""
    m = StopMatcher(stops)
    emitted: list[str] = []
    stopped = False
    for d in deltas:
        out, stopped = m.feed(d)
        emitted.append(out)
        if stopped:
            break
    tail = m.flush()
    return "".join(emitted) + tail, stopped, emitted


def test_feed_when_stop_split_over_three_deltas_then_stops_without_emitting_it() -> None:
    text, stopped, emitted = run(["END!"], ["Hello E", "N", "D! more"])
    assert (text, stopped) == ("Hello ", True)
    assert emitted[0] == "Hello "  # "E" is held back: it could start the stop


def test_feed_when_partial_prefix_is_not_a_stop_then_it_is_emitted() -> None:
    text, stopped, emitted = run(["END!"], ["Hello EN", "Ding", " done"])
    assert (text, stopped) == ("Hello ENDing done", False)
    assert emitted == ["Hello ", "ENDing", " done"]


def test_flush_when_generation_ends_on_a_held_prefix_then_it_is_returned() -> None:
    m = StopMatcher(["</s>"])
    assert m.feed("answer </") == ("answer ", False)
    assert m.flush() == "</"
    assert m.flush() == ""


def test_feed_when_several_stops_then_earliest_match_wins() -> None:
    text, stopped, _ = run(["\n\n", "User:", "###"], ["Sure. ##", "# User: hi\n\n"])
    assert (text, stopped) == ("Sure. ", True)


def test_feed_when_held_prefix_breaks_then_released_up_to_a_new_prefix() -> None:
    m = StopMatcher(["ab", "xyz"])
    assert m.feed("1xy") == ("1", False)
    assert m.feed("a") == ("xy", False)  # "xya" cannot become "xyz"; "a" may still become "ab"
    assert m.feed("b") == ("", True)
    assert m.matched == "ab"


def test_feed_when_stop_at_the_very_start_then_nothing_is_emitted() -> None:
    text, stopped, emitted = run(["Hello"], ["Hel", "lo world"])
    assert (text, stopped, emitted) == ("", True, ["", ""])
    text, stopped, _ = run(["Hello"], ["Hello"])
    assert (text, stopped) == ("", True)


def test_feed_when_stopped_then_further_text_is_swallowed() -> None:
    m = StopMatcher(["x"])
    assert m.feed("ax b") == ("a", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_feed_when_no_stops_then_text_passes_straight_through() -> None:
    m = StopMatcher(["", ""])  # empty stop strings are ignored
    assert m.feed("abc") == ("abc", False)
    assert m.feed("") == ("", False)
    assert m.flush() == ""


def test_feed_when_stop_inside_one_delta_with_multibyte_text_then_cut_exactly() -> None:
    text, stopped, _ = run(["。"], ["你好", "世界。再见"])
    assert (text, stopped) == ("你好世界", True)
