"""Rewards that are not RL math: rule rewards by name (`rules`), programs run against tests in a sandbox
(`sandbox`), scores from an HTTP service (`remote`) and worker processes that score beside the step (`pool`).

Why a package of its own: a reward is the task's verdict on a response, computed on host from text; the RL
math that shapes it into advantages (bias, scale, clip, EOS gate, overlong penalty) stays in
`jaxrlhf.algorithms.rewards`. Importing this package imports no JAX.
"""
