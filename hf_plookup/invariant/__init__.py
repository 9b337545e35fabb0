"""Invariant mode: every token's logits computed bitwise as in a 1-token step, whatever else shares
its forward: the linears' policy and kernels (`linears`, `row_linear`, `triton_linear`) and the
attention over exactly each query's keys (`attention`)."""
