"""Run assembly: everything between a resolved config and a running step loop.

`assembly.setup` is the one door every entry point (train, eval, the SFT warm-up,
re-planning, profile, plan, the scripts) goes through: it declares the algorithm,
reads the machine and the role model configs, and from there chooses the plan
(`planning`), builds the models on their home placements (`roles`) and binds them
to an executor. `stages` runs steps, `folder` claims the run's output folder,
`backend` starts JAX's devices.
"""
