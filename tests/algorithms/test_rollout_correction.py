"""Off-policy rollout correction (`algorithm.rollout_correction`): each kind's weights, masks and loss
against hand computations on small batches (ratios exactly at the band edges fix inclusive
semantics), the graph and config it brings, and tiny GRPO runs in which the recompute reproduces
the behaviour log-probs (a synchronous float32 run is on-policy: KL ~ 0, weights ~ 1)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import declare
from jaxrlhf.algorithms.correction import Correction, correction_weights
from jaxrlhf.algorithms.losses import get_loss
from jaxrlhf.algorithms.rollout import RLSettings, actor_train

KINDS = ("tis", "seq_mask", "icepop", "decoupled")


def _log(x):
    """float32 log-ratios rounded from float64, as the correction rounds its thresholds (log alpha, ...)."""
    return np.float32(np.log(np.asarray(x, np.float64)))


# ---------------------------------------------------------------- token level
# Three responses of 3, 2 and 1 tokens; behaviour log-probs 0, so old_logp = log rho. The padded
# slots hold junk that must not count. rho = 2.0 and 0.5 sit exactly on the edges (C = 2, and the IcePop
# band [0.5, 2.0] these tests give; its default is the paper's [0.5, 5]).
RHO = [[2.0, 3.0, 0.5], [1.0, 4.0, 9.0], [0.25, 9.0, 9.0]]
MASK = jnp.array([[1, 1, 1], [1, 1, 0], [1, 0, 0]], bool)
OLD = jnp.asarray(_log(RHO))
BEHAV = jnp.zeros((3, 3))
VALID = [2.0, 3.0, 0.5, 1.0, 4.0, 0.25]


def _weights(kind, **params):
    return correction_weights(Correction(kind, **params), OLD, BEHAV, MASK)


def test_token_stats_are_the_same_for_every_kind():
    k3 = np.mean([r - 1 - math.log(r) for r in VALID])  # KL(behaviour || old) from the behaviour's samples
    for kind in KINDS:
        _, _, stats = _weights(kind)
        np.testing.assert_allclose(stats["correction/kl_behaviour"], k3, rtol=1e-5)
        np.testing.assert_allclose(stats["correction/is_weight_mean"], sum(VALID) / 6, rtol=1e-6)
        np.testing.assert_allclose(stats["correction/is_weight_max"], 4.0, rtol=1e-6)  # not the padding's 9
        np.testing.assert_allclose(stats["correction/is_weight_min"], 0.25, rtol=1e-6)


def test_tis_truncates_at_c():
    w, loss_mask, stats = _weights("tis")
    np.testing.assert_allclose(w, [[2, 2, 0.5], [1, 2, 0], [0.25, 0, 0]], rtol=1e-6)
    assert (np.asarray(loss_mask) == np.asarray(MASK)).all()
    assert float(stats["correction/masked_fraction"]) == 0.0
    np.testing.assert_allclose(stats["correction/truncated_fraction"], 2 / 6)  # 3 and 4; 2.0 itself is not cut
    w, _, _ = _weights("tis", tis_cap=1.5)
    np.testing.assert_allclose(w, [[1.5, 1.5, 0.5], [1, 1.5, 0], [0.25, 0, 0]], rtol=1e-6)


def test_icepop_masks_outside_the_band_and_keeps_its_edges():
    # M(rho) = rho inside [alpha, beta] (edges included), 0 outside (IcePop's masking function)
    w, loss_mask, stats = _weights("icepop", icepop_high=2.0)
    np.testing.assert_allclose(w, [[2, 0, 0.5], [1, 0, 0], [0, 0, 0]], rtol=1e-6)
    assert (np.asarray(loss_mask) == np.asarray(MASK)).all()  # masked tokens stay in the normaliser
    np.testing.assert_allclose(stats["correction/masked_fraction"], 3 / 6)
    w, _, stats = _weights("icepop", icepop_low=0.5 + 1e-3, icepop_high=2.0 - 1e-3)  # just inside the edges
    np.testing.assert_allclose(w, [[0, 0, 0], [1, 0, 0], [0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(stats["correction/masked_fraction"], 5 / 6)


def test_decoupled_weights_by_the_behaviour_ratio_and_caps_by_masking():
    w, _, stats = _weights("decoupled")  # AReaL's default: no cap
    np.testing.assert_allclose(w, [[2, 3, 0.5], [1, 4, 0], [0.25, 0, 0]], rtol=1e-6)
    assert float(stats["correction/masked_fraction"]) == 0.0
    w, _, stats = _weights("decoupled", decoupled_cap=2.0)  # AReaL keeps weight <= cap, zeroes the rest
    np.testing.assert_allclose(w, [[2, 0, 0.5], [1, 0, 0], [0.25, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(stats["correction/masked_fraction"], 2 / 6)


def test_none_weighs_nothing():
    w, loss_mask, _ = _weights("none")
    assert w is None and (np.asarray(loss_mask) == np.asarray(MASK)).all()
    assert not Correction().active and RLSettings(estimator="grpo").correction == Correction("none")


# ---------------------------------------------------------------- sequence level
# Geometric mean rho per response against the band [0.999, 1.001]: exactly the upper edge (kept),
# exactly the lower edge (kept), above (dropped), a token at 1.002 averaged inside (kept: the
# criterion is per sequence), below (dropped). The band applies to the geometric mean of pi_behav /
# pi_old = 1 / rho (verl's seq_mean_k1), so a band [0.999, 1.001] on rho is [1 / 1.001, 1 / 0.999] there.
SEQ_BAND = {"seq_mask_low": 1 / 1.001, "seq_mask_high": 1 / 0.999}
SEQ_LOGS = [[_log(1.001), _log(1.001)], [_log(0.999), _log(0.999)], [_log(1.01), 5.0], [_log(1.002), 0.0],
            [_log(0.99), 0.0]]
SEQ_MASK = jnp.array([[1, 1], [1, 1], [1, 0], [1, 1], [1, 1]], bool)
SEQ_OLD = jnp.asarray(np.array(SEQ_LOGS, np.float32))


def test_seq_mask_drops_whole_sequences_outside_the_band():
    w, loss_mask, stats = correction_weights(Correction("seq_mask", **SEQ_BAND), SEQ_OLD, jnp.zeros((5, 2)), SEQ_MASK)
    assert w is None
    np.testing.assert_array_equal(loss_mask, [[1, 1], [1, 1], [0, 0], [1, 1], [0, 0]])
    np.testing.assert_allclose(stats["correction/masked_fraction"], 3 / 9)  # the dropped rows' tokens
    # the edges are inclusive: a band just inside them drops the first two responses too
    _, loss_mask, _ = correction_weights(Correction("seq_mask", seq_mask_low=1 / 1.0009998, seq_mask_high=1 / 0.9990002),
                                         SEQ_OLD, jnp.zeros((5, 2)), SEQ_MASK)
    np.testing.assert_array_equal(loss_mask.any(-1), [False, False, False, True, False])


def test_defaults_are_the_peers():
    """IcePop's band is the paper's [0.5, 5]; seq_mask bands the geometric mean of pi_behav / pi_old (verl's
    seq_mean_k1: mean_t -log rho_t) in [1 / high, high], the lower edge derived from the one threshold as verl
    derives it, so a response is dropped as verl drops it whichever way its ratio leans."""
    c = Correction()
    assert (c.icepop_low, c.icepop_high) == (0.5, 5.0)
    assert c.seq_mask_band == (1 / 1.001, 1.001)
    cfg = cfglib.load_config(None, [*GRPO, "algorithm.rollout_correction=seq_mask"])
    assert cfg.algorithm.icepop_high == 5.0 and cfg.algorithm.seq_mask_low is None
    w, _, stats = _weights("icepop")  # rho 3 and 4 are inside [0.5, 5] now; 0.25 is not
    np.testing.assert_allclose(w, [[2, 3, 0.5], [1, 4, 0], [0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(stats["correction/masked_fraction"], 1 / 6)
    # geometric means of rho: 1.001 (= high: 1 / rho at the derived lower edge, kept), 0.999 (1 / rho =
    # 1.001001 > high: dropped, as verl's band on -mean log rho drops it), 1.0005 and 0.9995 (kept)
    logs = np.float32(np.log([[1.001, 1.001], [0.999, 0.999], [1.0005, 1.0005], [0.9995, 0.9995]]))
    _, loss_mask, _ = correction_weights(Correction("seq_mask"), jnp.asarray(logs), jnp.zeros((4, 2)),
                                         jnp.ones((4, 2), bool))
    np.testing.assert_array_equal(loss_mask.any(-1), [True, False, True, True])
    # an asymmetric band applies to pi_behav / pi_old: [1, 1.01] keeps rho below 1, drops rho above it
    logs = np.float32(np.log([[0.995, 0.995], [1.005, 1.005]]))
    _, loss_mask, _ = correction_weights(Correction("seq_mask", seq_mask_low=1.0, seq_mask_high=1.01),
                                         jnp.asarray(logs), jnp.zeros((2, 2)), jnp.ones((2, 2), bool))
    np.testing.assert_array_equal(loss_mask.any(-1), [True, False])


def test_a_correction_is_a_registry_entry():
    """A new correction plugs in by registering its function; `Correction` validates kinds against the registry."""
    from jaxrlhf.algorithms.correction import ROLLOUT_CORRECTIONS, Corrected

    assert set(ROLLOUT_CORRECTIONS) == {"none", *KINDS}
    with pytest.raises(ValueError, match="unknown rollout correction 'clip_all'"):
        Correction("clip_all")

    def half(c, log_rho, rho, mask):  # every token weighted 1/2
        return Corrected(jnp.where(mask, 0.5, 0.0), mask, jnp.zeros(mask.shape, bool), jnp.zeros(mask.shape, bool))

    with ROLLOUT_CORRECTIONS.temporarily("half", half):
        w, loss_mask, stats = _weights("half")
        np.testing.assert_allclose(w, np.where(np.asarray(MASK), 0.5, 0.0))
        assert float(stats["correction/masked_fraction"]) == 0.0
    assert "half" not in ROLLOUT_CORRECTIONS


# ---------------------------------------------------------------- in the loss

# advantages of the token batch; logp == old, so the PPO ratio is 1 and each token's surrogate is -A
ADV = jnp.array([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0], [2.0, 0.0, 0.0]])


def _loss(name, kind, agg, logp=OLD, **params):
    w, loss_mask, _ = _weights(kind, **params)
    extra = {} if w is None else {"token_weights": w}
    return get_loss(name)(logp, OLD, ADV, loss_mask, clip_eps=0.2, agg=agg, **extra)[0]


def test_icepop_masked_tokens_still_count_in_a_token_mean():
    # kept: 2 x (-1), 0.5 x (-1), 1 x (+1) -> -1.5, over all 6 response tokens (not the 3 kept ones)
    np.testing.assert_allclose(_loss("ppo", "icepop", "token-mean", icepop_high=2.0), -1.5 / 6, rtol=1e-6)
    grad = jax.grad(lambda lp: _loss("ppo", "icepop", "token-mean", logp=lp, icepop_high=2.0))(OLD)
    np.testing.assert_allclose(grad, np.array([[-2, 0, -0.5], [1, 0, 0], [0, 0, 0]]) / 6, rtol=1e-5, atol=1e-7)


def test_tis_weights_each_token_of_a_sequence_mean():
    # rows: -(2 + 2 + 0.5) / 3 = -1.5; -(1 x -1 + 2 x -1) / 2 = 1.5; -(0.25 x 2) / 1 = -0.5; mean -1/6
    np.testing.assert_allclose(_loss("grpo", "tis", "seq-mean-token-mean"), -1 / 6, rtol=1e-5)
    # a weight of 1 everywhere is no correction at all: the same value and gradient, to the bit
    ones = jnp.where(MASK, 1.0, 0.0)
    for name, agg in (("ppo", "token-mean"), ("grpo", "seq-mean-token-mean"), ("grpo", "seq-mean-token-sum-norm")):
        def f(lp, **extra):
            return get_loss(name)(lp, OLD - 0.1, ADV, MASK, agg=agg, **extra)[0]
        assert float(f(OLD)) == float(f(OLD, token_weights=ones))
        np.testing.assert_array_equal(jax.grad(f)(OLD), jax.grad(functools.partial(f, token_weights=ones))(OLD))


def test_tis_weights_surrogate_not_kl():
    # GRPO with a KL term: the weight scales the surrogate (-A) only, the KL term (k3 of 0.5) is unweighted
    ref = OLD - 0.5
    w, loss_mask, _ = _weights("tis")
    loss, _ = get_loss("grpo")(OLD, OLD, ADV, loss_mask, ref_logp=ref, kl_coef=0.1, agg="token-mean",
                               token_weights=w)
    k3 = math.exp(-0.5) - 0.5
    np.testing.assert_allclose(loss, (-(2 + 2 + 0.5 - 1 - 2 + 0.5) + 6 * 0.1 * k3) / 6, rtol=1e-5)


def test_seq_mask_dropped_sequences_leave_the_normaliser():
    adv = jnp.array([[1.0, 1.0], [-1.0, -1.0], [5.0, 0.0], [2.0, 2.0], [7.0, 7.0]])
    _, loss_mask, _ = correction_weights(Correction("seq_mask", **SEQ_BAND), SEQ_OLD, jnp.zeros((5, 2)), SEQ_MASK)
    grpo = get_loss("grpo")
    # kept rows 0, 1 and 3 (per-token loss -A): per sequence (-1 + 1 - 2) / 3; per token (-2 + 2 - 4) / 6
    np.testing.assert_allclose(grpo(SEQ_OLD, SEQ_OLD, adv, loss_mask)[0], -2 / 3, rtol=1e-6)
    np.testing.assert_allclose(grpo(SEQ_OLD, SEQ_OLD, adv, loss_mask, agg="token-mean")[0], -4 / 6, rtol=1e-6)


def _hand_gspo(logp, old, adv, mask, w, low, high):
    """verl's token form of GSPO with the correction's weight on each token, averaged per sequence."""
    s_seq = jnp.exp(jnp.sum((logp - old) * mask, -1) / jnp.sum(mask, -1))
    s = jax.lax.stop_gradient(s_seq)[:, None] * jnp.exp(logp - jax.lax.stop_gradient(logp))
    per_token = jnp.maximum(-adv * s, -adv * jnp.clip(s, 1 - low, 1 + high)) * w
    return jnp.mean(jnp.sum(per_token * mask, -1) / jnp.sum(mask, -1))


def test_gspo_with_token_weights_in_value_and_gradient():
    logp = OLD + jnp.array([[0.1, -0.1, 0.3], [0.05, 0.05, 0.0], [0.3, 0.0, 0.0]])
    adv = jnp.array([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0], [1.0, 0.0, 0.0]])
    w, loss_mask, _ = _weights("tis")
    gspo = get_loss("gspo")

    def ours(lp, **extra):
        return gspo(lp, OLD, adv, loss_mask, clip_eps=0.2, clip_eps_high=0.2, **extra)[0]

    np.testing.assert_allclose(ours(logp, token_weights=w), _hand_gspo(logp, OLD, adv, MASK, w, 0.2, 0.2), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(functools.partial(ours, token_weights=w))(logp),
                               jax.grad(lambda lp: _hand_gspo(lp, OLD, adv, MASK, w, 0.2, 0.2))(logp),
                               rtol=1e-5, atol=1e-7)
    ones = jnp.where(MASK, 1.0, 0.0)  # unit weights: the sequence form's value and gradient
    np.testing.assert_allclose(ours(logp, token_weights=ones), ours(logp), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(functools.partial(ours, token_weights=ones))(logp), jax.grad(ours)(logp),
                               rtol=1e-5, atol=1e-7)


def test_a_correction_without_behaviour_logprobs_names_the_key():
    settings = RLSettings(estimator="grpo", correction=Correction("tis"))
    with pytest.raises(ValueError, match=r"algorithm.rollout_correction=tis .* no 'behaviour_logp'"):
        actor_train(None, None, settings, None, None, {"old_logp": OLD, "response_mask": MASK})


# ---------------------------------------------------------------- graph and config

GRPO = ["algorithm.name=grpo", "algorithm.group_size=2"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_correction_recomputes_old_logp_before_training(kind):
    alg = declare(cfglib.load_config(None, [*GRPO, f"algorithm.rollout_correction={kind}"]))
    graph = alg.graph()
    call = graph["actor.inference"]
    assert call.role == "actor" and call.kind == "inference" and call.outputs == ("old_logp",)
    assert "old_logp" in graph["actor.train"].inputs and "behaviour_logp" in graph["actor.train"].inputs


def test_none_keeps_the_graph_and_ppo_critic_does_not_take_old_logp():
    for name in ("ppo", "grpo", "rloo", "reinforce_pp", "remax", "dapo", "gspo", "dr_grpo"):
        over = [f"algorithm.name={name}"] + (["algorithm.group_size=2"] if name in ("grpo", "rloo", "dapo", "gspo",
                                                                                    "dr_grpo") else [])
        graph = declare(cfglib.load_config(None, over)).graph()
        assert "actor.inference" not in graph.names and "old_logp" not in graph["actor.train"].inputs, name
    ppo = declare(cfglib.load_config(None, ["algorithm.rollout_correction=icepop"])).graph()
    assert "old_logp" in ppo["actor.train"].inputs and "old_logp" not in ppo["critic.train"].inputs


def test_settings_read_the_config():
    from jaxrlhf.algorithms import build_algorithm

    cfg = cfglib.load_config(None, [*GRPO, "algorithm.rollout_correction=icepop", "algorithm.icepop_low=0.4",
                                    "algorithm.icepop_high=5", "algorithm.tis_cap=3", "algorithm.decoupled_cap=4"])
    assert build_algorithm(cfg).settings().correction == Correction(
        "icepop", tis_cap=3.0, icepop_low=0.4, icepop_high=5.0, seq_mask_low=None, seq_mask_high=1.001,
        decoupled_cap=4.0)
    shown = cfglib.format_config(cfg)
    assert "rollout_correction: icepop" in shown and "seq_mask_high: 1.001" in shown


@pytest.mark.parametrize("overrides, message", [
    ([*GRPO, "algorithm.rollout_correction=is"], "'algorithm.rollout_correction' must be one of none, tis, seq_mask"),
    ([*GRPO, "algorithm.tis_cap=0"], "'algorithm.tis_cap' must be > 0"),
    ([*GRPO, "algorithm.icepop_low=2", "algorithm.icepop_high=2"],
     "algorithm.icepop_low=2.0 must be below algorithm.icepop_high=2.0"),
    (["algorithm.seq_mask_low=1.001", "algorithm.seq_mask_high=1.01"],
     "algorithm.seq_mask_low=1.001 and algorithm.seq_mask_high=1.01 must hold 1"),
    ([*GRPO, "algorithm.decoupled_cap=0.5"], "'algorithm.decoupled_cap' must be > 1"),
    (["algorithm.name=sft", "algorithm.rollout_correction=tis"], "not read by algorithm.name=sft"),
])
def test_bad_values_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(cfglib.ConfigError, match=message) as info:
        cfglib.load_config(None, overrides)
    assert "\n" not in str(info.value)


def _plan_with_recompute_away_from_home(cfg):
    """The disaggregated preset's plan for `cfg` (a shadow actor generates), with `actor.inference` moved
    to another layout of the train group: away from the actor's home, where the shadow would be used."""
    import dataclasses

    from jaxrlhf.models.config import preset
    from jaxrlhf.planner.plan import Layout, Placement
    from jaxrlhf.run import planning

    alg = declare(cfg)
    plan = planning.plan_for(cfg, alg, {r: preset("tiny") for r in alg.roles()}, 8)
    home = plan.calls["actor.train"]
    away = Placement(home.group, Layout(data=home.layout.data * home.layout.fsdp * home.layout.tensor))
    assert away != home and "actor" in plan.shadow_roles and plan.offpolicy
    return dataclasses.replace(plan, calls={**plan.calls, "actor.inference": away})


def test_the_recompute_reads_fresh_weights_in_the_plan_and_the_step():
    from jaxrlhf.planner.simulator import build_ops

    cfg = cfglib.load_config(None, [*GRPO, "algorithm.rollout_correction=tis", "algorithm.max_staleness=1",
                                    "plan.strategy=disaggregated", "data.batch_size=4"])
    graph = declare(cfg).graph()
    # the executor runs it with the train calls, never ahead with its step's rollout
    assert graph["actor.inference"].fresh_weights and "actor.inference" in graph.downstream_of_training()
    assert "actor.generate" not in graph.downstream_of_training()
    plan = _plan_with_recompute_away_from_home(cfg)
    ops = {op.name: op for op in build_ops(graph, plan, {c: 1.0 for c in graph.names}, {c: 0.5 for c in graph.names},
                                           3)}
    # the planner's schedule: the trained weights moved for it after the previous update, no shadow sync
    assert "actor.train@1" in ops["actor.inference:realloc@2"].deps
    assert not any(name.startswith("actor.inference:sync") for name in ops)
    assert "actor.generate:sync@0" in ops  # the generator still reads its shadow


# ---------------------------------------------------------------- the train call


def _train_inputs(b=8, p=4, n=5):
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, 300, size=(b, p + n)).astype(np.int32)
    response_mask = np.arange(n)[None, :] < np.array([5, 1, 3, 5, 2, 4, 5, 1])[:, None]
    mask = np.ones((b, p + n), bool)
    mask[:, p:] = response_mask
    from jaxrlhf.models.transformer import positions_from_mask

    behaviour = -rng.uniform(1, 6, size=(b, n)).astype(np.float32)
    return {
        "tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask), "positions": positions_from_mask(jnp.asarray(mask)),
        "response_tokens": jnp.asarray(tokens[:, p:]), "response_mask": jnp.asarray(response_mask),
        "behaviour_logp": jnp.asarray(behaviour), "rule_scores": jnp.asarray(rng.uniform(-1, 1, size=b), jnp.float32),
        "ended_with_eos": jnp.ones((b,), bool), "kl_coef": jnp.float32(0.0), "rng_actor": jax.random.key(3),
        # the recompute: rows 0-3 on policy up to 1e-4, rows 4-7 off by 0.2 per token (dropped by seq_mask)
        "old_logp": jnp.asarray(behaviour + np.where(np.arange(b)[:, None] < 4, 1e-4, 0.2).astype(np.float32)),
    }


@pytest.mark.slow
def test_the_train_call_none_equals_an_exact_recompute_and_micro_batches_keep_the_mask():
    import optax
    from flax import nnx

    from jaxrlhf.models.config import preset
    from jaxrlhf.models.transformer import build_model

    graphdef, params = nnx.split(build_model(preset("tiny"), seed=0))
    opt = optax.sgd(0.1)

    def run(correction, inputs, micro=None):
        s = RLSettings(estimator="grpo", loss="grpo", loss_agg="seq-mean-token-mean", group_size=2, minibatches=2,
                       micro_batch=micro, kl_in_reward=False, max_new_tokens=5, correction=correction)
        return jax.jit(functools.partial(actor_train, graphdef, opt, s))(params, opt.init(params), inputs)

    inputs = _train_inputs()
    # `none` is the ratio against the behaviour log-probs; tis given a recompute equal to them has weight 1
    # on every token, the same ratio and mask: the same update, to the bit
    exact = {**inputs, "old_logp": inputs["behaviour_logp"]}
    (p0, _, o0), (p1, _, o1) = run(Correction(), inputs), run(Correction("tis"), exact)
    for a, b in zip(jax.tree_util.tree_leaves(p0), jax.tree_util.tree_leaves(p1)):
        np.testing.assert_array_equal(a, b)
    assert float(o0["actor_stats"]["loss/policy"]) == float(o1["actor_stats"]["loss/policy"])
    assert float(o1["actor_stats"]["correction/is_weight_max"]) == 1.0
    # seq_mask drops rows 4-7; micro-batches of 2 rows weigh each by the sequences it kept
    band = Correction("seq_mask", seq_mask_low=0.9, seq_mask_high=1.1)
    (p0, _, o0), (p1, _, o1) = run(band, inputs), run(band, inputs, micro=2)
    np.testing.assert_allclose(o0["actor_stats"]["correction/masked_fraction"], 12 / 26, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(p0), jax.tree_util.tree_leaves(p1)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for key in ("loss/policy", "entropy", "clipfrac", "grad_norm"):
        np.testing.assert_allclose(o0["actor_stats"][key], o1["actor_stats"][key], rtol=2e-4, atol=1e-6)


# ---------------------------------------------------------------- tiny GRPO runs

BASE = [
    "model.actor.preset=tiny", "run.steps=2", "run.checkpoint_every=0", "run.tensorboard=false",
    "run.export_hf=false", "data.batch_size=4", "data.max_prompt_len=16", "generation.max_new_tokens=4",
    "sft.steps=0", "optimizer.actor.lr=1e-3", "rewards.eos_only=false",
    'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]',
    "algorithm.name=grpo", "algorithm.group_size=4", "algorithm.minibatches=2", "algorithm.kl_coef=0",
    "plan.strategy=colocated",
]
METRICS = ("kl_behaviour", "is_weight_mean", "is_weight_max", "is_weight_min", "masked_fraction",
           "truncated_fraction")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_synchronous_grpo_run_recomputes_the_behaviour_logprobs(kind, tmp_path):
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics

    out = tmp_path / kind
    train.run(cfglib.load_config(None, [*BASE, f"algorithm.rollout_correction={kind}", f"run.output_dir={out}"]))
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # float32, no staleness: pi_old == pi_behaviour up to float rounding
        assert all(f"correction/{m}" in r for m in METRICS)
        assert abs(r["correction/kl_behaviour"]) < 1e-6, r
        assert r["correction/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert r["correction/is_weight_min"] == pytest.approx(1.0, abs=1e-4)
        assert r["correction/masked_fraction"] == 0.0 and r["correction/truncated_fraction"] == 0.0
        assert np.isfinite(r["loss/policy"])
    skipped = [k for k in records[-1] if k.endswith(("skipped_nonfinite", "skipped_empty"))]
    assert skipped and all(records[-1][k] == 0 for k in skipped)  # the weighted updates were applied


@pytest.mark.slow
def test_a_stale_rollout_is_corrected_against_the_trainers_weights(tmp_path):
    """algorithm.max_staleness=2 on a disaggregated plan whose recompute runs on the train group in
    another layout than the trainer's (away from home, where a shadow actor exists): steps 2 and 3
    train rollouts of the initial weights, so pi_behaviour != pi_old (KL > 0); pi_old is the weights
    the update starts from, not the generator's stale copy, so with one minibatch the PPO ratio
    before the update is 1."""
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics

    over = [*BASE, "algorithm.rollout_correction=tis", "algorithm.minibatches=1", "algorithm.max_staleness=2",
            "run.steps=3", "plan.strategy=disaggregated"]
    path = tmp_path / "plan.yaml"
    _plan_with_recompute_away_from_home(cfglib.load_config(None, over)).save(str(path))
    out = tmp_path / "run"
    train.run(cfglib.load_config(None, [*over, f"plan.file={path}", f"run.output_dir={out}"]))
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["rollout/staleness"] for r in records] == [0.0, 1.0, 2.0]
    assert abs(records[0]["correction/kl_behaviour"]) < 1e-6
    for r in records[1:]:
        assert r["correction/kl_behaviour"] > 1e-6, r
        assert r["ratio/max"] == pytest.approx(1.0, abs=1e-4), r
