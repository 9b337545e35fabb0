#!/usr/bin/env bash
# fp16 models on CPU, before and after the C linears and attention took fp16: the main job on
# SmolLM2 in fp16 and on its GPTQ 4-bit checkpoint loaded in fp16 (the dtype transformers' "auto"
# gives most published GPTQ checkpoints), batch 1, against HF's fp16 greedy of the same model.
# Run from the repository root with gptqmodel's venv (../cpu-avx2-2026-11-29-gptq/NOTES.md), in this
# checkout (tag "after") and in others (ROOT: a checkout's root, its C extension built there; TAG:
# "before" for 595e6a0, "mid" for 43819d9):
#   GPTQ_PY=/path/to/gptq-venv/bin/python bash docs/measurements/cpu-avx2-2026-11-29-fp16/run.sh CKPT_DIR [ROOT TAG]
set -euo pipefail
here=$PWD/docs/measurements/cpu-avx2-2026-11-29-fp16
ckpt=$1
root=${2:-$PWD}
tag=${3:-after}
py=${GPTQ_PY:-python}
[ -d "$ckpt" ] || PYTHONPATH=. $py docs/measurements/cpu-avx2-2026-11-29-gptq/make_checkpoint.py "$ckpt" 64
cd "$root"
PYTHONPATH=. $py eval/summarize.py --model smollm2-135m --dtype fp16 --num-docs 4 --max-new-tokens 48 \
    --batch-size 1 --k 4 8 --threads 2 --no-plot --bootstrap 0 --out "$here/smollm2_fp16_b1_$tag"
# HF's fp16 greedy of the GPTQ model runs torch's CPU int4 kernel in fp16, seconds a token
# (hf_gptq_fp16_forward.py): few short documents, and not before (the engine ran that kernel too)
if [ "$tag" != before ]; then
    PYTHONPATH=. $py eval/summarize.py --model "$ckpt" --dtype fp16 --num-docs 3 --max-input-tokens 128 \
        --max-new-tokens 32 --batch-size 1 --k 4 8 --threads 2 --no-plot --bootstrap 0 --out "$here/gptq_fp16_b1_$tag"
fi
