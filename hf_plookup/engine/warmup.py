"""`wrap(model, warmup={...})`: the compiled and captured steps that later calls will run, built
at wrap time, so that no call compiles or captures.

Where decode steps run compiled (`compile=True`) or in CUDA graphs, each new step bucket (a step
width, a batch bucket, a context bucket: steps.graphs) is compiled or captured the first time a
step needs it, inside that call. A warm-up builds the buckets that calls of up to
`max_batch_size` rows with the given `prompt_lookup_num_tokens` will meet, up to `max_length`
tokens of context, on rows that are all padding (steps.graphs.dummy_layout): the widths the
calls' steps choose among (engine.widths), in every batch bucket up to that size (a call's batch
shrinks through the smaller ones as its rows finish), over every context bucket up to that
length. One compile serves every context bucket of its width and batch bucket (the key dimension
is dynamic), so the extra context buckets cost a capture each (CUDA) or one forward of dummy rows
(CPU).

The spec, a dict (every key optional):
- `max_batch_size`: the most rows a call (or calls joined in one loop) holds (default 1);
- `prompt_lookup_num_tokens`: an int or a list of them, 0 for plain greedy (default 0);
- `max_length`: the longest prompt plus new tokens to cover (default: the KV cache's capacity,
  at most the model's `max_position_embeddings`).

Example: wrap(model, compile=True, warmup={"max_batch_size": 4, "prompt_lookup_num_tokens": 4})
builds, on CPU, the width-5 step at batch buckets 1, 2 and 4 (one compile each) in every context
bucket; a later `generate(ids, prompt_lookup_num_tokens=4)` of 1 to 4 rows then reports
`last_stats.compile_time == 0`. An engine whose steps run eagerly has nothing to build.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..base.checks import positive_int
from ..steps.graphs import BATCH_BUCKETS, batch_bucket
from .sequence import DecodeConfig

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger("hf_plookup")

KEYS = ("max_batch_size", "prompt_lookup_num_tokens", "max_length")


def warmup_spec(value) -> dict | None:
    """The `warmup` option checked and normalized: None, or a dict of the three keys, the k values
    a sorted tuple, `max_length` an int or None. A ValueError names the bad part.

    Example: warmup_spec({"max_batch_size": 16, "prompt_lookup_num_tokens": [8, 4]}) ==
    {"max_batch_size": 16, "prompt_lookup_num_tokens": (4, 8), "max_length": None}."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"warmup must be a dict with keys {list(KEYS)} or None, got {type(value).__name__} {value!r}")
    unknown = set(value) - set(KEYS)
    if unknown:
        raise ValueError(f"warmup: unknown key(s) {sorted(map(str, unknown))}; allowed: {list(KEYS)}")

    def int_of(name: str, v, minimum: int = 1, none_ok: bool = False) -> int | None:
        return positive_int(f"warmup['{name}']", v, minimum=minimum, none_ok=none_ok, type_error=ValueError)

    ks = value.get("prompt_lookup_num_tokens", 0)
    ks = list(ks) if isinstance(ks, Sequence) and not isinstance(ks, str) else [ks]
    if not ks:
        raise ValueError("warmup['prompt_lookup_num_tokens'] must not be empty")
    return {"max_batch_size": int_of("max_batch_size", value.get("max_batch_size", 1)),
            "prompt_lookup_num_tokens": tuple(sorted({int_of("prompt_lookup_num_tokens", k, minimum=0) for k in ks})),
            "max_length": int_of("max_length", value.get("max_length"), none_ok=True)}


def check_warmup(engine: Engine, spec: dict) -> int:
    """A ValueError, before anything is allocated or built, where `spec` (a `warmup_spec`) asks for
    more than `engine` holds: rows beyond `max_num_seqs`, a length beyond the KV cache. Returns
    the length the warm-up covers (`max_length`, or its default)."""
    most = spec["max_batch_size"]
    if most > engine.options.max_num_seqs:
        raise ValueError(f"warmup['max_batch_size'] is {most}, more than max_num_seqs={engine.options.max_num_seqs}")
    capacity = engine.capacity_blocks * engine.options.block_size
    length = spec["max_length"]
    if length is None:
        return min(capacity, getattr(engine.model.config.get_text_config(), "max_position_embeddings", None)
                   or capacity)
    if length > capacity:
        raise ValueError(f"warmup['max_length'] is {length} but the KV cache holds {capacity} tokens; raise "
                         "`max_cache_tokens` (or `num_blocks`) in hf_plookup.wrap(...)")
    return length


def warm_up(engine: Engine, spec: dict) -> dict:
    """Build `engine`'s step buckets for `spec` (a `warmup_spec` that `check_warmup` passed),
    before any call. Returns what it did: {"buckets": built, "compile_seconds",
    "capture_seconds", "seconds"} (all 0 where the steps run eagerly)."""
    t0 = time.perf_counter()
    done = {"buckets": 0, "compile_seconds": 0.0, "capture_seconds": 0.0, "seconds": 0.0}
    if not (engine.use_graphs or engine.use_compile):
        logger.info("hf_plookup: warmup has nothing to build (decode steps run eagerly: neither CUDA graphs "
                    "nor compile=True)")
        return done
    length = check_warmup(engine, spec)
    with engine._loop_lock:
        engine.prepare_steps()
        graphs = engine.graph_runner()
        compile0, capture0 = graphs.compile_seconds, graphs.capture_seconds
        for k in spec["prompt_lookup_num_tokens"]:
            widths, tree = engine.step_widths(DecodeConfig(max_new_tokens=1, eos_token_ids=frozenset(), k=k))
            for b in BATCH_BUCKETS[: BATCH_BUCKETS.index(batch_bucket(spec["max_batch_size"])) + 1]:
                for q in widths:
                    done["buckets"] += graphs.warm(q, b, tree, max(length, q))
        done["compile_seconds"] = graphs.compile_seconds - compile0
        done["capture_seconds"] = graphs.capture_seconds - capture0
    done["seconds"] = time.perf_counter() - t0
    logger.info("hf_plookup: warmed up %d step buckets in %.1f s (compile %.1f s, capture %.1f s)",
                done["buckets"], done["seconds"], done["compile_seconds"], done["capture_seconds"])
    return done
