"""Orbax checkpoints of a training run: array state plus JSON metadata.

Arrays (params, optimizer states, RNG keys) are saved with their shardings
and restored onto whatever shardings the *current* plan wants, so a run can
resume under a different placement. Small host-side state (step, data
position, KL controller, counters) goes into a JSON item beside them.

Multi-process: every process writes its own shards (the folder must be
shared). Orbax refuses arrays whose devices are all on one process (a group
of one host, as interleaved and disaggregated plans make), so those are
copied, device to device, to a layout over all devices for the save, and
restored through that layout; the files do not depend on the process count,
so a run resumes on any number of processes.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrlhf.models.hf_io import CheckpointError


class CheckpointManager:
    """Thin wrapper over `ocp.CheckpointManager` with one array item and one JSON item."""

    def __init__(self, directory: str, max_to_keep: int | None = 3):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            # declared up front, so a fresh manager can read a step's metadata before restoring it
            item_handlers={"arrays": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, arrays: Any, meta: dict[str, Any]) -> None:
        """Save and block until the checkpoint is complete on disk (a SIGKILL after this loses nothing)."""
        arrays, copies = _spread(arrays)
        self._mngr.save(
            step,
            args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self._mngr.wait_until_finished()
        for x in copies:
            x.delete()

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """Restore arrays onto the shardings of `target` (arrays or ShapeDtypeStructs with shardings)."""
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_save_sharding(x) or x.sharding), target
        )
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
        )
        return _gather_back(out["arrays"], target), dict(out["meta"])

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def _check_shapes(self, step: int, target: Any) -> None:
        """A checkpoint saved by a run with other model shapes names the first difference (instead of
        failing deep inside the restore). Parameters are compared by path; optimizer states follow them."""
        saved = self._mngr.item_metadata(step)["arrays"]
        tree = getattr(saved, "tree", saved)
        have = {_dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
        for path, x in jax.tree_util.tree_flatten_with_path(target)[0]:
            key = _dotted(path)
            if ".params." not in f".{key}.":
                continue
            if key not in have:
                raise CheckpointError(f"checkpoint step {step} has no parameter {key}: it was saved by a run "
                                      "with other models or another algorithm; resume with that run's config")
            shape = tuple(getattr(have[key], "shape", ()) or ())
            if shape != tuple(x.shape):
                raise CheckpointError(
                    f"checkpoint step {step} holds {key} with shape {list(shape)}, but this config builds "
                    f"{list(x.shape)}: resume with the model settings the run was started with"
                )

    def restore_latest(self, target: Any) -> tuple[int, Any, dict[str, Any]]:
        """The newest checkpoint that restores, falling back (and saying so) past damaged ones.

        When none restores because the model's shapes differ from the saved ones, that is the error."""
        problems = []
        for step in reversed(self.steps()):
            try:
                self._check_shapes(step, target)
                arrays, meta = self.restore(step, target)
                if int(meta.get("step", -1)) != step:
                    raise ValueError(f"its metadata says step {meta.get('step')!r}")
            except Exception as e:  # noqa: BLE001 - any failure to read a step is damage to that step
                problems.append((step, e))
                _collect_quietly()
            else:
                for bad, why in problems:
                    kept = self._set_aside(bad)
                    print(f"checkpoint step {bad} in {self.directory} cannot be restored ({_reason(why)}); "
                          f"using step {step} (the damaged one is kept as {kept})", file=sys.stderr, flush=True)
                if problems:
                    self._mngr.reload()
                return step, arrays, meta
        mismatch = [e for _, e in problems if isinstance(e, CheckpointError) and "this config builds" in str(e)]
        if mismatch:
            raise mismatch[0]
        detail = "; ".join(f"step {s}: {_reason(e)}" for s, e in problems) or "no checkpoint steps"
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be restored ({detail}); start afresh with run.resume=false "
            "and another run.output_dir (or run.overwrite=true)"
        )

    def _set_aside(self, step: int) -> str:
        """Move a damaged step out of the way (the run will save that step again), keeping it."""
        kept = os.path.join(self.directory, f"damaged-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(os.path.join(self.directory, str(step)), kept)
        return kept

    def close(self) -> None:
        self._mngr.close()


def _save_sharding(x: Any) -> NamedSharding | None:
    """The layout `x` is saved from when its devices are not on every process (None: its own): all
    devices, split along its largest dimension that divides evenly, replicated otherwise."""
    from jaxrlhf.placement.devices import global_devices

    if jax.process_count() == 1 or len({d.process_index for d in x.sharding.device_set}) == jax.process_count():
        return None
    devices = global_devices()
    mesh = Mesh(np.array(devices, dtype=object), ("all",), axis_types=(AxisType.Auto,))
    spec: list[str | None] = [None] * len(x.shape)
    dims = [k for k in sorted(range(len(x.shape)), key=lambda k: -x.shape[k]) if x.shape[k] % len(devices) == 0]
    if dims:
        spec[dims[0]] = "all"
    return NamedSharding(mesh, PartitionSpec(*spec), memory_kind=x.sharding.memory_kind)


def _spread(arrays: Any) -> tuple[Any, list[jax.Array]]:
    """`arrays` with every one-process array copied to its save layout; returns the copies to delete."""
    from jaxrlhf.placement.realloc import reallocate

    leaves, treedef = jax.tree_util.tree_flatten(arrays)
    todo = [(i, t) for i, x in enumerate(leaves) if (t := _save_sharding(x)) is not None]
    if not todo:
        return arrays, []
    copies, _ = reallocate([leaves[i] for i, _ in todo], [t for _, t in todo])
    for (i, _), y in zip(todo, copies):
        leaves[i] = y
    return jax.tree_util.tree_unflatten(treedef, leaves), copies


def _gather_back(restored: Any, target: Any) -> Any:
    """Restored arrays moved from their save layout to `target`'s shardings (where those differ)."""
    from jaxrlhf.placement.realloc import reallocate

    leaves, treedef = jax.tree_util.tree_flatten(restored)
    wanted = jax.tree_util.tree_leaves(target)
    todo = [i for i, t in enumerate(wanted) if _save_sharding(t) is not None]
    if todo:
        moved, _ = reallocate([leaves[i] for i in todo], [wanted[i].sharding for i in todo], free_source=True)
        for i, y in zip(todo, moved):
            leaves[i] = y
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _collect_quietly() -> None:
    """A failed Orbax restore leaves async handles whose finalisers print "Event loop is closed"
    tracebacks whenever they are collected; collect them now, without that noise."""
    import gc

    previous = sys.unraisablehook

    def hook(u):
        if not (isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value)):
            previous(u)

    sys.unraisablehook = hook
    try:
        gc.collect()
    finally:
        sys.unraisablehook = previous


def _dotted(path) -> str:
    """A tree path as "actor.opt_state.1.0.mu": the same for our trees and Orbax's metadata tree (which
    stores named tuples as lists)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    if parts and parts[-1] == "value":  # an NNX Variable's payload: Orbax's metadata tree has no such level
        parts.pop()
    return ".".join(parts)


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0][:200] if text else type(e).__name__)
