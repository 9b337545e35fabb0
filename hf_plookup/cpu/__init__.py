"""CPU-only code: the C kernels' Python face (`kernels`), Llama- and Gemma-form decoder layers in C
(`layers`), the LM head's layout (`head`), the linear weights packed in place (`packed_weight`),
weights on 2 MB pages (`huge_pages`), numba's row linear (`row_linear`) and invariant mode's
choice of linear per weight (`invariant_linears`). The kernels' C source is in `hf_plookup/csrc/`."""
