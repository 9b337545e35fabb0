"""Before/after table of `ab_rounds.sh`'s JSON outputs: per (batch, k), the time outside the
forwards per decode step (ms) of each round, its median and fastest, before and after, and
after / before of the medians and of the fastest.

    python docs/measurements/cpu-avx2-2026-11-29-host-cut/table.py DIR
"""

import json
import statistics
import sys
from pathlib import Path


def rounds(folder: Path, tree: str) -> dict[tuple[int, int], list[float]]:
    out: dict[tuple[int, int], list[float]] = {}
    for f in sorted(folder.glob(f"{tree}_r*.json")):
        for r in json.loads(f.read_text())["results"]:
            out.setdefault((r["batch"], r["k"]), []).append(1e3 * r["outside_s"])
    return out


def main(folder: str) -> None:
    base, new = rounds(Path(folder), "base"), rounds(Path(folder), "new")
    print("| batch, k | before: rounds | median | fastest | after: rounds | median | fastest | after/before (median) | (fastest) |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|")
    for key in sorted(base):
        b, n = base[key], new[key]
        mb, mn = statistics.median(b), statistics.median(n)
        print(f"| {key[0]}, {key[1]} | {', '.join(f'{x:.2f}' for x in b)} | {mb:.2f} | {min(b):.2f} | "
              f"{', '.join(f'{x:.2f}' for x in n)} | {mn:.2f} | {min(n):.2f} | {mn / mb:.2f} | {min(n) / min(b):.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
