#!/usr/bin/env bash
# Side by side, in one process per line: the working tree's cpu_kernels.c (A) against this
# run's start (B, commit 84e7e41), 2 threads. Linears: lin_ab.c (SmolLM2's 210 layer linears,
# weights streamed). Attention: the `cpu-avx2-2026-11-26-attention-tiles` run's attend_ab.c, with EVICT=40 (40 MB read before
# each layer's call, so that the pages come from memory as in a step; EVICT=9 left them in L3).
# Then bw.c: one KV head's rows of a page (128 of every 384 bytes) against whole rows, from memory.
# Run from the repository root with its venv active:
#   bash docs/measurements/cpu-avx2-2026-11-27-five-cuts/run_ab.sh
set -euo pipefail
here=$(dirname "$0"); tmp=$(mktemp -d); start=84e7e41
source "$here/../ab_builds.sh"
harness "$here/lin_ab.c" "$tmp/lin_ab"
harness "$here/../cpu-avx2-2026-11-26-attention-tiles/attend_ab.c" "$tmp/attend_ab"
gcc -O2 -mavx2 "$here/bw.c" -o "$tmp/bw"
python "$here/../cpu-avx2-2026-11-26-attention-tiles/attend_bits.py" "$tmp/start.so" 31 400   # the same bits as the start's build
for cfg in "1 1" "5 1" "9 1" "10 1" "20 1" "40 1" "5 0" "9 0"; do
  set -- $cfg
  "$tmp/lin_ab" "$tmp/new.so" "$tmp/start.so" "$1" "$2" 2 15
done
for cfg in "1 1 1" "5 1 1" "9 1 1" "5 1 4" "1 1 8" "9 0 1"; do
  set -- $cfg
  EVICT=40 "$tmp/attend_ab" "$tmp/new.so" "$tmp/start.so" "$1" "$2" "$3" 2 21
done
"$tmp/bw" 16 384 128 evict; "$tmp/bw" 16 384 384 evict
rm -rf "$tmp"
