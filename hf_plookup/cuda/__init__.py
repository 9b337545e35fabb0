"""GPU steps: bucketed decode/verify steps captured in CUDA graphs and, with `compile=True`,
compiled (`graphs`; one compiled decoder layer for all layers: `regional`), and the Triton linear
of invariant mode (`triton_linear`)."""
