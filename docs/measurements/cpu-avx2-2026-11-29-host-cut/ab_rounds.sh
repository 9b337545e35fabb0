#!/bin/bash
# Interleaved rounds of eval/host_work.py on two trees: BASE (the code before, `git archive` of the
# commit it came from, with the built _cpu_kernels*.so copied in) and NEW (the code after), one
# script for both (SCRIPT: the new eval/host_work.py, whose forwards include the eager prompt
# chunks; or the one of the commit before). Outputs: OUT/{base,new}_rROUND.{txt,json}.
#   BASE=/tmp/host_base NEW=/tmp/host_new SCRIPT=/tmp/host_new/eval/host_work.py OUT=... ROUNDS=3 ab_rounds.sh
set -e
mkdir -p "$OUT"
for r in $(seq "$ROUNDS"); do
  for v in base new; do
    tree=$([ $v = base ] && echo "$BASE" || echo "$NEW")
    (cd "$tree" && PYTHONPATH="$tree" python "$SCRIPT" --batch-sizes 1 16 64 --k 0 4 --repeats 5 \
        --json "$OUT/${v}_r$r.json" > "$OUT/${v}_r$r.txt" 2>/dev/null)
  done
done
