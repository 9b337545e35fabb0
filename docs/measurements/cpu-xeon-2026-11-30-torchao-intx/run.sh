#!/usr/bin/env bash
# SmolLM2 in the main job at batch 1 quantized at load by torchao's int4 weights for CPUs
# (`--quantization torchao-intx-int4`: IntxWeightOnlyConfig, int4 in groups of 32), in fp32 and
# bf16, each against HF's greedy of the same quantized model in the same process, in this checkout
# (tag "after") or in one of the code before (ROOT: its root with this eval/lib/quantization.py,
# the C extension built there; TAG "before"). Run from the repository root:
#   bash docs/measurements/cpu-xeon-2026-11-30-torchao-intx/run.sh [ROOT TAG]
set -euo pipefail
here=$PWD/docs/measurements/cpu-xeon-2026-11-30-torchao-intx
root=${1:-$PWD}
tag=${2:-after}
cd "$root"
# QUANTIZATIONS: which (default torchao-intx-int4; torchao-dyn-intx-int4: the same weights with
# each call's activations quantized per token first)
for q in ${QUANTIZATIONS:-torchao-intx-int4}; do
    for dtype in ${DTYPES:-fp32 bf16}; do
        PYTHONPATH=. python eval/summarize.py --model smollm2-135m --quantization $q --dtype $dtype \
            --num-docs 8 --batch-size 1 --k 4 8 --threads 2 --no-plot --bootstrap 0 --out "$here/${q#torchao-}_${dtype}_b1_$tag"
    done
done
