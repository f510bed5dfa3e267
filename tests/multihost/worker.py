"""One process of the multi-process tests (started by test_multihost.py; not a test module).

`python worker.py SPEC_JSON`: join the run described by the spec, then do its `runs` (train.run of
each override list, timing it, its plan searches `search_iterations` long), its `realloc` check and its `fail`, `signal_in_save` or `disk_full` behaviour, writing
what it found
to `<out>/worker-<process>.json`.
"""

from __future__ import annotations

import json
import os
import sys
import time


def realloc_check() -> dict:
    """Move arrays between groups on different processes (and spanning both) with transfer guards on;
    read them back gathered and compare on every process."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxrlhf.placement.devices import global_devices
    from jaxrlhf.transfer.host import host_get
    from jaxrlhf.transfer.realloc import put_host, reallocate

    devs = global_devices()

    def sharding(lo, hi, shape, names, spec):
        mesh = Mesh(np.array(devs[lo:hi], dtype=object).reshape(shape), names,
                    axis_types=(AxisType.Auto,) * len(names))
        return NamedSharding(mesh, P(*spec))

    value = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    cases = {  # name: (source, target)
        "p0 fsdp4 -> p1 fsdp4": (sharding(0, 4, (4,), ("f",), ("f",)), sharding(4, 8, (4,), ("f",), ("f",))),
        "p0 fsdp4 -> p1 2x2": (sharding(0, 4, (4,), ("f",), ("f",)),
                               sharding(4, 8, (2, 2), ("d", "t"), ("d", "t"))),
        "all 8 -> p1 tensor2": (sharding(0, 8, (8,), ("f",), ("f",)), sharding(4, 6, (2,), ("t",), (None, "t"))),
        "p1 2x2 -> all 2x4": (sharding(4, 8, (2, 2), ("d", "t"), ("d", "t")),
                              sharding(0, 8, (2, 4), ("d", "t"), ("t", "d"))),
        "p1 fsdp4 -> p0 replicated": (sharding(4, 8, (4,), ("f",), ("f",)), sharding(0, 4, (4,), ("f",), ())),
    }
    out = {}
    for name, (src, dst) in cases.items():
        x = put_host(value, src)
        with jax.transfer_guard_device_to_host("disallow_explicit"), \
                jax.transfer_guard_host_to_device("disallow_explicit"):
            y, _ = reallocate({"w": x}, {"w": dst})
        y = y["w"]
        out[name] = bool(y.sharding == dst and np.array_equal(host_get(y), value))
    return out


def main() -> int:
    spec = json.loads(sys.argv[1])
    pid = spec["process_id"]
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.run import planning
    from jaxrlhf.run.backend import setup_devices

    dist = cfglib.DistributedConfig(
        coordinator_address=f"127.0.0.1:{spec['port']}", num_processes=spec["processes"], process_id=pid,
        transfer_port_base=spec["port"] + 1, heartbeat_timeout_s=spec.get("heartbeat_s", 100),
    )
    # the test run's compilation cache, shared by every process of every multi-process test
    run = cfglib.RunConfig(platform="cpu", devices=spec["devices"], distributed=True,
                           compile_cache=os.environ.get("JAXRLHF_TEST_COMPILE_CACHE"))
    setup_devices(run, dist)
    print(f"process {pid} joined", flush=True)
    found: dict = {"runs": {}}
    if spec.get("search_iterations"):  # as tests/test_replan.py: a search that finishes before its time cap
        from jaxrlhf.planner import search

        search.DEFAULT_ITERATIONS = spec["search_iterations"]
    if spec.get("realloc"):
        found["realloc"] = realloc_check()
    for name, overrides in spec.get("runs", {}).items():
        folder = spec.get("wait_for", {}).get(name)
        while folder and not os.path.isdir(folder):  # a folder the test process is still writing
            time.sleep(0.5)
        cfg = cfglib.load_config(None, overrides)
        if spec.get("fail") == pid:  # an exception in this process only, before its first collective
            planning.plan_for = _fails  # where the run's setup chooses its plan
        if spec.get("signal_in_save") == pid:  # SIGTERM to this process only, while it saves a checkpoint
            _signal_during_first_save()
        if spec.get("disk_full", [None])[0] == pid:  # this process's writes of one step fail for want of space
            _disk_fills_at(spec["disk_full"][1])
        t0 = time.perf_counter()
        train.run(cfg)
        found["runs"][name] = {"seconds": time.perf_counter() - t0}
    with open(os.path.join(spec["out"], f"worker-{pid}.json"), "w") as f:
        json.dump(found, f)
    return 0


def _signal_during_first_save() -> None:
    """The first checkpoint save of this process sends it SIGTERM before returning: the flag is set after
    the processes agreed on this step's stop, so only an agreed decision keeps them together."""
    import signal

    from jaxrlhf.checkpoint import CheckpointManager

    save, sent = CheckpointManager.save, []

    def save_then_signal(self, *args, **kwargs):
        save(self, *args, **kwargs)
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    CheckpointManager.save = save_then_signal


def _disk_fills_at(step: int) -> None:
    """This process's writes of checkpoint `step` (its `step`-th save) end as TensorStore's end on a full
    disk: the write futures the array handler returns fail after writing part of the shards, in Orbax's
    save thread, before the barrier where the other processes wait for this one."""
    import orbax.checkpoint as ocp

    async_save, saves = ocp.StandardCheckpointHandler.async_save, []

    class Full:
        def result(self, timeout=None):
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "actor/0": No space left on device [os_error_code=28]')

        def cancel(self):
            pass

    async def save_then_fail(self, *args, **kwargs):
        futures = await async_save(self, *args, **kwargs)
        saves.append(True)
        return [*(futures or []), Full()] if len(saves) == step else futures

    ocp.StandardCheckpointHandler.async_save = save_then_fail


def _fails(*args, **kwargs):
    raise RuntimeError("injected failure in process 1")


if __name__ == "__main__":
    from jaxrlhf.errors import run_cli

    sys.exit(run_cli("worker", lambda argv: main()))
