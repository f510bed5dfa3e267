"""Losses of the offline stages (reward modelling, DPO/IPO, SFT, pair log-probs) and the token
aggregations, against hand-computed numbers or a plain-numpy recomputation from the model's logits."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.algorithms import dpo, pairs, rm, sft
from jaxrlhf.algorithms.losses import aggregate
from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model, positions_from_mask


def _np_log_softmax(logits):
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def lm():
    model = build_model(preset("tiny"), "lm", seed=0)
    return nnx.split(model)


# ---------------------------------------------------------------- reward modelling


def test_rm_pairwise_loss_accuracy_and_margin():
    chosen = jnp.array([2.0, 0.5, 1.0])
    rejected = jnp.array([1.0, 0.5, 3.0])
    # margins r_c - r_r = [1, 0, -2]
    # -log sigmoid(m) = softplus(-m): [0.3132617, 0.6931472, 2.1269280] -> mean 1.0444456
    loss, stats = jax.jit(rm.pairwise_loss)(chosen, rejected)
    np.testing.assert_allclose(loss, 1.0444456263737136, rtol=1e-6)
    np.testing.assert_allclose(stats["loss/rm"], loss)
    # strict >: only the first pair is right; the tie (0.5 vs 0.5) counts as wrong
    np.testing.assert_allclose(stats["rm/accuracy"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(stats["rm/margin"], (1 + 0 - 2) / 3, rtol=1e-6)
    np.testing.assert_allclose(stats["rm/chosen_mean"], 3.5 / 3, rtol=1e-6)
    np.testing.assert_allclose(stats["rm/rejected_mean"], 4.5 / 3, rtol=1e-6)


def test_rm_gradient_pushes_chosen_up_and_rejected_down():
    chosen = jnp.array([2.0, 0.5, 1.0])
    rejected = jnp.array([1.0, 0.5, 3.0])
    gc, gr = jax.grad(lambda c, r: rm.pairwise_loss(c, r)[0], argnums=(0, 1))(chosen, rejected)
    # d/dr_c softplus(-(r_c - r_r)) / 3 = -sigmoid(-m) / 3
    expected = np.array([-1 / (1 + math.exp(1)), -0.5, -1 / (1 + math.exp(-2))]) / 3
    np.testing.assert_allclose(gc, expected, rtol=1e-5)
    np.testing.assert_allclose(gr, -expected, rtol=1e-5)


# ---------------------------------------------------------------- DPO / IPO

# Three pairs, summed log-probs, chosen in row 0.
#   ratio_chosen   = logp_c - ref_c = [-10+11, -21+20, -7.5+8]  = [1, -1, 0.5]
#   ratio_rejected = logp_r - ref_r = [-13+12, -18+18, -9.5+10] = [-1, 0, 0.5]
#   x = ratio_c - ratio_r = [2, -1, 0]
LOGP = jnp.array([[-10.0, -21.0, -7.5], [-13.0, -18.0, -9.5]])
REF = jnp.array([[-11.0, -20.0, -8.0], [-12.0, -18.0, -10.0]])
LENGTHS = jnp.array([[4.0, 2.0, 5.0], [2.0, 4.0, 5.0]])
BETA = 0.1


def test_dpo_sigmoid_loss_and_implicit_reward_stats():
    loss, stats = dpo.dpo_loss(LOGP, REF, LENGTHS, beta=BETA, label_smoothing=0.0, kind="sigmoid")
    # -log sigmoid(0.1 x) = softplus(-0.1 x): [softplus(-0.2), softplus(0.1), log 2]
    #   = [0.5981389, 0.7443967, 0.6931472] -> mean 0.6785609
    np.testing.assert_allclose(loss, 0.6785609033383694, rtol=1e-6)
    np.testing.assert_allclose(stats["loss/dpo"], loss)
    # implicit rewards beta * ratio: chosen [0.1, -0.1, 0.05], rejected [-0.1, 0, 0.05]
    np.testing.assert_allclose(stats["rewards/chosen"], 0.05 / 3, rtol=1e-5)
    np.testing.assert_allclose(stats["rewards/rejected"], -0.05 / 3, rtol=1e-5)
    np.testing.assert_allclose(stats["rewards/margin"], (0.2 - 0.1 + 0.0) / 3, rtol=1e-5)
    # strict >: pair 1 right, pair 2 wrong, pair 3 a tie (0.05 vs 0.05) -> wrong
    np.testing.assert_allclose(stats["rewards/accuracy"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(stats["logps/chosen"], (-10 - 21 - 7.5) / 3, rtol=1e-6)
    np.testing.assert_allclose(stats["logps/rejected"], (-13 - 18 - 9.5) / 3, rtol=1e-6)


def test_dpo_loss_does_not_depend_on_lengths():
    # Sigmoid DPO uses summed log-probs: lengths matter only to IPO.
    a, _ = dpo.dpo_loss(LOGP, REF, LENGTHS, beta=BETA, label_smoothing=0.0, kind="sigmoid")
    b, _ = dpo.dpo_loss(LOGP, REF, LENGTHS * 7.0, beta=BETA, label_smoothing=0.0, kind="sigmoid")
    np.testing.assert_allclose(a, 0.6785609033383694, rtol=1e-6)
    np.testing.assert_allclose(b, 0.6785609033383694, rtol=1e-6)


def test_cdpo_label_smoothing_formula():
    ls = 0.2
    loss, _ = dpo.dpo_loss(LOGP, REF, LENGTHS, beta=BETA, label_smoothing=ls, kind="sigmoid")
    # -(1-ls) log sigmoid(bx) - ls log sigmoid(-bx) = 0.8 softplus(-bx) + 0.2 softplus(bx):
    #   x=2:  0.8*0.5981389 + 0.2*0.7981389 = 0.6381389
    #   x=-1: 0.8*0.7443967 + 0.2*0.6443967 = 0.7243967
    #   x=0:  log 2 = 0.6931472            -> mean 0.6852276
    np.testing.assert_allclose(loss, 0.685227570005036, rtol=1e-6)


def test_ipo_uses_length_averaged_log_ratios():
    loss, stats = dpo.dpo_loss(LOGP, REF, LENGTHS, beta=BETA, label_smoothing=0.0, kind="ipo")
    # per-token ratios: chosen [1/4, -1/2, 0.5/5] = [0.25, -0.5, 0.1], rejected [-1/2, 0/4, 0.5/5] = [-0.5, 0, 0.1]
    # x' = [0.75, -0.5, 0]; 1/(2 beta) = 5: (x' - 5)^2 = [18.0625, 30.25, 25] -> mean 24.4375
    # (summed log-probs, as OpenRLHF, would give (2-5)^2, (-1-5)^2, 25 -> 23.333: a different number)
    np.testing.assert_allclose(loss, 24.4375, rtol=1e-6)
    # Implicit rewards stay on the summed log-ratios, as TRL >= 0.29.
    np.testing.assert_allclose(stats["rewards/margin"], 0.1 / 3, rtol=1e-5)
    np.testing.assert_allclose(stats["rewards/accuracy"], 1 / 3, rtol=1e-6)


def test_dpo_gradient_direction():
    def loss_of(logp, ls=0.0):
        return dpo.dpo_loss(logp, REF, LENGTHS, beta=BETA, label_smoothing=ls, kind="sigmoid")[0]

    g = jax.grad(loss_of)(LOGP)
    # Raising a chosen log-prob lowers the loss, raising a rejected one raises it:
    # d/dlogp_c = -beta sigmoid(-beta x) / B = [-0.0150055, -0.0174993, -0.0166667]
    assert np.all(np.asarray(g[0]) < 0) and np.all(np.asarray(g[1]) > 0)
    np.testing.assert_allclose(g[0], [-0.015005533422917406, -0.017499306249298, -0.016666666666666666], rtol=1e-5)
    np.testing.assert_allclose(g[1], -g[0], rtol=1e-6)
    # A small step up on the first chosen log-prob really lowers the loss.
    assert float(loss_of(LOGP.at[0, 0].add(0.5))) < float(loss_of(LOGP))
    # cDPO (ls < 0.5) keeps the direction: [-(0.8) b s(-bx) + 0.2 b s(bx)] / 3
    gc = jax.grad(lambda lp: loss_of(lp, 0.2))(LOGP)
    np.testing.assert_allclose(gc[0], [-0.008338866756250741, -0.010832639582631335, -0.01], rtol=1e-5)
    # The reference log-probs are constants of the loss: the rewards in the stats carry no gradient.
    g_stats = jax.grad(lambda lp: dpo.dpo_loss(lp, REF, LENGTHS, beta=BETA, label_smoothing=0.0,
                                                kind="sigmoid")[1]["rewards/margin"])(LOGP)
    np.testing.assert_array_equal(g_stats, np.zeros((2, 3)))


# ---------------------------------------------------------------- SFT


@pytest.mark.slow
def test_sft_nll_completion_tokens_only(lm):
    graphdef, params = lm
    # Two left-padded demonstrations: [pad pad pad | BOS 40 41 | 50 51 52 EOS] and
    # [pad | BOS 60 61 62 | 70 71 72 73 EOS]; only the completions (and EOS) are targets.
    tokens = np.array([
        [0, 0, 0, 1, 40, 41, 50, 51, 52, 2],
        [0, 1, 60, 61, 62, 70, 71, 72, 73, 2],
    ], np.int32)
    mask = tokens != 0
    loss_mask = np.zeros_like(mask)
    loss_mask[0, 6:] = True  # completion 50 51 52 + EOS (prompt BOS 40 41)
    loss_mask[1, 5:] = True  # completion 70 71 72 73 + EOS (prompt BOS 60 61 62)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    inputs = {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask), "loss_mask": jnp.asarray(loss_mask),
              "positions": jnp.asarray(positions)}

    loss, count = jax.jit(sft.sft_nll, static_argnums=0)(graphdef, params, inputs)

    logits, _ = nnx.merge(graphdef, params)(inputs["tokens"], inputs["positions"], inputs["mask"])
    logp = _np_log_softmax(logits)
    nll = []
    for b in range(2):
        for t in range(1, tokens.shape[1]):
            if loss_mask[b, t]:  # target token t is predicted by the logits at t - 1
                nll.append(-logp[b, t - 1, tokens[b, t]])
    assert count == 4 + 5 == len(nll)
    np.testing.assert_allclose(loss, np.mean(nll), rtol=1e-5)

    # Prompt tokens are never targets: the loss with the prompt included is a different number.
    with_prompt = [-logp[b, t - 1, tokens[b, t]] for b in range(2) for t in range(1, 10) if mask[b, t - 1] and mask[b, t]]
    assert abs(np.mean(with_prompt) - float(loss)) > 1e-4
    # A loss mask on the first column cannot be a target (nothing predicts token 0).
    inputs2 = dict(inputs, loss_mask=jnp.asarray(loss_mask).at[:, 0].set(True))
    loss2, count2 = jax.jit(sft.sft_nll, static_argnums=0)(graphdef, params, inputs2)
    assert count2 == count
    np.testing.assert_allclose(loss2, loss, rtol=1e-6)


# ---------------------------------------------------------------- pair log-probs


@pytest.mark.slow
def test_pair_logprobs_sum_response_tokens_only(lm):
    graphdef, params = lm
    # Two pairs, left-padded to length 9; prompts of 3 and 4 tokens (BOS included).
    seqs = {
        "chosen": [[1, 30, 31, 80, 81, 2], [1, 40, 41, 42, 90, 91, 92, 93, 2]],
        "rejected": [[1, 30, 31, 85, 2], [1, 40, 41, 42, 95, 96, 2]],
    }
    prompt_lens = [3, 4]
    length = 9
    inputs = {}
    for side, rows in seqs.items():
        tokens = np.zeros((2, length), np.int32)
        mask = np.zeros((2, length), bool)
        loss_mask = np.zeros((2, length), bool)
        for b, ids in enumerate(rows):
            tokens[b, length - len(ids):] = ids
            mask[b, length - len(ids):] = True
            loss_mask[b, length - len(ids) + prompt_lens[b]:] = True
        inputs[f"{side}_tokens"], inputs[f"{side}_mask"], inputs[f"{side}_loss_mask"] = tokens, mask, loss_mask

    logp, lengths = jax.jit(pairs.pair_logprobs, static_argnums=0)(
        graphdef, params, {k: jnp.asarray(v) for k, v in inputs.items()})

    model = nnx.merge(graphdef, params)
    expected = np.zeros((2, 2))
    expected_len = np.zeros((2, 2))
    for i, side in enumerate(("chosen", "rejected")):
        # A separate forward per side (the function stacks both into one forward).
        tokens, mask = jnp.asarray(inputs[f"{side}_tokens"]), jnp.asarray(inputs[f"{side}_mask"])
        logits, _ = model(tokens, positions_from_mask(mask), mask)
        lp = _np_log_softmax(logits)
        for b, ids in enumerate(seqs[side]):
            start = length - len(ids)
            # response tokens (after the prompt, EOS included), each predicted by the previous position
            for t in range(start + prompt_lens[b], length):
                expected[i, b] += lp[b, t - 1, inputs[f"{side}_tokens"][b, t]]
                expected_len[i, b] += 1
    np.testing.assert_array_equal(lengths, [[3, 5], [2, 3]])
    np.testing.assert_array_equal(lengths, expected_len)
    np.testing.assert_allclose(logp, expected, rtol=1e-5)


# ---------------------------------------------------------------- aggregation

LOSS = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # row 1 has one token


def test_aggregate_token_mean():
    # (1 + 2 + 3 + 4) / 4 tokens
    np.testing.assert_allclose(aggregate(LOSS, MASK, "token-mean"), 2.5, rtol=1e-6)


def test_aggregate_seq_mean_token_mean():
    # row means 6/3 = 2 and 4/1 = 4 -> (2 + 4) / 2 = 3
    np.testing.assert_allclose(aggregate(LOSS, MASK, "seq-mean-token-mean"), 3.0, rtol=1e-6)
    # A row with no tokens does not count as a sequence: (2 + 4) / 2 still.
    loss3 = jnp.concatenate([LOSS, jnp.full((1, 3), 100.0)])
    mask3 = jnp.concatenate([MASK, jnp.zeros((1, 3))])
    np.testing.assert_allclose(aggregate(loss3, mask3, "seq-mean-token-mean"), 3.0, rtol=1e-6)


def test_aggregate_seq_mean_token_sum_norm():
    # Dr. GRPO: all token sums / (rows * norm_len) = (6 + 4) / (2 * 3) with the padded horizon 3,
    np.testing.assert_allclose(aggregate(LOSS, MASK, "seq-mean-token-sum-norm"), 10 / 6, rtol=1e-6)
    # and (6 + 4) / (2 * 8) with the configured maximum response length 8 (a constant, not the batch's).
    np.testing.assert_allclose(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=8), 10 / 16, rtol=1e-6)


def test_aggregate_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(LOSS, MASK, "seq-mean-token-sum")
