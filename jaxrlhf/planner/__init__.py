"""The planner, free of JAX: hardware profiles, execution plans, cost and memory models,
the multi-step simulator, strategy presets and the plan search.

It knows an RLHF algorithm only through the call graph it is given
(`jaxrlhf.graph`); it never imports `jaxrlhf.algorithms` or JAX, so a
70B plan for 128 GPUs can be searched on a laptop.
"""
