"""The run configuration's schema: nested frozen dataclasses, one per YAML section.

Field types drive validation (`jaxrlhf.config` hands them to pydantic), `_field(check=...)`
attaches a per-key value rule, a section's `problems` method holds the rules between its keys and
other keys (each broken one's message), and the comment after a field (or the lines just above it)
says what it means: `python -m jaxrlhf.config_reference` turns them into docs/config_reference.md,
so every field needs one. The `algorithm` section has one class per set of keys an algorithm reads
and their defaults (`ALGORITHM_CONFIGS`). Loading, overrides and the checks that look names up in
registries or files live in `jaxrlhf.config`; an algorithm's own rules in its declaration.

One file over 600 lines, and on purpose: it is the whole schema, which `config_reference` reads top to
bottom into the reference, and each section sits beside its rules, so a key and the rules about it change
together.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, Any, Callable, Iterator, Literal, TypeVar

import pydantic

from jaxrlhf.registry import Registry

if TYPE_CHECKING:
    from jaxrlhf.algorithms.base import Algorithm

# ---------------------------------------------------------------------------------------------
# Scalar types: YAML values are taken as written, not converted ("10" is no int, 1 no bool).
# `str` needs no marker: pydantic never turns a number into a string.


def _float_from_text(value: Any) -> Any:
    """YAML 1.1 reads 1e-5 (no dot) as a string; take such text as the float it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


Int = pydantic.StrictInt
Bool = pydantic.StrictBool
Float = Annotated[float, pydantic.Strict(), pydantic.BeforeValidator(_float_from_text)]

_Section = TypeVar("_Section", bound=type)


def _no_extra_keys(cls: _Section) -> _Section:
    """A section refuses keys it does not have (jaxrlhf.config turns them into did-you-mean
    messages). pydantic reads this attribute on stdlib dataclasses; `pydantic.with_config`
    does the same but needs pydantic 2.7."""
    cls.__pydantic_config__ = pydantic.ConfigDict(extra="forbid")  # type: ignore[attr-defined]
    return cls


# ---------------------------------------------------------------------------------------------
# Per-key value checks (attached to fields as metadata)

Check = Callable[[Any], str | None]  # returns a complaint ("must be > 0") or None

# A section's rules that span keys are its method `problems(config, algorithm)`: it yields the message
# of each broken one (`algorithm` is the declaration `algorithm.name` picks); jaxrlhf.config raises the first.


def positive(value: Any) -> str | None:
    return None if value is None or value > 0 else "must be > 0"


def non_negative(value: Any) -> str | None:
    return None if value is None or value >= 0 else "must be >= 0"


def unit_interval(value: Any) -> str | None:
    """(0, 1]: probabilities such as top_p, discount factors."""
    return None if value is None or 0 < value <= 1 else "must be in (0, 1]"


def closed_unit_interval(value: Any) -> str | None:
    return None if value is None or 0 <= value <= 1 else "must be in [0, 1]"


def not_empty(value: Any) -> str | None:
    return None if value is None or len(value) > 0 else "must not be empty"


def module_names(value: Any) -> str | None:
    ok = all(all(part.isidentifier() for part in name.split(".")) for name in value)
    return None if ok else "must be importable module names, e.g. [my_envs] or [my_package.envs]"


def _field(default: Any = dataclasses.MISSING, *, check: Check | None = None, factory: Any = None) -> Any:
    """A dataclass field with an optional value check."""
    metadata = {"check": check} if check else {}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


Dtype = Literal["float32", "bfloat16", "float16"]


# ---------------------------------------------------------------------------------------------
# Schema


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class WandbSection:
    """Weights & Biases logging of the run's metrics and resolved config (pip install 'jaxrlhf[wandb]')."""

    project: str | None = None  # the W&B project; null = $WANDB_PROJECT, else jaxrlhf
    name: str | None = None  # the W&B run's display name; null = the output folder's name
    # online: stream to the W&B server; offline: files only (upload later with `wandb sync`); disabled: nothing;
    # null = $WANDB_MODE, else online
    mode: Literal["online", "offline", "disabled"] | None = None


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where outputs go, how long to run and on which devices."""

    output_dir: str = "runs/default"  # metrics, checkpoints, TensorBoard logs and exported models go here
    steps: Int = _field(100, check=positive)  # training steps (one step = one batch through the step graph)
    seed: Int = 0  # seeds model init, sampling and (unless data.seed) data order
    resume: Bool = False  # continue from the latest checkpoint in output_dir
    overwrite: Bool = False  # start afresh in an output_dir that holds another run (its files are removed)
    checkpoint_every: Int = _field(50, check=non_negative)  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: Int = _field(3, check=positive)  # newest checkpoints kept; older ones are deleted
    save_checkpoints: Bool = True  # false: write none (benchmarks, smoke tests); such a run cannot be resumed
    log_every: Int = _field(1, check=positive)  # steps between metric records (metrics.jsonl, TensorBoard)
    eval_every: Int = _field(0, check=non_negative)  # steps between evaluations on data.eval_split; 0 = none
    # steps whose JAX profiler trace is written to <output_dir>/profile (TensorBoard, Perfetto); see docs/profiling.md
    profile_steps: tuple[Int, ...] = ()
    platform: Literal["cpu", "gpu", "tpu", "auto"] = "auto"  # JAX backend; auto = what JAX finds
    devices: Int | None = _field(None, check=positive)  # simulated CPU devices; null = what JAX has
    distributed: Bool = False  # several processes form one run (jax.distributed); see the distributed section
    # persistent compilation cache, and the finished plan searches of plan.strategy=auto (in plans/); null = off
    compile_cache: str | None = "~/.cache/jaxrlhf/xla"
    tensorboard: Bool = True  # also write metrics as TensorBoard events to <output_dir>/tensorboard
    # also log metrics and the resolved config to Weights & Biases (pip install 'jaxrlhf[wandb]'; main process only; a
    # resumed run continues its W&B run): {project, name, mode: online, offline or disabled}; a null project is
    # $WANDB_PROJECT else jaxrlhf, a null name the output folder's, a null mode $WANDB_MODE else online; null = off
    wandb: WandbSection | None = None
    export_hf: Bool = True  # write the final actor as an HF checkpoint

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        if self.devices is not None and self.platform in ("gpu", "tpu"):
            yield f"run.devices simulates CPU devices; it cannot be used with run.platform={self.platform}"


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How the processes of a multi-host run (`run.distributed=true`) find each other.

    Null keys are detected (Cloud TPU, SLURM, or the JAXRLHF_COORDINATOR /
    JAXRLHF_NUM_PROCESSES / JAXRLHF_PROCESS_ID environment variables the
    launchers set). See docs/multihost.md.
    """

    coordinator_address: str | None = None  # host:port of process 0's coordination service
    num_processes: Int | None = _field(None, check=positive)  # processes in the run
    process_id: Int | None = _field(None, check=non_negative)  # this process (0 = the coordinator)
    cpu_collectives: Literal["gloo", "mpi"] = "gloo"  # run.platform=cpu only: cross-process collectives
    # run.platform=cpu only: each process's loopback port for cross-process device-to-device copies
    # (port = transfer_port_base + process_id)
    transfer_port_base: Int = _field(47700, check=positive)
    initialization_timeout_s: Int = _field(300, check=positive)  # how long to wait for every process to join
    heartbeat_timeout_s: Int = _field(100, check=positive)  # a process silent this long counts as dead

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        run = config.run
        given = [k for k in ("coordinator_address", "num_processes", "process_id") if getattr(self, k) is not None]
        if given and not run.distributed:
            yield (
                f"{', '.join('distributed.' + k for k in given)} set, but run.distributed=false: each process would "
                "train alone, into the same run.output_dir. Add run.distributed=true (or drop the distributed.* keys)"
            )
        if run.distributed and self.cpu_collectives == "mpi" and (run.devices or 1) > 1:
            yield (
                f"distributed.cpu_collectives=mpi with run.devices={run.devices}: XLA:CPU's MPI collectives take one "
                "device per process (several fail at the first collective); set run.devices=1 and start one process "
                "per device, or keep distributed.cpu_collectives=gloo (docs/multihost.md)"
            )


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """How model calls are placed on devices: the plan (jaxrlhf.planner), run by jaxrlhf.placement."""

    # a preset placement, or auto: the planner searches plans for these devices and picks the fastest
    strategy: Literal["colocated", "interleaved", "disaggregated", "reallocated", "heuristic", "verl", "auto"] = "colocated"
    file: str | None = None  # a plan YAML; overrides strategy
    offpolicy: Bool = False  # the same as algorithm.max_staleness=1 (generate step i+1 while training step i)
    hardware: str | None = None  # planner hardware profile; null = the chip JAX runs on (NVIDIA H200 -> h200), else the platform's
    # a profile measured on this hardware (`python -m jaxrlhf.profile`): its numbers and call tables replace plan.hardware's
    profile: str | None = None
    axis_rules: dict[str, Any] | None = None  # logical axis -> mesh axis (or list, or null)
    # frozen roles kept in host memory between their calls; null = what the memory model needs to fit
    offload: tuple[Literal["actor", "critic", "ref", "reward"], ...] | None = None
    # trained roles whose optimizer state waits in host memory between train calls (two host copies of it per
    # step); null = what the memory model needs to fit
    offload_optimizer: tuple[Literal["actor", "critic", "reward"], ...] | None = None
    # with strategy=auto: every K steps feed the run's own call times into the cost model, search again and
    # switch to another plan live when it is predicted faster by more than replan_threshold; 0 = never
    replan_every: Int = _field(0, check=non_negative)
    replan_threshold: Float = _field(0.1, check=non_negative)  # predicted gain a switch needs (0.1 = 10 %)
    # for the planner: median response length (tokens) of the log-normal lengths it prices generation with
    # (an off-policy plan's buffer absorbs long steps); null = every response runs to generation.max_new_tokens
    response_length_median: Int | None = _field(None, check=positive)
    response_length_sigma: Float = _field(0.0, check=non_negative)  # sigma of those log-normal lengths; 0 = none vary

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        eta = getattr(config.algorithm, "max_staleness", 0)
        ahead = (f"algorithm.max_staleness={eta}" if eta else "plan.offpolicy=true")
        if self.offpolicy and not hasattr(config.algorithm, "max_staleness"):
            yield (f"plan.offpolicy=true generates the next rollout while this one trains, but "
                   f"algorithm.name={config.algorithm.name} has no rollout; set plan.offpolicy=false")
        streamed = config.generation.partial_rollout  # a stream refills its pool ahead on any plan
        if (self.offpolicy or eta) and not streamed and self.file is None and self.strategy not in ("disaggregated", "auto"):
            yield (
                f"{ahead} overlaps generation with training, which needs separate generation devices: "
                f"use plan.strategy=disaggregated (or auto), not {self.strategy}, or stream the rollouts "
                "(generation.partial_rollout=true with generation.engine=continuous), which runs ahead on any plan"
            )
        if self.replan_every and (self.file is not None or self.strategy != "auto"):
            yield (f"plan.replan_every={self.replan_every} re-runs the planner's search, which only "
                   f"plan.strategy=auto uses (and no plan.file); set plan.strategy=auto or plan.replan_every=0")
        if self.replan_every and (self.offpolicy or eta) and not streamed:
            yield (f"plan.replan_every with {ahead} is not supported: an off-policy plan always "
                   "has the next rollout in flight, so there is no step boundary to switch plans at; "
                   "set one of them off, or stream the rollouts (generation.partial_rollout=true: the "
                   "stream is drained at the switch)")
        cap = config.generation.max_new_tokens
        if self.response_length_median is not None and self.response_length_median > cap:
            yield (f"plan.response_length_median={self.response_length_median} is above the response length cap "
                   f"generation.max_new_tokens={cap}; set it to at most {cap} (or null)")
        if self.profile is not None and self.hardware is not None:
            yield ("plan.profile and plan.hardware both name the hardware; keep one (the measured "
                   "profile holds its hardware numbers)")


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """The algorithm or training stage (`algorithm.name`, see jaxrlhf.algorithms) and its hyperparameters.

    Each algorithm has its own class below, holding exactly the keys it reads (`ALGORITHM_CONFIGS`),
    so a key another algorithm reads is refused. The stages sft and rm read only these shared keys.
    """

    # ppo, grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, remax (RL); sft, rm, dpo (stages)
    name: str = _field("ppo", check=not_empty)
    # rows per micro-batch of every train and inference call; null = the planner's choice per call (plan.yaml)
    micro_batch_size: Int | None = _field(None, check=positive)

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        micro = self.micro_batch_size
        if micro is not None:
            sizes = {"a minibatch": algorithm.batch_rows // algorithm.minibatches, "a step's batch": algorithm.batch_rows}
            if config.sft.steps:
                sizes["a warm-up batch (sft.batch_size)"] = config.sft.batch_size
            for what, rows in sizes.items():
                if micro < rows and rows % micro:
                    yield (
                        f"algorithm.micro_batch_size={micro} must divide {what} ({rows} rows); "
                        f"divisors: {[d for d in range(1, rows + 1) if rows % d == 0]}"
                    )


LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def packing_problems(alg: Any, longest: int, what: str) -> Iterator[str]:
    """The rules of `algorithm.pack_sequences` and `algorithm.max_tokens_per_micro_batch` (RL algorithms
    and DPO): the budget replaces the row micro-batch size and holds `longest` tokens. (A budget turns
    packing on as the config loads: `config._packing_for_a_token_budget`.)"""
    budget = alg.max_tokens_per_micro_batch
    if alg.pack_sequences and alg.micro_batch_size is not None:
        yield ("algorithm.pack_sequences sizes micro-batches in tokens: use algorithm.max_tokens_per_micro_batch "
               "instead of algorithm.micro_batch_size (set it to null)")
    if budget is not None and budget < longest:
        yield f"algorithm.max_tokens_per_micro_batch={budget} is below {what} = {longest}: set it to at least {longest}"


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class RolloutConfig(AlgorithmConfig):
    """What every RL algorithm reads: KL to the reference, the clipped policy update, sampling groups.
    Defaults follow ReaLHF's PPO; an algorithm whose published defaults differ has its own class
    below that sets them, so a loaded config holds the values a run uses."""

    kl_coef: Float = _field(0.1, check=non_negative)  # KL-to-reference coefficient; 0 (and no kl_target) = no reference model
    kl_target: Float | None = _field(None, check=positive)  # KL per sequence the adaptive coefficient aims at; null = fixed
    kl_horizon: Int = _field(10000, check=positive)  # adaptive controller horizon (samples)
    # KL estimator (ppo, rloo, reinforce_pp, remax put the KL in the token rewards; the grpo family adds it to the loss)
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    clip_eps: Float = _field(0.2, check=positive)  # ratio clip 1 - eps
    clip_eps_high: Float | None = _field(None, check=positive)  # upper clip 1 + eps; null = clip_eps (symmetric)
    # off-policy correction between the sampling policy and the trainer's (docs/algorithms.md#off-policy-correction):
    # none (the ratio against the sampled log-probs), tis, seq_mask, icepop, decoupled (recompute them first)
    rollout_correction: Literal["none", "tis", "seq_mask", "icepop", "decoupled"] = "none"
    tis_cap: Float = _field(2.0, check=positive)  # tis: C, the truncation of each token's weight min(rho, C)
    icepop_low: Float = _field(0.5, check=positive)  # icepop: alpha, tokens with rho below it carry no loss
    # icepop: beta, tokens with rho above it carry no loss (5: the IcePop paper's band is [0.5, 5])
    icepop_high: Float = _field(5.0, check=positive)
    # seq_mask: drop responses whose geometric-mean pi_behaviour / pi_old is below (verl's seq_mean_k1 band);
    # null = 1 / seq_mask_high, as verl derives it from one threshold
    seq_mask_low: Float | None = _field(None, check=positive)
    seq_mask_high: Float = _field(1.001, check=positive)  # seq_mask: ... or above this
    # decoupled: tokens whose weight pi_old / pi_behaviour exceeds this carry no loss (AReaL's behav_imp_weight_cap,
    # > 1); null = no cap
    decoupled_cap: Float | None = _field(None, check=lambda v: None if v is None or v > 1 else "must be > 1")
    minibatches: Int = _field(4, check=positive)  # policy updates per epoch over the step's rollouts
    epochs: Int = _field(1, check=positive)  # passes over the step's rollouts
    ratio_early_stop: Float | None = _field(5.0, check=positive)  # stop a step's updates past this ratio; null = never
    # samples per prompt; the grouped algorithms (the grpo family, rloo) compare a prompt's samples: >= 2, and
    # their default, 8, runs when a config names one of them alone
    group_size: Int = _field(1, check=positive)
    # how token losses become the loss: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm (docs/algorithms.md)
    loss_agg: LossAgg = "token-mean"
    entropy_coef: Float = _field(0.0, check=non_negative)  # entropy bonus in the policy loss
    overlong_buffer: Int = _field(0, check=non_negative)  # DAPO soft length penalty over the last N tokens; 0 = off
    overlong_penalty: Float = _field(1.0, check=non_negative)  # penalty at max_new_tokens
    # weight updates the policy that sampled a trained rollout may lag the trainer (eta); 0 = synchronous.
    # > 0: the generator runs up to eta batches ahead on its own devices (plan.strategy disaggregated or auto),
    # or, with generation.partial_rollout, the stream admits prompts up to eta batches ahead on any plan
    max_staleness: Int = _field(0, check=non_negative)
    # mixture-of-experts actor: weight of the load-balancing loss (`models.moe.load_balancing_loss`, HF's
    # router_aux_loss_coef) added to the policy loss; 0 = off (the router statistics are logged either way)
    router_aux_loss_coef: Float = _field(0.0, check=non_negative)
    # mixture-of-experts actor: the generate call records every token's experts and the actor's train and
    # inference forwards route those tokens to them (weights from the current router; docs/algorithms.md#router-replay)
    router_replay: Bool = False
    # train and inference calls run packed rows: each sequence's real tokens back to back, no padding
    # (docs/placement.md#packed-calls-and-token-budgets); the math is the unpacked one
    pack_sequences: Bool = False
    # real tokens per micro-batch of packed rows (prompt + response; the micro-batches of one update balanced
    # under it): set, it turns pack_sequences on; null = one micro-batch per update
    max_tokens_per_micro_batch: Int | None = _field(None, check=positive)
    # response positions a device whose full-vocabulary logits the actor's and reference's log-prob calls
    # build at once (`models.logit_chunks`: head, log-softmax and entropy a chunk of positions at a time, each
    # chunk's logits recomputed in the backward); null = all at once. Only the memory changes
    logit_chunk_tokens: Int | None = _field(4096, check=positive)

    def __post_init__(self) -> None:
        # a null upper clip is the lower one, resolved here: the config holds the value the loss uses
        if self.clip_eps_high is None:
            object.__setattr__(self, "clip_eps_high", self.clip_eps)

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        yield from super().problems(config, algorithm)
        yield from packing_problems(self, config.data.max_prompt_len + config.generation.max_new_tokens,
                                    "the longest sequence a rollout may hold, data.max_prompt_len + "
                                    "generation.max_new_tokens")


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class PPOConfig(RolloutConfig):
    """PPO: GAE advantages from a learned critic."""

    gamma: Float = _field(1.0, check=closed_unit_interval)  # discount of later token rewards (in GAE)
    lam: Float = _field(1.0, check=closed_unit_interval)  # GAE lambda
    whiten_advantages: Bool = True  # whiten the advantages over the global batch
    value_clip_eps: Float | None = _field(0.2, check=positive)  # value clip around the old values; null = unclipped value loss
    normalize_values: Bool = False  # the critic learns running-normalised returns


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class DiscountedConfig(RolloutConfig):
    """REINFORCE++ and ReMax: discounted returns of the token rewards, no critic."""

    gamma: Float = _field(1.0, check=closed_unit_interval)  # discount of later token rewards (in the return-to-go)


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class GroupedConfig(RolloutConfig):
    """Algorithms that compare the group of samples of one prompt (rloo; grpo and its variants)."""

    # 8: TRL's GRPO default and the bundled configs' (1, the base class's, is no group)
    group_size: Int = _field(8, check=positive)
    dynamic_sampling: Bool = False  # drop groups whose rewards are all equal, train on a larger pool's informative ones
    dynamic_sampling_factor: Int = _field(2, check=positive)  # prompts generated per prompt trained on


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class GRPOConfig(GroupedConfig):
    """GRPO and its variants dr_grpo, dapo and gspo (which change only defaults: the classes below)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # in the loss
    loss_agg: LossAgg = "seq-mean-token-mean"  # the paper's
    norm_adv_by_std: Bool = True  # divide the advantages by the group's reward std


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class DrGRPOConfig(GRPOConfig):
    """Dr. GRPO (Liu et al. 2025): no std division, each sequence's token sum over max_new_tokens."""

    loss_agg: LossAgg = "seq-mean-token-sum-norm"
    norm_adv_by_std: Bool = False


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class DAPOConfig(GRPOConfig):
    """DAPO (Yu et al. 2025): clip-higher, a token-level loss, dynamic sampling (overlong shaping:
    `overlong_buffer`, off unless set, since its length is in tokens of max_new_tokens)."""

    clip_eps_high: Float | None = _field(0.28, check=positive)  # clip-higher: [1 - 0.2, 1 + 0.28]
    loss_agg: LossAgg = "token-mean"
    dynamic_sampling: Bool = True


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class GSPOConfig(GRPOConfig):
    """GSPO (Zheng et al. 2025): a per-sequence ratio, clipped to the paper's [1 - 3e-4, 1 + 4e-4]."""

    clip_eps: Float = _field(3e-4, check=positive)
    clip_eps_high: Float | None = _field(4e-4, check=positive)


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class DPOConfig(AlgorithmConfig):
    """DPO and IPO on preference pairs."""

    dpo_beta: Float = _field(0.1, check=positive)  # strength of the implicit KL to the reference
    # conservative DPO (cDPO): the share of pairs taken as mislabelled
    dpo_label_smoothing: Float = _field(0.0, check=lambda v: None if 0 <= v < 0.5 else "must be in [0, 0.5)")
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"  # sigmoid = DPO, ipo = IPO
    # both calls run packed rows, each pair's two sequences back to back with others' (docs/placement.md)
    pack_sequences: Bool = False
    # real tokens (both sequences of every pair) per micro-batch of packed rows: set, it turns pack_sequences on;
    # null = one micro-batch
    max_tokens_per_micro_batch: Int | None = _field(None, check=positive)

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        yield from super().problems(config, algorithm)
        longest = config.data.max_seq_len or config.data.max_prompt_len + config.generation.max_new_tokens
        yield from packing_problems(self, 2 * longest, "a pair of the longest sequences, 2 x data.max_seq_len "
                                                       "(or data.max_prompt_len + generation.max_new_tokens)")


# Which keys each algorithm reads, and their defaults: `algorithm.name` picks the class the section is
# validated against and filled from. A new algorithm adds its name here (with the class of the keys it
# reads, a subclass where its defaults differ) and registers its declaration in jaxrlhf.algorithms.
ALGORITHM_CONFIGS: Registry[type[AlgorithmConfig]] = Registry("algorithm", entries={
    "ppo": PPOConfig,
    "grpo": GRPOConfig, "dr_grpo": DrGRPOConfig, "dapo": DAPOConfig, "gspo": GSPOConfig,
    "rloo": GroupedConfig,
    "reinforce_pp": DiscountedConfig, "remax": DiscountedConfig,
    "sft": AlgorithmConfig, "rm": AlgorithmConfig,
    "dpo": DPOConfig,
})


LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class LoraSection:
    """LoRA adapters on the role's chosen projections (HF module names); the base is frozen."""

    rank: Int = _field(8, check=positive)
    alpha: Float = _field(16.0, check=positive)  # the update is scaled by alpha / rank (PEFT's lora_alpha)
    targets: tuple[LoraTarget, ...] = _field(("q_proj", "v_proj"), check=not_empty)
    dtype: Dtype = "float32"  # the adapters' dtype; the base keeps its own


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class RoleModelConfig:
    """Where one role's weights come from: a size preset, an HF checkpoint, or another role."""

    preset: str | None = None  # a name from jaxrlhf.models.config.PRESETS (random init)
    path: str | None = None  # HF checkpoint folder (config.json + *.safetensors)
    init_from: Literal["actor", "critic", "ref", "reward"] | None = None  # copy that role's trunk (its weights at start)
    overrides: dict[str, Any] = _field(factory=dict)  # ModelConfig fields to replace
    dtype: Dtype | None = None  # compute dtype; null = the model's own
    param_dtype: Dtype | None = None  # stored parameter dtype; null = the model's own
    # rematerialise the scanned layer in training: none, full (keep layer inputs), dots (keep matmul outputs);
    # null = the planner's choice with the placement (the least that fits; plan.yaml says which)
    remat: Literal["none", "full", "dots"] | None = None
    # run the layer loop unrolled (faster, compiles longer) or as a loop; null = unrolled up to 8 layers (CPU), 16 (GPU)
    unroll_layers: Bool | None = None
    lora: LoraSection | None = None  # train LoRA adapters only (docs/lora.md); not inherited through init_from

    @property
    def source(self) -> str | None:
        """A short description of where the weights come from, or None if unset."""
        if self.init_from:
            return f"init_from {self.init_from}"
        return self.path or (f"preset {self.preset}" if self.preset else None)


ROLES = ("actor", "critic", "ref", "reward")


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class ModelsConfig:
    """The four roles and the tokenizer they share."""

    actor: RoleModelConfig = _field(factory=lambda: RoleModelConfig(preset="tiny"))
    critic: RoleModelConfig = _field(factory=lambda: RoleModelConfig(init_from="actor"))
    ref: RoleModelConfig = _field(factory=lambda: RoleModelConfig(init_from="actor"))
    reward: RoleModelConfig = _field(factory=RoleModelConfig)  # used when rewards.model is true
    tokenizer: str = "byte"  # "byte" or a path to tokenizer.json (or its folder)

    def init_chain(self, role: str) -> tuple[str, ...]:
        """`role`, the role it is initialised from, and so on: the one walk of the init_from links. The
        last role has its own weights, unless the links form a cycle (the chain stops before repeating a
        role; validation refuses that) or it has none at all."""
        chain = [role]
        while (source := getattr(self, chain[-1]).init_from) is not None and source not in chain:
            chain.append(source)
        return tuple(chain)


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup and a decay schedule, for one trained role."""

    lr: Float = _field(1e-5, check=positive)  # peak learning rate
    weight_decay: Float = _field(0.0, check=non_negative)  # AdamW decoupled weight decay
    b1: Float = _field(0.9, check=closed_unit_interval)  # Adam first-moment decay
    b2: Float = _field(0.95, check=closed_unit_interval)  # Adam second-moment decay
    eps: Float = _field(1e-8, check=positive)  # Adam denominator epsilon
    warmup_steps: Int = _field(0, check=non_negative)  # optimizer updates of linear warm-up from 0
    schedule: Literal["constant", "cosine", "linear"] = "constant"  # after warm-up: constant, cosine or linear decay
    max_grad_norm: Float | None = _field(1.0, check=positive)  # gradient global-norm clip; null = no clipping
    master_weights: Bool = True  # bf16/fp16 params: AdamW on an fp32 master copy (no effect on fp32 params)


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class OptimizersConfig:
    """One optimizer per trained role (the reward model is trained by the `rm` stage)."""

    actor: OptimConfig = _field(factory=OptimConfig)
    critic: OptimConfig = _field(factory=lambda: OptimConfig(lr=5e-5))
    reward: OptimConfig = _field(factory=lambda: OptimConfig(lr=1e-5))


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Prompt data for rollouts (see jaxrlhf.data.sources for what `source` accepts)."""

    source: str = _field("arithmetic", check=not_empty)  # bundled task, file, folder or TFDS name
    split: str = "train"  # the split of data.source to train on
    eval_split: str | None = "test"  # held-out split for run.eval_every; null = no evaluation
    # null (rm, dpo): chosen and rejected hold the whole dialogue; their shared token prefix is the prompt
    prompt_key: str | None = _field("prompt", check=not_empty)
    answer_key: str | None = "answer"  # reference answers' column; null = none (reward model only)
    answer_extract: str = "none"  # a name in jaxrlhf.data.answers.ANSWER_EXTRACTORS
    prompt_template: str = "{prompt}"  # text around each prompt; must contain {prompt}
    # raw: prompt text as is (after prompt_template); chat: through the tokenizer's own chat_template
    # (tokenizer_config.json), with the assistant header; SFT then trains on assistant turns only
    prompt_format: Literal["raw", "chat"] = "raw"
    system_prompt: str | None = None  # chat: a system message before each text prompt
    messages_key: str = _field("messages", check=not_empty)  # chat: rows with a message list here are conversations
    add_bos: Bool | None = None  # prepend BOS to prompts; null = as the tokenizer does (its post-processor / add_bos_token)
    batch_size: Int = _field(32, check=positive)  # prompts per step (global)
    max_prompt_len: Int = _field(64, check=positive)  # prompt length cap (tokens); longer prompts are skipped
    pad_multiple: Int = _field(16, check=positive)  # prompt lengths pad to multiples of this
    shuffle: Bool = True  # a new order every epoch (seeded)
    seed: Int | None = None  # data order seed; null = run.seed
    data_dir: str | None = None  # TFDS data dir; null = $JAXRLHF_DATA_DIR or ~/.cache/jaxrlhf/tfds
    chosen_key: str = _field("chosen", check=not_empty)  # the preferred response's column (rm, dpo)
    rejected_key: str = _field("rejected", check=not_empty)  # the dispreferred response's column
    max_seq_len: Int | None = _field(None, check=positive)  # sequence length cap of sft/rm/dpo; null = max_prompt_len + max_new_tokens
    packing: Bool = False  # sft: several demonstrations per row

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        name = config.algorithm.name
        if self.prompt_format == "chat" and self.add_bos is not None:
            yield (
                "data.add_bos does not apply with data.prompt_format=chat: the chat template writes the BOS "
                "token itself (as transformers' apply_chat_template); leave data.add_bos unset (null)"
            )
        if self.prompt_format == "chat" and algorithm.data == "pairs":
            yield (
                f"data.prompt_format=chat is for prompts and demonstrations; algorithm.name={name} reads "
                "preference pairs as text (render them with the template beforehand, or use prompt_format=raw)"
            )
        if self.prompt_key is None:
            if algorithm.data != "pairs":
                yield (
                    f"data.prompt_key=null is for preference pairs whose texts hold the prompt (rm, dpo); "
                    f"algorithm.name={name} reads its prompts from data.prompt_key: name that column"
                )
            if config.sft.steps:
                yield (
                    "data.prompt_key=null: the SFT warm-up (sft.steps > 0) reads prompts from data.prompt_key; "
                    "name the prompt column or set sft.steps=0"
                )


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Optional supervised warm-up of the actor before RL: the `sft` stage run first, on the
    actor's training placement (the reference then copies the warmed-up actor)."""

    steps: Int = _field(0, check=non_negative)  # warm-up steps before the algorithm; 0 = no warm-up
    source: str | None = None  # demonstrations; null = data.source
    split: str = "sft"  # the split of sft.source with the demonstrations
    completion_key: str | None = None  # the demonstration's column; null = data.answer_key
    batch_size: Int = _field(32, check=positive)  # demonstrations per warm-up step
    lr: Float = _field(1e-3, check=positive)  # warm-up learning rate (constant after 10 warm-up updates)
    packing: Bool = False  # several demonstrations per row
    # names in jaxrlhf.environments.TOOLS (the environment's env.args.tools): the demonstrations are
    # then rendered through the tokenizer's chat template with these tools described, as env.name=tools renders
    # its episodes (whatever data.prompt_format says; only assistant turns carry loss); [] = none described;
    # null = as data.prompt_format says
    tools: tuple[str, ...] | None = None

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        roles, name = algorithm.roles(), config.algorithm.name
        if self.steps and (name == "sft" or not ("actor" in roles and roles["actor"].trained)):
            yield (
                f"sft.steps={self.steps} warms up a trained actor before another algorithm; "
                f"algorithm.name={name} has none to warm up (set sft.steps=0)"
            )


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Sampling for rollouts; the loss recomputes log-probs with the same processing."""

    max_new_tokens: Int = _field(32, check=positive)  # response length cap (tokens)
    temperature: Float = _field(1.0, check=positive)  # logits are divided by this before sampling
    top_k: Int = _field(0, check=non_negative)  # sample among the k likeliest tokens; 0 = off
    top_p: Float = _field(1.0, check=unit_interval)  # nucleus sampling mass; 1 = off
    greedy: Bool = False  # argmax decoding instead of sampling
    # static: the batch decodes together until its longest row ends; continuous: each distinct prompt
    # prefilled once, `slots` rows decode over a paged KV cache, finished rows make room for waiting ones
    # and steps narrow to the rows still running (docs/generation.md)
    engine: Literal["static", "continuous"] = "static"
    # continuous engine's rows decoding at once; null = the planner's choice (the whole batch unless memory needs fewer)
    slots: Int | None = _field(None, check=positive)
    # continuous engine's KV page pool: response pages of 16 tokens (all batch shards together); null = the
    # planner's: the most pages its rows hold at once on the plan's response lengths (plan.response_length_median
    # and _sigma) with a quarter to spare, else every slot can hold max_new_tokens (never preempts). Smaller
    # trades memory for recomputing preempted rows
    kv_pages: Int | None = _field(None, check=positive)
    # cut the rollout batch after generation to its longest response, rounded up to max_new_tokens / 2^k
    # (k < 4, multiples of 8): the train and inference calls skip the padding past it (docs/generation.md)
    trim_responses: Bool = True
    # sample every response to max_new_tokens, past any EOS token (the rollout only; evaluation still
    # stops at EOS): identical work every step, for benchmarks against peers run the same way (TRL's
    # stop_token=None, vLLM's ignore_eos). Needs rewards.eos_only=false: no response ends with EOS
    ignore_eos: Bool = False
    # partial rollouts: the continuous engine streams the rollouts (docs/placement.md#partial-rollouts): its
    # pool stays full across steps, admitting the prompts of the next steps (up to algorithm.max_staleness
    # batches ahead) as groups finish, and rows in flight go on under new weights when they arrive, keeping
    # their KV cache; every token records the weight version that sampled it. Needs engine=continuous
    partial_rollout: Bool = False
    stream_chunk: Int = _field(16, check=positive)  # partial rollouts: decode steps between looks for new weights
    # partial rollouts: when new weights arrive, recompute the KV cache of the rows in flight (a prefill of
    # prompt + tokens so far) so they decode on exactly as the new weights would; false keeps the old
    # weights' cache, as AReaL and verl do (docs/placement.md#partial-rollouts). Needs partial_rollout=true
    partial_recompute: Bool = False
    # responses end at lengths drawn from plan.response_length_median / response_length_sigma (the planner's
    # own draws), not at EOS: a synthetic workload to measure throughput and check the planner's estimates
    # with a model that does not yet answer at realistic lengths. Needs ignore_eos=true (nothing learns)
    simulated_lengths: Bool = False
    # the rollout kind producing the samples, a name in jaxrlhf.rollouts.ROLLOUTS (docs/architecture.md, "A new
    # rollout kind"); null = the kind the other keys imply: agents (env.name=openai_agent), episodes (another
    # env.name), stream (partial_rollout=true), else graph (the step graph's generate call)
    rollout: str | None = None

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        rollout = hasattr(config.algorithm, "max_staleness")  # the algorithms that generate rollouts
        name = config.algorithm.name
        if self.rollout is not None and not rollout:
            yield f"generation.rollout={self.rollout} applies to rollouts, and algorithm.name={name} has none"
        for key in ("partial_rollout", "simulated_lengths"):
            if getattr(self, key) and not rollout:
                yield f"generation.{key}=true applies to rollouts, and algorithm.name={name} has none; set it false"
        if self.partial_recompute and not self.partial_rollout:
            yield ("generation.partial_recompute=true recomputes the KV cache of rows a stream keeps in flight "
                   "across weight updates: set generation.partial_rollout=true (or partial_recompute=false)")
        if self.partial_rollout and self.engine != "continuous":
            yield ("generation.partial_rollout=true streams rollouts through the continuous engine's paged pool; "
                   f"set generation.engine=continuous (not {self.engine})")
        if self.simulated_lengths and config.plan.response_length_median is None:
            yield ("generation.simulated_lengths=true draws response lengths from the planner's distribution: "
                   "set plan.response_length_median (and plan.response_length_sigma)")
        if self.simulated_lengths and not self.ignore_eos:
            yield ("generation.simulated_lengths=true ends responses at drawn lengths, not at EOS: set "
                   "generation.ignore_eos=true (and rewards.eos_only=false)")


AGENT_ENVIRONMENT = "openai_agent"  # env.name whose rows are played by env.agent through the endpoint


def tcp_port(value: Any) -> str | None:
    return None if value is None or 0 <= value <= 65535 else "must be a TCP port in [0, 65535] (0 = any free port)"


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class AgentServerConfig:
    """env.server: the OpenAI-compatible endpoint that `env.agent` agents talk to
    (docs/agentic.md#the-agent-endpoint); each episode's base URL is http://{host}:{port}/episodes/{id}/v1."""

    port: Int = _field(0, check=tcp_port)  # 0 = any free port
    # the address it listens on; another than 127.0.0.1 / localhost / ::1 is reachable from other machines (and
    # unauthenticated: anyone who reaches it samples from the policy), so it prints a warning
    host: str = _field("127.0.0.1", check=not_empty)
    window_ms: Float = _field(10.0, check=non_negative)  # how long a generate call waits to gather more requests
    # an agent still running after this many seconds fails its episode (later requests get 404); null = no limit
    agent_timeout_s: Float | None = _field(None, check=positive)
    failure: Float = 0.0  # the reward of an episode whose agent raised or timed out


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class RewardRule:
    """One rule reward by registry name, its weight and keyword arguments."""

    name: str = _field(check=not_empty)  # a name in jaxrlhf.rewards.rules.REWARD_FUNCTIONS
    weight: Float = 1.0  # the rule's weight in the sum
    args: dict[str, Any] = _field(factory=dict)  # keyword arguments of the rule function


def _rule_by_name(value: Any) -> Any:
    """A rule may be given by its name alone: `rules: [exact_match]`."""
    return {"name": value} if isinstance(value, str) else value


RuleOrName = Annotated[RewardRule, pydantic.BeforeValidator(_rule_by_name)]


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    """Reward = (sum of weighted rules [+ reward model] - bias) * scale, clipped."""

    model: Bool = False  # score with the reward model (model.reward)
    rules: tuple[RuleOrName, ...] = (RewardRule("exact_match"),)  # rule rewards: names or {name, weight, args}
    scale: Float = 1.0  # multiplies the score after the bias
    bias: Float = 0.0  # subtracted from the score first
    clip: Float | None = _field(20.0, check=positive)  # |reward| bound; null = no clipping
    eos_only: Bool = True  # sequences that did not end with EOS get no score
    # worker processes scoring the rules beside the step (docs/agentic.md): a batch spread over them, and with
    # generation.partial_rollout each sample scored as soon as it ends, while the rest decode; 0 = in the step
    workers: Int = _field(0, check=non_negative)


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Multi-turn episodes (docs/agentic.md#environments): the policy talks to an environment, turn by turn; the
    observations' tokens are appended to its trajectory and carry no loss."""

    # a name in jaxrlhf.environments.ENVIRONMENTS (tools: the model calls Python tools); null = the
    # single-turn rollout
    name: str | None = None
    args: dict[str, Any] = _field(factory=dict)  # keyword arguments of the environment's factory, e.g. {tools: [calculator]}
    max_turns: Int = _field(4, check=positive)  # model turns per episode; the episode ends after the last one
    # response tokens of a whole trajectory, the model's and the observations' together (at most
    # generation.max_new_tokens, the batch's response width); null = generation.max_new_tokens
    max_tokens: Int | None = _field(None, check=positive)
    # model tokens per turn: a longer turn is cut, closed by an end-of-turn token (no loss) and shown to the
    # environment; null = max_tokens
    max_turn_tokens: Int | None = _field(None, check=positive)
    max_observation_tokens: Int = _field(256, check=positive)  # tokens of one observation; a longer one ends the episode
    threads: Int = _field(4, check=positive)  # host threads stepping environments while the other rows decode
    # worker processes holding the environments (each episode in one, built there from env.name and env.args), so
    # their Python work does not hold the trainer's GIL; 0 = the environments live in the trainer's process
    workers: Int = _field(0, check=non_negative)
    # with env.workers: a step running longer ends its episode (env/env_error/timeout) and restarts its
    # worker; null = no limit (steps on the trainer's threads cannot be stopped: no limit there)
    step_timeout_s: Float | None = _field(60.0, check=positive)
    failure: Float = 0.0  # the reward of an episode whose step raised, timed out or lost its worker (env/env_error)
    # modules imported (in the trainer and in each worker) before env.name is looked up: the user modules that
    # register custom environments, e.g. [my_envs]; their folder must be on PYTHONPATH
    imports: tuple[str, ...] = _field((), check=module_names)
    # env.name=openai_agent: the agent playing each row, "module:function"; function(client, row) -> reward or
    # None, with an openai.OpenAI client on the run's endpoint (docs/agentic.md#the-agent-endpoint)
    agent: str | None = None
    # env.name=openai_agent: the endpoint the agents talk to, {port: 0 = any free one, host: 127.0.0.1 (another is
    # reachable from other machines; a warning says so), window_ms: a generate call's wait for more requests,
    # agent_timeout_s: an agent running longer fails its episode (null = no limit), failure: a failed episode's
    # reward}; null = those defaults
    server: AgentServerConfig | None = None

    def problems(self, config: Config, algorithm: Algorithm) -> Iterator[str]:
        if (self.name == AGENT_ENVIRONMENT) != (self.agent is not None):
            yield (f"env.name={AGENT_ENVIRONMENT} plays rows with env.agent (\"module:function\"), and only it does: "
                   f"set both, or neither (env.name={self.name}, env.agent={self.agent})")
        if self.name is None:  # an unknown name: the rollout algorithms' validation (the registry is above)
            return
        if not hasattr(config.algorithm, "max_staleness"):
            yield (f"env.name={self.name} runs multi-turn rollouts, and algorithm.name={config.algorithm.name} has "
                   "none; set env.name=null")
        if config.generation.engine != "continuous" and self.name != AGENT_ENVIRONMENT:
            yield (f"env.name={self.name} runs episodes on the continuous engine's paged KV cache (an observation is "
                   f"prefilled onto its row's pages): set generation.engine=continuous (not {config.generation.engine})")
        if config.generation.partial_rollout:
            yield (f"env.name={self.name}: partial rollouts (generation.partial_rollout=true) do not run environments "
                   "yet; set generation.partial_rollout=false")
        for key in ("ignore_eos", "simulated_lengths"):
            if getattr(config.generation, key):
                yield f"env.name={self.name}: a turn ends on an EOS token; set generation.{key}=false"
        if config.staleness_budget:
            yield (f"env.name={self.name}: episodes are generated in the step, by the trainer's current weights; set "
                   "algorithm.max_staleness=0 and plan.offpolicy=false")
        if self.workers and self.name == AGENT_ENVIRONMENT:
            yield (f"env.workers={self.workers} runs environments in worker processes, and env.name={AGENT_ENVIRONMENT}'s "
                   "episodes are played by agents (env.agent), not environments: set env.workers=0")
        budget = self.max_tokens or config.generation.max_new_tokens
        if budget > config.generation.max_new_tokens:
            yield (f"env.max_tokens={budget} exceeds generation.max_new_tokens={config.generation.max_new_tokens}, the "
                   f"rollout batch's response width: set generation.max_new_tokens >= {budget}")
        if self.max_turn_tokens is not None and self.max_turn_tokens > budget:
            yield (f"env.max_turn_tokens={self.max_turn_tokens} exceeds the trajectory's budget env.max_tokens="
                   f"{budget}: set env.max_turn_tokens <= {budget}")


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation of the RL algorithms on data.eval_split (`run.eval_every`, `python -m
    jaxrlhf.eval`): greedy accuracy always, pass@k from `samples` sampled responses per prompt."""

    samples: Int = _field(0, check=non_negative)  # sampled responses per prompt for pass@k; 0 = greedy only
    pass_k: tuple[Int, ...] = _field((1,), check=not_empty)  # the k of pass@k, each <= samples
    correct_rule: str | None = None  # rewards.rules entry that decides correctness; null = the first
    correct_threshold: Float = 1.0  # a response is correct when that rule scores at least this
    max_prompts: Int | None = _field(None, check=positive)  # held-out prompts evaluated; null = all


@_no_extra_keys
@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""

    run: RunConfig = _field(factory=RunConfig)
    distributed: DistributedConfig = _field(factory=DistributedConfig)
    plan: PlanConfig = _field(factory=PlanConfig)
    algorithm: AlgorithmConfig = _field(factory=PPOConfig)  # the class ALGORITHM_CONFIGS[algorithm.name]
    model: ModelsConfig = _field(factory=ModelsConfig)
    optimizer: OptimizersConfig = _field(factory=OptimizersConfig)
    data: DataConfig = _field(factory=DataConfig)
    sft: SFTConfig = _field(factory=SFTConfig)
    generation: GenerationConfig = _field(factory=GenerationConfig)
    rewards: RewardsConfig = _field(factory=RewardsConfig)
    env: EnvConfig = _field(factory=EnvConfig)
    eval: EvalConfig = _field(factory=EvalConfig)


    @property
    def staleness_budget(self) -> int:
        """eta: how many weight updates a trained rollout's sampling policy may lag the trainer
        (`algorithm.max_staleness`; `plan.offpolicy=true` is the same as 1). 0 = synchronous."""
        return max(getattr(self.algorithm, "max_staleness", 0), int(self.plan.offpolicy))

    @property
    def generator_lead(self) -> int:
        """Steps the generator runs ahead of the trainer on an off-policy plan: the budget, at least 1
        (a plan may be off-policy by itself). The runtime (`RunSetup.staleness`) and the planner
        (`Workload.staleness`) both read it, so they schedule the same eta."""
        return max(self.staleness_budget, 1)
