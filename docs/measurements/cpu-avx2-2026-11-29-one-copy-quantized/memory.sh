#!/bin/bash
# BEFORE, AFTER: checkouts of the commits compared (each with the C extension built); VENV: the
# environment; OUT: where logs and JSON go (see NOTES.md)
. "$VENV"/bin/activate
for q in quanto-int8 quanto-int4 bnb-nf4 torchao-int8; do
  for side in after before; do
    dir="$AFTER"; [ $side = before ] && dir="$BEFORE"
    cd $dir && python eval/cpu_memory.py --model random:qwen3-1.7b --dtype bf16 --quantization $q --threads 2 --num-prompts 1 --max-new-tokens 8 --json "$OUT"/$side-$q.json > "$OUT"/$side-$q.log 2>&1
    echo "$side $q: $(grep -E '^wrap|^hf_plookup greedy' "$OUT"/$side-$q.log | tr '\n' ' ')" >> "$OUT"/summary.txt
  done
done
