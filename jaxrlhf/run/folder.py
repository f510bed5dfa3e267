"""A run's output folder: one run at a time per folder, and never over another run's files.

`output_dir_lock` refuses a second run started into a folder in use;
`prepare_output_dir` refuses to start over a finished run's files unless the
config says to resume or overwrite it; `RunFiles` names every file a run
writes there, and says so on the console at the start and at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Iterator

from jaxrlhf import config as cfglib
from jaxrlhf.errors import EveryProcess, RunError


class OutputDirBusy(RunError, EveryProcess):
    """Another run holds the output folder; every process of this one is refused alike."""


@contextlib.contextmanager
def output_dir_lock(out: str) -> Iterator[None]:
    """Hold `<out>/.lock` for the run, so a second run started into the same folder (by mistake, or a
    launcher started twice) is refused before it touches a file. Process 0 takes the lock; every process
    agrees on the outcome. An OS lock (flock; NFS v4 shares it between hosts) dies with its process, so a
    killed run leaves no stale lock; the empty file stays."""
    import fcntl

    from jaxrlhf.transfer.processes import any_process, is_main

    handle, busy = None, False
    if is_main() and not (os.path.exists(out) and not os.path.isdir(out)):  # a file: prepare_output_dir says so
        os.makedirs(out, exist_ok=True)
        handle = open(os.path.join(out, ".lock"), "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            handle, busy = None, True
    if any_process(busy):
        raise OutputDirBusy(f"run.output_dir={out!r} is in use by another run that is still going (it holds "
                       f"{os.path.join(out, '.lock')}); nothing was changed. Wait for it to end, or choose "
                       "another run.output_dir")
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # releases the lock


def prepare_output_dir(run_cfg: cfglib.RunConfig, write: bool = True) -> None:
    """Refuse to start a new run over another run's files (nothing is changed), unless asked to resume
    it or to overwrite it. Every process checks (so all stop alike); only the one that `write`s removes."""
    import shutil

    out = run_cfg.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise RunError(f"run.output_dir={out!r} is a file, not a folder; choose another run.output_dir")
    if run_cfg.resume or not os.path.isdir(out):
        return

    def holds(name: str) -> bool:  # empty leftovers of a run that failed at start-up do not count
        path = os.path.join(out, name)
        return bool(os.listdir(path)) if os.path.isdir(path) else os.path.exists(path) and os.path.getsize(path) > 0

    found = [n for n in ("checkpoints", "metrics.jsonl", "tensorboard") if holds(n)]
    if not found:
        return
    if not run_cfg.overwrite:
        raise RunError(
            f"run.output_dir={out!r} holds another run ({', '.join(found)}); nothing was changed. Continue it "
            "with run.resume=true, choose another run.output_dir, or replace it with run.overwrite=true"
        )
    if not write:
        return
    from jaxrlhf.metrics import WANDB_ID_FILE

    others = [n for n in os.listdir(out) if n.endswith(("_hf", "_lora")) or n in ("profile", "wandb", WANDB_ID_FILE)]
    for name in found + others:
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    print(f"run.overwrite=true: removed the previous run's {', '.join(found)} from {out}", flush=True)


def set_aside_log(out: str) -> None:
    """run.resume=true with no checkpoint starts at step 0; the old log is kept beside the new one."""
    log = os.path.join(out, "metrics.jsonl")
    print(f"run.resume=true, but {out} has no checkpoint: starting from step 0", flush=True)
    if os.path.exists(log):
        kept = os.path.join(out, f"metrics.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        os.replace(log, kept)
        print(f"the previous metrics.jsonl (no checkpoint) is kept as {kept}", flush=True)


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """Where a run writes: the one place that names its files, printed at the start and at the end."""

    folder: str
    metrics: str
    tensorboard: str | None  # None: run.tensorboard=false
    checkpoints: str
    exports: dict[str, str]  # role -> its HF checkpoint folder (empty: run.export_hf=false)
    plan: str = ""  # the plan the run started with (re-plans: replan/plan_step<N>.yaml)
    hardware: str = ""  # the hardware profile plan choice priced it with

    @classmethod
    def of(cls, run_cfg: cfglib.RunConfig, export_roles: tuple[str, ...]) -> "RunFiles":
        out = run_cfg.output_dir
        return cls(out, os.path.join(out, "metrics.jsonl"),
                   os.path.join(out, "tensorboard") if run_cfg.tensorboard else None,
                   os.path.join(out, "checkpoints"),
                   {role: os.path.join(out, f"{role}_hf") for role in export_roles} if run_cfg.export_hf else {},
                   os.path.join(out, "plan.yaml"), os.path.join(out, "hardware.yaml"))

    def summary(self, run_cfg: cfglib.RunConfig, last_checkpoint: int | None = None, finished: bool = False) -> str:
        """What goes where, with how often; at the end (`finished`) only what was written."""
        every = run_cfg.log_every
        often = _every(every)
        saves = _every(run_cfg.checkpoint_every) if run_cfg.checkpoint_every else "at the last step"
        lines = [f"run folder: {self.folder}",
                 f"  metrics:     {self.metrics} ({often}, run.log_every={every}; the console shows the same steps)"]
        if self.tensorboard:
            lines.append(f"  tensorboard: {self.tensorboard} (tensorboard --logdir {self.tensorboard})")
        if run_cfg.wandb is not None:
            from jaxrlhf.metrics import WandbSettings

            wb = WandbSettings.of(run_cfg.wandb, self.folder)
            if wb.mode != "disabled":
                lines.append(f"  wandb:       project {wb.project}, run {wb.name}, {wb.mode} "
                             f"(W&B files under {os.path.join(wb.dir, 'wandb')})")
        if self.plan:
            lines.append(f"  plan:        {self.plan} (the placement it {'started' if finished else 'starts'} with; "
                         f"plan.file=... runs it again), priced with {self.hardware}")
        if finished:
            lines.append(f"  checkpoints: {self.checkpoints} (latest: step {last_checkpoint})" if last_checkpoint
                         else f"  checkpoints: none written ({self.checkpoints})")
        elif not run_cfg.save_checkpoints:
            lines.append("  checkpoints: none (run.save_checkpoints=false)")
        else:
            lines.append(f"  checkpoints: {self.checkpoints} ({saves}, the newest {run_cfg.keep_checkpoints} kept)")
        for role, folder in self.exports.items():
            lines.append(f"  {role} model: {folder} (HF checkpoint{'' if finished else ', written at the end'})")
        return "\n".join(lines)


def _every(n: int) -> str:
    return "every step" if n == 1 else f"every {n} steps and the last"
