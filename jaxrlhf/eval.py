"""Evaluate a trained actor on the held-out split of its run's config.

    python -m jaxrlhf.eval --config FILE --checkpoint DIR [--output FILE] [key=value ...]

DIR is an HF checkpoint (config.json + *.safetensors), or a run's output folder holding one as
`actor_hf/` (what a run exports at its end), or a run's Orbax training checkpoints: `RUN/checkpoints`
(its newest step), `RUN/checkpoints/N` (step N), or a run folder that exported nothing. The config is the one the actor was trained with
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


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What `--checkpoint` names: an HF folder (`hf`), or a training run's Orbax checkpoints folder
    with the step to read (`orbax`, `step`)."""

    hf: str | None = None
    orbax: str | None = None
    step: int | None = None


def find_checkpoint(path: str) -> Checkpoint:
    """The checkpoint `--checkpoint` names: an HF checkpoint folder or a run folder holding `actor_hf/`;
    else a run's Orbax checkpoints (`RUN/checkpoints`, its newest step) or one step of them
    (`RUN/checkpoints/N`), or a run folder with `checkpoints/` and no export."""
    for folder in (path, os.path.join(path, "actor_hf")):
        if os.path.isfile(os.path.join(folder, "config.json")):
            return Checkpoint(hf=folder)
    path = os.path.normpath(path)
    if os.path.isdir(os.path.join(path, "arrays")) and os.path.basename(path).isdigit():
        return Checkpoint(orbax=os.path.dirname(path), step=int(os.path.basename(path)))
    for folder in (path, os.path.join(path, "checkpoints")):
        steps = [int(n) for n in _listdir(folder) if n.isdigit() and os.path.isdir(os.path.join(folder, n, "arrays"))]
        if steps:
            return Checkpoint(orbax=folder, step=max(steps))
    raise cfglib.ConfigError(
        f"--checkpoint {path}: no HF checkpoint (config.json + *.safetensors) there or in {path}/actor_hf, and "
        "no training checkpoint (a run's checkpoints/ folder or one step of it, checkpoints/N); a run writes "
        "both (run.export_hf, run.checkpoint_every)"
    )


def _listdir(folder: str) -> list[str]:
    return os.listdir(folder) if os.path.isdir(folder) else []


def evaluate(cfg: cfglib.Config, checkpoint: str) -> dict[str, float]:
    """Load the actor from `checkpoint` onto the devices and run the algorithm's held-out evaluation:
    only its generate call, colocated on every device, assembled like any run (`assembly.setup`)."""
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.run.assembly import setup

    found = find_checkpoint(checkpoint)
    if found.hf:
        actor = dataclasses.replace(cfg.model.actor, path=found.hf, preset=None, init_from=None)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, actor=actor))
    cfglib.validate(cfg)
    if not cfg.data.eval_split:
        raise cfglib.ConfigError("data.eval_split is null: name the held-out split to evaluate on")
    run_setup = setup(cfg, calls=("actor.generate",))
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    run = run_setup.build(run_setup.choose_plan("colocated"), tokenizer)
    if found.orbax:  # the actor as the run's config builds it, then its weights of that step
        from jaxrlhf.checkpoint import CheckpointManager

        actor = run.roles["actor"]
        reader = CheckpointManager(found.orbax, max_to_keep=None)
        try:
            actor.params = reader.restore_params(found.step, "actor", actor.params)
        finally:
            reader.close()
        print(f"evaluating the actor of step {found.step} of {found.orbax}", file=sys.stderr, flush=True)
    metrics = run_setup.algorithm.evaluate(run.executor)
    if not metrics:
        raise cfglib.ConfigError(f"algorithm.name={cfg.algorithm.name} with these rewards has no held-out evaluation "
                                 "(RL algorithms need rewards.rules)")
    return metrics


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, cfglib.Config]:
    p = argparse.ArgumentParser(prog="python -m jaxrlhf.eval", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run's config YAML")
    p.add_argument("--checkpoint", required=True, help="HF checkpoint folder, a run folder (actor_hf/ or checkpoints/), RUN/checkpoints or RUN/checkpoints/N")
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
