"""RLHF algorithms and training stages, each a dataflow graph of model calls with
pure call functions and the host-side logic between them.

Importing the package registers every algorithm in `ALGORITHMS`:
RL from rollouts (`ppo`, `grpo`, `rloo`, `reinforce_pp`, `remax`) and the
stages of the InstructGPT pipeline and its offline alternative (`sft`, `rm`, `dpo`).
The package imports only the declarations (no JAX): `build_algorithm` imports an
algorithm's runtime when a run needs it (see `jaxrlhf.algorithms.base`).
"""

from jaxrlhf.algorithms import grpo, ppo, reinforce_pp, remax, rloo, stages  # noqa: F401  (registration)
from jaxrlhf.algorithms.base import ALGORITHMS, Algorithm, AlgorithmConfigError, RoleSpec, build_algorithm, declare

__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmConfigError", "RoleSpec", "build_algorithm", "declare"]
