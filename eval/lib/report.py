"""The one JSON shape every eval script writes:

    {"script": "bench",                                  # eval/<script>.py
     "command": ["eval/bench.py", "--device", "cpu"],    # how it was started (the script and its arguments)
     "machine": {...},                                   # machine.machine_info
     "args": {...},                                      # the parsed arguments, defaults resolved
     "results": [...],                                   # the script's records (rows, variants, ...)
     ...}                                                # run-level figures of that script, after these

and the table cells of the scripts' printed tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .machine import machine_info


def command_line(script: str, argv: list[str] | None) -> list[str]:
    """["eval/<script>.py", *arguments]: `argv` as given to main(), else this process's arguments."""
    return [f"eval/{script}.py", *(sys.argv[1:] if argv is None else [str(a) for a in argv])]


def report(script: str, argv: list[str] | None, args, device, results, **extra) -> dict:
    """A script's report: the shared keys, then `extra` (run-level figures)."""
    return {"script": script, "command": command_line(script, argv), "machine": machine_info(device),
            "args": dict(vars(args)), "results": results, **extra}


def write_json(path, data: dict) -> Path:
    """`data` as indented JSON at `path` (folders made); values JSON has no type for are written as strings."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def cell(x, spec: str) -> str:
    """A table cell: `x` formatted with `spec`, "–" when there is no value."""
    return "–" if x is None else format(x, spec)
