"""RL from rollouts: the calls and host steps PPO, GRPO, RLOO, REINFORCE++ and ReMax share.

The algorithms are declared (roles, graph, config rules) in `jaxrlhf.algorithms.rl`, without
JAX; `RolloutRuntime` here is their runtime half. The step graph (bracketed parts depend on the algorithm and the config):

    feed   prompt_tokens, prompt_mask, prompts, answers, rng_generate, rng_actor[, rng_critic]
    state  kl_coef[, value_moments]

    actor.generate           prompts -> tokens, mask, positions, response_tokens, response_mask,
                             behaviour_logp, ended_with_eos
    [actor.generate_greedy]  the same prompts decoded greedily -> greedy_* (ReMax's baseline)
    [trim_responses]         host: the batch cut to its longest response (`generation.trim_responses`;
                             the generate call's outputs are then named full_*)
    [score_rules]            host: decoded responses + reference answers -> rule_scores[, greedy_rule_scores]
    [reward.inference]       reward-model scores -> model_scores[, greedy_model_scores]
    [actor.inference]        the trainer's log-probs of the response before its update -> old_logp
                             (`algorithm.rollout_correction` other than none; `jaxrlhf.algorithms.correction`)
    [ref.inference]          reference log-probs of the response -> ref_logp
    [critic.inference]       values of every response token -> values
    actor.train              policy update -> actor_stats, advantages
    [critic.train]           value update -> critic_stats, value_moments (carried)
    [kl_control]             host: adaptive KL coefficient -> kl_coef (carried)

The runtime here binds the pieces, each in its own module: the generate call is the rollout's
(`jaxrlhf.rollouts`: the step graph's engine call, or samples a stream, environments or agents produced),
the inference calls and `RLSettings` are `rollout_calls`, the rewards, advantages and train calls
`rollout_train`, the host steps `rollout_host`. Conventions for a batch of sequences: `rollout_calls`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import numpy as np

from jaxrlhf.algorithms.base import AlgorithmConfigError
from jaxrlhf.algorithms.correction import Correction
from jaxrlhf.algorithms.evaluation import pass_at_k
from jaxrlhf.algorithms.kl import adaptive_kl_coef
from jaxrlhf.algorithms.rollout_calls import (  # noqa: F401  (the family's calls, as the runtime binds them)
    RLSettings,
    critic_values,
    policy_logprobs,
    reward_scores,
    sampling_params,
)
from jaxrlhf.algorithms.rollout_host import (  # noqa: F401
    GroupFilter,
    repeat_rows,
    select_groups,
    simulated_lengths,
    trim_responses,
)
from jaxrlhf.algorithms.rollout_train import (  # noqa: F401
    actor_train,
    critic_train,
    model_tokens,
    rollout_advantages,
    shaped_scores,
)
from jaxrlhf.algorithms.stats import RunningMoments
from jaxrlhf.algorithms.update import minibatch_indices
from jaxrlhf.models.packing import pack_batch
from jaxrlhf.models.tokenizer import decode_responses
from jaxrlhf.rewards.rules import CombinedReward
from jaxrlhf.rollouts.graph import bound_generate, generate_call  # noqa: F401

# RLSettings field -> the `algorithm` key of the sections that have it (PPO's GAE keys, the grpo family's std)
_OWN_KEYS = {"gamma": "gamma", "lam": "lam", "norm_adv_by_std": "norm_adv_by_std", "whiten": "whiten_advantages",
             "value_clip_eps": "value_clip_eps", "normalize_values": "normalize_values"}


class RolloutRuntime:
    """The runtime half of every `jaxrlhf.algorithms.rl.RolloutAlgorithm`: `build_algorithm` joins it to
    the declaration (whose class attributes - estimator, loss, where the KL goes - it reads)."""

    def settings(self) -> RLSettings:
        alg, gen, rw = self.cfg.algorithm, self.cfg.generation, self.cfg.rewards
        actor = self.model_configs.get("actor")
        if actor is not None and alg.router_aux_loss_coef and not actor.num_experts:
            raise AlgorithmConfigError(
                f"algorithm.router_aux_loss_coef={alg.router_aux_loss_coef} weighs a mixture of experts' "
                "load-balancing loss, but the actor has no experts (num_experts=0): set it to 0")
        if actor is not None and alg.router_replay and not actor.num_experts:
            raise AlgorithmConfigError(
                "algorithm.router_replay=true replays a mixture of experts' routing, but the actor has no experts "
                "(num_experts=0): set algorithm.router_replay=false")
        # the config holds every default (each algorithm's class in jaxrlhf.config_schema sets its own); a key
        # only some algorithms' classes have is one the others' estimators and losses ignore: RLSettings' value
        own = {setting: getattr(alg, key) for setting, key in _OWN_KEYS.items() if hasattr(alg, key)}
        return RLSettings(
            estimator=self.estimator, loss=self.loss, group_size=alg.group_size, **own,
            clip_eps=alg.clip_eps, clip_eps_high=alg.clip_eps_high, kl_estimator=alg.kl_estimator,
            kl_in_reward=self.kl_in_reward and self.uses_ref, kl_in_loss=not self.kl_in_reward and self.uses_ref,
            loss_agg=alg.loss_agg, max_new_tokens=gen.max_new_tokens,
            minibatches=alg.minibatches, epochs=alg.epochs,
            ratio_early_stop=alg.ratio_early_stop, entropy_coef=alg.entropy_coef, sampling=sampling_params(self.cfg),
            reward_bias=rw.bias, reward_scale=rw.scale, reward_clip=rw.clip, eos_only=rw.eos_only,
            overlong_buffer=alg.overlong_buffer, overlong_penalty=alg.overlong_penalty,
            ignore_eos=gen.ignore_eos, engine=gen.engine,
            # the continuous engine's page pool as the plan sized it (a set generation.kv_pages is already the plan's)
            kv_pages=gen.kv_pages if self.execution is None or self.execution.gen_pages is None
            else self.execution.gen_pages,
            # the continuous engine's pool as the plan chose it (a set generation.slots is already the plan's)
            slots=gen.slots if self.execution is None or self.execution.gen_slots is None else self.execution.gen_slots,
            correction=Correction.from_config(alg),
            router_aux_coef=alg.router_aux_loss_coef,
            router_top_k=actor.num_experts_per_tok if actor is not None else 0,
            router_replay=alg.router_replay, logit_chunk=alg.logit_chunk_tokens,
        )

    # ---- runtime --------------------------------------------------------------------------
    def functions(self) -> dict[str, Any]:
        s = self.settings()
        m = self.models
        micro = self.execution.micro_batch  # each call's rows per micro-batch, as the plan was priced
        fns: dict[str, Any] = {
            "actor.generate": self.rollout.generate_function(),  # whatever produces the samples (`jaxrlhf.rollouts`)
            "actor.train": functools.partial(actor_train, m["actor"].graphdef, m["actor"].optimizer,
                                             dataclasses.replace(s, micro_batch=micro("actor.train"))),
        }
        if self.greedy_baseline:  # ReMax's baseline: the same prompts decoded greedily, in the step graph
            fns["actor.generate_greedy"] = bound_generate(self, greedy=True, prefix="greedy_")
        if s.correction.active:  # pi_old: the actor's log-probs of the rollout before this step's update
            fns["actor.inference"] = functools.partial(policy_logprobs, m["actor"].graphdef, s.sampling,
                                                       micro("actor.inference"), output="old_logp",
                                                       replay=s.router_replay, logit_chunk=s.logit_chunk)
        if "ref" in m:
            fns["ref.inference"] = functools.partial(policy_logprobs, m["ref"].graphdef, s.sampling,
                                                     micro("ref.inference"), logit_chunk=s.logit_chunk)
        if "critic" in m:
            fns["critic.inference"] = functools.partial(critic_values, m["critic"].graphdef, micro("critic.inference"))
            fns["critic.train"] = functools.partial(critic_train, m["critic"].graphdef, m["critic"].optimizer,
                                                    dataclasses.replace(s, micro_batch=micro("critic.train")))
        if "reward" in m:
            prefixes = ("", "greedy_") if self.greedy_baseline else ("",)
            fns["reward.inference"] = functools.partial(reward_scores, m["reward"].graphdef, prefixes,
                                                        micro("reward.inference"))
        return fns

    def host_steps(self) -> dict[str, Any]:
        steps: dict[str, Any] = {}
        rules_spec = self.rules_spec
        if rules_spec:
            rules = CombinedReward(rules_spec)
            prefixes = ("", "greedy_") if self.greedy_baseline else ("pool_",) if self.dynamic_sampling else ("",)

            def score_rules(prompts, answers, **responses):
                out = {}
                for p in prefixes:
                    tokens, mask = jax.device_get((responses[f"{p}response_tokens"], responses[f"{p}response_mask"]))
                    texts = decode_responses(self.tokenizer, np.asarray(tokens), np.asarray(mask))
                    pool = self.reward_pool  # worker processes, or here (a rule may score rows concurrently)
                    if pool:
                        parts = pool.score(prompts, texts, answers)
                    else:
                        start = time.perf_counter()
                        parts = rules.batch_components(prompts, texts, answers)
                        self.reward_timing.record(time.perf_counter() - start, len(prompts))
                    out[f"{p}rule_scores"] = np.asarray([rules.combine(c) for c in parts], np.float32)
                    out[f"{p}rule_components"] = {n: np.asarray([c[n] for c in parts], np.float32)
                                                  for n in rules.names}
                return out

            steps["score_rules"] = score_rules
        if self.dynamic_sampling:
            def select(pool_rule_scores, pool_rule_components, **generated):
                values = {k.removeprefix("pool_"): v for k, v in generated.items()}
                values.update(rule_scores=pool_rule_scores, rule_components=pool_rule_components)
                out, stats = self.group_filter.select(values, pool_rule_scores)
                out = {(self.uncut_prefix + k if k in self.generated else k): v for k, v in out.items()}
                return {**out, "sampling_stats": {k: np.float32(v) for k, v in stats.items()}}

            steps["select_groups"] = select
        if self.trims:
            def trim(**full):
                batch = {k.removeprefix(self.uncut_prefix): v for k, v in full.items()}
                return trim_responses(batch, self.cfg.generation.max_new_tokens)

            steps["trim_responses"] = trim
        alg = self.cfg.algorithm
        if self.packings:
            steps["pack_sequences"] = self._pack_sequences
        if self.uses_ref:
            def kl_control(kl_coef, actor_stats):
                if alg.kl_target is None:
                    return {"kl_coef": kl_coef}
                kl = float(jax.device_get(actor_stats["kl/mean"]))
                return {"kl_coef": adaptive_kl_coef(float(kl_coef), kl, self.batch_rows, alg.kl_target,
                                                    alg.kl_horizon)}

            steps["kl_control"] = kl_control
        return steps

    @functools.cached_property
    def group_filter(self) -> GroupFilter:
        """Dynamic sampling's filter (`rollout_host.GroupFilter`), the one the stream uses too."""
        rw = self.cfg.rewards
        return GroupFilter(self.group_size, self.cfg.data.batch_size, bias=rw.bias, scale=rw.scale, clip=rw.clip,
                           eos_only=rw.eos_only)

    @property
    def rules_spec(self) -> list[tuple[str, float, dict[str, Any]]]:
        """`rewards.rules` as `CombinedReward` entries."""
        return [(r.name, r.weight, dict(r.args)) for r in self.cfg.rewards.rules]

    @functools.cached_property
    def reward_pool(self) -> Any:
        """The worker processes scoring rule rewards (`rewards.workers`, `rewards.pool`), or None."""
        if not self.cfg.rewards.workers or not self.cfg.rewards.rules:
            return None
        from jaxrlhf.rewards.pool import RewardPool

        return RewardPool(self.rules_spec, self.cfg.rewards.workers, self.reward_timing)

    @functools.cached_property
    def reward_timing(self) -> Any:
        """The rules' seconds per row as this run measures them (`rewards.pool.RewardTiming`), for the
        planner (`reward_fields`)."""
        from jaxrlhf.rewards.pool import RewardTiming, rows_at_once

        return RewardTiming(rows_at_once(self.rules_spec))

    def reward_fields(self) -> dict[str, Any]:
        """The workload's rule-reward fields (`planner.rewards`): the measured seconds per row (0 until
        a batch was scored), rows scored at once, `rewards.workers`."""
        if not self.cfg.rewards.rules:
            return {}
        timing = self.reward_timing
        return {"reward_row_s": timing.row_s, "reward_at_once": timing.at_once,
                "reward_workers": self.cfg.rewards.workers}

    def rollout_fields(self) -> dict[str, Any]:
        """The workload's fields of the rollout kind producing the samples (`Rollout.workload_fields`): a
        multi-turn episode batch's measured work, say, for the planner to price the generate call with."""
        return self.rollout.workload_fields()

    def _pack_sequences(self, tokens, mask, positions, response_mask, shards, rng_actor, rng_critic=None,
                        router_experts=None):
        """The host step `pack_sequences`: the batch packed for each call that reads it (`models.packing`):
        the inference calls' packing over the whole batch, each train call's over the minibatches its key
        draws (`update.minibatch_indices`, as the unpacked call draws them in its program); with router
        replay the recorded experts packed beside the tokens of the packings an actor call reads."""
        alg = self.cfg.algorithm
        mask = np.asarray(mask)
        rows, width = mask.shape[0], np.asarray(response_mask).shape[1]
        keys = {"packed_actor": rng_actor, "packed_critic": rng_critic}
        out: dict[str, Any] = {}
        stats: dict[str, np.float32] = {}
        for name, readers in self.packings.items():
            if name in keys:
                updates = np.asarray(minibatch_indices(keys[name], rows, alg.minibatches, alg.epochs))
            else:
                updates = np.arange(rows)[None]
            replayed = router_experts is not None and any(c.startswith("actor.") for c in readers)
            out[name], packed = pack_batch(mask, tokens, positions, width, updates,
                                           shards=math.lcm(*(shards[c] for c in readers)),
                                           budget=self.execution.token_budget,
                                           experts=np.asarray(router_experts) if replayed else None,
                                           blockwise=self.one_row(readers))
            short = name.removeprefix("packed_")
            stats.update({k: np.float32(v) for k, v in packed.metrics(f"packing/{short}").items()})
            stats[f"packing/{short}/micro_batches"] = np.float32(out[name]["slots"].shape[2])
        out["packing_stats"] = stats
        return out

    def initial_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"kl_coef": np.float32(self.cfg.algorithm.kl_coef)}
        if self.uses_critic:
            state["value_moments"] = jax.tree_util.tree_map(np.asarray, RunningMoments.create())
        return state

    def dataset(self, tokenizer: Any, split: str | None = None) -> Any:
        from jaxrlhf.data import PromptDataset

        return PromptDataset.from_config(self.cfg, tokenizer, split=split,
                                         batch_size=self.cfg.data.batch_size * self.pool_factor)

    def feed(self, batch: Any, rng: jax.Array) -> dict[str, Any]:
        batch = repeat_rows(batch, self.group_size)
        gen, actor, critic = jax.random.split(rng, 3)
        feed = {
            "prompt_tokens": batch.input_ids, "prompt_mask": batch.attention_mask, "prompts": batch.prompts,
            "answers": batch.answers, "rng_generate": gen, "rng_actor": actor,
        }
        if self.uses_critic:
            feed["rng_critic"] = critic
        if self.cfg.generation.simulated_lengths:
            feed["max_lengths"] = simulated_lengths(self.cfg, gen, len(batch.prompts))
        return feed

    def metric_values(self) -> tuple[str, ...]:
        return ("actor_stats", "critic_stats", "response_mask", "ended_with_eos", "mask", "rule_scores",
                "rule_components", "model_scores", "greedy_rule_scores", "sampling_stats", "packing_stats")

    def metrics(self, result: Any) -> dict[str, float]:
        v = result.values
        stats = dict(v["actor_stats"])
        if "critic_stats" in v:
            stats.update(v["critic_stats"])
        stats, rmask, ended, mask = jax.device_get((stats, v["response_mask"], v["ended_with_eos"], v["mask"]))
        out = {k: float(x) for k, x in stats.items()}
        out.update({
            "response/length_mean": float(np.sum(rmask, axis=1).mean()),
            "response/eos_frac": float(np.mean(ended)),
            "throughput/tokens_per_s": float(np.sum(mask)) / max(result.seconds, 1e-9),
        })
        if "rule_scores" in v:
            out["reward/rule_mean"] = float(np.mean(v["rule_scores"]))
            out.update({f"reward/rule/{n}": float(np.mean(x)) for n, x in v["rule_components"].items()})
        if "model_scores" in v:
            out["reward/model_mean"] = float(np.mean(jax.device_get(v["model_scores"])))
        if "greedy_rule_scores" in v:
            out["reward/greedy_rule_mean"] = float(np.mean(v["greedy_rule_scores"]))
        for stats_of in ("sampling_stats", "packing_stats"):
            if stats_of in v:
                out.update({k: float(x) for k, x in v[stats_of].items()})
        return out

    def evaluate(self, executor: Any) -> dict[str, float]:
        """Held-out metrics on `data.eval_split` (docs/evaluation.md): the mean of every rule reward
        (unweighted) and the accuracy of greedy responses; with `eval.samples`, pass@k over that many
        sampled responses per prompt (the rollout's sampling settings), Chen et al.'s estimator."""
        if not self.cfg.rewards.rules or not self.cfg.data.eval_split:
            return {}
        ev = self.cfg.eval
        rules = CombinedReward([(r.name, r.weight, dict(r.args)) for r in self.cfg.rewards.rules])
        judge = ev.correct_rule or self.cfg.rewards.rules[0].name

        def scored(batch: Any, out: dict[str, Any]) -> list[dict[str, float]]:
            tokens, mask = jax.device_get((out["response_tokens"], out["response_mask"]))
            texts = decode_responses(self.tokenizer, np.asarray(tokens), np.asarray(mask))
            return rules.batch_components(batch.prompts, texts, batch.answers)

        totals: dict[str, float] = {}
        count = 0.0
        for batch, weight in self._eval_batches(self.batch_rows):
            out = executor.run_at("actor.generate", self._greedy_generate, {
                "prompt_tokens": batch.input_ids, "prompt_mask": batch.attention_mask,
                "rng_generate": jax.random.key(0)})
            for parts, w in zip(scored(batch, out), weight):
                for name, value in parts.items():
                    totals[name] = totals.get(name, 0.0) + w * value
                totals["accuracy"] = totals.get("accuracy", 0.0) + w * (parts[judge] >= ev.correct_threshold)
            count += float(np.sum(weight))
        metrics = {f"eval/greedy/{name}": float(total) / max(count, 1.0) for name, total in totals.items()}
        metrics["eval/prompts"] = count
        if not ev.samples:
            return metrics
        n, passed, prompts = ev.samples, dict.fromkeys(ev.pass_k, 0.0), 0.0
        key = jax.random.key(self.cfg.run.seed)
        for i, (batch, weight) in enumerate(self._eval_batches(self.batch_rows // n)):
            group = repeat_rows(batch, n)
            out = executor.run_at("actor.generate", self._sampled_generate, {
                "prompt_tokens": group.input_ids, "prompt_mask": group.attention_mask,
                "rng_generate": jax.random.fold_in(key, i)})
            correct = np.asarray([p[judge] >= ev.correct_threshold for p in scored(group, out)]).reshape(-1, n)
            for c, w in zip(correct.sum(axis=1), weight):
                for k in passed:
                    passed[k] += w * pass_at_k(n, int(c), k)
            prompts += float(np.sum(weight))
        metrics.update({f"eval/pass_at_{k}": float(v) / max(prompts, 1.0) for k, v in passed.items()})
        metrics["eval/samples_per_prompt"] = float(n)
        return metrics

    def _eval_batches(self, size: int) -> Any:
        """Held-out batches of `size` prompts with real-row weights, up to `eval.max_prompts` prompts."""
        data = self.dataset(self.tokenizer, split=self.cfg.data.eval_split)
        left = self.cfg.eval.max_prompts
        for batch, weight in data.single_pass(size):
            if left is not None:
                weight = np.where(np.cumsum(weight) <= left, weight, 0.0).astype(np.float32)
                left -= int(np.sum(weight))
            yield batch, weight
            if left is not None and left <= 0:
                return

    @functools.cached_property
    def _greedy_generate(self) -> Any:
        """Greedy decoding for evaluation, bound once (the call cache keys compiled functions by identity);
        it stops at EOS whatever `generation.ignore_eos` says."""
        return bound_generate(self, greedy=True, group_size=1, stop_at_eos=True)

    @functools.cached_property
    def _sampled_generate(self) -> Any:
        """Sampling with the rollout's settings for pass@k, bound once."""
        return bound_generate(self, group_size=self.cfg.eval.samples, stop_at_eos=True)
