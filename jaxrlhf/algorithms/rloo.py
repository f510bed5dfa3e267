"""RLOO (Kool et al. 2019; Ahmadian et al. 2024): REINFORCE with a leave-one-out baseline.

G samples per prompt; each sample's baseline is the mean reward of the other
G - 1, so it does not depend on the sample itself. The reward includes the
token-level KL penalty (as TRL's RLOO trainer), advantages are not whitened,
and the update is the clipped PPO surrogate over minibatches (with one epoch
and one minibatch it is plain REINFORCE).
"""

from jaxrlhf.algorithms.base import register_algorithm
from jaxrlhf.algorithms.rl import RolloutAlgorithm


@register_algorithm
class RLOO(RolloutAlgorithm):
    name = "rloo"
    estimator = "rloo"
    loss = "ppo"
    kl_in_reward = True
    grouped = True
