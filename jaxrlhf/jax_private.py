"""The one place jaxrlhf reads JAX's private multi-process state (`jax._src.distributed`).

Why private: JAX's public API has no barrier across processes that names a
stuck peer and times out (`multihost_utils.sync_global_devices` compiles and
runs a collective, and waits forever for a dead process), and no way to read
this process's id before a backend starts (`jax.process_index()` starts one,
and the cross-process transfer address must be set before that). The
coordination service client and `global_state` give both. Should JAX rename
them, this module is the only one to change.

Importing this module does not import JAX.
"""

from __future__ import annotations

import sys
from typing import Any

_MODULE = "jax._src.distributed"


def _state() -> Any:
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state


def process_id() -> int:
    """This process's id as `jax.distributed.initialize` set it, without starting a backend."""
    return _state().process_id


def coordination_client() -> Any:
    """The coordination service client of a multi-process run (its `wait_at_barrier`)."""
    return _state().client


def all_processes_meet(barrier_id: str, timeout_s: float) -> bool:
    """Whether every process of the run reached `barrier_id` within `timeout_s`: how processes that
    agree to exit on an error meet first (a process that exits first ends the coordination service,
    process 0's, while the others still use it, and JAX aborts them)."""
    try:
        coordination_client().wait_at_barrier(barrier_id, int(timeout_s * 1000))
    except Exception:  # noqa: BLE001 - a missing or dead process surfaces as a generic client error
        return False
    return True


def joined_several_processes() -> bool:
    """Whether this process joined others through `jax.distributed` (False when JAX was never loaded:
    callers on the error path must not import JAX)."""
    state = getattr(sys.modules.get(_MODULE), "global_state", None)
    return state is not None and state.client is not None and (state.num_processes or 1) > 1
