"""Documents to summarize: the samples shipped in eval/data/ and any JSON-lines file."""

from __future__ import annotations

import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "eval" / "data"
BUILTIN_PATH = DATA_DIR / "builtin.jsonl"


def load_jsonl(path, text_field: str = "document", summary_field: str | None = "summary", id_field: str = "id") -> list[dict]:
    """Documents from a JSON-lines file as [{id, document, summary}] (summary None when the
    file has no such field and `summary_field` is None). Blank lines are skipped; a missing
    text field is a ValueError naming the line.

    A file with the lines `{"id": "a", "text": "doc one", "ref": "one"}` and `{"text": "doc two",
    "ref": "two"}` read with text_field="text", summary_field="ref" gives
    [{"id": "a", "document": "doc one", "summary": "one"}, {"id": "line-2", "document": "doc two", "summary": "two"}]."""
    docs = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if text_field not in row:
                raise ValueError(f"{path}:{lineno}: no field {text_field!r} (fields: {sorted(row)}); use --text-field")
            summary = None
            if summary_field is not None:
                if summary_field not in row:
                    raise ValueError(
                        f"{path}:{lineno}: no field {summary_field!r} (fields: {sorted(row)}); use --summary-field"
                    )
                summary = str(row[summary_field])
            docs.append({"id": str(row.get(id_field, f"line-{lineno}")), "document": str(row[text_field]), "summary": summary})
    return docs
