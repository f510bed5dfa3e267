"""Device groups: named, contiguous ranges of the global device list.

The global list is every device of every process, sorted by process then
device id, so index ranges mean the same thing on every process and a
contiguous range stays on as few hosts as possible. A group never splits a
host unless it is smaller than one host: a group of size <= devices_per_host
lies inside one host; a bigger one starts at a host boundary and covers
whole hosts. Collectives inside a group then use intra-host links wherever
they can.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax

from jaxrlhf.mesh.plan import DeviceGroup, PlanError

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


def host_rule_violation(group: DeviceGroup, devices_per_host: int | None) -> str | None:
    """Why `group` breaks the host rule, or None when it respects it."""
    if not devices_per_host or group.size <= 0:
        return None
    dph = devices_per_host
    if group.size <= dph:
        if group.start // dph != (group.stop - 1) // dph:
            first = group.start // dph * dph
            return (
                f"group {group.name!r} (devices {group.start}-{group.stop - 1}) straddles two hosts of "
                f"{dph} devices; start it at a multiple of {dph} or inside one host (e.g. start={first + dph})"
            )
        return None
    if group.start % dph or group.size % dph:
        return (
            f"group {group.name!r} (devices {group.start}-{group.stop - 1}) splits a host: a group larger than one "
            f"host ({dph} devices) must start at a multiple of {dph} and cover whole hosts"
        )
    return None


def check_group(group: DeviceGroup, num_devices: int, devices_per_host: int | None = None) -> None:
    """Raise PlanError unless `group` lies inside [0, num_devices) and respects hosts."""
    if group.size < 1:
        raise PlanError(f"group {group.name!r} has size {group.size}; a group needs at least one device")
    if group.start < 0 or group.stop > num_devices:
        raise PlanError(
            f"group {group.name!r} covers devices {group.start}-{group.stop - 1} but only devices "
            f"0-{num_devices - 1} exist; shrink or move the group"
        )
    reason = host_rule_violation(group, devices_per_host)
    if reason:
        raise PlanError(reason)


def carve(
    sizes: Mapping[str, int],
    num_devices: int,
    devices_per_host: int | None = None,
    start: int = 0,
) -> dict[str, DeviceGroup]:
    """Lay groups of the given sizes side by side from `start`, checking every one.

    Example: carve({"gen": 4, "train": 4}, 8) -> gen = 0-3, train = 4-7.
    """
    groups: dict[str, DeviceGroup] = {}
    offset = start
    for name, size in sizes.items():
        g = DeviceGroup(name, offset, int(size))
        check_group(g, num_devices, devices_per_host)
        groups[name] = g
        offset = g.stop
    return groups


def valid_group_sizes(num_devices: int, devices_per_host: int | None = None) -> list[int]:
    """Sizes a group may take: anything up to one host, then whole hosts."""
    dph = devices_per_host or num_devices
    small = list(range(1, min(dph, num_devices) + 1))
    return small + [k * dph for k in range(2, num_devices // dph + 1)]


def group_devices(group: DeviceGroup, devices: Sequence[Device] | None = None) -> list[Device]:
    """The devices of `group`, in global order."""
    devs = global_devices(devices)
    if group.stop > len(devs) or group.start < 0:
        raise PlanError(
            f"group {group.name!r} needs devices {group.start}-{group.stop - 1} but only {len(devs)} "
            f"devices are available ({devs[0].platform if devs else 'none'})"
        )
    return devs[group.start : group.stop]
