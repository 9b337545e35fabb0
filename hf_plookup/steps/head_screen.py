"""The greedy token of a CPU decode step without reading the whole LM head.

A greedy step needs only each row's argmax, yet the head is the largest single read of a step: a
151k x 2048 head is 622 MB in bf16, as much as eight of Qwen3-1.7B's 28 layers in 4-bit. The
screen is an int8 copy of the head with one scale per output (a quarter of the fp32 head's bytes,
half of the bf16 one's) that bounds every exact logit from one cheap pass:

1. the screen's logits a [M, V] (the C W_Q8 linear, at up to `SCREEN_ROWS` rows a call);
2. per output a bound B_n with |exact_n - a_n| <= B_n for any input x: B_n = |x|_2 D_n plus
   rounding terms, D_n holding the output's quantization error's norm |w_n - s_n q_n|_2 (Cauchy-
   Schwarz) and the float chains' rounding bounds (cpu_kernels.h, "head screen");
3. the candidates, the outputs whose largest possible logit reaches the largest smallest possible
   one; on real text these are one to a few dozen of the vocabulary;
4. their exact logits, each the same FMA chain `cpu.kernels.linear` computes, rounded to the head's
   dtype, and the first largest, as `argmax` of the full logits picks.

So the token is bitwise the full head's argmax, ties and all (`tests/cpu/test_head_screen.py`
checks against it). Where a row keeps more than `CAP` candidates (a flat distribution, a NaN),
the step computes the full logits instead. It runs only where the engine asks for tokens, not
logits: greedy, no logits processors but those that only ban tokens (`min_new_tokens`,
`suppress_tokens`: their banned outputs are taken out of the screen's logits first, so the token is
the argmax of the processed scores), no recorded scores or logits, no recycled successors
(`engine.batch.Batch.argmax_request`), on a plain float head without soft-capping, and the
`head_screen=False` option of `wrap` turns it off.

Example: for a head [[1, 0], [0, 1], [1, 1]] (fp32) and x = [2, 1], the screen's a is about
[2, 1, 3]; the third output's bound interval lies above the others', so it alone is a candidate,
and its exact logit 3 gives token 2.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..cpu import kernels as cpu_kernels

# rows per screen call: the W_Q8 tiles stream the weight once for up to 9 rows (cpu_kernels.h, x_block);
# past that they are compute-bound, and two calls of 9 rows cost less than one of 18
SCREEN_ROWS = 9
# candidates a row may keep before the step falls back on the full logits: each costs one output's
# exact chain, a column of the packed head
CAP = 256


# the tokens each of a step's kept rows may not take, as a function of the vocabulary size: bool [N, V],
# True where the step's logits processors set the score to -inf (engine.batch.Batch.argmax_request)
Bans = Callable[[int], torch.Tensor]


class Argmax(NamedTuple):
    """What a step returns in place of logits where it computed only the greedy tokens: `tokens`
    int64 [N], one per kept row."""

    tokens: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.tokens.device


class HeadScreen:
    """The int8 screen of `head`'s weight (a float `nn.Linear` the C linears read), made by `prepare`
    or when first used, and again when the weight's values move or change. `steps` and `fallbacks` count the steps
    it decided and those it passed on to the full logits."""

    def __init__(self, head: torch.nn.Linear):
        self.head = head
        self.key = None  # the weight's values' address and version when the screen was made
        self.screen: tuple[torch.Tensor, torch.Tensor] | None = None
        self.steps = 0
        self.fallbacks = 0

    @classmethod
    def of(cls, head: torch.nn.Module, softcap: float | None) -> HeadScreen | None:
        """A screen for `head` where it can decide the argmax: a plain linear of a float weight the C
        kernels read, its logits not soft-capped (a cap's tanh makes ties of distinct logits)."""
        if not cpu_kernels.available() or softcap is not None or not isinstance(head, torch.nn.Linear):
            return None
        w = head.weight
        if w.dtype not in cpu_kernels.DTYPES or not cpu_kernels.supported(w):
            return None
        return cls(head) if cpu_kernels.weight_kind(w) == cpu_kernels.W_FLOAT else None

    def prepare(self) -> None:
        """Make the screen now (`wrap` does, so that its memory is taken before the KV cache is
        sized from what is left)."""
        self._current()

    def _current(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        w = self.head.weight
        src = cpu_kernels.values_of(w)
        # (a PackedWeight written in place keeps its panels' address and version: its own version moves)
        key = (src.data_ptr(), cpu_kernels._version(src), cpu_kernels._version(w))
        packed = cpu_kernels.packed(w)
        if key != self.key:
            self.screen = cpu_kernels.screen_pack(packed, w.shape[0], w.shape[1])
            self.key = key
        return packed, self.screen

    def argmax(self, x: torch.Tensor, count: bool = True, bans: Bans | None = None) -> torch.Tensor | None:
        """Each row's greedy token (int64 [M]) for the head's inputs x [M, K] (the head's dtype),
        bitwise `linear(x, weight, bias).argmax(-1)`, or with `bans` the argmax of those logits with
        each row's banned outputs at -inf; None where a row keeps more than CAP candidates, where it
        may take no output, or where the head holds a value that is not finite. `count`: in `steps`
        or `fallbacks` (not for a check)."""
        packed, screen = self._current()
        if screen is None:
            return None
        codes, bound = screen
        x = x.contiguous()
        m, n = x.shape[0], self.head.weight.shape[0]
        xf = x.float()
        a = torch.empty(m, n, dtype=torch.float32)
        for i in range(0, m, SCREEN_ROWS):
            cpu_kernels._linear_call(xf[i : i + SCREEN_ROWS], codes, cpu_kernels.W_Q8, None, n, a[i : i + SCREEN_ROWS])
        if bans is not None:  # (a banned output's interval is empty: never a candidate, nor the threshold)
            a.masked_fill_(bans(n).to(a.device), float("-inf"))
        bias = self.head.bias
        bias = None if bias is None else bias.detach().to(x.dtype).contiguous()
        cand, kept = cpu_kernels.screen_pick(x, a, bound, bias, CAP)
        over = bool((kept > CAP).any())
        if count:
            self.fallbacks += over
            self.steps += not over
        return None if over else cpu_kernels.screen_exact(x, packed, n, bias, cand, kept)
