"""GRPO (Shao et al. 2024): no critic; G samples per prompt, group-normalised outcome advantages.

A = (r - mean_group) / (std_group + eps) with the unbiased std (as TRL and
verl), never re-whitened over the batch: an all-equal group keeps advantage
exactly 0 and advantages do not depend on response length. The KL to the
reference is a term of the loss (k3, `algorithm.kl_coef`; the paper uses
0.04), not a reward penalty, so the group compares the task reward alone.
Losses are averaged per sequence, then over sequences (the paper's
seq-mean-token-mean) unless `algorithm.loss_agg` says otherwise.

Dr. GRPO (Liu et al. 2025): `algorithm.norm_adv_by_std=false` keeps only the
mean baseline, and `algorithm.loss_agg=seq-mean-token-sum-norm` divides each
sequence's token sum by the maximum response length instead of its own length.
"""

from jaxrlhf.algorithms.base import register_algorithm
from jaxrlhf.algorithms.rollout import RolloutAlgorithm


@register_algorithm
class GRPO(RolloutAlgorithm):
    name = "grpo"
    estimator = "grpo"
    loss = "grpo"
    kl_in_reward = False
    default_kl_estimator = "k3"
    default_loss_agg = "seq-mean-token-mean"
    grouped = True
