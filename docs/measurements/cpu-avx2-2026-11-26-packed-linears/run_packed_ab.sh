#!/bin/bash
# Build the packed-weights prototype (packed_proto.c, which compiles the project's cpu_kernels.c into the
# same library) and A/B it against the project's linears in one process on 2 cores (cpus 0 and 1).
# Run from the repository root: bash docs/measurements/cpu-avx2-2026-11-26-packed-linears/run_packed_ab.sh OUTDIR
D=docs/measurements/cpu-avx2-2026-11-26-packed-linears
OUTDIR=${1:-/tmp}
lscpu | grep -E 'Model name|^Core|^Thread|L3'
grep -o -w -E 'avx2|avx512f|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
cat /sys/kernel/mm/transparent_hugepage/enabled
INC=$(python3 -c "import sysconfig;print(sysconfig.get_paths()['include'])")
gcc -O3 -std=c11 -ffp-contract=off -shared -fPIC -DPFD=16384 -DPFD_F=4096 "-DCPU_KERNELS_C=\"$PWD/hf_plookup/csrc/cpu_kernels.c\"" \
    -I"$INC" -o /tmp/packed_proto.so $D/packed_proto.c -lpthread || exit 1
taskset -c 0,1 python3 $D/packed_ab.py /tmp/packed_proto.so ${REPS:-7} 1,0 1,2,3 > "$OUTDIR/packed_ab.txt"
cat "$OUTDIR/packed_ab.txt"
