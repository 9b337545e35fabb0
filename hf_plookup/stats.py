"""Acceptance and speed statistics of one `generate` call (`SpecStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStats:
    """What one `generate` call did.

    A *row step* is one sequence taking part in one forward that produces tokens for it
    (the last prefill chunk or a decode/verify step); `tokens_per_forward` is new tokens
    per row step, i.e. per sequence per forward, the figure that speculative decoding
    raises above 1.
    """

    num_sequences: int = 0
    forwards: int = 0  # model forwards: prefill chunks and decode/verify steps
    prefill_forwards: int = 0  # forwards that carried at least one prompt chunk
    prompt_tokens: int = 0  # prompt tokens over all rows
    cached_prompt_tokens: int = 0  # of those, tokens whose K/V came from the prefix pool or the caller's cache (not prefilled)
    row_steps: int = 0  # (sequence, forward) pairs that produced tokens
    new_tokens: int = 0  # generated tokens over all rows (stops included, padding not)
    drafted: int = 0  # draft tokens fed to verification
    accepted: int = 0  # draft tokens accepted
    accepted_recycled: int = 0  # of those, drafts from recycled successors alone (draft_recycled; drafting.recycle)
    drafted_per_position: list[int] = field(default_factory=list)  # [k]
    accepted_per_position: list[int] = field(default_factory=list)  # [k]
    drafter: str = ""  # "ngram" (one chain of k drafts), "ngram-tree" (candidate trees), "" (none)
    memory_tokens: int = 0  # tokens of earlier calls' outputs the trees drafted from (drafting.memory)
    verify_steps: int = 0  # row steps that verified drafts (decode steps of drafting rows)
    accepted_hist: list[int] = field(default_factory=list)  # [k+1]: verify steps that accepted j drafts
    propose_time: float = 0.0  # seconds in the proposer
    propose_calls: int = 0  # proposer calls (one per decode step)
    wall_time: float = 0.0  # seconds, whole call
    compile_time: float = 0.0  # seconds of wall_time spent compiling new step buckets (their first run)
    capture_time: float = 0.0  # seconds of wall_time spent capturing new step buckets in CUDA graphs
    # how the forwards that carried this call's decoding rows ran: "graph" (its bucket's CUDA graph
    # replayed), "compiled" (its bucket's compiled forward, uncaptured), "static" (its bucket's static
    # buffers run eagerly: a test and benchmark mode) or "eager" (the model's own forward: a step no
    # bucket holds, or an engine with neither CUDA graphs nor compiled steps). Prompt chunks always
    # run eagerly and are counted in prefill_forwards.
    decode_steps_by_path: dict[str, int] = field(default_factory=dict)
    # where graphs or compiled steps are on: why decode steps ran eagerly (reason -> steps)
    eager_reasons: dict[str, int] = field(default_factory=dict)
    delegated: bool = False  # True when the call went to HF's own generate
    delegated_reason: str = ""
    attn_backend: str = ""
    prefix_cache: bool = False  # the prefix pool was on for this call (engine: EngineOptions.prefix_cache)
    invariant: bool = False  # invariant mode ran (invariant.linears: drafts change no token's arithmetic)
    # why greedy may part from HF's greedy after a near-tie: a quantized model whose kernels round a
    # row differently with another row count, accepted by the wrap-time probe (attention.probe); "" else
    exactness_note: str = ""
    k: int = 0  # prompt_lookup_num_tokens (0: plain greedy)

    def __post_init__(self) -> None:
        if len(self.drafted_per_position) != len(self.accepted_per_position):
            raise ValueError("drafted_per_position and accepted_per_position must have equal length")

    def resize(self, k: int) -> None:
        """Start per-position counters for `k` draft positions."""
        self.k = k
        self.drafted_per_position = [0] * k
        self.accepted_per_position = [0] * k
        self.accepted_hist = [0] * (k + 1)

    def count_forward(self, prefill: bool, path: str | None = None, reason: str | None = None) -> None:
        """One model forward that carried a row of this call (`prefill`: a prompt chunk among them).
        `path`: how it ran (see decode_steps_by_path), where it carried a decoding row of this call
        (None: only prompt chunks of it); `reason`: why it ran eagerly where graphs or compiled
        steps are on (GraphRunner.unsupported).

        Example: a call's prompt chunk, then 3 replayed decode steps and one step beside another
        call's prompt chunk: forwards 5, prefill_forwards 2, decode_steps_by_path {"graph": 3,
        "eager": 1}, eager_reasons {"a prompt chunk": 1}."""
        self.forwards += 1
        self.prefill_forwards += prefill
        if path is not None:
            self.decode_steps_by_path[path] = self.decode_steps_by_path.get(path, 0) + 1
            if reason is not None:
                self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1

    @property
    def decode_steps(self) -> int:
        """Forwards that carried a decoding row of this call (decode and verify steps)."""
        return sum(self.decode_steps_by_path.values())


    def count_propose(self, seconds: float) -> None:
        """One proposer call of `seconds` that drafted for a row of this call."""
        self.propose_time += seconds
        self.propose_calls += 1

    def count_verify(self, drafted: int, accepted: int, deepest: int) -> None:
        """One row's verify step: `drafted` draft tokens fed, `accepted` of them taken, the
        deepest fed node `deepest` levels below the row's last token (a chain: `drafted`);
        drafts at the levels 1..deepest count per position, those on the accepted path as taken."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        self.accepted_hist[min(accepted, len(self.accepted_hist) - 1)] += 1
        for j in range(min(deepest, len(self.drafted_per_position))):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < accepted

    def count_emitted(self, tokens: int) -> None:
        """One row step that appended `tokens` (a stopping criterion may take some back: `uncount`)."""
        self.row_steps += 1
        self.new_tokens += tokens

    def uncount(self, tokens: int) -> None:
        """`tokens` generated tokens dropped by a stopping criterion that cut their row."""
        self.new_tokens -= tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of drafts at position j (0-based) that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def mean_tree_size(self) -> float:
        """Draft tokens (tree nodes, or chain length) fed per verify step."""
        return self.drafted / self.verify_steps if self.verify_steps else 0.0

    @property
    def propose_ms_per_step(self) -> float:
        return 1000 * self.propose_time / self.propose_calls if self.propose_calls else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def accepted_by_source(self) -> dict[str, int]:
        """Accepted draft tokens by where they came from: "text" (the prompt, the output, other
        rows, a corpus, earlier calls) and "recycled" (the model's own earlier predictions alone)."""
        return {"text": self.accepted - self.accepted_recycled, "recycled": self.accepted_recycled}

    def as_dict(self) -> dict:
        return {
            "num_sequences": self.num_sequences,
            "forwards": self.forwards,
            "prefill_forwards": self.prefill_forwards,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefix_cache": self.prefix_cache,
            "row_steps": self.row_steps,
            "new_tokens": self.new_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accepted_by_source": self.accepted_by_source,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_forward": self.tokens_per_forward,
            "acceptance_per_position": self.acceptance_per_position,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "drafter": self.drafter,
            "memory_tokens": self.memory_tokens,
            "verify_steps": self.verify_steps,
            "mean_tree_size": self.mean_tree_size,
            "accepted_hist": list(self.accepted_hist),
            "propose_ms_per_step": self.propose_ms_per_step,
            "wall_time": self.wall_time,
            "compile_time": self.compile_time,
            "capture_time": self.capture_time,
            "decode_steps_by_path": dict(self.decode_steps_by_path),
            "eager_reasons": dict(self.eager_reasons),
            "tokens_per_second": self.tokens_per_second,
            "delegated": self.delegated,
            "delegated_reason": self.delegated_reason,
            "attn_backend": self.attn_backend,
            "invariant": self.invariant,
            "exactness_note": self.exactness_note,
            "k": self.k,
        }
