"""eval/host_work.py end to end on CPU (its tiny Llama, a few tokens): every setting gets its per-step
figures, each timed part is seen, and the engine's methods are its own again afterwards; a forward
inside another (a static-buffer step's model call) counts once."""

from __future__ import annotations

import json


def test_host_work_measures_every_part_and_restores_the_engine(tmp_path):
    from eval import host_work
    from hf_plookup.engine import batch, engine
    from hf_plookup.steps import forward, graphs

    before = (graphs.GraphRunner._forward, forward.StepForward.run, batch.Batch.postprocess, engine.lay_out,
              engine.lay_out_staged, graphs.pad_layout)
    out = tmp_path / "host.json"
    assert host_work.main(["--batch-sizes", "2", "--k", "0", "4", "--max-new-tokens", "8", "--repeats", "1",
                           "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["batch"], r["k"]) for r in rows] == [(2, 0), (2, 4)]
    for r in rows:
        assert r["decode_steps"] >= 1 and 0 < r["forward_s"] < r["step_s"]
        assert abs(r["outside_s"] - (r["step_s"] - r["forward_s"])) < 1e-12
        # (padding is timed where a step is padded: a bucket's first; the others are laid out in its buffer)
        assert {"layout", "postprocess", "runner.run"} <= set(r["parts_s"])
    assert "propose" in rows[1]["parts_s"]  # k=4 drafts
    assert (graphs.GraphRunner._forward, forward.StepForward.run, batch.Batch.postprocess, engine.lay_out,
            engine.lay_out_staged, graphs.pad_layout) == before


def test_parts_time_nested_calls_of_one_label_once():
    from eval.host_work import Parts

    class Owner:
        def inner(self):
            return 1

        def outer(self):
            return self.inner() + 1

    parts = Parts()
    parts.wrap(Owner, "outer", "forward")
    parts.wrap(Owner, "inner", "forward")
    parts.wrap(Owner, "absent", "forward")  # a method the engine does not have: left alone
    try:
        assert Owner().outer() == 2 and Owner().inner() == 1
    finally:
        parts.remove()
    assert len(parts.times["forward"]) == 2  # the outer call (its inner one inside it), then the lone inner one
    assert not hasattr(Owner, "absent") and Owner.outer.__name__ == "outer" and "timed" not in repr(Owner.inner)
