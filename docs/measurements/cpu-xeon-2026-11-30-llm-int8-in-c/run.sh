#!/usr/bin/env bash
# SmolLM2 in the main job quantized at load by bitsandbytes' LLM.int8 (`--quantization bnb-8bit`:
# BitsAndBytesConfig(load_in_8bit=True)), in fp32 and bf16, each against HF's greedy of the same
# quantized model in the same process, in this checkout (tag "after") or in one of the code before
# (ROOT: its root, the C extension built there; TAG "before"); BATCH (default 1) the batch size.
# Run from the repository root:
#   bash docs/measurements/cpu-xeon-2026-11-30-llm-int8-in-c/run.sh [ROOT TAG]
set -euo pipefail
here=$PWD/docs/measurements/cpu-xeon-2026-11-30-llm-int8-in-c
root=${1:-$PWD}
tag=${2:-after}
cd "$root"
for dtype in ${DTYPES:-fp32 bf16}; do
    PYTHONPATH=. python eval/summarize.py --model smollm2-135m --quantization bnb-8bit --dtype $dtype \
        --num-docs 8 --batch-size ${BATCH:-1} --k 4 8 --threads 2 --no-plot --bootstrap 0 \
        --out "$here/${dtype}_b${BATCH:-1}_$tag"
done
