#!/bin/bash
# The code of 2026-11-26; paths since moved, see docs/gpu.md (its short run). Kept as it ran; no current doc uses it.
# one device run: host CPU facts, the C kernels built there, the CPU tests of every SIMD level the
# host has, the SmolLM2 step bench on 2 host cores (fp32, bf16), then the GPU tests
# Ran as `bash docs/measurements/h100-host-2026-11-26/device_run.sh` from the repository root on the
# H100 host ($OUT: where the log and JSON go); its output is log.txt and the step_bench JSON here.
exec > >(tee "$OUT/log.txt") 2>&1
T0=$(date +%s); el() { echo "--- $(( $(date +%s) - T0 )) s: $*"; }
el start
nproc; lscpu | grep -E 'Model name|^Socket|^Core|^Thread|L3'
grep -o -w -E 'avx512[a-z0-9_]*|amx[a-z0-9_]*|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
nvidia-smi -L
python -c "import sys,torch,transformers,triton;print(sys.version.split()[0],torch.__version__,transformers.__version__,triton.__version__)"
python -c "import xdist, hypothesis; print('xdist+hypothesis ok')"
EXT=$(python -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
INC=$(python -c "import sysconfig;print(sysconfig.get_paths()['include'])")
gcc -O3 -std=c11 -ffp-contract=off -DNDEBUG -fwrapv -shared -fPIC -I"$INC" hf_plookup/csrc/cpu_kernels.c -o "hf_plookup/_cpu_kernels$EXT" -lpthread
export PYTHONPATH=$PWD
python -c "from hf_plookup.engine import cpu_kernels as c; print('C kernels', c.available(), 'simd level', c.simd_level())"
el built
timeout 100 python -m pytest tests/engine/test_cpu_kernels.py tests/engine/test_cpu_layers.py tests/engine/test_cpu_head.py -q -rs -n 8 -p no:cacheprovider 2>&1 | tail -15
el cpu-tests
for dt in fp32 bf16; do
  timeout 110 taskset -c 0,1 python eval/step_bench.py --device cpu --dtype $dt --modes eager --invariant --threads 2 --breakdown --kernels --out "$OUT/step_bench_$dt.json" 2>&1 | grep -v Warning
  el bench-$dt
done
timeout 200 python -m pytest tests/gpu tests/attention/test_triton.py tests/engine/test_invariant.py tests/test_compile.py -q -rs -n 8 -p no:cacheprovider 2>&1 | tail -40
el gpu-tests
