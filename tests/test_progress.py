"""kiln.progress.phase: nested phases keyed by their path, re-entered phases summed."""

import time

from kiln.progress import phase, recording, top_level


def test_nested_phases_add_up():
    got: dict[str, float] = {}
    with recording(got):
        with phase("a"):
            with phase("b"):
                time.sleep(0.01)
            with phase("b"):
                time.sleep(0.01)
        with phase("c"):
            pass
    assert set(got) == {"a", "a/b", "c"}
    assert got["a/b"] >= 0.02 and got["a"] >= got["a/b"]
    assert set(top_level(got)) == {"a", "c"}


def test_no_recording_no_record():
    outer: dict[str, float] = {}
    with phase("x"):  # no recording: nothing to add to, nothing fails
        pass
    with recording(outer), recording({}) as inner, phase("y"):
        pass
    assert outer == {} and set(inner) == {"y"}  # the innermost recording takes them
