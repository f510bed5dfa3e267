"""Per-step metrics: JSON lines, TensorBoard event files, Weights & Biases (optional), and a terminal
progress display.

`metrics.jsonl` gets one object per step, one per line, flushed at once so a
killed run keeps every completed step. On resume the file is truncated to
the checkpointed step so the log never holds a step twice. With `run.wandb`
set the same records go to a W&B run whose id is kept in the run folder
(`WANDB_ID_FILE`), so a resumed run continues it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import string
import sys
from typing import Any, Mapping

# Keys shown in the progress line / plain log line, in this order, with their short names.
# Each algorithm's records hold some of them; those present are shown.
HEADLINE = {
    "reward/mean": "reward",
    "kl/mean": "kl",
    "loss/policy": "pg_loss",
    "loss/value": "v_loss",
    "loss/sft": "sft_loss",
    "loss/rm": "rm_loss",
    "rm/accuracy": "rm_acc",
    "loss/dpo": "dpo_loss",
    "rewards/accuracy": "dpo_acc",
    "eval/loss": "eval_loss",
    "eval/rm_accuracy": "eval_rm_acc",
    "eval/rewards_accuracy": "eval_dpo_acc",
    "time/step_s": "step_s",
}

WANDB_ID_FILE = "wandb_run_id"  # in the run folder: the W&B run a resumed run continues
WANDB_INSTALL = "pip install 'jaxrlhf[wandb]'"


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """`run.wandb` with its nulls resolved: the environment's W&B variables, then our defaults."""

    project: str
    name: str
    mode: str  # online, offline or disabled
    dir: str  # W&B writes its files under <dir>/wandb

    @classmethod
    def of(cls, section: Any, output_dir: str) -> "WandbSettings":
        return cls(project=section.project or os.environ.get("WANDB_PROJECT") or "jaxrlhf",
                   name=section.name or os.path.basename(os.path.normpath(os.path.abspath(output_dir))),
                   mode=section.mode or os.environ.get("WANDB_MODE") or "online",
                   dir=os.environ.get("WANDB_DIR") or output_dir)


def require_wandb(section: Any) -> None:
    """One clear line before a run spends any time: `run.wandb` is set (and not disabled) but the
    optional wandb package is not installed."""
    import importlib.util

    from jaxrlhf.config import ConfigError

    if section is None or (section.mode or os.environ.get("WANDB_MODE")) == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"run.wandb is set, but the wandb package is not installed: {WANDB_INSTALL} "
                          "(or set run.wandb=null)")


def _open_wandb(section: Any, output_dir: str, resume_step: int, config: Mapping[str, Any] | None):
    """The W&B run of this training run: the one named in the run folder when resuming from a
    checkpoint, else a new one (its id written there)."""
    settings = WandbSettings.of(section, output_dir)
    if settings.mode == "disabled":
        return None
    require_wandb(section)
    import wandb

    id_file = os.path.join(output_dir, WANDB_ID_FILE)
    run_id = None
    if resume_step > 0 and os.path.exists(id_file):
        with open(id_file) as f:
            run_id = f.read().strip() or None
    if run_id is None:
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's kind
        with open(id_file, "w") as f:
            f.write(run_id + "\n")
    os.makedirs(settings.dir, exist_ok=True)
    return wandb.init(project=settings.project, name=settings.name, id=run_id, resume="allow",
                      mode=settings.mode, dir=settings.dir, config=dict(config or {}))


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All step records of a metrics.jsonl file; a half-written last line (a run killed while writing
    it) is dropped, a damaged line anywhere else is an error naming it."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not a JSON record") from None
    return records


class MetricsWriter:
    """Writes the run's metrics; `enabled=False` (every process but the first of a multi-process run)
    writes nothing, so the files hold each step once."""

    def __init__(self, output_dir: str, total_steps: int, resume_step: int = 0, tensorboard: bool = True,
                 enabled: bool = True, wandb: Any = None, config: Mapping[str, Any] | None = None):
        """`wandb`: the `run.wandb` section (None: off), `config` the run's resolved config it logs."""
        self.enabled = enabled
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._truncate_after(resume_step)
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=resume_step + 1)
        self._wandb = _open_wandb(wandb, output_dir, resume_step, config) if wandb is not None else None
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=resume_step, desc="train", dynamic_ncols=True)

    def _truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (they belong to a run that died before its checkpoint)."""
        if not os.path.exists(self.path):
            return
        keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        with open(self.path, "w") as f:
            for r in keep:
                f.write(json.dumps(r) + "\n")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _jsonable(v) for k, v in sorted(metrics.items())}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:  # W&B keeps the first record of a step (one logged before a resume stays)
            self._wandb.log({k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))},
                            step=step)
        head = "  ".join(
            f"{short}={record[k]:.4g}" for k, short in HEADLINE.items() if isinstance(record.get(k), (int, float))
        )
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(head)
        else:
            print(f"step {step}: {head}", flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()
