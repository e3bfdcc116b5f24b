"""What a command-line value may be, declared once per flag and checked while argparse parses
(before anything loads).

Each numeric flag names its range where it is declared (``type=COUNT``, ``type=Range(float, low=0,
...)``), so a value out of range is refused in one line naming the flag, the value and what it may
be; :class:`OneLineParser` prints that line instead of argparse's usage block. Serving dtypes and
stop policies get their own validators: the runtime serves fp32 and bf16 (fp16 is refused here,
before a model loads, with the reason), and a stop policy's numbers are range-checked as the policy
is written (``fixed:-1`` never reaches the loop).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from typing import NoReturn


@dataclass(frozen=True)
class Range:
    """An argparse ``type``: a number of ``kind`` (int or float) between ``low`` and ``high``
    (``None``: unbounded;
    ``*_open``: the bound itself is excluded), finite; ``hint`` is added to the refusal (what the
    flag means).
    """

    kind: type = int
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    hint: str = ""

    @property
    def __name__(self) -> str:  # argparse names a type by it in its own messages
        return "integer" if self.kind is int else "number"

    def bounds(self) -> str:
        """``>= 1``, ``in (0, 1]``, ... (what the refusal says the value may be)."""
        if self.low is not None and self.high is not None:
            return (
                f"in {'(' if self.low_open else '['}{self.low:g},"
                f" {self.high:g}{')' if self.high_open else ']'}"
            )
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return (
            f"{'<' if self.high_open else '<='} {self.high:g}"
            if self.high is not None
            else "a number"
        )

    def __call__(self, text: str) -> int | float:
        hint = f" ({self.hint})" if self.hint else ""
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"takes {'an integer' if self.kind is int else 'a number'} "
                f"{self.bounds()}, got {text!r}{hint}"
            ) from None
        too_low = self.low is not None and (
            value <= self.low if self.low_open else value < self.low
        )
        too_high = self.high is not None and (
            value >= self.high if self.high_open else value > self.high
        )
        if not math.isfinite(value) or too_low or too_high:
            raise argparse.ArgumentTypeError(f"must be {self.bounds()}, got {text}{hint}")
        return value


COUNT = Range(int, low=1)
SEED = Range(int, low=0, hint="a generator seed")
TEMPERATURE = Range(
    float, low=0, hint="the sampling temperature: 0 decodes greedily, above 0 samples"
)
TOP_P = Range(
    float, low=0, high=1, low_open=True, hint="the nucleus kept when sampling: 1 keeps every token"
)
PROBABILITY = Range(float, low=0, high=1)


def counts(hint: str) -> Range:
    """An integer >= 1 with a hint (e.g. what leaving the flag out does)."""
    return Range(int, low=1, hint=hint)


def number_list(item: Range, what: str):
    """A comma-separated list whose every item is ``item`` (``--sweep-k 0,1,2``, ``--grid
    0,0.5,1``)."""

    def parse(text: str) -> str:  # checked, then passed on as written (its reader splits it)
        try:
            values = [item(part) for part in text.split(",") if part.strip()]
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(
                f"takes {what}, each {item.bounds()}; {text!r} has one that "
                f"{str(err).split(', got')[0]}"
            ) from None
        if not values:
            raise argparse.ArgumentTypeError(f"takes {what}, got {text!r}")
        return text

    parse.__name__ = "list"
    return parse


SERVED_DTYPES = ("auto", "fp32", "float32", "bf16", "bfloat16")


def served_dtype(text: str) -> str:
    """A dtype the runtime serves: auto | fp32 | bf16. fp16 is refused with the reason (the
    runtime's CPU kernels, its exactness check and the target fingerprint a drafter is checked
    against are fp32/bf16)."""
    name = str(text).lower().removeprefix("torch.")
    if name in ("fp16", "float16", "half"):
        raise argparse.ArgumentTypeError(
            f"{text} is not served: the runtime runs fp32 (exact) or bf16 (the same "
            "range as fp32, half the bytes); fp16 has no CPU kernels here and would "
            "not match the drafter's target fingerprint. Use --dtype bf16 or fp32"
        )
    if name not in SERVED_DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; valid: auto, fp32, bf16")
    return name


_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def stop_policy(text: str) -> str:
    """``--stop-policy``: auto | export | none | fixed:K (K >= 0) | confidence:T[:MAX] (T in (0, 1),
    MAX >= 1) | learned:H[:MIN:MAX] (H in (0, 1), 1 <= MIN <= MAX), the numbers checked here."""
    kind, *parts = str(text).split(":")
    forms = (
        "auto, export, none, fixed:K, confidence:THRESHOLD[:MAX_DEPTH] or"
        " learned:H[:MIN_DEPTH:MAX_DEPTH] (e.g. fixed:3, confidence:0.4:6)"
    )
    shapes = {
        "auto": (0,),
        "export": (0,),
        "none": (0,),
        "fixed": (0, 1),
        "confidence": (1, 2),
        "learned": (1, 3),
    }
    if (
        kind not in shapes
        or len(parts) not in shapes[kind]
        or not all(re.fullmatch(_NUMBER, p) for p in parts)
    ):
        raise argparse.ArgumentTypeError(f"{text!r} is not a stop policy; use {forms}")

    def check(value: str, what: str, valid: Range) -> int | float:
        try:
            return valid(value)
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{text}: {what} {err}") from None

    if kind == "fixed" and parts:
        check(parts[0], "the draft depth K", Range(int, low=0, hint="0 drafts nothing"))
    if kind in ("confidence", "learned"):
        check(parts[0], "the threshold", Range(float, low=0, high=1, low_open=True, high_open=True))
        depths = [check(p, "a draft depth", COUNT) for p in parts[1:]]
        if len(depths) == 2 and depths[0] > depths[1]:
            raise argparse.ArgumentTypeError(
                f"{text}: MIN_DEPTH {depths[0]} is above MAX_DEPTH {depths[1]}"
            )
    return text


_ARGUMENT = re.compile(r"^argument (-[-\w]+)(?:/-[-\w]+)?: ")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose refusals are one line, ``PROG: error: --flag must be ..., got ...``
    (and a pointer to ``--help``), not argparse's usage block; exit status 2 as argparse's."""

    def error(self, message: str) -> NoReturn:
        """Print one line naming the flag and the problem, then exit 2."""
        homes = getattr(
            self, "flag_homes", {}
        )  # bench modes: which mode takes a flag this one does not
        if message.startswith("unrecognized arguments:") and homes:
            moved = [
                f"{flag} belongs to `draftsmith bench {homes[flag]}`"
                for flag in (t.split("=", 1)[0] for t in message.split(":", 1)[1].split())
                if flag in homes
            ]
            message += "; " + "; ".join(moved) if moved else ""
        text = _ARGUMENT.sub(
            lambda m: (
                m.group(1)
                + (" " if message.split(": ", 1)[-1].startswith(("must", "takes", "is ")) else ": ")
            ),
            message,
        )
        print(f"{self.prog}: error: {text} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


__all__ = [
    "COUNT",
    "OneLineParser",
    "PROBABILITY",
    "Range",
    "SEED",
    "SERVED_DTYPES",
    "TEMPERATURE",
    "TOP_P",
    "counts",
    "number_list",
    "served_dtype",
    "stop_policy",
]
