"""The step engine: runs the PPO dataflow graph on the placements of an execution plan.

For every call it asks the plan where the call runs, brings the role's
parameters there (no move when the call runs where they live; a persistent
shadow copy for roles the plan shadows; otherwise a reallocation whose copy
is dropped after the call), moves the call's inputs to that placement, and
dispatches the function jitted for it. Dispatch is asynchronous: calls on
disjoint device groups issued one after another run at the same time; the
engine synchronises with the host only to score decoded text with rule
rewards and to read metrics at the end of the step.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrlhf.mesh.calls import CallCache, Placed
from jaxrlhf.mesh.plan import ExecutionPlan
from jaxrlhf.mesh.realloc import reallocate
from jaxrlhf.models import axes as ax
from jaxrlhf.models.generation import Generator
from jaxrlhf.models.tokenizer import Tokenizer
from jaxrlhf.ppo import calls
from jaxrlhf.ppo.calls import Experience, PPOHParams
from jaxrlhf.ppo.kl import KLController
from jaxrlhf.ppo.rewards import CombinedReward, shape_scores
from jaxrlhf.ppo.stats import RunningMoments


@dataclasses.dataclass
class Role:
    """One model of the pipeline: structure, parameters at home, and (if trained) its optimizer."""

    name: str
    graphdef: nnx.GraphDef
    params: nnx.State
    optimizer: optax.GradientTransformation | None = None
    opt_state: Any = None
    shadow: nnx.State | None = None  # persistent copy at the generation placement (disaggregated)

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    """How sequence scores are made: rule rewards and/or the reward model, then shaped."""

    rules: CombinedReward | None
    use_model: bool
    scale: float = 1.0
    bias: float = 0.0
    clip: float | None = 20.0
    eos_only: bool = True


@dataclasses.dataclass
class Collected:
    """One batch of rollouts with everything the train calls need (arrays still on device)."""

    exp: Experience
    rule_scores: np.ndarray
    scores_model: jax.Array | None
    texts: list[str]
    timer: "CallTimer"


class CallTimer:
    """Wall time from dispatch to completion of each call, measured without blocking dispatch.

    A daemon thread waits on each call's outputs, so timing never serialises
    calls that the plan lets run concurrently.
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._threads: list[threading.Thread] = []

    def track(self, name: str, t0: float, outputs: Any) -> None:
        def wait():
            jax.block_until_ready(outputs)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

        th = threading.Thread(target=wait, daemon=True)
        th.start()
        self._threads.append(th)

    def join(self) -> dict[str, float]:
        for th in self._threads:
            th.join()
        self._threads.clear()
        return dict(self.seconds)


def _leaves_delete(tree: Any) -> None:
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


class PPOEngine:
    """Owns the roles and runs one PPO step at a time under a plan."""

    def __init__(
        self,
        plan: ExecutionPlan,
        roles: dict[str, Role],
        *,
        tokenizer: Tokenizer,
        hparams: PPOHParams,
        rewards: RewardSettings,
        kl: KLController,
        max_new_tokens: int,
        cache: CallCache,
    ):
        self.plan = plan
        self.roles = roles
        self.tokenizer = tokenizer
        self.hp = hparams
        self.rewards = rewards
        self.kl = kl
        self.max_new_tokens = max_new_tokens
        self.cache = cache
        # Committed (replicated on the actor's train placement) so a checkpoint restores it as such.
        self.moments = jax.device_put(RunningMoments.create(), self.placed("actor.train").replicated())
        actor = roles["actor"]
        # The tag keeps generation compiled per placement: activation constraints are read at trace time.
        gen = self.placed("actor.generate")
        self.generator = Generator(
            actor.graphdef, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, tag=(gen.group, gen.placement)
        )
        self.realloc_seconds = self.transfer_seconds = 0.0
        self.realloc_bytes = self.transfer_bytes = 0
        self._pending: Collected | None = None  # next step's rollout, off-policy plans only
        # Bound once: the call cache keys compiled functions by identity.
        g = {name: role.graphdef for name, role in roles.items()}
        self._fns: dict[str, Callable] = {
            "ref.inference": functools.partial(calls.policy_logprobs, g["ref"], hparams.sampling),
            "actor.train": functools.partial(calls.actor_train, g["actor"], actor.optimizer, hparams),
        }
        if "critic" in roles:
            self._fns["critic.inference"] = functools.partial(calls.critic_values, g["critic"])
            self._fns["critic.train"] = functools.partial(
                calls.critic_train, g["critic"], roles["critic"].optimizer, hparams
            )
        if "reward" in roles:
            self._fns["reward.inference"] = functools.partial(calls.reward_scores, g["reward"])

    # ---------------------------------------------------------------- placement helpers
    def placed(self, call: str) -> Placed:
        return self.cache.placed(call)

    def _home_placed(self, role: str) -> Placed:
        return self.placed(self.plan.home_call(role))

    def move(self, tree: Any, shardings: Any, *, free_source: bool = False, params: bool = True) -> Any:
        """Reshard `tree` device to device (no host round trip); no-op where already in place.

        Parameter moves count as reallocation, batch moves as transfers (separate metrics).
        """
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        targets = jax.tree_util.tree_leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
        todo = [i for i, (x, s) in enumerate(zip(leaves, targets)) if not x.sharding.is_equivalent_to(s, x.ndim)]
        if not todo:
            return tree
        moved, stats = reallocate([leaves[i] for i in todo], [targets[i] for i in todo], free_source=free_source)
        for i, x in zip(todo, moved):
            leaves[i] = x
        if params:
            self.realloc_seconds += stats.seconds
            self.realloc_bytes += stats.bytes
        else:
            self.transfer_seconds += stats.seconds
            self.transfer_bytes += stats.bytes
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def move_batch(self, tree: Any, call: str) -> Any:
        """Batch-major arrays (inputs and outputs of calls) onto `call`'s placement."""
        placed = self.placed(call)
        shardings = jax.tree_util.tree_map(lambda x: placed.batch_sharding(x.ndim), tree)
        return self.move(tree, shardings, params=False)

    def put_batch(self, array: np.ndarray, call: str) -> jax.Array:
        """Host data (prompts, rule scores) straight onto `call`'s placement."""
        return jax.device_put(array, self.placed(call).batch_sharding(np.ndim(array)))

    def replicated_on(self, tree: Any, call: str) -> Any:
        """Small replicated state (value moments) onto `call`'s placement."""
        placed = self.placed(call)
        return self.move(tree, jax.tree_util.tree_map(lambda _: placed.replicated(), tree), params=False)

    def params_for(self, role_name: str, call: str) -> tuple[nnx.State, bool]:
        """The role's parameters on `call`'s placement, and whether that copy is temporary."""
        role = self.roles[role_name]
        placed = self.placed(call)
        if placed.placement == self._home_placed(role_name).placement:
            return role.params, False
        shardings = placed.param_shardings(role.params)
        if role_name in self.plan.shadow_roles:
            if role.shadow is None:
                role.shadow = self.move(role.params, shardings)
            return role.shadow, False
        return self.move(role.params, shardings), True

    def sync_shadow(self, role_name: str) -> None:
        """Push freshly trained weights to the role's shadow copy (disaggregated plans)."""
        role = self.roles[role_name]
        if role.shadow is None:
            return
        old = role.shadow
        role.shadow = self.move(role.params, jax.tree_util.tree_map(lambda x: x.sharding, old))
        _leaves_delete(old)

    def function(self, call: str) -> Callable:
        """The call's function jitted for its placement; shardings follow the (committed) arguments."""
        return self.cache.function(call, self._fns[call], in_shardings=None, out_shardings=None)

    # ---------------------------------------------------------------- the step
    def rollout(self, prompts, rng: jax.Array, timer: CallTimer) -> tuple[Any, np.ndarray, dict[str, Any]]:
        """actor.generate, then rule scores on host. Returns (generation output, rule scores, info)."""
        call = "actor.generate"
        placed = self.placed(call)
        params, temporary = self.params_for("actor", call)
        tokens = self.put_batch(prompts.input_ids, call)
        mask = self.put_batch(prompts.attention_mask, call)
        t0 = time.perf_counter()
        with ax.activation_sharding(placed.resolver()):
            out = self.generator(
                params, tokens, mask, max_new_tokens=self.max_new_tokens, sampling=self.hp.sampling, rng=rng
            )
        timer.track(call, t0, out)
        response = np.asarray(jax.device_get(out.response_tokens))
        response_mask = np.asarray(jax.device_get(out.response_mask))
        if temporary:
            jax.block_until_ready(out)
            _leaves_delete(params)
        texts = [
            self.tokenizer.decode([int(t) for t, m in zip(row, mrow) if m and t != self.tokenizer.eos_id])
            for row, mrow in zip(response, response_mask)
        ]
        rule_scores = np.zeros(len(texts), np.float32)
        if self.rewards.rules is not None:
            rule_scores = self.rewards.rules.batch(prompts.prompts, texts, prompts.answers)
        return out, rule_scores, {"texts": texts}

    def _run_inference(self, role: str, call: str, args: tuple, timer: CallTimer) -> Any:
        params, temporary = self.params_for(role, call)
        args = self.move_batch(args, call)
        t0 = time.perf_counter()
        out = self.function(call)(params, *args)
        timer.track(call, t0, out)
        if temporary:
            jax.block_until_ready(out)
            _leaves_delete(params)
        return out

    def collect(self, prompts, rng: jax.Array) -> "Collected":
        """actor.generate, rule scores, and the inference calls: everything actor.train needs.

        The inference calls are only dispatched; their results stay on device.
        """
        timer = CallTimer()
        gen_rng = jax.random.split(rng, 3)[0]
        out, rule_scores, info = self.rollout(prompts, gen_rng, timer)
        seq = (out.tokens, out.mask, out.positions)
        resp = (out.response_tokens, out.response_mask)

        # Independent inference calls: dispatched back to back, they overlap on disjoint groups.
        scores_model = None
        if self.rewards.use_model:
            scores_model = self._run_inference("reward", "reward.inference", seq, timer)
        ref_logp = self._run_inference("ref", "ref.inference", seq + resp, timer)
        if "critic.inference" in self.plan.calls:
            values, bootstrap = self._run_inference("critic", "critic.inference", seq + (out.response_mask,), timer)
        else:
            values = jnp.zeros(out.response_mask.shape, jnp.float32)
            bootstrap = jnp.zeros(out.response_mask.shape[:1], jnp.float32)

        # Scores: rule scores (host) plus reward-model scores (device), then shaping.
        scores = self.put_batch(rule_scores, "actor.train")
        if scores_model is not None:
            scores = scores + self.move_batch(scores_model, "actor.train")
        shaped = shape_scores(
            scores, self.move_batch(out.ended_with_eos, "actor.train"), bias=self.rewards.bias,
            scale=self.rewards.scale, clip=self.rewards.clip, eos_only=self.rewards.eos_only,
        )
        exp = Experience(
            tokens=out.tokens, mask=out.mask, positions=out.positions,
            response_tokens=out.response_tokens, response_mask=out.response_mask,
            behaviour_logp=out.logprobs, ref_logp=ref_logp, values=values, bootstrap_values=bootstrap,
            scores=shaped, ended_with_eos=out.ended_with_eos,
        )
        return Collected(exp, rule_scores, scores_model, info["texts"], timer)

    def step(self, prompts, rng: jax.Array, next_prompts=None, next_rng: jax.Array | None = None) -> dict[str, float]:
        """One PPO step; returns host-side metrics.

        With a one-step off-policy plan (`plan.offpolicy`), pass the next
        step's prompts and rng: its rollout is generated on the shadow actor
        (still holding the previous weights) while this step trains, and used
        by the next call of `step`, which then ignores its own `prompts`.
        """
        t_start = time.perf_counter()
        self.realloc_seconds = self.transfer_seconds = 0.0
        self.realloc_bytes = self.transfer_bytes = 0
        collected = self._pending if self._pending is not None else self.collect(prompts, rng)
        self._pending = None
        exp = collected.exp
        timer = CallTimer()
        _, actor_rng, critic_rng = jax.random.split(rng, 3)
        kl_coef = jnp.asarray(self.kl.value, jnp.float32)

        # Train calls: both dispatched before either is waited on.
        metrics: dict[str, Any] = {}
        actor = self.roles["actor"]
        actor_exp = self.move_batch(exp, "actor.train")
        t0 = time.perf_counter()
        actor.params, actor.opt_state, actor_stats = self.function("actor.train")(
            actor.params, actor.opt_state, actor_exp, kl_coef, self.replicated_on(self.moments, "actor.train"),
            actor_rng,
        )
        timer.track("actor.train", t0, actor.params)
        if "critic.train" in self.plan.calls:
            critic = self.roles["critic"]
            critic_exp = self.move_batch(exp, "critic.train")
            t0 = time.perf_counter()
            critic.params, critic.opt_state, self.moments, critic_stats = self.function("critic.train")(
                critic.params, critic.opt_state, critic_exp, kl_coef,
                self.replicated_on(self.moments, "critic.train"), critic_rng,
            )
            timer.track("critic.train", t0, critic.params)
            metrics.update(critic_stats)
        if self.plan.offpolicy and next_prompts is not None:
            # Overlaps the train calls above: the shadow is synced only after this dispatch.
            self._pending = self.collect(next_prompts, next_rng)
        if "actor" in self.plan.shadow_roles:
            self.sync_shadow("actor")
        metrics.update(actor_stats)

        # Host-side metrics (the step's only other sync).
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.kl = self.kl.update(metrics["kl/mean"], n_steps=int(exp.tokens.shape[0]))
        call_seconds = collected.timer.join()
        for c, sec in timer.join().items():
            call_seconds[c] = call_seconds.get(c, 0.0) + sec
        rmask, shaped, ended, mask = jax.device_get((exp.response_mask, exp.scores, exp.ended_with_eos, exp.mask))
        step_s = time.perf_counter() - t_start
        metrics.update(
            {
                "reward/mean": float(np.mean(shaped)),
                "reward/rule_mean": float(collected.rule_scores.mean()),
                "response/length_mean": float(np.sum(rmask, axis=1).mean()),
                "response/eos_frac": float(np.mean(ended)),
                "kl/coef": float(kl_coef),
                "time/step_s": step_s,
                "time/realloc_s": self.realloc_seconds,
                "realloc/bytes": float(self.realloc_bytes),
                "time/transfer_s": self.transfer_seconds,
                "transfer/bytes": float(self.transfer_bytes),
                "throughput/tokens_per_s": int(np.sum(mask)) / max(step_s, 1e-9),
                **{f"time/{c}_s": sec for c, sec in call_seconds.items()},
            }
        )
        if collected.scores_model is not None:
            metrics["reward/model_mean"] = float(np.mean(jax.device_get(collected.scores_model)))
        self.last_texts = collected.texts
        return metrics

    # ---------------------------------------------------------------- checkpoint state
    def array_state(self) -> dict[str, Any]:
        """Arrays to checkpoint: trained roles' params and optimizer states, value moments."""
        state: dict[str, Any] = {"moments": {"mean_acc": self.moments.mean_acc, "sq_acc": self.moments.sq_acc,
                                             "debias": self.moments.debias}}
        for name, role in self.roles.items():
            if role.trainable:
                state[name] = {"params": role.params, "opt_state": role.opt_state}
        return state

    def load_array_state(self, state: dict[str, Any]) -> None:
        m = state["moments"]
        self.moments = self.moments.replace(mean_acc=m["mean_acc"], sq_acc=m["sq_acc"], debias=m["debias"])
        for name, role in self.roles.items():
            if role.trainable:
                role.params = state[name]["params"]
                role.opt_state = state[name]["opt_state"]
                if role.shadow is not None:
                    self.sync_shadow(name)
