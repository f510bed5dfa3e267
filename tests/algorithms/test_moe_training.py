"""A mixture-of-experts actor in the RL update: `algorithm.router_aux_loss_coef` adds the load-balancing
loss (logged with the router's load), only it moves the update, and a dense actor refuses the key; a GRPO run
of a tiny MoE actor (router replay and the balancing loss on) learns, and gives the same metrics on other
plans: a reallocated one and an expert-parallel one (plan equivalence on the expert axis)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.algorithms import AlgorithmConfigError, build_algorithm, rollout
from jaxrlhf.metrics import read_metrics
from jaxrlhf.models.config import preset
from jaxrlhf.models.moe import forward_with_router_logits, load_balancing_loss
from jaxrlhf.models.transformer import build_model, positions_from_mask
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement


@pytest.mark.slow
def test_the_balancing_loss_joins_the_update_and_is_logged():
    cfg = preset("tiny-qwen3-moe")
    graphdef, params = nnx.split(build_model(cfg, seed=0))
    rng = np.random.RandomState(0)
    b, p, n = 4, 4, 6
    mask = np.ones((b, p + n), bool)
    mask[:, p:] = np.arange(n)[None, :] < np.array([6, 2, 4, 1])[:, None]
    tokens = np.where(mask, rng.randint(3, cfg.vocab_size, size=mask.shape), 0).astype(np.int32)
    inputs = {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask),
              "positions": positions_from_mask(jnp.asarray(mask)), "response_tokens": jnp.asarray(tokens[:, p:]),
              "response_mask": jnp.asarray(mask[:, p:]), "behaviour_logp": jnp.full((b, n), -2.0),
              "rule_scores": jnp.asarray([1.0, 0.0, 0.5, 0.2]), "ended_with_eos": jnp.ones(b, bool),
              "kl_coef": jnp.float32(0.0), "rng_actor": jax.random.key(0)}
    opt = optax.sgd(1.0)
    runs = {}
    for coef in (0.0, 0.5):
        s = rollout.RLSettings(estimator="grpo", loss="grpo", group_size=2, minibatches=1, max_new_tokens=n,
                               kl_in_reward=False, router_aux_coef=coef, router_top_k=cfg.num_experts_per_tok)
        runs[coef] = jax.jit(functools.partial(rollout.actor_train, graphdef, opt, s))(params, opt.init(params), inputs)
    _, router = forward_with_router_logits(nnx.merge(graphdef, params), inputs["tokens"], inputs["positions"],
                                           inputs["mask"])
    want = load_balancing_loss(router, cfg.num_experts_per_tok, inputs["mask"])
    for coef, (_, _, out) in runs.items():
        stats = out["actor_stats"]
        np.testing.assert_allclose(stats["router/aux_loss"], want, rtol=1e-5)
        assert stats["router/load_max"] >= 1.0 >= stats["router/load_min"] >= 0.0
    moved = runs[0.5][0]["model"]["layers"]["mlp"]["router"].value - runs[0.0][0]["model"]["layers"]["mlp"]["router"].value
    assert float(jnp.abs(moved).max()) > 0  # the balancing loss reaches the router
    # the policy loss itself is the same with and without it
    np.testing.assert_allclose(runs[0.5][2]["actor_stats"]["loss/policy"], runs[0.0][2]["actor_stats"]["loss/policy"],
                               rtol=1e-6)


def test_a_dense_actor_refuses_the_balancing_loss():
    cfg = cfglib.load_config(None, ["model.actor.preset=tiny", "algorithm.name=grpo", "algorithm.group_size=2",
                                    "algorithm.router_aux_loss_coef=0.01", "sft.steps=0"])
    algorithm = build_algorithm(cfg)
    algorithm.model_configs = {"actor": preset("tiny")}
    with pytest.raises(AlgorithmConfigError, match="algorithm.router_aux_loss_coef=0.01 .* has no experts"):
        algorithm.settings()


# GRPO on the bundled arithmetic prompts, a random tiny Qwen3-MoE actor (8 experts, 2 per token), no warm-up,
# router replay and the balancing loss on; the reward is a digit anywhere in the 4-token response, which a
# random byte-level policy emits about 6 % of the time and has to find and reinforce.
MOE_RUN = [
    "model.actor.preset=tiny-qwen3-moe", "sft.steps=0", "algorithm.name=grpo", "algorithm.group_size=4",
    "data.source=arithmetic", "data.batch_size=8", "data.max_prompt_len=16", "generation.max_new_tokens=4",
    "algorithm.minibatches=2", "algorithm.kl_coef=0.0", "optimizer.actor.lr=3e-3", "optimizer.actor.warmup_steps=0",
    "rewards.eos_only=false", 'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[0-9]"}}]',
    "algorithm.router_replay=true", "algorithm.router_aux_loss_coef=0.01", "run.checkpoint_every=0",
    "run.tensorboard=false", "run.export_hf=false", "run.save_checkpoints=false",
]
MOE_STEPS = 20
MOE_COMPARED = ("reward/mean", "loss/policy", "entropy", "ratio/mean", "ratio/max", "clipfrac", "router/aux_loss",
                "router/load_max", "router/load_min")


def _moe_run(path, *overrides: str) -> list[dict]:
    train.run(cfglib.load_config(None, [*MOE_RUN, f"run.output_dir={path}", *overrides]))
    return read_metrics(str(path / "metrics.jsonl"))


@pytest.fixture(scope="module")
def moe_colocated(tmp_path_factory):
    return _moe_run(tmp_path_factory.mktemp("moe") / "colocated", "plan.strategy=colocated", f"run.steps={MOE_STEPS}")


@pytest.mark.slow
def test_a_moe_actor_learns_with_router_replay(moe_colocated):
    records = moe_colocated
    assert [r["step"] for r in records] == list(range(1, MOE_STEPS + 1))
    rewards = np.array([r["reward/rule_mean"] for r in records])
    first, last = rewards[:5].mean(), rewards[-5:].mean()
    assert first < 0.35, rewards
    assert last > first + 0.3, rewards
    # replayed routing: each step's first update is on the rollout's policy (the second, after an update, is not)
    assert all(abs(r["ratio/mean"] - 1) < 0.05 for r in records)


def _expert_parallel_plan(path) -> str:
    """Every call on 8 devices, the experts split 4 ways (2 of the 8 on each device): generation beside data
    2, training beside FSDP 2, so the actor's parameters are reallocated between the two expert layouts
    before and after every call."""
    calls = {"actor.generate": Placement("all", Layout(data=2, expert=4)),
             "actor.train": Placement("all", Layout(fsdp=2, expert=4))}
    ExecutionPlan("expert-parallel", 8, {"all": DeviceGroup("all", 0, 8)}, calls).save(str(path))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["reallocated", "expert-parallel"])
def test_a_moe_run_matches_across_plans(plan, moe_colocated, tmp_path):
    """The first two steps (the second after an update) of the same run on another placement: the actor
    reallocated between its train and generate layouts, or its experts split over the devices."""
    where = (f"plan.file={_expert_parallel_plan(tmp_path / 'plan.yaml')}" if plan == "expert-parallel"
             else f"plan.strategy={plan}")
    records = _moe_run(tmp_path / plan, where, "run.steps=2")
    for ref, got in zip(moe_colocated[:2], records, strict=True):
        for key in MOE_COMPARED:
            assert got[key] == pytest.approx(ref[key], rel=1e-3, abs=2e-5), (plan, ref["step"], key)
    assert all(r["realloc/bytes"] > 0 for r in records)  # both plans move the actor between layouts


@pytest.mark.slow
def test_the_shipped_moe_config_runs_with_an_expert_axis_and_router_replay(tmp_path, monkeypatch):
    """configs/moe-grpo.yaml as shipped, for 2 steps (and 2 warm-up steps): its plan splits the experts over
    an expert axis of 2, and the router's statistics are logged beside a replayed ratio of 1."""
    import os

    from jaxrlhf.planner.plan import ExecutionPlan

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.chdir(root)  # its plan.file is relative to the repository root
    out = tmp_path / "moe-grpo"
    cfg = cfglib.load_config(os.path.join("configs", "moe-grpo.yaml"), [
        f"run.output_dir={out}", "run.steps=2", "sft.steps=2", "run.checkpoint_every=0", "run.save_checkpoints=false",
        "run.tensorboard=false", "run.export_hf=false"])
    assert cfg.algorithm.router_replay and cfg.model.actor.preset == "tiny-qwen3-moe"
    train.run(cfg)
    plan = ExecutionPlan.load(str(out / "plan.yaml"))
    assert {name: p.layout.expert for name, p in plan.calls.items()} == {"actor.generate": 2, "actor.train": 2}
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["router/aux_loss"] > 0 and r["router/load_max"] >= 1.0 >= r["router/load_min"] >= 0.0
        assert abs(r["ratio/mean"] - 1) < 0.05  # replayed routing: the update starts on the rollout's policy
