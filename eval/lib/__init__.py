"""Code the scripts in eval/ share (modules, not scripts), one job each:

- `cli`: the scripts' common options (dtype, --threads, --invariant) and `--help` with defaults;
- `documents`: the shipped documents (eval/data/) and JSON-lines files;
- `prompts`: summarization prompts (chat template or few-shot) and the benchmarks' prompts;
- `models`: loading a model by alias, HF id, checkpoint, .gguf file, or random weights of a shape;
- `batching`: left-padded batches in, generated tokens out, where two outputs part;
- `calls`: timed `generate` calls of HF and hf_plookup;
- `timing`: device-synchronised timers, engine step times, kernel counts, copy bandwidth;
- `variants`: the benchmark's variant names (hf-greedy, plk-k4, plk-k4-t16, ...);
- `machine`: what the measurement ran on;
- `report`: the one JSON shape every script writes.
"""
