#!/usr/bin/env bash
# A compressed-tensors W4A16 SmolLM2 (`--quantization ct-w4a16`: made at load by compressed-tensors'
# compressor, loaded by transformers) in the main job at batch 1, against HF's greedy of the same
# model (compressed-tensors decompresses it to float at its first forward), in fp32 and bf16, in this
# checkout (tag "after") or in one of the code before (ROOT: its root, the C extension built there;
# TAG "before"). Run from the repository root:
#   bash docs/measurements/cpu-avx2-2026-11-30-compressed-tensors/run.sh [ROOT TAG]
set -euo pipefail
here=$PWD/docs/measurements/cpu-avx2-2026-11-30-compressed-tensors
root=${1:-$PWD}
tag=${2:-after}
cd "$root"
for dtype in fp32 bf16; do
    PYTHONPATH=. python eval/summarize.py --model smollm2-135m --quantization ct-w4a16 --dtype $dtype --num-docs 8 \
        --batch-size 1 --k 4 8 --threads 2 --no-plot --bootstrap 0 --out "$here/ct_${dtype}_b1_$tag"
done
