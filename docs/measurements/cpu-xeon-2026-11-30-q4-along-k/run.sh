#!/usr/bin/env bash
# SmolLM2 in the main job at batch 1, quantized at load by bitsandbytes (nf4, compute dtype the
# model's) and from a compressed-tensors W4A16 checkpoint (`--quantization ct-w4a16`), in fp32 and
# bf16, each against HF's greedy of the same quantized model in the same process, in this checkout
# (tag "after") or in one of the code before (ROOT: its root, the C extension built there; TAG
# "before"). Run from the repository root:
#   bash docs/measurements/cpu-xeon-2026-11-30-q4-along-k/run.sh [ROOT TAG]
set -euo pipefail
here=$PWD/docs/measurements/cpu-xeon-2026-11-30-q4-along-k
root=${1:-$PWD}
tag=${2:-after}
cd "$root"
for q in ${QUANTIZATIONS:-bnb-nf4 ct-w4a16}; do
    for dtype in ${DTYPES:-bf16 fp32}; do
        PYTHONPATH=. python eval/summarize.py --model smollm2-135m --quantization $q --dtype $dtype --num-docs 8 \
            --batch-size ${BATCH:-1} --k 4 8 --threads 2 --no-plot --bootstrap 0 --out "$here/${q}_${dtype}_b${BATCH:-1}_$tag"
    done
done
