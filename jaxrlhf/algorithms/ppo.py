"""PPO (Schulman et al. 2017) with a critic, as in InstructGPT and ReaLHF.

Token-level KL penalty to the reference in the reward (k1, coef 0.1, fixed
or adaptive), GAE advantages (gamma = lambda = 1 by default, no bootstrap
after the last response token), advantages whitened over the global batch by
default (`algorithm.whiten_advantages`), clipped policy and value losses,
optional EMA value normalisation, minibatch updates with an early stop when
the importance ratio explodes. The step graph is the full one of
`jaxrlhf.algorithms.rollout` (generate, reward, reference and critic
inference, actor and critic training).
"""

from jaxrlhf.algorithms.base import register_algorithm
from jaxrlhf.algorithms.rl import RolloutAlgorithm


@register_algorithm
class PPO(RolloutAlgorithm):
    name = "ppo"
    estimator = "gae"
    loss = "ppo"
    kl_in_reward = True
