"""One registry helper for every "pick an implementation by name" table
(algorithms and their config classes, advantage and KL estimators, policy losses, rule
rewards, answer extractors, lr schedules, model presets, bundled tasks, strategy presets).

    LOSSES = Registry("policy loss")

    @LOSSES.register("ppo")
    def ppo_loss(...): ...

    LOSSES.get("ppo")      # unknown names raise `error` with the close matches and the known names
    PRESETS = Registry("model preset", KeyError, {"tiny": ..., "small": ...})  # a table given whole

A registry is a read-only mapping of name -> entry, so config validation can
list or check names without importing the implementations' dependencies.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Mapping
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Named entries of one kind; `error` is the exception type unknown names raise."""

    def __init__(self, kind: str, error: type[Exception] = ValueError, entries: Mapping[str, T] | None = None):
        self.kind = kind
        self.error = error
        self._entries: dict[str, T] = {}
        for name, entry in (entries or {}).items():
            self.register(name)(entry)

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding an entry under `name` (names are unique)."""

        def wrap(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry

        return wrap

    @contextlib.contextmanager
    def temporarily(self, name: str, entry: T) -> Iterator[T]:
        """`entry` registered as `name` inside the block only (a test's toy entry: a registry is global)."""
        self.register(name)(entry)
        try:
            yield entry
        finally:
            del self._entries[name]

    def unknown(self, name: str) -> str:
        """The message for an unknown `name`: close matches first, then every known name."""
        close = difflib.get_close_matches(str(name), list(self._entries), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}.{hint} Known: {sorted(self._entries)}"

    def get(self, name: str) -> T:  # type: ignore[override]
        """The entry registered as `name`, or `error` naming the known ones."""
        if name not in self._entries:
            raise self.error(self.unknown(name))
        return self._entries[name]

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
