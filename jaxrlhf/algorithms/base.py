"""What every algorithm and training stage provides, and the registry that picks one by name.

An algorithm comes in two halves. Its declaration (a registered `Algorithm` subclass: name,
roles, step graph, config rules; the keys it reads are `ALGORITHM_CONFIGS[name]` in
jaxrlhf.config_schema) is built from the run config alone and imports no JAX, so config
validation, the planner and `python -m jaxrlhf.plan` can ask which roles it needs and what
its step graph is without touching weights or devices. Its runtime (the class `runtime`
names: the pure function of every call, the host steps between them, the carried state,
how a data batch becomes the step's feed, metrics) imports the jitted code;
`build_algorithm` joins the two, and `bind()` gives the result the built models.

    algo = declare(cfg)          # the declaration: no JAX
    algo.roles()                 # {"actor": RoleSpec("lm", trained=True, ...), ...}
    algo.graph()                 # the CallGraph the planner plans and the executor runs
    run = build_algorithm(cfg)   # declaration + runtime, for a run
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from jaxrlhf.config_schema import ALGORITHM_CONFIGS, AlgorithmConfig
from jaxrlhf.graph import CallGraph
from jaxrlhf.registry import Registry

if TYPE_CHECKING:
    from jaxrlhf.config_schema import Config
    from jaxrlhf.models.tokenizer import Tokenizer
    from jaxrlhf.placement.executor import Executor, Role, StepResult
    from jaxrlhf.planner.plan import Execution
    from jaxrlhf.planner.workload import Workload
    from jaxrlhf.rollouts import Rollout


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
    runtime: ClassVar[str] = ""  # "module:Class" of the runtime half, imported by `build_algorithm`

    def __init__(self, cfg: "Config"):
        self.cfg = cfg
        self.tokenizer: "Tokenizer | None" = None
        self.models: dict[str, "Role"] = {}
        self.model_configs: dict[str, Any] = {}  # role -> its `models.config.ModelConfig`; `bind` sets them
        self.execution: "Execution | None" = None  # `bind` sets it

    # ---- declaration: config only --------------------------------------------------------
    @abc.abstractmethod
    def roles(self) -> dict[str, RoleSpec]:
        """Every role the step uses (and so every role the config must give weights)."""

    @abc.abstractmethod
    def graph(self) -> CallGraph:
        """The step's dataflow graph."""

    def validate(self) -> None:
        """Algorithm-specific config rules; raise AlgorithmConfigError naming the key and the fix."""

    @classmethod
    def config_class(cls) -> type[AlgorithmConfig]:
        """The class of the `algorithm` keys this algorithm reads."""
        return ALGORITHM_CONFIGS[cls.name]

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates each train call makes per step (sizes the learning-rate schedules)."""
        return 1

    def workload(self) -> "Workload":
        """What one step processes, for the planner: derived from the same config the runtime reads."""
        from jaxrlhf.planner.workload import AUTO, Workload

        cfg = self.cfg
        roles = list(self.roles())
        trained = [c.role for c in self.graph().calls if c.kind == "train"]
        micro = cfg.algorithm.micro_batch_size
        return Workload(
            batch_size=self.batch_rows, prompt_len=cfg.data.max_prompt_len, gen_len=cfg.generation.max_new_tokens,
            minibatches=self.minibatches, ppo_epochs=self.epochs,
            # unset memory knobs are the planner's to choose with the placement (`planner.knobs`)
            micro_batch=AUTO if micro is None else micro,
            remat={r: getattr(cfg.model, r).remat or AUTO for r in roles},
            donate=True,  # the executor always donates parameters and optimizer state to train calls
            adam_master_fp32={r: getattr(cfg.optimizer, r).master_weights for r in trained},
            gen_engine=cfg.generation.engine, gen_group=self.group_size,
            gen_slots=AUTO if cfg.generation.slots is None and cfg.generation.engine == "continuous" else cfg.generation.slots,
            # unset: the planner sizes the page pool to the drawn lengths (`Workload.held_pages`)
            gen_pages=AUTO if cfg.generation.kv_pages is None and cfg.generation.engine == "continuous"
            else cfg.generation.kv_pages,
            base_views=tuple(sorted(self.base_views().items())),
            staleness=cfg.generator_lead,
            gen_len_median=cfg.plan.response_length_median, gen_len_sigma=cfg.plan.response_length_sigma,
            gen_stream=cfg.generation.partial_rollout and cfg.staleness_budget >= 1,
            gen_chunk=cfg.generation.stream_chunk,
            # only the RL algorithms have the keys (algorithm.pack_sequences: packed train and inference calls)
            packed=getattr(cfg.algorithm, "pack_sequences", False),
            token_budget=getattr(cfg.algorithm, "max_tokens_per_micro_batch", None),
            logit_chunk=getattr(cfg.algorithm, "logit_chunk_tokens", None),  # the RL log-prob calls' (`logit_chunks`)
            **self.reward_fields(),
            **self.rollout_fields(),
        )

    def reward_fields(self) -> dict[str, Any]:
        """The workload's rule-reward fields (`planner.rewards`); none for a stage that scores no rules."""
        return {}

    def rollout_fields(self) -> dict[str, Any]:
        """The workload's fields of the rollout kind producing the samples (`jaxrlhf.rollouts`, priced through
        `planner.episodes.rollout_cost`); none for a declaration or a stage without a generate call."""
        return {}

    @property
    def rollout_kind(self) -> str:
        """The rollout kind that produces each step's batch (`jaxrlhf.rollouts.ROLLOUTS`): a stage's feed as
        drawn, its calls in the step graph."""
        return "graph"

    @functools.cached_property
    def rollout(self) -> "Rollout":
        """What produces each step's batch, for the step loop (`run.stages.run_steps`)."""
        from jaxrlhf.rollouts import make_rollout

        return make_rollout(self)

    def base_views(self) -> dict[str, str]:
        """Frozen roles that are a LoRA role's base (role -> that role): copied from a role with adapters,
        with none of their own and the same head, before any training changed it (no SFT warm-up). They
        hold no weights: their calls run on the source's frozen base (`Role.base_of`), no second copy."""
        cfg, specs = self.cfg, self.roles()
        out = {}
        for role, spec in specs.items():
            rc = getattr(cfg.model, role)
            source = rc.init_from
            if (source in specs and not spec.trained and getattr(cfg.model, source).lora and not rc.lora
                    and spec.head == specs[source].head and not cfg.sft.steps):
                out[role] = source
        return out

    @property
    def batch_rows(self) -> int:
        """Rows of a step's batch (prompts x samples per prompt for RL, pairs for preference stages)."""
        return self.cfg.data.batch_size

    @property
    def group_size(self) -> int:
        """Adjacent rows of a generate call that share one prompt (RL algorithms sample groups)."""
        return 1

    @property
    def minibatches(self) -> int:
        return 1

    @property
    def epochs(self) -> int:
        return 1

    # ---- runtime (the `runtime` class implements these) --------------------------------------
    def bind(self, tokenizer: "Tokenizer", models: Mapping[str, "Role"],
             model_configs: Mapping[str, Any] | None = None, execution: "Execution | None" = None) -> None:
        """Attach the tokenizer, the built models and their `ModelConfig`s (what their dimensions are:
        a mixture of experts' routing, say) and the memory knobs the plan runs the calls with
        (`ExecutionPlan.execution`; default the config's own keys, for a caller without a plan); call
        functions are bound from here."""
        self.tokenizer = tokenizer
        self.models = dict(models)
        self.model_configs = dict(model_configs or {})
        self.execution = execution if execution is not None else self.configured_execution()

    def one_row(self, readers: tuple[str, ...]) -> tuple[int, int] | None:
        """`models.packing.one_row_rule` of a packing's reading calls: their models' blockwise settings and their
        layouts' context degrees (`Execution.contexts`), as the planner prices each call's packing."""
        from jaxrlhf.models.packing import one_row_rule

        return one_row_rule([self.model_configs[c.split(".")[0]] for c in readers],
                            [self.execution.contexts.get(c, 1) for c in readers])

    def configured_execution(self) -> "Execution":
        """The memory knobs the config itself sets: `algorithm.micro_batch_size` for every train and
        inference call, `model.<role>.remat` of the trained roles, the token budget; unset ones off."""
        from jaxrlhf.planner.plan import Execution

        cfg, graph = self.cfg, self.graph()
        micro = cfg.algorithm.micro_batch_size
        return Execution(
            micro_batch_size={c.name: micro for c in graph.calls if c.kind != "generate"} if micro else {},
            remat={c.role: getattr(cfg.model, c.role).remat or "none" for c in graph.calls if c.kind == "train"},
            token_budget=getattr(cfg.algorithm, "max_tokens_per_micro_batch", None), gen_slots=cfg.generation.slots,
            gen_pages=cfg.generation.kv_pages)

    def functions(self) -> dict[str, Any]:
        """Pure function of every call of the graph (see `jaxrlhf.placement.executor`), bound once."""
        raise self._declaration_only()

    def host_steps(self) -> dict[str, Any]:
        """Host-side function of every host step of the graph."""
        return {}

    def initial_state(self) -> dict[str, Any]:
        """Values carried between steps, before the first step (host values; arrays as numpy)."""
        return {}

    def dataset(self, tokenizer: "Tokenizer", split: str | None = None) -> Any:
        """The training data stream (`next_batch`, `state_dict`, `load_state_dict`, `metrics`)."""
        raise self._declaration_only()

    def feed(self, batch: Any, rng: Any) -> dict[str, Any]:
        """A data batch and the step's random key -> the graph's feed."""
        raise self._declaration_only()

    def metrics(self, result: "StepResult") -> dict[str, float]:
        """Host-side metrics of one step (the only other read of device values besides host steps)."""
        raise self._declaration_only()

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

    def _declaration_only(self) -> Exception:
        """The error a runtime method raises on a bare declaration (callers `raise` it)."""
        return NotImplementedError(f"{type(self).__name__} is a declaration; build_algorithm() adds its runtime")


ALGORITHMS: Registry[type[Algorithm]] = Registry("algorithm")


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: register under `cls.name` (which must have its keys in `ALGORITHM_CONFIGS`)."""
    if cls.name not in ALGORITHM_CONFIGS:
        raise ValueError(f"algorithm {cls.name!r}: add the class of its keys to jaxrlhf.config_schema.ALGORITHM_CONFIGS")
    return ALGORITHMS.register(cls.name)(cls)
