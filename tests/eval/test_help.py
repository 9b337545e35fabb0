"""`--help` of every eval script shows the default of every option that has one."""

from __future__ import annotations

import argparse

import pytest

from eval import bench, gpu_bench, summarize


@pytest.mark.parametrize("module", [summarize, bench, gpu_bench], ids=lambda m: m.__name__)
def test_help_shows_every_default(module):
    parser = module.build_parser()
    text = " ".join(parser.format_help().split())  # one line: help wraps at any width
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        help_text = " ".join(parser._get_formatter()._expand_help(action).split())
        assert "default" in help_text, f"{action.option_strings[0]} does not show its default {action.default!r}"
        assert help_text in text
        checked += 1
    assert checked >= 5  # --dtype, --max-new-tokens, --k, --repeats/--batch-size, ... have defaults
