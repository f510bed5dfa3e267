"""Evaluate a trained actor on the held-out split of its run's config.

    python -m jaxrlhf.eval --config FILE --checkpoint DIR [--output FILE] [key=value ...]

DIR is an HF checkpoint (config.json + *.safetensors), or a run's output folder holding one as
`actor_hf/` (what a run exports at its end). The config is the one the actor was trained with
(its tokenizer, data, generation and reward settings); overrides apply as for training, e.g.
`eval.samples=16 eval.pass_k=[1,8]` or `data.eval_split=test`. The metrics are those of
`run.eval_every` (docs/evaluation.md): greedy accuracy and rule means, and pass@k with
`eval.samples`. They are printed as one JSON object and, with `--output`, written to FILE
(an existing FILE is not overwritten). Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Sequence

from jaxrlhf import config as cfglib


def checkpoint_dir(path: str) -> str:
    """The HF checkpoint folder `--checkpoint` names: the folder itself or its `actor_hf/`."""
    for folder in (path, os.path.join(path, "actor_hf")):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return folder
    raise cfglib.ConfigError(
        f"--checkpoint {path}: no HF checkpoint (config.json + *.safetensors) there or in {path}/actor_hf; "
        "a run writes one at its end (run.export_hf=true)"
    )


def evaluate(cfg: cfglib.Config, checkpoint: str) -> dict[str, float]:
    """Load the actor from `checkpoint` onto the devices and run the algorithm's held-out evaluation."""
    import jax

    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.algorithms.base import RoleSpec
    from jaxrlhf.graph import CallGraph
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.placement.executor import Executor, Role
    from jaxrlhf.placement.layout import AxisRules
    from jaxrlhf.planner.presets import build_plan
    from jaxrlhf.run.planning import role_configs
    from jaxrlhf.run.roles import RoleBuilder

    actor = dataclasses.replace(cfg.model.actor, path=checkpoint_dir(checkpoint), preset=None, init_from=None)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, actor=actor))
    cfglib.validate(cfg)
    if not cfg.data.eval_split:
        raise cfglib.ConfigError("data.eval_split is null: name the held-out split to evaluate on")
    algorithm = build_algorithm(cfg)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    # Only the generate call runs: the actor alone, on every device.
    graph = CallGraph((algorithm.graph()["actor.generate"],), feed=("prompt_tokens", "prompt_mask", "rng_generate"))
    models = role_configs(cfg, ["actor"], jax.default_backend())
    plan = build_plan("colocated", jax.device_count(), models, graph, batch_size=algorithm.batch_rows)
    cache = CallCache(plan, rules=AxisRules.from_config(cfg.plan.axis_rules))
    builder = RoleBuilder(cfg, {"actor": RoleSpec("lm", False, "evaluated")}, models, cache, plan)
    built = builder.direct("actor", "actor")
    role = Role("actor", built.graphdef, built.params)
    algorithm.bind(tokenizer, {"actor": role})
    executor = Executor(plan, graph, {"actor": role}, cache=cache,
                        functions={"actor.generate": algorithm.functions()["actor.generate"]})
    metrics = algorithm.evaluate(executor)
    if not metrics:
        raise cfglib.ConfigError(f"algorithm.name={cfg.algorithm.name} with these rewards has no held-out evaluation "
                                 "(RL algorithms need rewards.rules)")
    return metrics


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, cfglib.Config]:
    p = argparse.ArgumentParser(prog="python -m jaxrlhf.eval", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run's config YAML")
    p.add_argument("--checkpoint", required=True, help="HF checkpoint folder, or a run folder holding actor_hf/")
    p.add_argument("--output", help="also write the metrics as JSON to this (new) file")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(list(argv))
    return args, cfglib.load_config(args.config, args.overrides)


def _main(argv: Sequence[str]) -> int:
    from jaxrlhf.run.backend import setup_devices

    args, cfg = _parse(argv)
    if args.output and os.path.exists(args.output):
        raise cfglib.ConfigError(f"--output {args.output} exists; name a new file (results are never overwritten)")
    setup_devices(cfg.run, cfg.distributed)
    metrics: dict[str, Any] = evaluate(cfg, args.checkpoint)
    text = json.dumps(dict(sorted(metrics.items())))
    print(text, flush=True)
    if args.output:
        with open(args.output, "x") as f:
            f.write(text + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxrlhf.eval`: exit 0, or 2 with one line for a user's mistake (see jaxrlhf.errors)."""
    from jaxrlhf.errors import run_cli

    return run_cli("jaxrlhf.eval", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
