#!/bin/bash
# BEFORE, AFTER: checkouts of the commits compared (each with the C extension built); VENV: the
# environment; OUT: where logs and JSON go (see NOTES.md)
. "$VENV"/bin/activate
for q in quanto-int8 bnb-nf4; do
  for side in after before; do
    dir="$AFTER"; [ $side = before ] && dir="$BEFORE"
    cd $dir && python eval/summarize.py --model smollm2-135m --quantization $q --dataset cnn_dailymail --num-docs 8 --batch-size 1 --k 4 --threads 2 --no-plot --out "$OUT"/sum-$side-$q > "$OUT"/sum-$side-$q.log 2>&1
    echo "== $side $q" >> "$OUT"/sum-summary.txt; grep -A12 "^| variant\|^|" "$OUT"/sum-$side-$q/results.md | head -14 >> "$OUT"/sum-summary.txt
  done
done
