"""What every algorithm and training stage provides, and the registry that picks one by name.

An `Algorithm` is built from the run config alone, so config validation, the
planner and `python -m jaxrlhf.plan` can ask it which roles it needs and
what its step graph is without touching weights or devices. `bind()` then
gives it the built models; from there it supplies what the executor runs:
the pure function of every call, the host steps between them, the carried
state, and how a data batch becomes the step's feed.

    algo = ALGORITHMS.get(cfg.algorithm.name)(cfg)
    algo.roles()      # {"actor": RoleSpec("lm", trained=True, ...), ...}
    algo.graph()      # the CallGraph the planner plans and the executor runs
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from jaxrlhf.graph import CallGraph
from jaxrlhf.registry import Registry

if TYPE_CHECKING:
    from jaxrlhf.config import Config
    from jaxrlhf.models.tokenizer import Tokenizer
    from jaxrlhf.placement.executor import Executor, Role, StepResult
    from jaxrlhf.planner.cost import Workload


class AlgorithmConfigError(ValueError):
    """A config value the chosen algorithm cannot work with (the CLI reports it as a config error)."""


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """A model the algorithm needs: its output head, whether it is trained, and why it is needed."""

    head: str  # "lm", "value" or "reward"
    trained: bool
    why: str


class Algorithm(abc.ABC):
    """An RLHF algorithm or training stage (see the module docstring)."""

    name: ClassVar[str] = ""
    data: ClassVar[str] = "prompts"  # what a step consumes: "prompts", "demonstrations" or "pairs"

    def __init__(self, cfg: "Config"):
        self.cfg = cfg
        self.tokenizer: "Tokenizer | None" = None
        self.models: dict[str, "Role"] = {}

    # ---- declaration: config only --------------------------------------------------------
    @abc.abstractmethod
    def roles(self) -> dict[str, RoleSpec]:
        """Every role the step uses (and so every role the config must give weights)."""

    @abc.abstractmethod
    def graph(self) -> CallGraph:
        """The step's dataflow graph."""

    def validate(self) -> None:
        """Algorithm-specific config rules; raise AlgorithmConfigError naming the key and the fix."""

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates each train call makes per step (sizes the learning-rate schedules)."""
        return 1

    def workload(self) -> "Workload":
        """What one step processes, for the planner: derived from the same config the runtime reads."""
        from jaxrlhf.planner.cost import Workload

        cfg = self.cfg
        roles = list(self.roles())
        trained = [c.role for c in self.graph().calls if c.kind == "train"]
        return Workload(
            batch_size=self.batch_rows, prompt_len=cfg.data.max_prompt_len, gen_len=cfg.generation.max_new_tokens,
            minibatches=self.minibatches, ppo_epochs=self.epochs,
            micro_batch=cfg.algorithm.micro_batch_size,
            remat={r: getattr(cfg.model, r).remat for r in roles},
            donate=True,  # the executor always donates parameters and optimizer state to train calls
            adam_master_fp32={r: getattr(cfg.optimizer, r).master_weights for r in trained},
        )

    @property
    def batch_rows(self) -> int:
        """Rows of a step's batch (prompts x samples per prompt for RL, pairs for preference stages)."""
        return self.cfg.data.batch_size

    @property
    def minibatches(self) -> int:
        return 1

    @property
    def epochs(self) -> int:
        return 1

    # ---- runtime ----------------------------------------------------------------------------
    def bind(self, tokenizer: "Tokenizer", models: Mapping[str, "Role"]) -> None:
        """Attach the tokenizer and built models; call functions are bound from here."""
        self.tokenizer = tokenizer
        self.models = dict(models)

    @abc.abstractmethod
    def functions(self) -> dict[str, Any]:
        """Pure function of every call of the graph (see `jaxrlhf.placement.executor`), bound once."""

    def host_steps(self) -> dict[str, Any]:
        """Host-side function of every host step of the graph."""
        return {}

    def initial_state(self) -> dict[str, Any]:
        """Values carried between steps, before the first step (host values; arrays as numpy)."""
        return {}

    @abc.abstractmethod
    def dataset(self, tokenizer: "Tokenizer", split: str | None = None) -> Any:
        """The training data stream (`next_batch`, `state_dict`, `load_state_dict`, `metrics`)."""

    @abc.abstractmethod
    def feed(self, batch: Any, rng: Any) -> dict[str, Any]:
        """A data batch and the step's random key -> the graph's feed."""

    @abc.abstractmethod
    def metrics(self, result: "StepResult") -> dict[str, float]:
        """Host-side metrics of one step (the only other read of device values besides host steps)."""

    def metric_values(self) -> tuple[str, ...]:
        """The step values `metrics` reads: the executor brings them to host in one gather per step
        (a value read that is not named here costs a gather of its own)."""
        return ()

    def evaluate(self, executor: "Executor") -> dict[str, float]:
        """Metrics on the held-out split (`data.eval_split`), run every `run.eval_every` steps."""
        return {}

    def export_roles(self) -> tuple[str, ...]:
        """Roles written as HF checkpoints at the end of a run (`<role>_hf/`)."""
        return tuple(r for r, spec in self.roles().items() if spec.trained and spec.head in ("lm", "reward"))


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm")


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: register under `cls.name`."""
    return ALGORITHMS.register(cls.name)(cls)
