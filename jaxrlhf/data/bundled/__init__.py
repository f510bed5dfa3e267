"""Small bundled data files (JSONL), read by the TFDS builders in `jaxrlhf.data.tasks`.

A package (not a bare folder) so setuptools ships the files in wheels and
`importlib.resources` finds them in any install. Regenerate them with
`scripts/make_bundled_data.py`.
"""

from __future__ import annotations

import importlib.resources
import pathlib


def bundled_file(name: str) -> pathlib.Path:
    """Path of a bundled file such as `arithmetic_train.jsonl`."""
    path = pathlib.Path(str(importlib.resources.files(__name__).joinpath(name)))
    if not path.exists():
        raise FileNotFoundError(f"bundled data file {name!r} is missing from {path.parent}")
    return path
