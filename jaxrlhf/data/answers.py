"""Answer extractors: turn a data set's reference answer field into the string
a rule reward compares against (e.g. GSM8K keeps the final answer after '####').

Kept free of heavy imports so config validation can check names against it.
"""

from __future__ import annotations

import re
from typing import Callable

from jaxrlhf.registry import Registry

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _verbatim(text: str) -> str | None:
    return text.strip() or None


def _after_hashes(text: str) -> str | None:
    """GSM8K style: the reasoning, then '#### 72'; thousands separators dropped."""
    if "####" not in text:
        return None
    final = text.rsplit("####", 1)[1].strip().replace(",", "")
    return final or None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


# name -> extractor; None from an extractor marks the row malformed ("bad_answer").
ANSWER_EXTRACTORS: Registry[Callable[[str], str | None]] = Registry("answer extractor", entries={
    "none": _verbatim,
    "gsm8k": _after_hashes,
    "last_number": _last_number,
})
