"""GRPO (Shao et al. 2024) and the variants that changed its defaults: Dr. GRPO, DAPO, GSPO.

GRPO: no critic; G samples per prompt, group-normalised outcome advantages
A = (r - mean_group) / (std_group + eps) with the unbiased std (as TRL and
verl), never re-whitened over the batch: an all-equal group keeps advantage
exactly 0 and advantages do not depend on response length. The KL to the
reference is a term of the loss (k3, `algorithm.kl_coef`; the paper uses
0.04), not a reward penalty, so the group compares the task reward alone.
Losses are averaged per sequence, then over sequences (the paper's
seq-mean-token-mean) unless `algorithm.loss_agg` says otherwise.

The variants are GRPO with other defaults; every default is a config key whose
value each variant's config class sets (jaxrlhf.config_schema: DrGRPOConfig,
DAPOConfig, GSPOConfig), so any mix can be written as `grpo` too
(docs/algorithms.md lists them).
"""

from jaxrlhf.algorithms.base import AlgorithmConfigError, register_algorithm
from jaxrlhf.algorithms.rl import RolloutAlgorithm


@register_algorithm
class GRPO(RolloutAlgorithm):
    name = "grpo"
    estimator = "grpo"
    loss = "grpo"
    kl_in_reward = False
    grouped = True


@register_algorithm
class DrGRPO(GRPO):
    """Dr. GRPO (Liu et al. 2025): both of GRPO's length and difficulty biases removed.

    Only the group mean is subtracted (dividing by the std up-weights groups that are nearly
    all right or all wrong), and each sequence's token sum is divided by the constant
    `generation.max_new_tokens` instead of its own length (which favours long wrong answers).
    """

    name = "dr_grpo"


@register_algorithm
class DAPO(GRPO):
    """DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic sampling, overlong shaping.

    The upper clip 1 + 0.28 is wider than the lower 1 - 0.2, so unlikely tokens can still gain
    probability (entropy does not collapse); the loss is a mean over all tokens of the batch, so
    long responses weigh by their length; groups whose rewards are all equal are dropped and the
    batch is filled from a larger pool (`select_groups`); `algorithm.overlong_buffer` turns on the
    soft length penalty. The paper uses no KL term: set `algorithm.kl_coef=0`.
    """

    name = "dapo"


@register_algorithm
class GSPO(GRPO):
    """GSPO (Zheng et al. 2025): the importance ratio and its clip are per sequence (see the
    `gspo` loss), with the paper's clip range 3e-4 / 4e-4."""

    name = "gspo"
    loss = "gspo"

    def validate(self) -> None:
        super().validate()
        agg = self.cfg.algorithm.loss_agg
        if agg != "seq-mean-token-mean":
            raise AlgorithmConfigError(
                f"algorithm.loss_agg={agg} does not apply to algorithm.name=gspo: its ratio and clip are per "
                "sequence, so it always averages per sequence; leave algorithm.loss_agg unset (seq-mean-token-mean)")
