"""RLHF algorithms and training stages, each a dataflow graph of model calls with
pure call functions and the host-side logic between them.

Importing the package registers every algorithm in `ALGORITHMS`:
RL from rollouts (`ppo`, `grpo`, `rloo`, `reinforce_pp`, `remax`) and the
stages of the InstructGPT pipeline and its offline alternative (`sft`, `rm`, `dpo`).
The package imports only the declarations (no JAX): `build_algorithm` imports an
algorithm's runtime when a run needs it (`runtime_class`; see `jaxrlhf.algorithms.base`).
"""

import functools
import importlib
from typing import Any

from jaxrlhf.algorithms import grpo, ppo, reinforce_pp, remax, rloo, stages  # noqa: F401  (registration)
from jaxrlhf.algorithms.base import ALGORITHMS, Algorithm, AlgorithmConfigError, RoleSpec


def declare(cfg: Any, name: str | None = None, **kwargs: Any) -> Algorithm:
    """The declaration of algorithm `name` (default `algorithm.name`) for this config; imports no JAX."""
    return ALGORITHMS.get(name or cfg.algorithm.name)(cfg, **kwargs)


def build_algorithm(cfg: Any, name: str | None = None, **kwargs: Any) -> Algorithm:
    """Algorithm `name` (default `algorithm.name`) with its runtime, for a run: imports the jitted code."""
    return runtime_class(ALGORITHMS.get(name or cfg.algorithm.name))(cfg, **kwargs)


@functools.cache
def runtime_class(cls: type[Algorithm]) -> type[Algorithm]:
    """`cls` with its runtime half first in the method order (the runtime reads the declaration's
    class attributes, so one runtime serves a family such as every RL algorithm)."""
    module, _, attr = cls.runtime.partition(":")
    runtime = getattr(importlib.import_module(module), attr)
    return type(cls.__name__, (runtime, cls), {"__module__": runtime.__module__, "__doc__": cls.__doc__})


__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmConfigError", "RoleSpec", "build_algorithm", "declare"]
