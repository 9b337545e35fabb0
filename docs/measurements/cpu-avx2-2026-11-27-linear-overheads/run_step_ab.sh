#!/usr/bin/env bash
# The engine's CPU step, side by side: the working tree's cpu_kernels.c (A, the installed build)
# against the `cpu-avx2-2026-11-27-linear-overheads` run's start (B, commit e75a29d), fp32 and bf16, batch 1, 2 threads
# (step_ab.py). Run from the repository root with its venv active, after building the extension:
#   bash docs/measurements/cpu-avx2-2026-11-27-linear-overheads/run_step_ab.sh
set -euo pipefail
here=$(dirname "$0"); tmp=$(mktemp -d); start=e75a29d
source "$here/../ab_builds.sh"
for dt in bf16 fp32; do python "$here/step_ab.py" "$tmp/start.so" $dt 21; done
rm -rf "$tmp"
