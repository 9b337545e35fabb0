"""One linear of SmolLM2's shapes in torchao's Int8DynamicActivationInt8WeightConfig, fp32 and bf16,
1 and 5 rows: torchao's own `F.linear` (per-token quantization by its generic functions, then
torch._int_mm) against hf_plookup's C linear of the same weight (cpu.kernels.linear: quantize_rows_i8,
the W_Q8 kernel, torchao's scaling steps), microseconds a call, 300 calls after 20. Run from the
repository root on 2 cores: taskset -c 0,1 python docs/measurements/cpu-xeon-2026-11-30-torchao-int8-dynamic/linear_times.py"""
import time, torch, warnings
warnings.filterwarnings("ignore")
from torchao.quantization import quantize_, Int8DynamicActivationInt8WeightConfig
from hf_plookup.cpu import kernels as K
torch.set_num_threads(2)
for dt in (torch.float32, torch.bfloat16):
  for (n, k) in ((1536, 576), (576, 1536)):
    lin = torch.nn.Linear(k, n, bias=False).to(dt)
    quantize_(lin, Int8DynamicActivationInt8WeightConfig())
    w = lin.weight
    for m in (1, 5):
      x = torch.randn(m, k, dtype=dt)
      def tao(): return torch.nn.functional.linear(x, w)
      def ours(): return K.linear(x, w, None)
      with torch.inference_mode():
        for f in (tao, ours):
          for _ in range(20): f()
          t=time.perf_counter()
          for _ in range(300): f()
          print(dt, n, k, m, f.__name__, f"{(time.perf_counter()-t)/300*1e6:.1f} us")
