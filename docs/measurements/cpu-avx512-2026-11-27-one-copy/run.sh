#!/usr/bin/env bash
# The measurements of "Larger models on CPU: one copy of the weights" (docs/results.md), in order.
#   bash docs/measurements/cpu-avx512-2026-11-27-one-copy/run.sh OUT OLD
# OLD: a worktree of the commit before the change (24eb1c8) with its C extension built in place:
#   git worktree add OLD 24eb1c8 && (cd OLD && python -c "from setuptools import setup; setup()" build_ext --inplace)
#   cp eval/cpu_memory.py OLD/eval/ && cp eval/lib/machine.py OLD/eval/lib/
set -euo pipefail
OUT=$1; OLD=$2; HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../../.." && pwd)
mkdir -p "$OUT"
for r in 1 2; do  # prompt and decode costs, old and new trees alternating
  for tree in "$OLD" "$ROOT"; do
    python "$HERE/prompt_costs.py" "$tree" random:qwen3-0.6b bf16 1000 3 | tail -1 >> "$OUT/prompt_costs.jsonl"
    python "$HERE/prompt_costs.py" "$tree" smollm2-135m fp32 1000 3 | tail -1 >> "$OUT/prompt_costs.jsonl"
  done
done
python "$OLD/eval/cpu_memory.py" --model random:qwen3-1.7b --dtype bf16 --json "$OUT/cpu_memory_qwen3-1.7b_old.json"
python "$ROOT/eval/cpu_memory.py" --model random:qwen3-1.7b --dtype bf16 --json "$OUT/cpu_memory_qwen3-1.7b.json"
python "$ROOT/eval/cpu_memory.py" --model random:qwen3-8b --dtype bf16 --max-new-tokens 32 --num-prompts 1 \
  --json "$OUT/cpu_memory_qwen3-8b.json"
python "$ROOT/eval/summarize.py" --model gemma3-270m --num-docs 8 --out "$OUT/summarize_gemma3"
