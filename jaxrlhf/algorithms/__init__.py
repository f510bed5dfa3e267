"""RLHF algorithms and training stages, each a dataflow graph of model calls with
pure call functions and the host-side logic between them.

Importing the package registers every algorithm in `ALGORITHMS`:
RL from rollouts (`ppo`, `grpo`, `rloo`, `reinforce_pp`, `remax`) and the
stages of the InstructGPT pipeline and its offline alternative (`sft`, `rm`, `dpo`).
"""

from jaxrlhf.algorithms import dpo, grpo, ppo, reinforce_pp, remax, rloo, rm, sft  # noqa: F401  (registration)
from jaxrlhf.algorithms.base import ALGORITHMS, Algorithm, AlgorithmConfigError, RoleSpec


def build_algorithm(cfg) -> Algorithm:
    """The algorithm `algorithm.name` names, built from the config (every algorithm is registered by
    the imports above)."""
    return ALGORITHMS.get(cfg.algorithm.name)(cfg)


__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmConfigError", "RoleSpec", "build_algorithm"]
