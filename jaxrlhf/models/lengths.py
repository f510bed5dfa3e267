"""Padded sequence lengths: the one bucketing rule, so a run sees few distinct shapes and compiles few programs."""

from __future__ import annotations


def bucket_length(length: int, minimum: int = 16, *, multiple: int | None = None, cap: int | None = None) -> int:
    """The padded length for sequences of up to `length` tokens.

    Without `multiple`: `minimum` doubled until it holds `length` (powers of two for a power-of-two
    minimum), which bounds the number of shapes by log2 of the longest. With `multiple`: the smallest
    multiple of it that holds `length` and `minimum`. Never above `cap` when given.
    """
    size = max(int(length), 1)
    if multiple:
        out = max(-(-size // multiple) * multiple, minimum)
    else:
        out = max(int(minimum), 1)
        while out < size:
            out *= 2
    return min(out, cap) if cap is not None else out
