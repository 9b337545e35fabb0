#!/usr/bin/env bash
# The one-row stream rates of bf16, int8 (W_Q8) and int8 by VNNI (W_Q8B) linears, 2 threads and 1.
# Run from the repository root:
#   bash docs/measurements/cpu-xeon-2026-11-30-int8-stream/run.sh
set -euo pipefail
here=docs/measurements/cpu-xeon-2026-11-30-int8-stream
for t in 2 1; do
    PYTHONPATH=. python $here/stream_rates.py --threads $t | tee $here/stream_rates_t$t.txt
done
