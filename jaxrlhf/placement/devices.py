"""The global device list and the devices of a group (see `jaxrlhf.planner.groups` for the rules).

The global list is every device of every process, sorted by (process, id),
so a group's index range names the same devices on every process.
"""

from __future__ import annotations

from typing import Sequence

import jax

from jaxrlhf.planner.plan import DeviceGroup, PlanError

Device = jax.Device


def global_devices(devices: Sequence[Device] | None = None) -> list[Device]:
    """All devices (every process), sorted by (process_index, id)."""
    devs = list(jax.devices() if devices is None else devices)
    return sorted(devs, key=lambda d: (d.process_index, d.id))


def devices_per_host(devices: Sequence[Device] | None = None) -> int:
    """Devices per process; processes with unequal device counts are not supported."""
    counts: dict[int, int] = {}
    for d in global_devices(devices):
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    sizes = set(counts.values())
    if len(sizes) != 1:
        raise PlanError(f"processes own different numbers of devices {counts}; every host must have the same count")
    return sizes.pop()


def group_devices(group: DeviceGroup, devices: Sequence[Device] | None = None) -> list[Device]:
    """The devices of `group`, in global order."""
    devs = global_devices(devices)
    if group.stop > len(devs) or group.start < 0:
        raise PlanError(
            f"group {group.name!r} needs devices {group.start}-{group.stop - 1} but only {len(devs)} "
            f"devices are available ({devs[0].platform if devs else 'none'})"
        )
    return devs[group.start : group.stop]
