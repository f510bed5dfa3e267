"""RL from rollouts, declared: what PPO, GRPO, RLOO, REINFORCE++ and ReMax share, without JAX.

`RolloutAlgorithm` says which roles a run needs, what its step graph is and which config
values it refuses; subclasses (ppo.py, grpo.py, ...) set the advantage estimator, the policy
loss and where the KL goes. The calls the graph names and the host steps between them are
`jaxrlhf.algorithms.rollout` (the module docstring there draws the graph).
"""

from __future__ import annotations

from typing import ClassVar

from jaxrlhf.algorithms.base import Algorithm, AlgorithmConfigError, RoleSpec
from jaxrlhf.algorithms.estimators import ESTIMATORS
from jaxrlhf.config_schema import AGENT_ENVIRONMENT
from jaxrlhf.environments import ENVIRONMENTS, TOOLS
from jaxrlhf.graph import CallGraph, CallSpec, HostStep
from jaxrlhf.models.lengths import response_widths
from jaxrlhf.rewards.rules import REWARD_FUNCTIONS
from jaxrlhf.rollouts import ENV_GENERATED, GENERATED, RESPONSE, ROLLOUTS, ROUTED, SEQUENCE


class RolloutAlgorithm(Algorithm):
    """Base of the RL algorithms: subclasses set the estimator, the loss and where the KL goes."""

    data = "prompts"
    runtime = "jaxrlhf.algorithms.rollout:RolloutRuntime"
    estimator: ClassVar[str] = "gae"
    loss: ClassVar[str] = "ppo"
    kl_in_reward: ClassVar[bool] = True  # -coef * KL per token in the reward; else a KL term in the loss
    greedy_baseline: ClassVar[bool] = False
    grouped: ClassVar[bool] = False  # needs several samples per prompt

    @property
    def uses_critic(self) -> bool:
        return ESTIMATORS.get(self.estimator).needs_critic

    @property
    def uses_ref(self) -> bool:
        alg = self.cfg.algorithm
        return alg.kl_coef > 0 or alg.kl_target is not None

    @property
    def group_size(self) -> int:
        return self.cfg.algorithm.group_size

    @property
    def corrects(self) -> bool:
        """An off-policy correction (`algorithm.rollout_correction` other than none): the actor recomputes
        the rollout's log-probs before its update (`actor.inference`), the train call weighs them against
        the behaviour log-probs the generate call recorded (`jaxrlhf.algorithms.correction`)."""
        return self.cfg.algorithm.rollout_correction != "none"

    @property
    def replays(self) -> bool:
        """Router replay (`algorithm.router_replay`): the generate call records each token's experts
        (`ROUTED`) and the actor's train and inference forwards route the tokens to them."""
        return self.cfg.algorithm.router_replay

    @property
    def runs_environments(self) -> bool:
        """`env.name`: the rollouts are environment episodes or agents' (their batch has `ENV_GENERATED`)."""
        return self.cfg.env.name is not None

    @property
    def rollout_kind(self) -> str:
        """`generation.rollout`, else the kind the config implies: agents through the endpoint
        (env.name=openai_agent), environment episodes (another env.name), a stream of partial rollouts
        (`generation.partial_rollout`), else the step graph's generate call (`jaxrlhf.rollouts`)."""
        gen, env = self.cfg.generation, self.cfg.env
        if gen.rollout is not None:
            return gen.rollout
        if env.name is not None:
            return "agents" if env.name == AGENT_ENVIRONMENT else "episodes"
        return "stream" if gen.partial_rollout else "graph"

    @property
    def generated(self) -> tuple[str, ...]:
        """The rollout batch's values: `GENERATED`, with router replay the recorded experts, and with environments
        the trajectories' `action_mask` (0 on observation tokens) and the environments' rewards (`env_reward`)."""
        out = (*GENERATED, ROUTED) if self.replays else GENERATED
        return (*out, *ENV_GENERATED) if self.runs_environments else out

    @property
    def dynamic_sampling(self) -> bool:
        """Generate a larger pool of groups and train on the informative ones (see `select_groups`)."""
        return getattr(self.cfg.algorithm, "dynamic_sampling", False)  # only grouped algorithms have the key

    @property
    def trims(self) -> bool:
        """Cut the rollout batch to its longest response after generation (`generation.trim_responses`;
        nothing to cut when `max_new_tokens` allows one width only or every response runs to it)."""
        gen = self.cfg.generation
        vary = not gen.ignore_eos or gen.simulated_lengths
        return bool(gen.trim_responses) and vary and len(response_widths(gen.max_new_tokens)) > 1

    @property
    def uncut_prefix(self) -> str:
        """Prefix of the rollout batch before `trim_responses` cuts it (`full_`), or none without the cut."""
        return "full_" if self.trims else ""

    @property
    def generated_prefix(self) -> str:
        """Prefix of the generate call's outputs: `pool_` (dynamic sampling selects from them), `full_`
        (`trim_responses` cuts them), or none (they are the batch)."""
        return "pool_" if self.dynamic_sampling else self.uncut_prefix

    @property
    def packs(self) -> bool:
        """Train and inference calls run packed rows (`algorithm.pack_sequences`, `models.packing`)."""
        return self.cfg.algorithm.pack_sequences

    @property
    def packings(self) -> dict[str, tuple[str, ...]]:
        """With packing: each packing the `pack_sequences` host step makes, and the calls that read it
        (the inference calls share one; each train call has its own, for its own minibatches)."""
        if not self.packs:
            return {}
        inference = [c for c, present in (
            ("actor.inference", self.corrects), ("ref.inference", self.uses_ref),
            ("critic.inference", self.uses_critic),
            ("reward.inference", bool(self.cfg.rewards.model) and not self.greedy_baseline),
        ) if present]
        out = {"packed_inference": tuple(inference)} if inference else {}
        out["packed_actor"] = ("actor.train",)
        if self.uses_critic:
            out["packed_critic"] = ("critic.train",)
        return out

    @property
    def pool_factor(self) -> int:
        """Prompts generated per prompt trained on."""
        return self.cfg.algorithm.dynamic_sampling_factor if self.dynamic_sampling else 1

    @property
    def batch_rows(self) -> int:
        return self.cfg.data.batch_size * self.group_size

    @property
    def minibatches(self) -> int:
        return self.cfg.algorithm.minibatches

    @property
    def epochs(self) -> int:
        return self.cfg.algorithm.epochs

    @property
    def updates_per_step(self) -> int:
        return self.minibatches * self.epochs

    def roles(self) -> dict[str, RoleSpec]:
        out = {"actor": RoleSpec("lm", True, "it is trained")}
        if self.uses_critic:
            out["critic"] = RoleSpec("value", True, f"algorithm.name={self.name} learns a value function")
        if self.uses_ref:
            out["ref"] = RoleSpec("lm", False, "algorithm.kl_coef > 0 (KL to the reference policy)")
        if self.cfg.rewards.model:
            out["reward"] = RoleSpec("reward", False, "rewards.model=true")
        return out

    def validate(self) -> None:
        alg, cfg = self.cfg.algorithm, self.cfg
        name = f"algorithm.name={self.name}"
        if self.grouped and alg.group_size < 2:
            raise AlgorithmConfigError(
                f"{name} compares samples of the same prompt: algorithm.group_size must be >= 2, got {alg.group_size}"
            )
        if self.batch_rows % alg.minibatches:
            raise AlgorithmConfigError(
                f"algorithm.minibatches={alg.minibatches} must divide the rollout batch "
                f"data.batch_size x algorithm.group_size = {cfg.data.batch_size} x {alg.group_size} = {self.batch_rows}"
            )
        if not cfg.rewards.model and not cfg.rewards.rules and cfg.env.name is None:
            raise AlgorithmConfigError("no reward: set rewards.model=true or give at least one rewards.rules entry "
                                       "(or env.name: an environment's rewards)")
        if self.dynamic_sampling and (cfg.rewards.model or not cfg.rewards.rules):
            raise AlgorithmConfigError(
                "algorithm.dynamic_sampling selects groups on the host by their rule scores: it needs "
                "rewards.rules and rewards.model=false (or set algorithm.dynamic_sampling=false)")
        ev = cfg.eval
        if ev.samples:
            if max(ev.pass_k) > ev.samples or min(ev.pass_k) < 1:
                raise AlgorithmConfigError(
                    f"eval.pass_k={list(ev.pass_k)}: every k must be in [1, eval.samples={ev.samples}]")
            if self.batch_rows % ev.samples:
                raise AlgorithmConfigError(
                    f"eval.samples={ev.samples} must divide the rollout batch data.batch_size x algorithm.group_size "
                    f"= {self.batch_rows} (evaluation batches have the rollout's shape)")
        names = [r.name for r in cfg.rewards.rules]
        if ev.correct_rule is not None and ev.correct_rule not in names:
            raise AlgorithmConfigError(f"eval.correct_rule={ev.correct_rule!r} is none of rewards.rules {names}")
        if alg.overlong_buffer > cfg.generation.max_new_tokens:
            raise AlgorithmConfigError(
                f"algorithm.overlong_buffer={alg.overlong_buffer} exceeds generation.max_new_tokens="
                f"{cfg.generation.max_new_tokens}: the penalty ramps over the last tokens of the response")
        if cfg.generation.ignore_eos and cfg.rewards.eos_only:
            raise AlgorithmConfigError(
                "generation.ignore_eos=true runs every response past EOS, so rewards.eos_only=true would score "
                "none of them: set rewards.eos_only=false (or generation.ignore_eos=false)")
        if cfg.generation.rollout is not None and cfg.generation.rollout not in ROLLOUTS:
            raise AlgorithmConfigError(f"generation.rollout: {ROLLOUTS.unknown(cfg.generation.rollout)}")
        for i, rule in enumerate(cfg.rewards.rules):
            if rule.name not in REWARD_FUNCTIONS:
                raise AlgorithmConfigError(f"rewards.rules[{i}].name: {REWARD_FUNCTIONS.unknown(rule.name)}")
        if cfg.env.imports:  # user modules registering environments, before the name is looked up
            from jaxrlhf.environments.pool import import_modules

            try:
                import_modules(cfg.env.imports)
            except ImportError as e:
                raise AlgorithmConfigError(str(e)) from None
        if cfg.env.name not in (None, AGENT_ENVIRONMENT) and cfg.env.name not in ENVIRONMENTS:
            raise AlgorithmConfigError(f"env.name: {ENVIRONMENTS.unknown(cfg.env.name)}")
        for name in cfg.sft.tools or ():  # the warm-up renders its demonstrations with these tools
            if name not in TOOLS:
                raise AlgorithmConfigError(f"sft.tools: {TOOLS.unknown(name)}")
        answer_rule = cfg.env.args.get("reward") if cfg.env.name == "tools" else None
        if isinstance(answer_rule, str) and answer_rule not in REWARD_FUNCTIONS:
            raise AlgorithmConfigError(f"env.args.reward: {REWARD_FUNCTIONS.unknown(answer_rule)}")
        if cfg.env.name is not None and (self.dynamic_sampling or self.greedy_baseline):
            raise AlgorithmConfigError(
                f"env.name={cfg.env.name}: episodes are generated for the step's batch only; "
                + ("algorithm.dynamic_sampling=true draws a larger pool: set it false" if self.dynamic_sampling
                   else f"algorithm.name={cfg.algorithm.name}'s greedy baseline is a second generation: use grpo, "
                        "rloo, reinforce_pp or ppo"))
        if alg.router_replay and cfg.generation.partial_rollout:
            raise AlgorithmConfigError(
                "algorithm.router_replay=true records experts in the generate call; partial rollouts "
                "(generation.partial_rollout=true) do not record them yet: set generation.partial_rollout=false")
        for band, example in (("icepop", "0.5 and 5.0"), ("seq_mask", "0.999 and 1.001")):
            high = getattr(alg, f"{band}_high")
            low = getattr(alg, f"{band}_low")
            low_shown = low
            if low is None:  # seq_mask's lower edge defaults to 1 / high (verl)
                low = 1.0 / high
            if not low < high:
                raise AlgorithmConfigError(
                    f"algorithm.{band}_low={low_shown} must be below algorithm.{band}_high={high} (e.g. {example})")
            if not low <= 1.0 <= high:  # pi_old / pi_behaviour is 1 on policy
                raise AlgorithmConfigError(
                    f"algorithm.{band}_low={low_shown} and algorithm.{band}_high={high} must hold 1 between them, the "
                    f"ratio of an on-policy token, or a synchronous run would mask every token (e.g. {example})")

    @property
    def generate_inputs(self) -> tuple[str, ...]:
        """Inputs of the generate calls: the prompts and the sampling key, and with
        `generation.simulated_lengths` each response's drawn length (`max_lengths`)."""
        drawn = ("max_lengths",) if self.cfg.generation.simulated_lengths else ()
        return ("prompt_tokens", "prompt_mask", "rng_generate", *drawn)

    def graph(self) -> CallGraph:
        pool = "pool_" if self.dynamic_sampling else ""
        calls: list[CallSpec] = [
            CallSpec("actor.generate", "actor", "generate", inputs=self.generate_inputs,
                     outputs=tuple(self.generated_prefix + v for v in self.generated), seqs_per_row=self.pool_factor),
        ]
        prefixes = (pool,)
        if self.greedy_baseline:
            prefixes = ("", "greedy_")
            calls.append(CallSpec("actor.generate_greedy", "actor", "generate", inputs=self.generate_inputs,
                                  outputs=tuple("greedy_" + v for v in GENERATED)))
        host: list[HostStep] = []
        generated = self.generated
        train_in = [*generated, "kl_coef", "rng_actor"]
        if self.cfg.rewards.rules:
            outs = tuple(f"{p}rule_scores" for p in prefixes)
            ins = tuple(f"{p}{v}" for p in prefixes for v in RESPONSE) + ("prompts", "answers")
            host.append(HostStep("score_rules", ins, outs + tuple(f"{p}rule_components" for p in prefixes)))
            train_in += ["rule_scores"] if pool else outs
        full = self.uncut_prefix
        if pool:  # dynamic sampling: the pool's informative groups become the step's batch
            host.append(HostStep("select_groups", (*(pool + v for v in generated), "pool_rule_scores",
                                                   "pool_rule_components"),
                                 (*(full + v for v in generated), "rule_scores", "rule_components", "sampling_stats")))
        if full:  # the batch cut to its longest response: every later call skips the padding past it
            host.insert(0, HostStep("trim_responses", tuple(full + v for v in generated), generated))
        packings = self.packings
        # what an inference call reads of the sequences: the packed rows, or the padded batch
        sequences = ("packed_inference",) if "packed_inference" in packings else SEQUENCE
        if self.cfg.rewards.model:
            outs = tuple(f"{p}model_scores" for p in prefixes)
            scored = (("packed_inference", "ended_with_eos") if "reward.inference" in packings.get("packed_inference", ())
                      else tuple(f"{p}{v}" for p in prefixes for v in SEQUENCE))
            calls.append(CallSpec("reward.inference", "reward", "inference", "reward", inputs=scored, outputs=outs,
                                  seqs_per_row=len(prefixes)))
            train_in += outs
        if self.greedy_baseline:
            train_in.append("greedy_ended_with_eos")
        if self.corrects:  # pi_old: the trainer's log-probs of the rollout before this step's update
            replayed = (ROUTED,) if self.replays and not packings else ()  # a packing carries them packed
            calls.append(CallSpec("actor.inference", "actor", "inference", inputs=(*sequences, *RESPONSE, *replayed),
                                  outputs=("old_logp",), fresh_weights=True))
            train_in.append("old_logp")
        if self.uses_ref:
            calls.append(CallSpec("ref.inference", "ref", "inference", inputs=(*sequences, *RESPONSE),
                                  outputs=("ref_logp",)))
            train_in.append("ref_logp")
        state = ["kl_coef"]
        if self.uses_critic:
            calls.append(CallSpec("critic.inference", "critic", "inference", "value",
                                  inputs=(*sequences, "response_mask"), outputs=("values",)))
            train_in += ["values", "value_moments"]
            state.append("value_moments")
        if packings:  # the train calls read their own packings instead of the padded sequences
            train_in = [v for v in train_in if v not in (*SEQUENCE, ROUTED)] + ["packed_actor"]
            rngs = ("rng_actor", "rng_critic") if self.uses_critic else ("rng_actor",)
            replayed = (ROUTED,) if self.replays else ()  # packed beside the tokens
            host.append(HostStep("pack_sequences", (*SEQUENCE, "response_mask", *rngs, *replayed),
                                 (*packings, "packing_stats"),
                                 shards_of=tuple(c for calls_of in packings.values() for c in calls_of)))
        calls.append(CallSpec("actor.train", "actor", "train", inputs=tuple(train_in),
                              outputs=("actor_stats", "advantages")))
        if self.uses_critic:
            critic_in = tuple({"packed_actor": "packed_critic"}.get(v, v) for v in train_in
                              if v not in ("rng_actor", "old_logp", ROUTED)) + ("rng_critic",)
            calls.append(CallSpec("critic.train", "critic", "train", "value", inputs=critic_in,
                                  outputs=("critic_stats", "value_moments")))
        if self.uses_ref:
            host.append(HostStep("kl_control", ("kl_coef", "actor_stats"), ("kl_coef",)))
        feed = ["prompt_tokens", "prompt_mask", "prompts", "answers", "rng_generate", "rng_actor"]
        if self.cfg.generation.simulated_lengths:
            feed.append("max_lengths")
        if self.uses_critic:
            feed.append("rng_critic")
        return CallGraph(tuple(calls), tuple(host), tuple(feed), tuple(state))
