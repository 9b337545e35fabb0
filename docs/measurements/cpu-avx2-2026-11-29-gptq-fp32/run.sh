#!/usr/bin/env bash
# fp32 GPTQ SmolLM2 on the C kernels: the checkpoint, then the main job on it (HF's fp32 greedy of
# a GPTQ model dequantizes every linear on every call, so few documents and tokens).
# Run from the repository root with gptqmodel's venv (../cpu-avx2-2026-11-29-gptq/NOTES.md):
#   GPTQ_PY=/path/to/gptq-venv/bin/python bash docs/measurements/cpu-avx2-2026-11-29-gptq-fp32/run.sh CKPT_DIR
set -euo pipefail
here=docs/measurements/cpu-avx2-2026-11-29-gptq-fp32
ckpt=$1
py=${GPTQ_PY:-python}
[ -d "$ckpt" ] || PYTHONPATH=. $py docs/measurements/cpu-avx2-2026-11-29-gptq/make_checkpoint.py "$ckpt" 64
PYTHONPATH=. $py eval/summarize.py --model "$ckpt" --dtype fp32 --num-docs 3 --max-new-tokens 48 \
    --batch-size 1 --k 4 8 --threads 2 --no-plot --bootstrap 0 --out "$here/summarize_fp32_b1"
