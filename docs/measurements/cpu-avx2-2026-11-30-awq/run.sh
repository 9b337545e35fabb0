#!/usr/bin/env bash
# An AWQ 4-bit SmolLM2 (gptqmodel's AWQ quantizer, loaded by transformers) in the main job at batch
# 1, against HF's greedy of the same model: in fp32 (its linears dequantize on every call) in this
# checkout (tag "after") and in one of the code before (ROOT: its root, the C extension built there;
# TAG "before"); in fp16 (transformers' dtype "auto" for an AWQ checkpoint: torch's CPU int4 kernel,
# seconds a token in HF's greedy, so few short documents) after only: before, the engine ran that
# kernel too. Run from the repository root with gptqmodel's venv
# (../cpu-avx2-2026-11-29-gptq/NOTES.md):
#   GPTQ_PY=/path/to/gptq-venv/bin/python bash docs/measurements/cpu-avx2-2026-11-30-awq/run.sh CKPT_DIR [ROOT TAG]
set -euo pipefail
here=$PWD/docs/measurements/cpu-avx2-2026-11-30-awq
ckpt=$1
root=${2:-$PWD}
tag=${3:-after}
py=${GPTQ_PY:-python}
[ -d "$ckpt" ] || PYTHONPATH=. $py "$here/make_checkpoint.py" "$ckpt"
cd "$root"
PYTHONPATH=. $py eval/summarize.py --model "$ckpt" --dtype fp32 --num-docs 3 --max-new-tokens 48 \
    --batch-size 1 --k 4 8 --threads 2 --no-plot --bootstrap 0 --out "$here/awq_fp32_b1_$tag"
if [ "$tag" != before ]; then
    PYTHONPATH=. $py eval/summarize.py --model "$ckpt" --dtype fp16 --num-docs 3 --max-input-tokens 128 \
        --max-new-tokens 32 --batch-size 1 --k 4 8 --threads 2 --no-plot --bootstrap 0 --out "$here/awq_fp16_b1_$tag"
fi
