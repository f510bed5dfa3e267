"""RL algorithms: dataflow graph, rollout, rewards, losses, advantages and the step engine."""
