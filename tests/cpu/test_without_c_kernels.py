"""Invariant mode as installed where no C compiler was found: the C extension is optional
(pyproject.toml), and CPU steps then take the numba kernel and torch's calls
(invariant.linears.row_strategy). Its tests run in a child pytest run with the extension's
import blocked (tests/conftest.py, HF_PLOOKUP_TEST_WITHOUT_C), since a module imported once
stays imported in this one."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
# drafts and trees against plain greedy, a padded batch against each row alone, prompts cut into
# chunks by different step budgets, in float32 and bfloat16; bitsandbytes' LLM.int8 linears as one
# bitsandbytes call a row, each row as alone, and lossless with drafts in invariant mode
SELECTION = ("test_drafts_and_batch_change_no_logit and (llama or gemma3_text) or test_padded_drafts_change_no_logit "
             "or test_units_per_step_change_no_logit or test_merged_prompt_calls or test_decode_steps_run_torch "
             "or test_rows_as_alone or test_greedy_with_drafts_is_lossless")


def test_invariant_mode_without_the_c_kernels():
    env = {**os.environ, "HF_PLOOKUP_TEST_WITHOUT_C": "1"}
    cmd = [sys.executable, "-m", "pytest", "tests/invariant/test_linears.py", "tests/invariant/test_bnb8bit.py", "-q",
           "-rs", "-p", "no:cacheprovider", "-k", SELECTION]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "the C kernels were not built" in out, out[-2000:]  # the child really ran without them
    assert " passed" in out and " failed" not in out
