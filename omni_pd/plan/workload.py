"""The workload the planner simulates, drawn the way `omni-pd bench serve` draws it.

Lengths are `N` or `uniform:LO:HI` (inclusive bounds), the bench's syntax. Request i gets the
i-th (prompt length, output length) pair of one sequence drawn from the seed, the same sequence
for every layout and every rate, from the same generator and seed string as the bench's
workload module (`random.Random("omni-pd bench serve lengths SEED")`, prompt then output per
request), so that a plan and a bench run with the same seed see the same requests. Arrivals are
the bench's own Poisson process (`bench.load.poisson_arrivals`: same seed, same times).

The bench's `--prompt-tokens` sizes the user message; the engine's prompt is that plus the chat
template's tokens (`template_tokens`: 8 for Qwen3-Omni's template, `<|im_start|>user\\n` ...
`<|im_end|>\\n<|im_start|>assistant\\n`, counted with its tokenizer).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..bench.load import poisson_arrivals
from .errors import PlanError

FORMS = "N or uniform:LO:HI (integers, LO <= HI)"
TEMPLATE_TOKENS = 8


@dataclass(frozen=True)
class Lengths:
    """A token length: fixed (`lo == hi`, written `N`) or uniform over lo..hi inclusive."""

    lo: int
    hi: int

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"uniform:{self.lo}:{self.hi}"

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    @property
    def median(self) -> float:
        return (self.lo + self.hi) / 2


def parse_lengths(text: str, flag: str, minimum: int = 1) -> Lengths:
    """`N` or `uniform:LO:HI`, every length at least `minimum`; anything else is refused with
    one line naming `flag` and the forms it takes."""
    parts = str(text).strip().split(":")
    numbers = parts[1:] if parts[0] == "uniform" and len(parts) == 3 else parts if len(parts) == 1 else None
    try:
        values = [int(v) for v in numbers] if numbers is not None else None
    except ValueError:
        values = None
    if values is None or values[0] > values[-1] or values[0] < minimum:
        raise PlanError(f"{flag} takes {FORMS}, each at least {minimum}; got {text!r}")
    return Lengths(values[0], values[-1])


@dataclass(frozen=True)
class Workload:
    """Prompt lengths (the user message, in tokens), output lengths (each request's max_tokens,
    all generated: the bench's --ignore-eos), the seed, and the template's tokens."""

    prompt: Lengths
    output: Lengths
    seed: int = 0
    template_tokens: int = TEMPLATE_TOKENS

    def pairs(self, count: int) -> list[tuple[int, int]]:
        """(prompt positions the engine computes, output tokens) of requests 0 .. count - 1."""
        rng = random.Random(f"omni-pd bench serve lengths {self.seed}")
        out = []
        for _ in range(count):
            prompt = self.prompt.draw(rng)
            out.append((prompt + self.template_tokens, self.output.draw(rng)))
        return out

    @property
    def median_prompt(self) -> int:
        """The median prompt's positions (template included)."""
        return round(self.prompt.median) + self.template_tokens

    @property
    def median_context(self) -> int:
        """Cached positions of a median request halfway through its output: the context a
        typical decode step attends to."""
        return self.median_prompt + round(self.output.median / 2)

    def describe(self) -> dict:
        return {
            "prompt_tokens": str(self.prompt),
            "output_tokens": str(self.output),
            "seed": self.seed,
            "template_tokens": self.template_tokens,
        }


def arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Send times (s) of `count` requests at `rate` req/s: the bench's Poisson process."""
    return poisson_arrivals(rate, count, seed)
