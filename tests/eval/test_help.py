"""`--help` of every script in eval/ and examples/ shows the default of every option that has
one, and every script takes `--threads` (its default spelled out); every script in eval/ starts
both ways, `python eval/X.py` and `python -m eval.X`, from the repository root."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EVAL_SCRIPTS = sorted(p for p in (REPO / "eval").glob("*.py") if p.name != "__init__.py")
SCRIPTS = EVAL_SCRIPTS + sorted((REPO / "examples").glob("*.py"))


def _load(path: Path):
    if path.parent.name == "eval":
        return importlib.import_module(f"eval.{path.stem}")
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eval_holds_scripts_only():
    """Shared code lives in eval/lib/, so every .py file in eval/ is a script with a parser."""
    assert len(EVAL_SCRIPTS) >= 9 and len(SCRIPTS) >= 11, [p.name for p in SCRIPTS]
    for path in SCRIPTS:
        assert 'if __name__ == "__main__":' in path.read_text(), f"{path.relative_to(REPO)} is not a script"


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_help_shows_every_default_and_threads(path):
    parser = _load(path).build_parser()
    text = " ".join(parser.format_help().split())  # one line: help wraps at any width
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        help_text = " ".join(parser._get_formatter()._expand_help(action).split())
        assert "default" in help_text, f"{action.option_strings[0]} does not show its default {action.default!r}"
        assert help_text in text
        checked += 1
    assert checked >= 2  # every script has a few options with defaults (--k, --max-new-tokens, --batch, ...)
    threads = next((a for a in parser._actions if "--threads" in a.option_strings), None)
    assert threads is not None, f"{path.name} has no --threads"
    threads_help = " ".join(parser._get_formatter()._expand_help(threads).split())
    assert "default:" in threads_help, threads_help


# Starts each eval script with `--help` the way `python eval/X.py` ("script": the script's folder
# first on sys.path) or `python -m eval.X` ("module": the current folder first) starts it, in one
# process per way (a process per script would cost seconds of imports each); `eval` modules are
# dropped between scripts, so each one finds `eval.lib` afresh.
_START = """
import contextlib, io, json, runpy, sys
way, root, names = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path[0] = root + "/eval" if way == "script" else root
failed = {}
for name in names:
    for mod in [m for m in sys.modules if m == "eval" or m.startswith("eval.")]:
        del sys.modules[mod]
    sys.argv = [name, "--help"]
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            if way == "script":
                runpy.run_path(root + "/eval/" + name + ".py", run_name="__main__")
            else:
                runpy.run_module("eval." + name, run_name="__main__", alter_sys=True)
        failed[name] = "no exit"
    except SystemExit as e:
        if e.code not in (0, None) or "usage:" not in text.getvalue():
            failed[name] = f"exit {e.code}: {text.getvalue()[-300:]}"
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
"""


def _clean_env() -> dict:
    """This environment without PYTHONPATH: the scripts must find `eval` through the install alone."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.parametrize("way", ["script", "module"])
def test_every_eval_script_starts_both_ways(way, tmp_path):
    names = [p.stem for p in EVAL_SCRIPTS]
    proc = subprocess.run([sys.executable, "-c", _START, way, str(REPO), *names], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize("command", [["eval/bench.py", "--help"], ["-m", "eval.bench", "--help"]], ids=["script", "module"])
def test_bench_starts_both_ways_for_real(command):
    """The two command lines themselves, from the repository root (one script: each costs seconds)."""
    proc = subprocess.run([sys.executable, *command], cwd=REPO, env=_clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--device" in proc.stdout and "random:SHAPE" in proc.stdout
