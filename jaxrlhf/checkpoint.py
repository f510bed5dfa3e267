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

import errno
import logging
import os
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrlhf.errors import EveryProcess
from jaxrlhf.models.hf_io import CheckpointError


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of another run: another algorithm, other roles or other model shapes."""


class DiskFull(CheckpointError, EveryProcess):
    """A save ran out of space on some process; every process raises it, after the partial step is gone."""


class CheckpointManager:
    """Thin wrapper over `ocp.CheckpointManager` with one array item and one JSON item."""

    def __init__(self, directory: str, max_to_keep: int | None = 3):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        _quiet_library_noise()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        arrays, meta = ocp.StandardCheckpointHandler(), ocp.JsonCheckpointHandler()
        self._abandon_key = ""  # where a process whose writes of the current save failed says so
        if jax.process_count() > 1:
            # Orbax's save thread waits for every process's writes; one whose writes failed never comes, so
            # it tells the others at once (`_telling`) and they stop waiting (`_save_barrier`) instead of
            # waiting out Orbax's 20-minute timeout.
            options.async_options = ocp.AsyncOptions(barrier_sync_fn=self._save_barrier)
            _telling(arrays, self._tell_failure)
            _telling(meta, self._tell_failure)
            # A restore that fails on one process only (damage to the shard files it alone reads) must fail
            # on all, before Orbax's barrier after the read, which the failed process would never reach.
            _agreeing(arrays)
            _agreeing(meta)
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=options,
            # declared up front, so a fresh manager can read a step's metadata before restoring it
            item_handlers={"arrays": arrays, "meta": meta},
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, arrays: Any, meta: dict[str, Any]) -> None:
        """Save and block until the checkpoint is complete on disk (a SIGKILL after this loses nothing).

        A save that fails for want of space leaves the earlier steps as they were (Orbax writes into a
        temporary folder and renames it only when complete); the partial folder is removed and the
        error says which step is the newest intact one. With several processes the space may run out
        for one of them only: it tells the others, and all stop alike."""
        import json

        from jaxrlhf.transfer.processes import Abandoned

        arrays, copies = _spread(arrays)
        self._abandon_key = f"checkpoint-save-failed/{step}"
        quiet = _OrbaxErrorLogs()
        logging.getLogger("absl").addFilter(quiet)
        try:
            self._mngr.save(
                step,
                args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - Orbax reports a full disk as a ValueError from TensorStore
            told = _in_chain(e, Abandoned)
            failed = json.loads(str(told)) if told else self._tell_failure(e)
            if not failed["disk_full"]:
                if told:
                    raise CheckpointError(f"cannot save checkpoint step {step} in {self.directory}: process "
                                          f"{failed['process']} could not write its part ({failed['reason']}); "
                                          "its output has the error") from None
                raise
            self._remove_partial(step)
            kept = [s for s in self.steps() if s != step]
            raise DiskFull(
                f"cannot save checkpoint step {step} in {self.directory}: the disk is full (no space left on device); "
                + (f"the newest intact checkpoint is step {kept[-1]}. " if kept else "no earlier checkpoint exists. ")
                + "Free space (or lower run.keep_checkpoints), then run the same command with run.resume=true"
            ) from None
        finally:
            logging.getLogger("absl").removeFilter(quiet)
            for x in copies:
                x.delete()

    def _tell_failure(self, e: BaseException) -> dict[str, Any]:
        """Tell the other processes that this one's writes of the current save failed, and why."""
        import json

        from jaxrlhf.transfer.processes import post

        failed = {"process": jax.process_index(), "disk_full": _disk_full(e), "reason": _reason(e)}
        post(self._abandon_key, json.dumps(failed))
        return failed

    def _save_barrier(self, *, key: str, timeout_ms: int) -> None:
        """Orbax's barriers: the one after every process's writes is called off by a process whose writes
        failed; the others (reached by every process, also after a failure) are plain."""
        from jaxrlhf import jax_private
        from jaxrlhf.transfer.processes import barrier_unless_posted

        if _WRITES_DONE in key:
            barrier_unless_posted(f"orbax/{key}", timeout_ms / 1000, self._abandon_key)
        else:
            jax_private.coordination_client().wait_at_barrier(key, timeout_ms)

    def _remove_partial(self, step: int) -> None:
        """Remove what a failed save of `step` left behind (only one process touches the shared folder)."""
        import shutil

        from jaxrlhf.transfer.processes import barrier, is_main

        if is_main():
            for name in os.listdir(self.directory):
                if name == str(step) or name.startswith(f"{step}.orbax-checkpoint-tmp"):
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        barrier("checkpoint_partial_removed")
        self._mngr.reload()

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

    def restore_params(self, step: int, role: str, target: Any) -> Any:
        """Only `role`'s parameters of step `step`, onto the shardings of `target` (evaluation of a
        run's intermediate step: no optimizer state, no other role read)."""
        saved = self._mngr.item_metadata(step)["arrays"]
        tree = getattr(saved, "tree", saved)
        if role not in tree or "params" not in tree[role]:
            raise CheckpointMismatch(f"checkpoint step {step} in {self.directory} holds no parameters of "
                                     f"{role!r} (roles: {', '.join(_roles(tree))})")
        self._check_compatible(step, {role: {"params": target}}, None, roles=False)
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_save_sharding(x) or x.sharding), target
        )
        folder = os.path.join(self.directory, str(step), "arrays")
        with ocp.PyTreeCheckpointer() as reader:
            out = reader.restore(folder, args=ocp.args.PyTreeRestore(
                item={role: {"params": abstract}}, partial_restore=True,
                restore_args=ocp.checkpoint_utils.construct_restore_args({role: {"params": abstract}})))
        return _gather_back(out[role]["params"], target)

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def read_meta(self, step: int) -> dict[str, Any]:
        """A step's JSON metadata alone (no arrays read)."""
        return dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def _check_compatible(self, step: int, target: Any, algorithm: str | None, roles: bool = True) -> None:
        """A checkpoint written by another algorithm, with other roles or other model shapes is not
        damage: say what wrote it (instead of Orbax's "tree structures do not match"). Parameters are
        compared by path; optimizer states follow them."""
        saved = self._mngr.item_metadata(step)["arrays"]
        tree = getattr(saved, "tree", saved)
        written_by = self.read_meta(step).get("algorithm")
        have_roles, want_roles = _roles(tree), _roles(target)
        if (algorithm and written_by and written_by != algorithm) or (roles and have_roles != want_roles):
            raise CheckpointMismatch(
                f"checkpoint step {step} was written by algorithm {written_by or '(not recorded)'} with roles "
                f"{', '.join(have_roles)}, but this config runs {algorithm or 'an algorithm'} with roles "
                f"{', '.join(want_roles)}: resume with the config that run was started with, or start afresh "
                "with run.resume=false and another run.output_dir"
            )
        have = {_dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
        for path, x in jax.tree_util.tree_flatten_with_path(target)[0]:
            key = _dotted(path)
            if ".params." not in f".{key}.":
                continue
            if key not in have:
                raise CheckpointMismatch(f"checkpoint step {step} has no parameter {key}: it was saved by a run "
                                         "with other models; resume with that run's config")
            shape = tuple(getattr(have[key], "shape", ()) or ())
            if shape != tuple(x.shape):
                raise CheckpointMismatch(
                    f"checkpoint step {step} holds {key} with shape {list(shape)}, but this config builds "
                    f"{list(x.shape)}: resume with the model settings the run was started with"
                )

    def restore_latest(self, target: Any, algorithm: str | None = None) -> tuple[int, Any, dict[str, Any]]:
        """The newest checkpoint that restores, falling back (and saying so) past damaged ones.

        With several processes the step is agreed: the newest one every process could read (damage may
        be visible to one process only, in its own shard files), and only process 0 moves damaged steps
        aside (the folder is shared). When none restores because the checkpoint was written by another
        algorithm or other model shapes, that is the error."""
        from jaxrlhf.transfer.processes import agreed_steps, any_process, barrier, is_main

        self.remove_leftovers()
        problems = []
        for step in reversed(agreed_steps(self.steps())):
            error: Exception | None = None
            try:
                self._check_compatible(step, target, algorithm)
                arrays, meta = self.restore(step, target)
                if int(meta.get("step", -1)) != step:
                    raise ValueError(f"its metadata says step {meta.get('step')!r}")
            except Exception as e:  # noqa: BLE001 - any failure to read a step is damage to that step
                error = e
                _collect_quietly()
            if any_process(error is not None):
                problems.append((step, error or CheckpointError("another process could not read it")))
                continue
            for bad, why in problems:
                kept = self._set_aside(bad) if is_main() else "aside by process 0"
                print(f"checkpoint step {bad} in {self.directory} cannot be restored ({_reason(why)}); "
                      f"using step {step} (the damaged one is kept as {kept})", file=sys.stderr, flush=True)
            if problems:
                barrier("checkpoint_set_aside")
                self._mngr.reload()
            return step, arrays, meta
        mismatch = [e for _, e in problems if isinstance(e, CheckpointMismatch)]
        if mismatch:
            raise mismatch[0]
        detail = "; ".join(f"step {s}: {_reason(e)}" for s, e in problems) or "no checkpoint steps"
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be restored ({detail}); start afresh with run.resume=false "
            "and another run.output_dir (or run.overwrite=true)"
        )

    def remove_leftovers(self) -> list[str]:
        """Remove the temporary folders (`N.orbax-checkpoint-tmp...`) of saves that never finished (a second
        Ctrl-C, a kill during a save), one line each; returns their paths. Only for the run that owns the
        folder (a resume): another run's save in progress looks the same. Process 0 removes (the folder is
        shared), every process waits for it."""
        import re
        import shutil

        from jaxrlhf.transfer.processes import barrier, is_main

        removed = []
        if is_main():
            for name in sorted(os.listdir(self.directory)):
                path = os.path.join(self.directory, name)
                if re.fullmatch(r"\d+\.orbax-checkpoint-tmp.*", name) and os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
                    print(f"removed {path}: an unfinished checkpoint save left it behind (the run was stopped "
                          "while saving); the finished steps are untouched", file=sys.stderr, flush=True)
        barrier("checkpoint_leftovers_removed")
        return removed

    def _set_aside(self, step: int) -> str:
        """Move a damaged step out of the way (the run will save that step again), keeping it."""
        kept = os.path.join(self.directory, f"damaged-step-{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(os.path.join(self.directory, str(step)), kept)
        return kept

    def close(self) -> None:
        self._mngr.close()


# Orbax's barrier after every process's writes of a save (orbax-checkpoint 0.12 names it so); should it
# be renamed, a process whose writes fail leaves the others waiting for Orbax's timeout again.
_WRITES_DONE = "async_write_complete"


class _OrbaxErrorLogs(logging.Filter):
    """Drops Orbax's error logs during a save: a failed save is logged with its traceback, from two
    threads, before it raises; the error boundary says it in one line (with the traceback under --debug,
    and a bug's traceback always)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


def _telling(handler: Any, tell) -> None:
    """Make `handler`'s writes, when they fail, `tell` the other processes at once: from Orbax's save
    thread, before the barrier where the others wait for this process's writes. (The instance's method
    is wrapped, not the class subclassed: Orbax looks handlers up by class.)"""
    async_save = handler.async_save

    async def telling_async_save(*args, **kwargs):
        return [_TellingFuture(f, tell) for f in await async_save(*args, **kwargs) or []]

    handler.async_save = telling_async_save


def _agreeing(handler: Any) -> None:
    """Make `handler`'s restores succeed or fail on every process alike: one whose read failed raises its
    error, the others a CheckpointError saying another process could not read it."""
    from jaxrlhf.transfer.processes import any_process_at

    restore = handler.restore

    def agreeing_restore(directory, *args, **kwargs):
        try:
            out, error = restore(directory, *args, **kwargs), None
        except Exception as e:  # noqa: BLE001 - agreed on first, then raised as it was
            out, error = None, e
        where = "/".join(os.path.normpath(str(directory)).split(os.sep)[-2:])  # "<step>/<item>": the same on every host
        if any_process_at(f"restore/{where}", error is not None) and error is None:
            raise CheckpointError(f"another process could not read {where}")
        if error is not None:
            raise error
        return out

    handler.restore = agreeing_restore


class _TellingFuture:
    """An Orbax write future that calls `tell(error)` when the write fails."""

    def __init__(self, future, tell):
        self._future, self._tell = future, tell

    def result(self, timeout: float | None = None) -> Any:
        try:
            return self._future.result(timeout=timeout)
        except Exception as e:  # noqa: BLE001 - told, then raised as it was
            self._tell(e)
            raise

    def cancel(self) -> Any:
        return self._future.cancel()


def _in_chain(e: BaseException | None, kind: type) -> BaseException | None:
    """The first exception of type `kind` among `e` and its causes."""
    while e is not None and not isinstance(e, kind):
        e = e.__cause__ or e.__context__
    return e


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
    from jaxrlhf.transfer.realloc import reallocate

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
    from jaxrlhf.transfer.realloc import reallocate

    leaves, treedef = jax.tree_util.tree_flatten(restored)
    wanted = jax.tree_util.tree_leaves(target)
    todo = [i for i, t in enumerate(wanted) if _save_sharding(t) is not None]
    if todo:
        moved, _ = reallocate([leaves[i] for i in todo], [wanted[i].sharding for i in todo], free_source=True)
        for i, y in zip(todo, moved):
            leaves[i] = y
    return jax.tree_util.tree_unflatten(treedef, leaves)


_library_noise_dropped = 0  # Orbax/TensorStore leftovers kept out of the console (`_quiet_library_noise`)


def _quiet_library_noise() -> None:
    """Keep the leftovers of a failed Orbax read or write out of the console, for the rest of the process.

    When one read or write of a restore or save fails, Orbax stops waiting for the others and closes its
    event loop: each read still pending is finalised later (at the next collection, or at exit) and its
    `except BaseException` turns the GeneratorExit into "Encountered error while reading array index",
    and each TensorStore write that completes afterwards calls into the closed loop ("Event loop is
    closed"). Python prints every one as an unraisable exception: one traceback per array, after the
    failure was already handled (a fallback to the previous step, a full disk's one line). Those are
    dropped (counted in `_library_noise_dropped`); every other unraisable exception goes on to the hook
    that was there. JAXRLHF_DEBUG=1 keeps them all."""
    if os.environ.get("JAXRLHF_DEBUG", "") not in ("", "0") or getattr(sys.unraisablehook, "_jaxrlhf_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(u) -> None:
        global _library_noise_dropped
        if _library_noise(u.exc_value, u.object):
            _library_noise_dropped += 1
        else:
            previous(u)

    hook._jaxrlhf_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_AsyncioOrbaxNoise())


def _library_noise(e: BaseException | None, obj: Any) -> bool:
    """Whether an unraisable exception is a leftover of a failed Orbax read or write (`_quiet_library_noise`)."""
    if isinstance(e, RuntimeError) and "Event loop is closed" in str(e):
        return True
    code = getattr(obj, "cr_code", None) or getattr(obj, "gi_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    return e is not None and _from_orbax(e.__traceback__)


def _from_orbax(tb) -> bool:
    """Whether a traceback passes through Orbax's code."""
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _AsyncioOrbaxNoise(logging.Filter):
    """asyncio's reports of Orbax tasks left behind by a failed read or write ("Task exception was never
    retrieved", "Task was destroyed but it is pending!"): the failure itself is reported once, by us."""

    def filter(self, record: logging.LogRecord) -> bool:
        global _library_noise_dropped
        exc = record.exc_info[1] if record.exc_info else None
        if (exc is not None and _from_orbax(exc.__traceback__)) or f"{os.sep}orbax{os.sep}" in record.getMessage():
            _library_noise_dropped += 1
            return False
        return True


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


def _roles(tree: Any) -> list[str]:
    """The roles a checkpoint tree holds (its top-level keys other than the algorithm's "state")."""
    return sorted(str(k) for k in tree if k != "state") if isinstance(tree, Mapping) else []


def _disk_full(e: BaseException) -> bool:
    """Whether a save failed for want of space: an OSError, or TensorStore's error text through Orbax."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0][:200] if text else type(e).__name__)
