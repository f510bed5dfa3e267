"""The test run's persistent compilation cache folder (tests/conftest.py makes one per test run)."""

from __future__ import annotations

import os

ENV = "JAXRLHF_TEST_COMPILE_CACHE"


def override() -> str:
    """The config override that points a CLI run a test starts at the test run's cache, so it reuses
    what other tests compiled and never writes the user's ~/.cache."""
    return f"run.compile_cache={os.environ[ENV]}"
