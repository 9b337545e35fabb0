"""ATen's CPU int4 GEMV (what gptqmodel's TorchAtenLinear runs in bf16) against bf16 F.linear, one
[6144, 2048] weight (Qwen3-1.7B's gate/up shape) and all 28x7 layer-sized weights streamed from memory."""
import time, torch
torch.set_num_threads(2)
N, K, G = 6144, 2048, 128
def best(f, n=30):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return min(ts)
x = torch.randn(1, K, dtype=torch.bfloat16)
copies = 40  # > L3: every call reads its weight from memory
ws = [torch.randn(N, K, dtype=torch.bfloat16) for _ in range(copies)]
q = [torch.randint(0, 16, (N, K), dtype=torch.int32) for _ in range(copies)]
packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(qq, 1) for qq in q]
sz = torch.randn(K // G, N, 2, dtype=torch.bfloat16)
i = [0]
def lin():
    i[0] = (i[0] + 1) % copies; torch.nn.functional.linear(x, ws[i[0]])
def int4():
    i[0] = (i[0] + 1) % copies; torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed[i[0]], G, sz)
for name, f in (("bf16 F.linear", lin), ("int4pack_mm", int4)):
    f(); t = best(f)
    print(f"{name}: {t*1e3:.3f} ms, {N*K/t/1e9:.1f} G weights/s")
