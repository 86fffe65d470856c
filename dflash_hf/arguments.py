"""Argument types for the command lines: a bad number is refused by argparse, with the flag and the allowed range,
before any model is loaded."""

import argparse
import math


def at_least(minimum, kind=int):
    """An argparse ``type`` accepting ``kind`` values ``>= minimum`` (NaN and infinities refused for floats)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if (kind is float and not math.isfinite(value)) or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a {'count' if kind is int else 'number'} >= {minimum}, got {text}")
        return value

    parse.__name__ = f"{kind.__name__} >= {minimum}"
    return parse


COUNT = at_least(1)  # sizes, lengths, steps, repeats
NON_NEGATIVE_INT = at_least(0)  # ids, "0 = off" switches
NON_NEGATIVE = at_least(0.0, float)  # temperatures, rates, seconds, norms


def FRACTION(text: str) -> float:
    """An argparse ``type`` for a share in ``[0, 1]`` (loss weights)."""
    value = NON_NEGATIVE(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def add_dtype_argument(parser: argparse.ArgumentParser, default: str, what: str) -> None:
    """``--dtype auto|float32|bfloat16`` for commands that run a target; ``auto`` is resolved by
    `dflash_hf.loading.resolve_dtype` (bf16 where the CPU computes it natively, else float32)."""
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=default,
                        help=f"{what}; auto = bfloat16 where the machine computes it natively, else float32 "
                        "(default: %(default)s)")
