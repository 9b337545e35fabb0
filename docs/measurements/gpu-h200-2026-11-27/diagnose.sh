#!/usr/bin/env bash
# Where a generate call's compiled steps lose time on a GPU (random SmolLM2 weights, bf16): the
# compiled step in a CUDA graph over a KV cache of only the pages it uses and over one as large as
# wrap's default; then whole generate calls, defaults beside compile=True (both caches sized as
# wrap sizes them), each engine's greedy call profiled. Run from the repository root with the
# package importable (PYTHONPATH); JSON into $OUT.
set -x
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
python3 eval/step_bench.py --models smollm2-135m --batch-sizes 1 --q 1 5 --modes graphs compiled+graphs --iters 10 \
  --out "$OUT/step_small_cache.json"
python3 eval/step_bench.py --models smollm2-135m --batch-sizes 1 --q 1 5 --modes graphs compiled+graphs --iters 10 \
  --cache-tokens auto --out "$OUT/step_wrap_cache.json"
python3 eval/bench.py --device cuda --model random:smollm2-135m --batch-sizes 1 --num-prompts 2 --k 4 \
  --max-new-tokens 64 --variants hf-greedy plk-greedy plk plk-compiled --engine-cache wrap --profile \
  --no-proposer-cost --json "$OUT/diag_bench.json"
