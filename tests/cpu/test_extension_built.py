"""pyproject.toml builds the C kernels as an optional extension, so that an install where no C
compiler is found goes on without them (tests/cpu/test_without_c_kernels.py runs that case). A
compile error then passes as silently: pip installs the package, and every test of the kernels
skips ("the C kernels were not built"). Where a C compiler is found, they must have been built."""

from __future__ import annotations

import os
import shutil
import sysconfig

import pytest

from hf_plookup.cpu import kernels as cpu_kernels


def test_the_kernels_load_where_a_c_compiler_is():
    if os.environ.get("HF_PLOOKUP_TEST_WITHOUT_C"):
        pytest.skip("the extension's import is blocked in this run (test_without_c_kernels)")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: the package installs without the kernels")
    assert cpu_kernels.available(), "a C compiler is here but the C kernels did not build or load"
