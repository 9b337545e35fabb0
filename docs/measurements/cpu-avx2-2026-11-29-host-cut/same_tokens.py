"""The tokens `eval/host_work.py`'s setting generates, as a digest per (batch, k): run once on the
code before and once after a change (each tree on PYTHONPATH); equal digests, the same tokens.
Rows stop at token 7 (an EOS) or after 100 new tokens; each setting runs twice (the second call
reuses the engine's graph buckets and measured step costs, so its steps' widths differ).

    PYTHONPATH=/path/to/tree python docs/measurements/cpu-avx2-2026-11-29-host-cut/same_tokens.py
"""

import hashlib

import torch

import hf_plookup
from eval.host_work import prompts
from eval.lib.cli import set_threads
from eval.lib.models import load_model
from hf_plookup.steps.graphs import GraphRunner

set_threads(1)
for b in (1, 3, 16, 64):
    for k in (0, 2, 4, 8):
        model, _ = load_model("random:tiny-llama", torch.float32, "cpu")
        wrapped = hf_plookup.wrap(model, max_cache_tokens=1 << 16, block_size=16, pad_drafts=True)
        eng = wrapped._engine
        eng._graphs = GraphRunner(wrapped, eng.cache(), "sdpa", eng.options.max_num_seqs, capture=False)
        eng.width_policy = True
        ids, mask = prompts(b, model.config.vocab_size)
        kw = dict(attention_mask=mask, max_new_tokens=100, prompt_lookup_num_tokens=k or None, do_sample=False,
                  eos_token_id=7, pad_token_id=0)
        h = hashlib.sha1()
        for _ in range(2):
            out = wrapped.generate(ids, **kw)
            h.update((out if isinstance(out, torch.Tensor) else out.sequences).numpy().tobytes())
        print(b, k, h.hexdigest()[:16], flush=True)
        hf_plookup.unwrap(wrapped)
