"""The workload the planner simulates, drawn the way `omni-pd bench serve` draws it.

Lengths are `N` or `uniform:LO:HI` (inclusive bounds), the bench's syntax. Request i gets the
i-th (prompt length, output length) pair of one sequence drawn from the seed, the same sequence
for every layout and every rate: the bench's own draw (`bench.workload.Workload.pairs`, which
this calls), so that a plan and a bench run with the same seed see the same requests. Arrivals
are the bench's own Poisson process (`bench.load.poisson_arrivals`: same seed, same times).

The bench's `--prompt-tokens` sizes the user message; the engine's prompt is that plus the chat
template's tokens (`template_tokens`: 8 for Qwen3-Omni's template, `<|im_start|>user\\n` ...
`<|im_end|>\\n<|im_start|>assistant\\n`, counted with its tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bench import workload as bench
from ..bench.load import poisson_arrivals
from ..bench.workload import FORMS, Lengths
from .errors import PlanError

__all__ = ["Lengths", "Workload", "arrivals", "parse_lengths"]
TEMPLATE_TOKENS = 8


def parse_lengths(text: str, flag: str, minimum: int = 1) -> Lengths:
    """The bench's `N` or `uniform:LO:HI`; anything else refused with one line naming `flag`
    and the forms it takes."""
    lengths = bench.read_lengths(text, minimum)
    if lengths is None:
        raise PlanError(f"{flag} takes {FORMS}, each at least {minimum}; got {text!r}")
    return lengths


@dataclass(frozen=True)
class Workload:
    """Prompt lengths (the user message, in tokens), output lengths (each request's max_tokens,
    all generated: the bench's --ignore-eos), the seed, and the template's tokens."""

    prompt: Lengths
    output: Lengths
    seed: int = 0
    template_tokens: int = TEMPLATE_TOKENS

    def pairs(self, count: int) -> list[tuple[int, int]]:
        """(prompt positions the engine computes, output tokens) of requests 0 .. count - 1:
        the bench's own draw, the template's tokens added."""
        drawn = bench.Workload(self.prompt, self.output, self.seed).pairs(count)
        return [(prompt + self.template_tokens, output) for prompt, output in drawn if prompt is not None]

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
