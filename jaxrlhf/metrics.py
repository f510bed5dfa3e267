"""Per-step metrics: JSON lines, TensorBoard event files, and a terminal progress display.

`metrics.jsonl` gets one object per step, one per line, flushed at once so a
killed run keeps every completed step. On resume the file is truncated to
the checkpointed step so the log never holds a step twice.
"""

from __future__ import annotations

import json
import math
import os
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
                 enabled: bool = True):
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
        if self._bar is not None:
            self._bar.close()
