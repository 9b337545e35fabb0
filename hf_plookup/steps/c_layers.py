"""Decode steps of Llama- and Gemma-form models on CPU in two C calls a layer (invariant mode).

Through HF's modules a 1-token step of SmolLM2-135M makes some 12,000 Python-level calls, which on
a 2-core CPU cost more than its attention (docs/results.md, "A step's cost on this CPU"). `CpuLayers` runs a decode
step's decoder layers in C instead (`csrc/layers.c`: `layer_attention`, `layer_mlp`): the same
norms, linears and attention kernels invariant mode calls through the modules, with torch's
elementwise arithmetic (RoPE, residual adds, the gate-times-up product) written out to round
as torch does. Only the activation stays with the model's own module, between the two calls,
so its bits are torch's. The embedding, the rotary tables, the final norm and the LM head run as in the
module path. Prompt steps keep the modules.

Which models: a decoder of `model.model.layers` whose layers hold exactly an input and a
post-attention RMSNorm (Llama, Mistral, Qwen2, Qwen3, SmolLM, ...) or Gemma 2/3's four norms
(input, on the attention's output, before the MLP, on the MLP's output: `LAYER_NORMS`),
`self_attn` with `q_proj`, `k_proj`, `v_proj`, `o_proj` (and optional per-head `q_norm`,
`k_norm`), every layer's heads of one shape (read per layer, `layer_shape`: Gemma 4's differ), and
`mlp` with `gate_proj`, `up_proj`, `down_proj` and an activation module (SiLU, Gemma's tanh GELU),
with rotary tables per kind of layer where the model has them (Gemma 3's local and global layers)
and soft-capped logits where the config says so (Gemma 2); every norm one `cpu_kernels.rms_norm`
reproduces and every linear on the "cpu" kernel (`llama_form` says why a model is not taken). Structure
does not show everything a forward does (a multiplier on the embeddings, a scaled residual), so
the first decode step is run both ways (`CpuLayers.run`): the C path is used from then on only
where its logits and its keys and values were bitwise the modules'. That run also records each
layer's attention arguments (scale, sliding window, soft-cap) as the module passes them.

Example (SmolLM2, fp32, one decode step of 5 tokens): `layer_attention` computes x = norm1(h);
q, k, v; RoPE; stores k and v in the layer's pages; attends; h += o_proj(a); x = norm2(h); g, u =
gate and up of x. The MLP's `act_fn` then gives y = silu(g), and `layer_mlp` computes
h += down_proj(y * u).
"""

from __future__ import annotations

import ctypes
import inspect
import logging

import numpy as np
import torch
from torch.nn.modules import module as _hooks

from ..invariant.attention import build_layout
from ..invariant import compressed_tensors, gptq
from ..invariant.linears import linear_module, linear_weight, module_view
from ..attention.registry import record_attention
from ..cpu import kernels as cpu_kernels
from ..cpu.kernels import rms_eps, rms_form
from .head_screen import Argmax, Bans, HeadScreen

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
log = logging.getLogger("hf_plookup")


class _Shape(ctypes.Structure):
    _fields_ = [(n, _I) for n in ("hidden", "H", "H_kv", "D", "inter", "dt")]


class _Layer(ctypes.Structure):
    _fields_ = ([(n, _P) for n in ("ln1", "ln2", "q_norm", "k_norm", "wq", "wk", "wv", "wo", "wg", "wu", "wd",
                                   "bq", "bk", "bv", "bo", "bg", "bu", "bd", "k_cache", "v_cache")]
                + [(n, _F) for n in ("eps1", "eps2", "eps_qk", "scale", "softcap")]
                + [(n, _I) for n in ("form1", "form2", "form_qk")]
                + [(n, _P) for n in ("ln_attn_out", "ln_mlp_out")]
                + [(n, _F) for n in ("eps_attn_out", "eps_mlp_out")]
                + [(n, _I) for n in ("form_attn_out", "form_mlp_out")]
                + [("wkind", _I * 7)])  # a cpu_kernels weight kind (W_FLOAT, W_Q8, ...) of wq .. wd in this order


class _Step(ctypes.Structure):
    _fields_ = [("T", _I), ("threads", _I)] + [(n, _P) for n in ("slots", "cos", "sin", "h", "x", "q", "k", "v",
                                                                  "a", "g", "u")]


class _Keys(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("kv_slots", "seq", "run_lo", "run_hi", "extra_off", "extra")] + [("Lk", _I)]


_LIB = cpu_kernels._LIB
if _LIB is not None:
    _LIB.layer_attention.restype = _I
    _LIB.layer_attention.argtypes = [_P, _P, _P, _P]
    _LIB.layer_mlp.restype = _I
    _LIB.layer_mlp.argtypes = [_P, _P, _P, _P]
    _LIB.layer_phases.restype = _I
    _LIB.layer_phases.argtypes = [_I, _P]

# what the layers' time is spent on, in the order `layer_phases` counts it
PHASES = ("norms, RoPE, KV writes, residuals", "q/k/v", "attention", "o_proj", "gate/up", "down")


def layer_phases(on: bool) -> dict[str, float]:
    """Seconds the C layers spent per phase (`PHASES`) since the last call, which zeroes them;
    `on`: go on timing (eval/step_bench.py --breakdown; off, the layers read no clock)."""
    out = np.zeros(len(PHASES), np.int64)
    _LIB.layer_phases(int(on), out.ctypes.data)
    return {name: float(ns) * 1e-9 for name, ns in zip(PHASES, out)}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()



def norm_forms(model: torch.nn.Module) -> dict:
    """{module: its `cpu_kernels.rms_form` (None: not one)} for every module of `model`."""
    return {m: rms_form(m) for m in model.modules()}


# a layer's norms by form: Llama's two (input, and before the MLP), or Gemma 2/3's four (input, on the
# attention's output, before the MLP, on the MLP's output); each tuple: the C path's (ln1, ln2,
# ln_attn_out, ln_mlp_out), None where the form has none
LAYER_NORMS = {
    "llama": ("input_layernorm", "post_attention_layernorm", None, None),
    "gemma": ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"),
}


def layer_norms(layer: torch.nn.Module) -> tuple | None:
    """The layer's norm modules in the C path's order (`LAYER_NORMS`), or None where its parts are
    neither form's."""
    kids = _weighted_children(layer)
    for names in LAYER_NORMS.values():
        if kids == {"self_attn", "mlp", *(n for n in names if n)}:
            return tuple(getattr(layer, n) if n else None for n in names)
    return None


def _weighted_children(module: torch.nn.Module) -> set[str]:
    """The names of `module`'s children that hold weights: parameters, or a quantized linear's codes
    in buffers (GPTQ's)."""
    return {n for n, m in module.named_children()
            if any(True for _ in m.parameters()) or any(gptq.is_gptq_linear(c) for c in m.modules())}


def layer_config(config, i: int):
    """Layer `i`'s config: a heterogeneous config's own for the layer (transformers'
    `per_layer_config`: Gemma 4's full-attention layers have wider heads, and reading such a
    per-layer attribute on the global config raises AmbiguousGlobalPerLayerAttributeError, which a
    getattr default does not catch), else the config itself."""
    if getattr(config, "is_heterogeneous", False):
        return config.per_layer_config[i]
    return config


def layer_shape(config, attn: torch.nn.Module, i: int) -> tuple[int, int, int]:
    """(heads, KV heads, head size) of layer `i`, whose attention module is `attn`: the head size
    the module keeps (`attn.head_dim`) where it has one, the rest from the layer's config."""
    cfg = layer_config(config, i)
    h = cfg.num_attention_heads
    h_kv = getattr(cfg, "num_key_value_heads", None) or h
    d = getattr(attn, "head_dim", None)
    if not isinstance(d, int) or isinstance(d, bool):
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    return h, h_kv, d


def llama_form(model: torch.nn.Module, forms: dict | None = None) -> str | None:
    """Why `CpuLayers` cannot take `model` (None: it can; the first decode step still checks it).
    `forms`: `norm_forms(model)` where the caller has it (invariant.InvariantLinears does)."""
    forms = norm_forms(model) if forms is None else forms
    if not cpu_kernels.available():
        return "the C kernels are not built"
    inner, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    parts = [getattr(inner, n, None) for n in ("embed_tokens", "layers", "norm", "rotary_emb")]
    if inner is None or any(p is None for p in parts) or not linear_module(head):
        return "not a decoder of model.model.{embed_tokens, layers, norm, rotary_emb} and model.lm_head"
    if not isinstance(parts[0], torch.nn.Embedding) or not len(parts[1]):
        return "its embedding is not an nn.Embedding, or it has no layers"
    # every parameter of one dtype, plain, but the linears' weights, which may also be quantized weights
    # the C linears read (cpu_kernels.int8_parts, q4_parts; the check below)
    # (a linear's weight counts with the dtype its F.linear computes in: bitsandbytes' 4-bit one, its compute dtype)
    # (a GPTQ linear keeps its codes in buffers, not parameters: its weight is no parameter's; a held
    # compressed-tensors linear keeps its codes and scales in parameters of its own, which its weight reads)
    linear_weights = {id(m.weight): linear_weight(m) for m in model.modules()
                      if linear_module(m) and not gptq.is_gptq_linear(m)}
    held = {id(p) for m in model.modules() if compressed_tensors.is_held(m) for p in m.parameters(recurse=False)}
    params = [p for p in model.parameters() if id(p) not in held]
    dtypes = {linear_weights.get(id(p), p).dtype for p in params}
    if len(dtypes) != 1 or next(iter(dtypes)) not in cpu_kernels.DTYPES or any(
            not cpu_kernels._plain(p) for p in params if id(p) not in linear_weights):
        return "its weights are not all plain (or quantized as the C linears read) CPU tensors of one dtype, float32, bfloat16 or float16"
    config = model.config
    shape0 = None  # layer 0's (heads, KV heads, head size): the C path takes one for every layer
    for i, layer in enumerate(parts[1]):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if layer_norms(layer) is None:
            kids = sorted(_weighted_children(layer))
            return f"layer {i} holds {kids}, not a Llama layer's four parts or a Gemma layer's six"
        akids, mkids = _weighted_children(attn), _weighted_children(mlp)
        if not ({"q_proj", "k_proj", "v_proj", "o_proj"} <= akids <= {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "q_norm", "k_norm"}) or ("q_norm" in akids) != ("k_norm" in akids):
            return f"layer {i}'s attention holds {sorted(akids)}"
        act = getattr(mlp, "act_fn", None)
        if mkids != {"gate_proj", "up_proj", "down_proj"} or not isinstance(act, torch.nn.Module) or any(
                True for _ in act.parameters()):
            return f"layer {i}'s MLP is not gate/up/down with an activation module"
        linears = [getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
            getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(linear_module(m) for m in linears):
            return f"layer {i} has a projection that is not a plain nn.Linear"
        q, k, v, o, g, u, dn = linears
        h, h_kv, d = layer_shape(config, attn, i)
        if shape0 is None:
            shape0 = (h, h_kv, d)
        elif (h, h_kv, d) != shape0:
            return (f"layer {i}'s attention has {h} heads of {d} over {h_kv} KV heads, layer 0's {shape0[0]} of "
                    f"{shape0[2]} over {shape0[1]}: the C layers take one shape for every layer")
        if (q.out_features != h * d or k.out_features != h_kv * d or v.out_features != h_kv * d
                or o.in_features != h * d or g.out_features != u.out_features or dn.in_features != g.out_features
                or d % 2):
            return f"layer {i}'s projections do not fit {h} heads of {d} over {h_kv} KV heads"
        norms = [n for n in layer_norms(layer) if n is not None] + [getattr(attn, n) for n in ("q_norm", "k_norm")
                                                                  if n in akids]
        if any(forms.get(m) is None for m in norms):
            return f"layer {i} has a norm cpu_kernels.rms_norm does not reproduce"
    if forms.get(parts[2]) is None:
        return "its final norm is not one cpu_kernels.rms_norm reproduces"
    if not all(cpu_kernels.supported(linear_weight(m)) for m in model.modules() if linear_module(m)):
        return "a linear layer does not run on the C kernel"
    if not all(cpu_kernels.takes_inputs_as_they_are(linear_weight(m)) for m in model.modules() if linear_module(m)):
        return "a linear layer's library quantizes its inputs first (torchao's per-token activations)"
    return None


class _ViewRef:
    """Stands for a quantized module's parameter dict in `CpuLayers._refs`: its weight is the
    `ModuleWeight` the C linears read (invariant.module_weight: bitsandbytes' 4-bit, GPTQ), not the
    tensor of its packed codes. `view`: the module's `linear_weight` (asked on each use)."""

    def __init__(self, module: torch.nn.Module, view):
        self.module, self.view = module, view

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.view(self.module)


def _weight_refs(layers: list[torch.nn.Module]) -> list[tuple[object, str]]:
    """(a module's parameter dict, or a `_ViewRef` for a quantized module's weight, name) of every
    weight of the layers."""
    refs = []
    for m in (m for la in layers for m in la.modules()):
        view = module_view(m)
        if view is not None:  # (its codes and scales: a "weight" parameter for bitsandbytes, buffers for
            # GPTQ, parameters of their own for compressed-tensors; all the view's parts, but the bias)
            refs.append((_ViewRef(m, view), "weight"))
        refs += [(m._parameters, n) for n, p in m._parameters.items()
                 if p is not None and not (view is not None and n != "bias")]
    return refs


class CpuLayers:
    """A Llama-form model's decode steps in C (see the module text). `run` takes a step."""

    def __init__(self, model: torch.nn.Module, forms: dict, head_screen: bool = True):
        self.model = model
        inner = model.model
        self.embed, self.rotary, self.norm, self.head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.norm_form = forms[self.norm]
        self.layers = list(inner.layers)
        config = model.config
        self.dtype = self.head.weight.dtype
        attn0, mlp0 = self.layers[0].self_attn, self.layers[0].mlp
        h, h_kv, d = layer_shape(config, attn0, 0)  # every layer's (llama_form checks)
        self.shape = _Shape(hidden=config.hidden_size, H=h, H_kv=h_kv, D=d,
                            inter=mlp0.gate_proj.out_features, dt=cpu_kernels.dtype_code(self.dtype))
        self.norms = [layer_norms(la) for la in self.layers]  # (ln1, ln2, ln_attn_out, ln_mlp_out) each
        self.forms = [tuple(forms[n] if n is not None else None for n in norms)
                      + (forms[la.self_attn.q_norm] if hasattr(la.self_attn, "q_norm") else None,)
                      for la, norms in zip(self.layers, self.norms)]
        # Gemma 3's rotary tables differ by kind of layer (local and global attention): one call each
        types = getattr(config, "layer_types", None)
        per_type = "layer_type" in inspect.signature(self.rotary.forward).parameters and types is not None
        self.layer_types = list(types[: len(self.layers)]) if per_type else [None] * len(self.layers)
        self.softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2: tanh on the logits
        # greedy steps' tokens from the head's int8 screen (steps.head_screen), or None
        self.screen = HeadScreen.of(self.head, self.softcap) if head_screen else None
        self.acts = [la.mlp.act_fn for la in self.layers]
        # the modules whose forward the C path does not call (the embedding, rotary and activation
        # modules it does call)
        self.skipped = [model, inner, self.norm, self.head] + [
            m for la in self.layers for m in la.modules() if not any(m is a for a in self.acts)]
        # their instance dicts, where a forward hook or a forward set on the instance shows: `takes` reads
        # them there every step, fewer lookups than through the attributes on objects that the weights'
        # stream has evicted from cache
        self._module_dicts = [vars(m) for m in self.skipped]
        self.checked = False  # the first decode step ran both ways
        self.on = False  # ... and the C path gave the modules' bits
        self.attention: dict[int, dict] = {}  # layer_idx -> the arguments its module passed the attention
        # (a module's parameter dict, name) of every weight of the layers: found now, as the quantized
        # modules' checks read no forward set on the instance (as invariant mode sets one per step)
        self._refs = _weight_refs(self.layers)
        self._plan_key = None  # the addresses the layer structs were built from
        self._structs: list[_Layer] = []
        self._held: list[torch.Tensor] = []
        self._windows: list[int | None] = []

    @classmethod
    def of(cls, model: torch.nn.Module, forms: dict | None = None, head_screen: bool = True) -> CpuLayers | None:
        """`CpuLayers` of `model` where `llama_form` takes it, else None (`forms`: as llama_form's;
        `head_screen`: whether greedy steps may take their tokens from the head's screen)."""
        forms = norm_forms(model) if forms is None else forms
        return cls(model, forms, head_screen) if llama_form(model, forms) is None else None

    def takes(self, layout) -> bool:
        """Whether `run` takes this step: a decode step with kept rows, unless the check failed or
        a module the C path would not call (the model, its layers and their parts, the final norm,
        the LM head) has a forward hook or a forward of its own set on the instance (accelerate's
        hooks wrap it so): those steps run the modules, hooks and all."""
        return ((self.on or not self.checked) and layout.is_decode and len(layout.keep) > 0
                and not (_hooks._global_forward_hooks or _hooks._global_forward_pre_hooks)
                and not any(d["_forward_hooks"] or d["_forward_pre_hooks"] or "forward" in d for d in self._module_dicts))

    def _tensors(self, weights: list[torch.Tensor], cache) -> list[torch.Tensor]:
        """Every tensor the layer structs point into (of a quantized weight, the tensor that holds its
        values: `cpu_kernels.values_of`), from the weights read now and the cache."""
        return [cpu_kernels.values_of(w) for w in weights] + [*cache.keys, *cache.values]

    def _plan(self, cache) -> tuple[list[_Layer], list[int | None]] | None:
        """The layers as C structs, rebuilt whenever a weight or a page tensor has moved (a
        parameter replaced or its `.data` swapped since the last step); None (and the C path off
        from then on) where a weight is no longer a contiguous tensor of the model's dtype (a quantized
        weight's values: of `cpu_kernels.VALUES_DTYPES`) or a linear's weight one the C linears do not read."""
        weights = [d[n] for d, n in self._refs]  # (read once: a quantized module's view is looked up)
        tensors = self._tensors(weights, cache)
        # addresses, and the weights' version counters: an in-place change repacks a weight (cpu_kernels.packed)
        key = [t.data_ptr() for t in tensors] + [cpu_kernels._version(w) for w in weights]
        if key == self._plan_key:
            return self._structs, self._windows
        # each tensor of the dtype it had when checked (a quantized weight's values: their own dtype)
        want = [cpu_kernels.VALUES_DTYPES.get(cpu_kernels.weight_kind(w), (self.dtype,)) for w in weights]
        want += [(self.dtype,)] * (len(tensors) - len(want))  # (the pages)
        if not all(t.dtype in w and t.is_contiguous() for t, w in zip(tensors, want)):
            self.on = False  # a weight swapped for another kind
            return None
        structs, windows = [], []
        for la, norms, (f1, f2, fa, fm, fqk) in zip(self.layers, self.norms, self.forms):
            attn, mlp = la.self_attn, la.mlp
            rec = self.attention[attn.layer_idx]
            k_cache, v_cache = cache.layer(attn.layer_idx)
            lin = {n: getattr(attn, p) for n, p in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj"))}
            lin.update({n: getattr(mlp, p) for n, p in (("g", "gate_proj"), ("u", "up_proj"), ("d", "down_proj"))})
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            ln1, ln2, ln_a, ln_m = norms
            s = _Layer(ln1=_ptr(ln1.weight), ln2=_ptr(ln2.weight),
                       q_norm=_ptr(qn.weight) if qn is not None else None,
                       k_norm=_ptr(kn.weight) if kn is not None else None,
                       k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
                       eps1=rms_eps(ln1), eps2=rms_eps(ln2),
                       eps_qk=rms_eps(qn) if qn is not None else 0.0, scale=rec["scale"], softcap=rec["softcap"] or 0.0,
                       form1=cpu_kernels.RMS_FORMS[f1], form2=cpu_kernels.RMS_FORMS[f2],
                       form_qk=cpu_kernels.RMS_FORMS[fqk] if fqk else 0,
                       ln_attn_out=_ptr(ln_a.weight) if ln_a is not None else None,
                       ln_mlp_out=_ptr(ln_m.weight) if ln_m is not None else None,
                       eps_attn_out=rms_eps(ln_a) if ln_a is not None else 0.0,
                       eps_mlp_out=rms_eps(ln_m) if ln_m is not None else 0.0,
                       form_attn_out=cpu_kernels.RMS_FORMS[fa] if fa else 0,
                       form_mlp_out=cpu_kernels.RMS_FORMS[fm] if fm else 0)
            for i, (n, m) in enumerate(lin.items()):
                weight = linear_weight(m)
                if not cpu_kernels.supported(weight) or weight.dtype != self.dtype:
                    self.on = False  # a weight swapped for one the C linears do not read
                    return None
                w = cpu_kernels.packed(weight)
                tensors.append(w)
                setattr(s, "w" + n, w.data_ptr())
                setattr(s, "b" + n, _ptr(m.bias))
                s.wkind[i] = cpu_kernels.weight_kind(weight)
            structs.append(s)
            windows.append(rec["window"])
        # the structs point into these tensors (and the packed weights): held, their memory outlives a
        # parameter's `.data` being swapped by another thread (cpu.huge_pages), or a weight repacked,
        # until the next step rebuilds the structs
        self._plan_key, self._structs, self._windows, self._held = key, structs, windows, tensors
        return structs, windows

    def _fits(self, cache) -> bool:
        """Whether the recorded attention and the cache's page shapes suit the C path (`_plan` checks
        the tensors' dtypes and layout)."""
        for la in self.layers:
            rec = self.attention.get(la.self_attn.layer_idx)
            if rec is None or rec["sinks"] or rec["scale"] is None:
                return False
            k, v = cache.layer(la.self_attn.layer_idx)
            if k.shape[-2:] != (self.shape.H_kv, self.shape.D) or v.shape[-2:] != k.shape[-2:]:
                return False
        return True

    def run(self, layout, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, cache,
            module_forward, argmax: bool | Bans = False) -> torch.Tensor | Argmax:
        """Logits of the decode step `layout` at rows `keep` ([N, V]). `module_forward()`: the same
        step through the modules (run instead where the C path is off, and beside it once, to check).
        `argmax`: only the greedy tokens are needed (with the tokens each row may not take, where it
        is a `Bans`), so the head's screen may give them (`Argmax`)."""
        if self.checked:
            plan = self._plan(cache) if self.on else None
            if plan is None:
                return module_forward()
            with cpu_kernels.serial_torch():
                rows = self._forward(layout, input_ids, positions, keep, plan)
                if argmax and self.screen is not None:
                    tokens = self.screen.argmax(rows, bans=None if argmax is True else argmax)
                    if tokens is not None:
                        return Argmax(tokens)
                return self._head(rows)
        with record_attention() as rec:
            ref = module_forward()
        self.attention = rec
        self.checked = True
        plan = self._plan(cache) if len(rec) == len(self.layers) and self._fits(cache) else None
        if plan is None:
            return ref
        slots = torch.from_numpy(np.ascontiguousarray(layout.slot_mapping))
        pages = [c.view(-1, *c.shape[-2:]) for la in self.layers for c in cache.layer(la.self_attn.layer_idx)]
        kv_ref = [p.index_select(0, slots) for p in pages]
        with cpu_kernels.serial_torch():
            rows = self._forward(layout, input_ids, positions, keep, plan)
            got = self._head(rows)
        self.on = torch.equal(got, ref) and all(torch.equal(p.index_select(0, slots), r) for p, r in zip(pages, kv_ref))
        if not self.on:  # the modules' keys and values stay, and the screen goes unused
            for p, r in zip(pages, kv_ref):
                p.index_copy_(0, slots, r)
            self.screen = None
        elif self.screen is not None:  # the screen's tokens checked once against the logits' argmax
            with cpu_kernels.serial_torch():
                tokens = self.screen.argmax(rows, count=False)
            if tokens is not None and not torch.equal(tokens, ref.float().argmax(dim=-1)):
                log.warning("hf_plookup: the LM head's screen gave other tokens than the logits' argmax "
                            "in its check; greedy steps compute the whole head")
                self.screen = None
        return ref

    def _forward(self, layout, input_ids, positions, keep, plan) -> torch.Tensor:
        """The step's decoder layers in C: the final norm's rows at `keep` ([N, hidden])."""
        structs, windows = plan
        inv = build_layout(layout, input_ids.device)
        t, shape = len(layout.input_ids), self.shape
        keys = {}  # window -> (_Keys, the arrays it points into)
        for w in set(windows):
            arrays = [np.ascontiguousarray(layout.kv_slots, dtype=np.int64),
                      *(np.ascontiguousarray(a, dtype=np.int64) for a in inv.decode_runs(w))]
            keys[w] = (_Keys(*(a.ctypes.data for a in arrays), layout.kv_slots.shape[1]), arrays)
        slots = np.ascontiguousarray(layout.slot_mapping, dtype=np.int64)
        with cpu_kernels.serial_torch():
            threads = cpu_kernels.threads()
            h = self.embed(input_ids).contiguous()  # [T, hidden]
            tables = {}  # layer type -> its rotary tables [T, D] (and the tensors they point into)
            for lt in set(self.layer_types):
                args = (h[None], positions[None]) + ((lt,) if lt is not None else ())
                cs = [c[0].contiguous() for c in self.rotary(*args)]
                tables[lt] = (cs[0].data_ptr(), cs[1].data_ptr(), cs)
            hd, kvd = shape.H * shape.D, shape.H_kv * shape.D
            x = h.new_empty(t, shape.hidden)
            q, a = h.new_empty(t, hd), h.new_empty(t, hd)
            k, v = h.new_empty(t, kvd), h.new_empty(t, kvd)
            g, u = h.new_empty(t, shape.inter), h.new_empty(t, shape.inter)
            cos, sin, _ = tables[self.layer_types[0]]
            step = _Step(t, threads, slots.ctypes.data, cos, sin, *(z.data_ptr() for z in (h, x, q, k, v, a, g, u)))
            ps, pp = ctypes.addressof(shape), ctypes.addressof(step)
            for s, w, act, lt in zip(structs, windows, self.acts, self.layer_types):
                step.cos, step.sin, _ = tables[lt]
                if _LIB.layer_attention(ps, ctypes.addressof(s), pp, ctypes.addressof(keys[w][0])):
                    raise MemoryError("cpu_layers: no memory for a layer's scratch")
                y = act(g)
                if _LIB.layer_mlp(ps, ctypes.addressof(s), pp, y.data_ptr()):
                    raise MemoryError("cpu_layers: no memory for a layer's scratch")
            rows = h.index_select(0, keep)
            return cpu_kernels.rms_norm(rows, self.norm.weight, rms_eps(self.norm), self.norm_form)

    def _head(self, rows: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of the final norm's `rows` ([N, V])."""
        logits = cpu_kernels.linear(rows, self.head.weight, self.head.bias)
        if self.softcap is not None:  # as Gemma's forward does: (logits / cap).tanh() * cap
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
