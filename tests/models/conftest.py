"""Fixtures shared by the generation engines' tests."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture
def spans_read(monkeypatch) -> list[int]:
    """The response columns each decode step of the paged engines reads, in order: `PagedEngine.decode` records its
    span from inside the `lax.switch` branch the step takes (a debug callback runs only in the taken branch)."""
    from jaxrlhf.models.continuous import PagedEngine

    reads: list[int] = []
    decode = PagedEngine.decode

    def recorded(self, w, read, pool, st):
        jax.debug.callback(lambda: reads.append(read))
        return decode(self, w, read, pool, st)

    monkeypatch.setattr(PagedEngine, "decode", recorded)
    return reads
