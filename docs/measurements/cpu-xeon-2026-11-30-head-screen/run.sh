#!/usr/bin/env bash
# SmolLM2 on 8 CNN/DailyMail articles, 64 new tokens, through eval/bench.py: hf_plookup's greedy and
# k=4 with the LM head's screen (the default) and without it (plk-noscreen: head_screen=False), side by
# side in one process with HF's greedy of the same model; fp32 and bf16 at batch 1 (bf16 also at 4),
# and fp32 with torchao's int8 weight-only linears (the LM head stays fp32). Run from the repository root:
#   bash docs/measurements/cpu-xeon-2026-11-30-head-screen/run.sh
set -euo pipefail
here=docs/measurements/cpu-xeon-2026-11-30-head-screen
common=(--model smollm2-135m --k 4 --prompt-source cnn_dailymail --num-prompts 8 --max-new-tokens 64 --threads 2
        --variants hf-greedy plk-greedy plk plk-noscreen)
python eval/bench.py "${common[@]}" --dtype fp32 --batch-sizes 1 --json $here/fp32.json | tee $here/fp32.txt
python eval/bench.py "${common[@]}" --dtype bf16 --batch-sizes 1 4 --json $here/bf16.json | tee $here/bf16.txt
python eval/bench.py "${common[@]}" --dtype fp32 --quantization torchao-int8 --batch-sizes 1 --json $here/int8.json \
    | tee $here/int8.txt
