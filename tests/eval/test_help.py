"""`--help` of every script in eval/ and examples/ shows the default of every option that has
one, and every script takes `--threads` (its default spelled out)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "eval").glob("*.py")) + sorted((REPO / "examples").glob("*.py"))


def _load(path: Path):
    if path.parent.name == "eval":
        return importlib.import_module(f"eval.{path.stem}")
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eval_holds_scripts_only():
    """Shared code lives in eval/lib/, so every .py file in eval/ is a script with a parser."""
    assert len(SCRIPTS) >= 11, [p.name for p in SCRIPTS]
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
