"""Stop strings over streamed text, however the text is cut into pieces."""
from hypothesis import given
from hypothesis import strategies as st

from engine.stop import StopMatcher


def run(pieces, stops):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.stopped


@given(st.lists(st.text(alphabet="abcXY\n", max_size=6), max_size=12),
       st.lists(st.text(alphabet="abcXY\n", min_size=1, max_size=3), max_size=3))
def test_emits_exactly_the_text_before_the_first_stop(pieces, stops):
    text = "".join(pieces)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    out, stopped = run(pieces, stops)
    assert out == (text[:min(hits)] if hits else text)
    assert stopped == bool(hits)


def test_holds_back_a_possible_start_until_it_is_decided():
    m = StopMatcher(["</end>"])
    assert m.feed("answer </e") == "answer "
    assert m.feed("x") == "</ex"
    assert m.feed(" more </en") == " more "
    assert m.feed("d> tail") == "" and m.stopped
