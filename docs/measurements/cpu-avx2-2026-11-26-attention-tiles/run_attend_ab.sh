#!/usr/bin/env bash
# Side by side, in one process per line: attend() of the `cpu-avx2-2026-11-26-attention-tiles` run's kernels (A, the working
# tree) and of the run's start (B, commit 3a9bf04), SmolLM2's attention shape, 2 threads; first with
# the pages left in cache between layers (EVICT=0), then with 9 MB read between layers, as a step's
# weights pass through the caches (EVICT=9; the `cpu-avx2-2026-11-27-five-cuts` run found the pages still in L3 then,
# where a step finds them in memory: EVICT=40 for that). PREFETCH=1: also the prefetch experiment
# (attend_prefetch_epyc_avx2.txt).
# Run from the repository root with its venv active: bash docs/measurements/cpu-avx2-2026-11-26-attention-tiles/run_attend_ab.sh
set -euo pipefail
here=$(dirname "$0"); tmp=$(mktemp -d); start=3a9bf04
source "$here/../ab_builds.sh"
harness "$here/attend_ab.c" "$tmp/ab"
python "$here/attend_bits.py" "$tmp/start.so" 61 400   # the same bits as the start's build first
for evict in 0 9; do
  echo "EVICT=$evict"
  for cfg in "1 1 1" "5 1 1" "9 1 1" "1 1 8" "5 1 4" "5 1 8" "1 0 1" "5 0 1" "9 0 1" "1 0 8" "5 0 4" "5 0 8"; do
    set -- $cfg
    EVICT=$evict "$tmp/ab" "$tmp/new.so" "$tmp/start.so" "$1" "$2" "$3" 2 21
  done
done
if [ "${PREFETCH:-}" = 1 ]; then  # the next layer's pages asked for during the weights' stream: this build both sides
  for total in 0 1; do
    echo "PREKV=1 EVICT=9 TOTAL=$total (A asks for the pages, B does not)"
    for cfg in "1 1 1" "1 0 1" "9 1 1"; do
      set -- $cfg
      TOTAL=$total PREKV=1 EVICT=9 "$tmp/ab" "$tmp/new.so" "$tmp/new.so" "$1" "$2" "$3" 2 21
    done
  done
fi
rm -rf "$tmp"
