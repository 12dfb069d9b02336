"""Prompt and output lengths for a benchmark workload: a fixed count or a seeded distribution.

`128` gives every request 128 tokens; `uniform:100-1024` draws each request's length uniformly from 100 to 1024
(both included) with a seeded generator, so a mixed-length workload is the same on every run and machine.
"""

import argparse
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Lengths:
    low: int
    high: int

    @classmethod
    def parse(cls, text: "str | int | Lengths") -> "Lengths":
        if isinstance(text, Lengths):
            return text
        if isinstance(text, int) and not isinstance(text, bool):
            text = str(text)
        if not isinstance(text, str):
            raise ValueError(f"a length is a whole number or uniform:LOW-HIGH, got {text!r}")
        spec = text.strip()
        try:
            if spec.startswith("uniform:"):
                low, high = (int(x) for x in spec[len("uniform:"):].split("-"))
            else:
                low = high = int(spec)
        except ValueError:
            raise ValueError(f"a length is a whole number or uniform:LOW-HIGH, got {text!r}") from None
        if not 1 <= low <= high:
            raise ValueError(f"lengths must be >= 1 and LOW <= HIGH, got {text!r}")
        return cls(low, high)

    @property
    def fixed(self) -> bool:
        return self.low == self.high

    def sample(self, n: int, seed: int) -> list[int]:
        """n lengths; the same (n, seed) always gives the same list."""
        if self.fixed:
            return [self.low] * n
        rng = random.Random(seed)
        return [rng.randint(self.low, self.high) for _ in range(n)]

    def __str__(self) -> str:
        return str(self.low) if self.fixed else f"uniform:{self.low}-{self.high}"


def lengths_arg(text: str) -> Lengths:
    """argparse `type=`: a bad value is a usage error naming the value."""
    try:
        return Lengths.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
