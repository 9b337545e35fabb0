"""eval/host_work.py end to end on CPU (its tiny Llama, a few tokens): every setting gets its per-step
figures, each timed part is seen, and the engine's methods are its own again afterwards."""

from __future__ import annotations

import json


def test_host_work_measures_every_part_and_restores_the_engine(tmp_path):
    from eval import host_work
    from hf_plookup.engine import batch, engine
    from hf_plookup.steps import graphs

    before = (graphs.GraphRunner._forward, batch.Batch.postprocess, engine.lay_out, graphs.pad_layout)
    out = tmp_path / "host.json"
    assert host_work.main(["--batch-sizes", "2", "--k", "0", "4", "--max-new-tokens", "8", "--repeats", "1",
                           "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["batch"], r["k"]) for r in rows] == [(2, 0), (2, 4)]
    for r in rows:
        assert r["decode_steps"] >= 1 and 0 < r["forward_s"] < r["step_s"]
        assert abs(r["outside_s"] - (r["step_s"] - r["forward_s"])) < 1e-12
        assert {"layout", "pad_layout", "postprocess", "runner.run"} <= set(r["parts_s"])
    assert "propose" in rows[1]["parts_s"]  # k=4 drafts
    assert (graphs.GraphRunner._forward, batch.Batch.postprocess, engine.lay_out, graphs.pad_layout) == before
