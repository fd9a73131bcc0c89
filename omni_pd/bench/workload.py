"""The seeded workload of `omni-pd bench serve`: each request's prompt length and output length.

`--prompt-tokens` and `--output-tokens` take a fixed length `N` or a distribution `uniform:LO:HI`
(inclusive bounds). Request i of a level (or of an open-loop rate) gets the i-th (prompt length,
output length) pair of one sequence drawn from `--seed`, so every config and every level of a run
sees the same pairs in the same order, and a rerun with the same seed sees them again.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

DEFAULT_MAX_TOKENS = 24
MIN_PROMPT_TOKENS = 8  # a sized prompt begins with its own number (sized_prompts.py)
FORMS = "N or uniform:LO:HI (integers, LO <= HI)"


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


def read_lengths(text: str, minimum: int = 1) -> Lengths | None:
    """`N` or `uniform:LO:HI`, every length at least `minimum`; None for anything else (the
    caller names its flag: `parse_lengths` here, `omni-pd plan`'s own error)."""
    parts = str(text).strip().split(":")
    numbers = parts[1:] if parts[0] == "uniform" and len(parts) == 3 else parts if len(parts) == 1 else None
    try:
        values = [int(v) for v in numbers] if numbers is not None else None
    except ValueError:
        values = None
    if values is None or values[0] > values[-1] or values[0] < minimum:
        return None
    return Lengths(values[0], values[-1])


def parse_lengths(text: str, flag: str, minimum: int = 1) -> Lengths:
    """`read_lengths`, or refused with one line naming `flag` and the accepted forms."""
    lengths = read_lengths(text, minimum)
    if lengths is None:
        raise SystemExit(f"error: {flag} takes {FORMS}, each at least {minimum}; got {text!r}")
    return lengths


@dataclass(frozen=True)
class Workload:
    """The prompt lengths (None: the short varied prompts of load.PROMPTS), the output lengths
    (each request's max_tokens) and the seed they are drawn with. `listed`: a length flag was
    given, and each result row lists its requests' drawn and answered token counts."""

    prompt: Lengths | None
    output: Lengths
    seed: int
    listed: bool = False

    def pairs(self, count: int) -> list[tuple[int | None, int]]:
        """(prompt length, output length) of requests 0 .. count - 1: the first `count` of one
        sequence, so a shorter level sees a prefix of a longer one's."""
        # Its own stream: random.Random(seed) is also the arrivals' generator (load.py), and the
        # same draws would tie each request's length to its arrival gap.
        rng = random.Random(f"omni-pd bench serve lengths {self.seed}")
        out: list[tuple[int | None, int]] = []
        for _ in range(count):
            prompt = self.prompt.draw(rng) if self.prompt is not None else None
            out.append((prompt, self.output.draw(rng)))
        return out

    def describe(self, count: int) -> dict:
        """The spec, and mean / min / max of the lengths of the first `count` requests (every
        level and rate of the run sends a prefix of those)."""
        pairs = self.pairs(count)

        def summary(values: list[int]) -> dict | None:
            if not values:
                return None
            return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}

        return {
            "prompt_tokens": str(self.prompt) if self.prompt is not None else None,
            "output_tokens": str(self.output),
            "seed": self.seed,
            "requests": count,
            "prompt_tokens_drawn": summary([p for p, _ in pairs if p is not None]),
            "output_tokens_drawn": summary([o for _, o in pairs]),
        }


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload `--prompt-tokens`, `--output-tokens` / `--max-tokens` and `--seed` ask for;
    a combination that cannot work refused before any server starts."""
    if args.output_tokens is not None and args.max_tokens is not None:
        raise SystemExit(
            "error: --max-tokens and --output-tokens both set each request's max_tokens; give one "
            "(--output-tokens also takes uniform:LO:HI)"
        )
    if args.multi_turn and (args.output_tokens is not None or args.prompt_tokens is not None):
        raise SystemExit(
            "error: --prompt-tokens and --output-tokens size the concurrency levels' requests; "
            "--multi-turn sends its own conversation turns (use --max-tokens there)"
        )
    if args.output_tokens is not None:
        output = parse_lengths(args.output_tokens, "--output-tokens")
    elif args.max_tokens is not None:
        if args.max_tokens < 1:
            raise SystemExit(f"error: --max-tokens must be >= 1, got {args.max_tokens}")
        output = Lengths(args.max_tokens, args.max_tokens)
    else:
        output = Lengths(DEFAULT_MAX_TOKENS, DEFAULT_MAX_TOKENS)
    prompt = (
        parse_lengths(args.prompt_tokens, "--prompt-tokens", MIN_PROMPT_TOKENS)
        if args.prompt_tokens is not None
        else None
    )
    listed = args.prompt_tokens is not None or args.output_tokens is not None
    return Workload(prompt, output, args.seed, listed)
