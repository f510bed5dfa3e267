"""DAPO, Dr. GRPO and GSPO against hand-computed numbers (the papers' formulas; verl's forms where
they differ are written out here from their math and compared), and their configuration."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import config as cfglib
from jaxrlhf.algorithms import build_algorithm
from jaxrlhf.algorithms.advantages import AdvantageBatch, compute_advantages
from jaxrlhf.algorithms.losses import get_loss
from jaxrlhf.algorithms.rewards import overlong_penalty
from jaxrlhf.algorithms.rollout import RLSettings, select_groups, shaped_scores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- DAPO


@pytest.mark.slow
def test_dapo_clip_higher_and_token_mean():
    # rows: [r=1.25 A=+1, r=1.4 A=+1] and [r=0.7 A=-1]
    #   1.25: inside [0.8, 1.28] -> -1.25   (symmetric 0.2 would clip it at 1.2 -> -1.2)
    #   1.4:  clipped at 1.28    -> -1.28
    #   0.7:  max(0.7, 0.8)      ->  0.8
    logp = jnp.log(jnp.array([[1.25, 1.4], [0.7, 1.0]]))
    old = jnp.zeros((2, 2))
    adv = jnp.array([[1.0, 1.0], [-1.0, 0.0]])
    mask = jnp.array([[1.0, 1.0], [1.0, 0.0]])
    grpo = get_loss("grpo")
    loss, stats = grpo(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28, agg="token-mean")
    np.testing.assert_allclose(loss, (-1.25 - 1.28 + 0.8) / 3, rtol=1e-5)
    np.testing.assert_allclose(stats["clipfrac"], 2 / 3, rtol=1e-6)
    symmetric, _ = grpo(logp, old, adv, mask, clip_eps=0.2, agg="token-mean")
    np.testing.assert_allclose(symmetric, (-1.2 - 1.2 + 0.8) / 3, rtol=1e-5)
    # token-mean weighs the 2-token row twice; the paper's GRPO mean per sequence would give
    per_seq, _ = grpo(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    np.testing.assert_allclose(per_seq, ((-1.25 - 1.28) / 2 + 0.8) / 2, rtol=1e-5)
    # only the unclipped token has a gradient: d(-A r / 3)/dlogp = -1.25 / 3
    grad = jax.grad(lambda lp: grpo(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28, agg="token-mean")[0])(logp)
    np.testing.assert_allclose(grad, [[-1.25 / 3, 0.0], [0.0, 0.0]], rtol=1e-5, atol=1e-7)


def test_overlong_penalty_by_hand():
    # max 8 tokens, buffer 4: no penalty up to 4 tokens, then -(len - 4) / 4, -1 at 8
    lengths = jnp.array([2, 4, 5, 6, 8])
    np.testing.assert_allclose(overlong_penalty(lengths, max_len=8, buffer=4), [0, 0, -0.25, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalty(lengths, max_len=8, buffer=4, penalty=0.5),
                               [0, 0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, max_len=8, buffer=9)


def test_overlong_penalty_is_added_after_the_eos_gate():
    # rule score 1 for both; row 0 ended with EOS after 3 tokens, row 1 was cut at 4 (no EOS):
    # row 0: 1 - (3 - 2) / 2 = 0.5; row 1: gated to 0, then the full penalty -1
    s = RLSettings(estimator="grpo", max_new_tokens=4, overlong_buffer=2, eos_only=True)
    inputs = {"rule_scores": jnp.array([1.0, 1.0]), "ended_with_eos": jnp.array([True, False]),
              "response_mask": jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)}
    np.testing.assert_allclose(shaped_scores(inputs, s), [0.5, -1.0])
    np.testing.assert_allclose(shaped_scores(inputs, RLSettings(estimator="grpo", max_new_tokens=4)), [1.0, 0.0])


def test_dynamic_sampling_keeps_informative_groups_and_masks_fillers():
    # 4 groups of 2 in the pool; groups 1 and 3 have different rewards, 0 and 2 do not
    scores = np.array([1, 1, 0, 1, 0, 0, 1, 0], np.float32)
    pool = {"response_mask": np.ones((8, 3), bool), "tokens": np.arange(8)[:, None] * np.ones((1, 3), int),
            "rule_components": {"exact_match": scores}}
    out, stats = select_groups(pool, scores, group_size=2, groups=2)
    np.testing.assert_array_equal(out["tokens"][:, 0], [2, 3, 6, 7])
    np.testing.assert_array_equal(out["rule_components"]["exact_match"], [0, 1, 1, 0])
    assert out["response_mask"].all()
    assert stats == {"dynamic_sampling/pool_groups": 4.0, "dynamic_sampling/informative_groups": 2.0,
                     "dynamic_sampling/kept_groups": 2.0}
    # three groups wanted, two informative: the first uninformative group fills, masked out
    out, stats = select_groups(pool, scores, group_size=2, groups=3)
    np.testing.assert_array_equal(out["tokens"][:, 0], [2, 3, 6, 7, 0, 1])
    np.testing.assert_array_equal(out["response_mask"].all(axis=1), [1, 1, 1, 1, 0, 0])
    assert stats["dynamic_sampling/kept_groups"] == 2.0
    with pytest.raises(ValueError, match="cannot fill"):
        select_groups(pool, scores, group_size=2, groups=5)


# ---------------------------------------------------------------- Dr. GRPO


@pytest.mark.slow
def test_dr_grpo_advantage_and_constant_length_normaliser():
    # group rewards [1, 0, 0, 1]: mean 0.5; Dr. GRPO A = r - 0.5; GRPO divides by std = sqrt(1/3)
    lengths = [1, 2, 3, 2]
    mask = jnp.array([[1.0] * n + [0.0] * (4 - n) for n in lengths])
    rewards = jnp.zeros((4, 4)).at[jnp.arange(4), jnp.array(lengths) - 1].set(jnp.array([1.0, 0, 0, 1]))
    batch = AdvantageBatch(rewards, mask)
    adv, _ = compute_advantages("grpo", batch, group_size=4, scale_by_std=False)
    np.testing.assert_allclose(adv[:, 0], [0.5, -0.5, -0.5, 0.5], rtol=1e-6)
    grpo_adv, _ = compute_advantages("grpo", batch, group_size=4)
    np.testing.assert_allclose(grpo_adv[:, 0], np.array([0.5, -0.5, -0.5, 0.5]) / math.sqrt(1 / 3), rtol=1e-5)
    # ratio 1: per-token loss -A; token sums -0.5, +1, +1.5, -1 = 1.0, over rows x L_max = 4 x 4
    logp = jnp.zeros((4, 4))
    loss, _ = get_loss("grpo")(logp, logp, adv, mask, agg="seq-mean-token-sum-norm", norm_len=4)
    np.testing.assert_allclose(loss, 1.0 / 16, rtol=1e-6)
    # GRPO's per-sequence mean gives every sequence -A: mean(-0.5, 0.5, 0.5, -0.5) = 0
    loss, _ = get_loss("grpo")(logp, logp, adv, mask)
    np.testing.assert_allclose(loss, 0.0, atol=1e-7)


# ---------------------------------------------------------------- GSPO

# Three responses: token log-ratios [0.1, -0.1, 0.3] (mean 0.1, A = +1), [0.5, 0.3] (mean 0.4,
# A = -2) and [0.3, 0.3] (mean 0.3, A = +1); the padded slots hold junk the loss must ignore.
G_LOGP = jnp.array([[0.1, -0.1, 0.3], [0.5, 0.3, 9.0], [0.3, 0.3, -9.0]])
G_OLD = jnp.zeros((3, 3))
G_MASK = jnp.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
G_ADV = jnp.array([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0], [1.0, 1.0, 0.0]])


@pytest.mark.slow
def test_gspo_sequence_ratio_and_clip_by_hand():
    # s = e^0.1 = 1.10517 (inside [0.8, 1.2]) -> -1.10517
    # s = e^0.4 = 1.49182, A < 0: max(2 * 1.49182, 2 * 1.2) = 2.98365 (a high ratio is not clipped for A < 0)
    # s = e^0.3 = 1.34986, A > 0: max(-1.34986, -1.2) = -1.2 (clipped)
    gspo = get_loss("gspo")
    loss, stats = jax.jit(lambda *a: gspo(*a, clip_eps=0.2, clip_eps_high=0.2))(G_LOGP, G_OLD, G_ADV, G_MASK)
    s = [math.exp(0.1), math.exp(0.4), math.exp(0.3)]
    np.testing.assert_allclose(loss, (-s[0] + 2 * s[1] - 1.2) / 3, rtol=1e-5)
    np.testing.assert_allclose(stats["clipfrac"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(stats["ratio/mean"], sum(s) / 3, rtol=1e-5)
    np.testing.assert_allclose(stats["ratio/max"], s[1], rtol=1e-5)
    # gradient: -A_i s_i / |y_i| / 3 on every token of an unclipped response, 0 on the clipped one
    grad = jax.grad(lambda lp: gspo(lp, G_OLD, G_ADV, G_MASK, clip_eps=0.2, clip_eps_high=0.2)[0])(G_LOGP)
    expected = [[-s[0] / 3 / 3] * 3, [2 * s[1] / 2 / 3] * 2 + [0.0], [0.0] * 3]
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)
    # the paper's range 1 - 3e-4 / 1 + 4e-4 (the defaults) clips every one of these responses
    _, stats = gspo(G_LOGP, G_OLD, G_ADV, G_MASK)
    np.testing.assert_allclose(stats["clipfrac"], 2 / 3, rtol=1e-6)  # A < 0 with s > 1 stays unclipped
    with pytest.raises(ValueError, match="averages per sequence"):
        gspo(G_LOGP, G_OLD, G_ADV, G_MASK, agg="token-mean")


def _verl_gspo_token_form(logp, old, adv, mask, low, high):
    """verl's GSPO written from its math: log s_it = sg(mean_t log r) + logp - sg(logp), the
    clipped surrogate per token, averaged per sequence then over sequences."""
    seq_log_ratio = jnp.sum((logp - old) * mask, -1) / jnp.sum(mask, -1)
    log_s = jax.lax.stop_gradient(seq_log_ratio)[:, None] + logp - jax.lax.stop_gradient(logp)
    s = jnp.exp(jnp.minimum(log_s, 10.0))
    per_token = jnp.maximum(-adv * s, -adv * jnp.clip(s, 1 - low, 1 + high))
    return jnp.mean(jnp.sum(per_token * mask, -1) / jnp.sum(mask, -1))


def test_gspo_equals_verls_token_form_in_value_and_gradient():
    # With one advantage per response (every outcome estimator) the sequence form and verl's
    # token form agree: the same value, and the same gradient through the stop-gradient trick.
    gspo = get_loss("gspo")
    for low, high in ((0.2, 0.2), (0.2, 0.28), (3e-4, 4e-4)):
        ours = gspo(G_LOGP, G_OLD, G_ADV, G_MASK, clip_eps=low, clip_eps_high=high)[0]
        np.testing.assert_allclose(ours, _verl_gspo_token_form(G_LOGP, G_OLD, G_ADV, G_MASK, low, high), rtol=1e-6)
        g_ours = jax.grad(lambda lp: gspo(lp, G_OLD, G_ADV, G_MASK, clip_eps=low, clip_eps_high=high)[0])(G_LOGP)
        g_verl = jax.grad(lambda lp: _verl_gspo_token_form(lp, G_OLD, G_ADV, G_MASK, low, high))(G_LOGP)
        np.testing.assert_allclose(g_ours, g_verl, rtol=1e-5, atol=1e-8)


def test_gspo_kl_term_per_sequence():
    # ratio 1 (logp == old), A = 0: only the KL term; ref_logp = logp - 0.5 -> k3 = e^-0.5 + 0.5 - 1 on every token
    logp = jnp.full((2, 3), -1.0)
    mask = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, stats = get_loss("gspo")(logp, logp, jnp.zeros((2, 3)), mask, ref_logp=logp - 0.5, kl_coef=0.1)
    k3 = math.exp(-0.5) - 0.5
    np.testing.assert_allclose(loss, 0.1 * k3, rtol=1e-5)
    np.testing.assert_allclose(stats["kl/loss"], k3, rtol=1e-5)


# ---------------------------------------------------------------- configuration


def _algorithm(name, *overrides):
    return build_algorithm(cfglib.load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), list(overrides)))


def test_variant_defaults_and_graph():
    dapo = _algorithm("dapo")
    s = dapo.settings()
    assert (s.clip_eps, s.clip_eps_high, s.loss_agg, s.overlong_buffer) == (0.2, 0.28, "token-mean", 2)
    graph = dapo.graph()
    assert graph["actor.generate"].seqs_per_row == 2  # the pool: 2 x the prompts trained on
    assert graph["actor.generate"].outputs[0].startswith("pool_")
    assert [h.name for h in graph.host_steps] == ["score_rules", "select_groups"]
    assert dapo.dataset(dapo_tokenizer()).batch_size == 2 * dapo.cfg.data.batch_size
    # the same defaults when the keys are left unset
    bare = _algorithm("quickstart-grpo", "algorithm.name=dapo")
    assert (bare.settings().clip_eps_high, bare.settings().loss_agg, bare.dynamic_sampling) == (0.28, "token-mean", True)
    dr = _algorithm("quickstart-grpo", "algorithm.name=dr_grpo").settings()
    assert (dr.norm_adv_by_std, dr.loss_agg) == (False, "seq-mean-token-sum-norm")
    gspo = _algorithm("quickstart-grpo", "algorithm.name=gspo").settings()
    assert (gspo.loss, gspo.clip_eps, gspo.clip_eps_high, gspo.loss_agg) == ("gspo", 3e-4, 4e-4, "seq-mean-token-mean")
    grpo = _algorithm("quickstart-grpo").settings()
    assert (grpo.clip_eps, grpo.clip_eps_high, grpo.norm_adv_by_std) == (0.2, 0.2, True)
    assert "select_groups" not in [h.name for h in _algorithm("quickstart-grpo").graph().host_steps]


def test_the_runtime_reads_its_settings_from_the_config():
    """The config holds every algorithm's defaults (jaxrlhf.config_schema); the runtime keeps no copy
    of them: its settings are the config's values, also where the user set one."""
    from jaxrlhf.algorithms import ALGORITHMS
    from jaxrlhf.algorithms.rl import RolloutAlgorithm

    assert not [k for k in vars(RolloutAlgorithm) if k.startswith("default_")]
    keys = {"kl_estimator": "kl_estimator", "clip_eps": "clip_eps", "clip_eps_high": "clip_eps_high",
            "loss_agg": "loss_agg", "norm_adv_by_std": "norm_adv_by_std", "whiten": "whiten_advantages"}
    for name, cls in ALGORITHMS.items():
        if not issubclass(cls, RolloutAlgorithm):
            continue
        for extra in ([], ["algorithm.clip_eps=0.1", "algorithm.kl_estimator=k2", "algorithm.loss_agg=token-mean"]):
            if name == "gspo" and extra:
                extra = extra[:2]  # gspo always averages per sequence
            alg = _algorithm("quickstart-grpo", f"algorithm.name={name}", *extra)
            settings = alg.settings()
            for setting, key in keys.items():
                if hasattr(alg.cfg.algorithm, key):
                    assert getattr(settings, setting) == getattr(alg.cfg.algorithm, key), (name, key, extra)
        assert alg.settings().clip_eps == 0.1 and alg.settings().kl_estimator == "k2"


def dapo_tokenizer():
    from jaxrlhf.models.tokenizer import load_tokenizer

    return load_tokenizer("byte")


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.name=gspo", "algorithm.loss_agg=token-mean"], "algorithm.loss_agg=token-mean does not apply"),
    (["algorithm.name=dapo", "rewards.model=true", "model.reward.init_from=actor"], "rewards.rules and rewards.model=false"),
    (["algorithm.name=reinforce_pp", "algorithm.dynamic_sampling=true"],
         "'algorithm.dynamic_sampling' is not read by algorithm.name=reinforce_pp"),
    (["algorithm.name=dapo", "algorithm.overlong_buffer=5"], "exceeds generation.max_new_tokens=4"),
])
def test_variant_config_errors(overrides, message):
    with pytest.raises(cfglib.ConfigError, match=message):
        _algorithm("quickstart-grpo", *overrides)
