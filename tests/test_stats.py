"""SpecStats' step accounting and the engine's log line for calls that ran eagerly, on literal cases."""

from __future__ import annotations

import logging

from hf_plookup.engine.engine import warn_eager
from hf_plookup.stats import SpecStats


def test_forwards_counted_by_path():
    s = SpecStats()
    s.count_forward(True)  # the call's prompt chunk
    for _ in range(3):
        s.count_forward(False, "graph")
    s.count_forward(True, "eager", "a prompt chunk")  # beside another call's prompt chunk
    assert (s.forwards, s.prefill_forwards, s.decode_steps) == (5, 2, 4)
    assert s.decode_steps_by_path == {"graph": 3, "eager": 1} and s.eager_reasons == {"a prompt chunk": 1}
    d = s.as_dict()
    assert d["decode_steps_by_path"] == {"graph": 3, "eager": 1} and d["eager_reasons"] == {"a prompt chunk": 1}
    assert d["compile_time"] == 0.0 and d["capture_time"] == 0.0


def test_one_line_when_most_decode_steps_ran_eagerly(caplog):
    s = SpecStats(decode_steps_by_path={"eager": 30, "graph": 2},
                  eager_reasons={"more rows than the largest batch bucket (256)": 30})
    with caplog.at_level(logging.WARNING, logger="hf_plookup"):
        assert warn_eager(s)
        # half or fewer eager, or fewer than 8 eager steps: nothing to say
        assert not warn_eager(SpecStats(decode_steps_by_path={"eager": 16, "graph": 16}))
        assert not warn_eager(SpecStats(decode_steps_by_path={"eager": 7}))
        assert not warn_eager(SpecStats(decode_steps_by_path={"compiled": 40}))
    assert [r.getMessage() for r in caplog.records] == [
        "hf_plookup: 30 of 32 decode steps of this call ran eagerly, off the captured or compiled steps "
        "(more rows than the largest batch bucket (256): 30)"]
