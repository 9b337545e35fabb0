"""The throughput benchmark's variants: families (what `--variants` takes) and the names they
expand to at one batch size, e.g. with k = 4 8 and tree nodes 16, at batch size 1:

    hf-greedy  hf-pl-k4 hf-pl-k8  hf-static  hf-batch  plk-greedy  plk-k4 plk-k8  plk-k4-t16 plk-k8-t16
    plk-greedy-nocompile plk-k4-nocompile  plk-greedy-eager plk-k4-eager

A name says what runs: its engine (`hf-*`: HF's generate on the plain model; `plk-*`: hf_plookup),
its k (`-k4`), its candidate trees (`-t16`), and which hf_plookup engine (`-nocompile`,
`-eager`, `-compiled`, `-compiled_nographs`; else the default one)."""

from __future__ import annotations

import re

HF_GREEDY = "hf-greedy"
FAMILIES = {
    "hf-greedy": "HF generate, greedy, left-padded batch (the reference of every ratio; always runs)",
    "hf-pl": "HF's own prompt lookup, hf-pl-k{k} (HF allows it at batch size 1 only)",
    "hf-static": "HF generate(cache_implementation='static'): HF compiles its forward on CUDA",
    "hf-batch": "HF continuous batching, model.generate_batch (paged attention, greedy, no speculative decoding)",
    "plk-greedy": "hf_plookup, plain batched greedy",
    "plk": "hf_plookup with prompt lookup, plk-k{k}, and candidate trees of n nodes, plk-k{k}-t{n} (--tree-nodes)",
    "plk-nocompile": "plk-greedy and plk-k{first k} with compile=False (CUDA graphs of the eager forward)",
    "plk-eager": "plk-greedy and plk-k{first k} with cuda_graphs=False, compile=False",
    "plk-compiled": "plk-greedy and plk-k{first k} with compile=True (compiled steps in CUDA graphs)",
    "plk-compiled_nographs": "plk-greedy and plk-k{first k} with compile=True, cuda_graphs=False",
    "plk-noscreen": "plk-greedy and plk-k{first k} with head_screen=False (the whole LM head every greedy CPU step)",
}
# hf_plookup engines: the wrap defaults, and one per setting of compile and cuda_graphs
ENGINE_OPTIONS = {
    "default": {},
    "nocompile": dict(compile=False),
    "eager": dict(cuda_graphs=False, compile=False),
    "compiled": dict(compile=True),
    "compiled_nographs": dict(compile=True, cuda_graphs=False),
    "noscreen": dict(head_screen=False),
}
ENGINES = tuple(ENGINE_OPTIONS)


def variant_names(families: list[str], ks: list[int], tree_nodes: list[int], batch_size: int,
                  hf_pl_ks: list[int] | None = None) -> list[str]:
    """The variants `families` run at `batch_size`, in a fixed order (hf-greedy first); HF's prompt
    lookup with `hf_pl_ks` (None: every k in `ks`)."""
    names = [HF_GREEDY]
    if "hf-pl" in families and batch_size == 1:
        names += [f"hf-pl-k{k}" for k in (ks if hf_pl_ks is None else hf_pl_ks)]
    for family in ("hf-static", "hf-batch", "plk-greedy"):
        if family in families:
            names.append(family)
    if "plk" in families:
        names += [f"plk-k{k}" for k in ks]
        names += [f"plk-k{k}-t{n}" for k in ks for n in tree_nodes]
    for engine in ENGINES[1:]:
        if f"plk-{engine}" in families:
            names += [f"plk-greedy-{engine}", f"plk-k{ks[0]}-{engine}"]
    return names


def k_of(name: str) -> int | None:
    """prompt_lookup_num_tokens of a variant: k_of("plk-k4-t16") == 4, k_of("plk-greedy") is None."""
    m = re.search(r"-k(\d+)", name)
    return int(m.group(1)) if m else None


def tree_of(name: str) -> int | None:
    """prompt_lookup_tree_nodes of a variant: tree_of("plk-k4-t16") == 16, None without trees."""
    m = re.search(r"-t(\d+)$", name)
    return int(m.group(1)) if m else None


def engine_of(name: str) -> str | None:
    """Which hf_plookup engine runs a variant (one of ENGINES); None for HF's variants."""
    if not name.startswith("plk"):
        return None
    last = name.rsplit("-", 1)[-1]
    return last if last in ENGINES else "default"
