#!/usr/bin/env bash
# SmolLM2 in the main job at batch 1 from a compressed-tensors W8A16 checkpoint (`--quantization
# ct-w8a16`: int8 in groups of 64, made by compressed-tensors' compressor), in fp32 and bf16, each
# against HF's greedy of the same checkpoint in the same process, in this checkout (tag "after") or
# in one of the code before (ROOT: its root with this eval/lib/quantization.py, the C extension built
# there; TAG "before"). Run from the repository root:
#   bash docs/measurements/cpu-xeon-2026-11-30-ct-w8a16/run.sh [ROOT TAG]
set -euo pipefail
here=$PWD/docs/measurements/cpu-xeon-2026-11-30-ct-w8a16
root=${1:-$PWD}
tag=${2:-after}
cd "$root"
for dtype in fp32 bf16; do
    PYTHONPATH=. python eval/summarize.py --model smollm2-135m --quantization ct-w8a16 --dtype $dtype --num-docs 8 \
        --batch-size 1 --k 4 8 --threads 2 --no-plot --bootstrap 0 --out "$here/ct-w8a16_${dtype}_b1_$tag"
done
