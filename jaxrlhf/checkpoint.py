"""Orbax checkpoints of a training run: array state plus JSON metadata.

Arrays (params, optimizer states, RNG keys) are saved with their shardings
and restored onto whatever shardings the *current* plan wants, so a run can
resume under a different placement. Small host-side state (step, data
position, KL controller, counters) goes into a JSON item beside them.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointManager:
    """Thin wrapper over `ocp.CheckpointManager` with one array item and one JSON item."""

    def __init__(self, directory: str, max_to_keep: int | None = 3):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, arrays: Any, meta: dict[str, Any]) -> None:
        """Save and block until the checkpoint is complete on disk (a SIGKILL after this loses nothing)."""
        self._mngr.save(
            step,
            args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._mngr.wait_until_finished()

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """Restore arrays onto the shardings of `target` (arrays or ShapeDtypeStructs with shardings)."""
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
        )
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
        )
        return out["arrays"], dict(out["meta"])

    def close(self) -> None:
        self._mngr.close()
