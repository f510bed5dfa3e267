"""Measure the local JAX devices into a planner hardware profile (`jaxrlhf.planner.hardware`).

The planner is JAX-free; this is the one place that turns the machine at hand
into the numbers it plans with.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

from jaxrlhf.planner.hardware import HardwareProfile, get_profile


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    """Fastest of `repeats` runs of `fn` (which must block), after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _host_memory_bytes() -> float:
    """Physical memory of this machine (CPU devices share it)."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def dispatch_latency(device, repeats: int) -> float:
    """Seconds from dispatching a tiny compiled program to having its result: the host round trip (with
    one device, what `calibrate` records as the collective latency: there is nothing to meet)."""
    import jax
    import jax.numpy as jnp

    tiny = jax.device_put(jnp.ones((8,), jnp.float32), device)
    add = jax.jit(lambda x: x + 1)
    return best_time(lambda: add(tiny).block_until_ready(), repeats)


def per_link_seconds(link: Callable[[Any], Any], x: Any, repeats: int, short: int = 16, long: int = 144,
                     wrap: Callable[[Callable], Callable] = lambda f: f) -> float:
    """Seconds per `link` inside one compiled program: the difference between chains of `long` and
    `short` dependent links (each waits for the last: nothing to fuse or overlap), per link, so that
    neither dispatch nor the host round trip counts. `wrap` turns a chain into the program (a
    `shard_map`, say) before it is compiled."""
    import jax

    def chain(links: int) -> float:
        def run(v):
            for _ in range(links):
                v = link(v)
            return v
        fn = jax.jit(wrap(run))
        return best_time(lambda: fn(x).block_until_ready(), repeats)

    return max((chain(long) - chain(short)) / (long - short), 1e-7)


def kernel_latency(device, repeats: int) -> float:
    """Seconds per kernel inside one compiled program (a chain of tiny matmuls). A model's per-layer ops
    cost this, not a host round trip (on an H200 a tiny program's round trip took 52 us, one kernel
    inside a program 1.1 us)."""
    import jax
    import jax.numpy as jnp

    x = jax.device_put(jnp.full((8, 8), 0.1, jnp.float32), device)
    return per_link_seconds(lambda v: jnp.tanh(v @ v), x, repeats)


def collective_latency(devices, repeats: int) -> float:
    """Seconds per collective inside one compiled program over `devices` (a chain of all-reduces of a
    tiny array). Simulated CPU devices meet at each collective on shared cores: 8 of them on 2 cores
    took ~110-150 us per all-reduce or all-gather (4: ~50, 2: ~18), where a tiny program's host round
    trip took 9 us. FSDP runs ~20 collectives per layer and step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    mesh = Mesh(np.array(devices), ("d",))
    x = jax.device_put(jnp.ones((n * 8,), jnp.float32), NamedSharding(mesh, P("d")))
    return per_link_seconds(lambda v: jax.lax.psum(v, "d") * (1.0 / n) + 1.0, x, repeats,
                            wrap=lambda run: jax.shard_map(run, mesh=mesh, in_specs=P("d"), out_specs=P("d")))


# Sizes large enough that launch latency is noise: a GPU runs a 1024^3 matmul or a 64 MB copy in
# microseconds, well short of its peak rates.
CALIBRATION_SIZES = {"cpu": (1024, 64)}  # platform -> (matmul size, copy MB); others: ACCELERATOR_SIZES
ACCELERATOR_SIZES = (8192, 1024)


def calibrate(base: str = "cpu", *, matmul_size: int | None = None, copy_mb: int | None = None,
              repeats: int = 5, name: str | None = None) -> HardwareProfile:
    """Measure the local JAX devices and return `base` with measured numbers.

    Measures: matmul FLOP/s on one device and on all local devices at once
    (the latter bounds `host_flops` when devices share cores), copy bytes/s
    (read + write) likewise, a device-to-device transfer, an all-reduce over
    all local devices (reported as ring bus bandwidth), host -> device bytes/s
    the cost of one all-reduce inside a compiled program over all local devices (`collective_latency`;
    with one device, a tiny program's host round trip) and of one kernel inside a program
    (`kernel_latency`). Efficiencies are set to 1
    because the numbers are what kernels actually reach.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    base_profile = get_profile(base)
    devices = jax.local_devices()
    n = len(devices)
    default_matmul, default_copy = CALIBRATION_SIZES.get(devices[0].platform, ACCELERATOR_SIZES)
    matmul_size = matmul_size or default_matmul
    copy_mb = copy_mb or default_copy
    dtype = "float32"

    # Matmul: one device, then one per device concurrently (sharded over a 1-D mesh).
    # Random operands: on constant data some chips multiply faster than they will on weights.
    a = jax.device_put(jax.random.normal(jax.random.key(0), (matmul_size, matmul_size), dtype), devices[0])
    mm = jax.jit(lambda x: x @ x)
    t1 = best_time(lambda: mm(a).block_until_ready(), repeats)
    flops_one = 2 * matmul_size**3 / t1
    mesh = Mesh(np.array(devices), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    stacked = jax.device_put(jnp.broadcast_to(a, (n, matmul_size, matmul_size)), NamedSharding(mesh, P("d")))
    bmm = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x))
    tn = best_time(lambda: bmm(stacked).block_until_ready(), repeats)
    flops_all = n * 2 * matmul_size**3 / tn

    # Streaming copy: read + write of `copy_mb` per device.
    elems = copy_mb * 2**20 // 4
    v = jax.device_put(jnp.ones((elems,), dtype), devices[0])
    inc = jax.jit(lambda x: x * 1.0001 + 1.0)
    bw_one = 2 * elems * 4 / best_time(lambda: inc(v).block_until_ready(), repeats)
    vs = jax.device_put(jnp.ones((n, elems // n), dtype), NamedSharding(mesh, P("d")))
    bw_all = 2 * (elems // n) * 4 * n / best_time(lambda: inc(vs).block_until_ready(), repeats)

    # Device-to-device copy between two local devices.
    if n > 1:
        link = elems * 4 / best_time(lambda: jax.device_put(v, devices[1]).block_until_ready(), repeats)
    else:
        link = bw_one

    # All-reduce over all local devices: ring bus bandwidth 2 (n-1)/n * bytes / t.
    if n > 1:
        reduce_mesh = Mesh(np.array(devices), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
        part = jax.device_put(jnp.ones((n, elems // n), dtype), NamedSharding(reduce_mesh, P("d")))
        allreduce = jax.jit(lambda x: jnp.sum(x, axis=0, keepdims=True),
                            out_shardings=NamedSharding(reduce_mesh, P()))
        t_ar = best_time(lambda: allreduce(part).block_until_ready(), repeats)
        collective = 2 * (n - 1) / n * (elems // n) * 4 / t_ar
    else:
        collective = link

    host = np.ones((elems,), np.float32)
    h2d = elems * 4 / best_time(lambda: jax.device_put(host, devices[0]).block_until_ready(), repeats)

    # a collective's fixed cost: inside a program, where the formulas charge it (one device: none to meet)
    latency = (collective_latency(devices, max(repeats, 20)) if n > 1
               else dispatch_latency(devices[0], max(repeats, 20)))
    per_kernel = kernel_latency(devices[0], max(repeats, 20))

    # Other dtypes: measured where cheap (bfloat16), else scaled from the base profile's ratios.
    flops = {k: flops_one * v / base_profile.flops["float32"] for k, v in base_profile.flops.items()}
    b = a.astype(jnp.bfloat16)
    flops["bfloat16"] = 2 * matmul_size**3 / best_time(lambda: mm(b).block_until_ready(), repeats)
    return dataclasses.replace(
        base_profile,
        name=name or f"{base_profile.name}-calibrated",
        flops=flops,
        hbm_bandwidth=bw_one,
        intra_host_bandwidth=min(link, collective),
        inter_host_bandwidth=min(link, collective),
        devices_per_host=n,
        hbm_capacity=_host_memory_bytes() / n if devices[0].platform == "cpu" else base_profile.hbm_capacity,
        host_bandwidth=h2d,
        matmul_efficiency=1.0,
        memory_efficiency=1.0,
        link_efficiency=1.0,
        collective_latency=latency,
        kernel_latency=per_kernel,
        host_flops=flops_all if base_profile.host_flops is not None else None,
        host_memory_bandwidth=bw_all if base_profile.host_memory_bandwidth is not None else None,
        notes=f"calibrated on {n} local {devices[0].platform} devices ({time.strftime('%Y-%m-%d')})",
    )
