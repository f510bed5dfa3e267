"""Hardware profiles: the few numbers the cost model needs about a device kind.

Peak numbers come from vendor datasheets; the `*_efficiency` factors turn
them into what large, well-shaped kernels reach in practice, so that one
profile serves both compute-bound training and memory-bound decoding. The
local CPU profile is a placeholder until `jaxrlhf.placement.calibrate`
measures the machine (matmul FLOP/s, copy GB/s, collective GB/s, dispatch
latency) and writes a profile file that `get_profile(path)` loads back.

Simulated CPU devices share the host's cores and memory bus, which no
accelerator does; `host_flops` / `host_memory_bandwidth` cap what all the
devices of one host reach together so the cost model stays honest there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import yaml

from jaxrlhf.planner.measured import Measured
from jaxrlhf.yaml_input import read as read_yaml

GB = 1e9
# tensor-parallel ways at most on a TPU slice (`HardwareProfile.max_tensor`): two hosts' chips, as many as a GPU
# node's; the cost model charges one latency per all-reduce, whatever its ring, so longer rings' hops go unpriced
TORUS_MAX_TENSOR = 8


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Per-device peak numbers and efficiencies; bandwidths in bytes/s, capacity in bytes."""

    name: str
    flops: Mapping[str, float]  # dtype name -> peak dense matmul FLOP/s per device
    hbm_bandwidth: float  # device memory bytes/s
    hbm_capacity: float  # device memory bytes
    intra_host_bandwidth: float  # per device, one direction, to a device of the same host
    inter_host_bandwidth: float  # per host: all its NICs together, one direction (8 x 400 Gb/s = 400 GB/s)
    devices_per_host: int
    host_bandwidth: float = 25 * GB  # device <-> host memory (PCIe / DMA), per device
    matmul_efficiency: float = 0.6  # fraction of peak FLOP/s large matmuls reach
    memory_efficiency: float = 0.8  # fraction of peak HBM bandwidth streaming kernels reach
    link_efficiency: float = 0.8  # fraction of link bandwidth collectives reach
    collective_latency: float = 10e-6  # seconds per collective (launch + sync)
    kernel_latency: float = 5e-6  # seconds per dispatched kernel / layer op
    memory_reserve: float = 0.1  # fraction of capacity kept free (allocator, fragmentation)
    # TPU slices: ICI links per chip and the dimensions of the slice's torus (v5e: 4 links, 2D; v4 and v5p: 6
    # links, 3D); 0 = devices talk over a switch (NVLink inside a host, NICs between hosts)
    ici_links: int = 0
    torus_dims: int = 0
    host_flops: float | None = None  # all devices of a host together (shared cores), if capped
    host_memory_bandwidth: float | None = None  # likewise for memory bandwidth
    notes: str = ""
    # call times measured on this hardware (`jaxrlhf.profile`); the cost model prefers them to its formulas
    measured: Measured | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def shares_cores(self) -> bool:
        """Whether the devices of a host share its cores (simulated CPU devices): then calls on disjoint
        groups of one host take turns on the same cores instead of running side by side."""
        return self.host_flops is not None

    @property
    def shared_host(self) -> int | None:
        """Devices per host when they share its cores (what `simulator.schedule` takes), else None."""
        return self.devices_per_host if self.shares_cores else None

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise KeyError(f"hardware {self.name!r} has no FLOP/s for dtype {dtype!r}; known: {sorted(self.flops)}")
        return self.flops[dtype]

    def matmul_flops(self, dtype: str, devices_on_host: int = 1) -> float:
        """FLOP/s one device reaches while `devices_on_host` devices of its host compute at once."""
        f = self.peak_flops(dtype) * self.matmul_efficiency
        if self.host_flops is not None:
            f = min(f, self.host_flops * self.matmul_efficiency / max(devices_on_host, 1))
        return f

    def memory_bandwidth(self, devices_on_host: int = 1) -> float:
        bw = self.hbm_bandwidth * self.memory_efficiency
        if self.host_memory_bandwidth is not None:
            bw = min(bw, self.host_memory_bandwidth * self.memory_efficiency / max(devices_on_host, 1))
        return bw

    def link_bandwidth(self, crosses_hosts: bool, devices_on_host: int = 1, members_on_host: int = 1) -> float:
        """Bytes/s one ring (or point-to-point stream) reaches over the links it uses.

        Inside a host a ring runs at one device's link. Across hosts the host's NICs are
        shared by every device of the host that sends at once (`devices_on_host`); a ring
        with `members_on_host` members on one host pools their shares, because its bytes
        cross the host boundary once however many of its members sit there (NCCL stripes
        a ring over all NICs). So a 16-member FSDP ring over two full hosts gets the whole
        NIC, and 8 concurrent 2-member rings (fsdp=2 x tensor=8) get 1/8 of it each.
        """
        if not crosses_hosts or self.torus_dims:  # a TPU slice's hosts are joined by the same ICI torus, no NICs
            return self.intra_host_bandwidth * self.link_efficiency
        sharing = max(min(devices_on_host, self.devices_per_host), 1)
        share = self.inter_host_bandwidth * min(max(members_on_host, 1), sharing) / sharing
        return min(share, self.intra_host_bandwidth) * self.link_efficiency

    @property
    def max_tensor(self) -> int:
        """The most ways the planner splits a layer by tensor parallelism. On GPUs the devices of one host
        (a node's NVLink domain): tensor parallelism all-reduces twice per layer and token, and across nodes
        those latency-bound collectives would share the NICs; data, FSDP and pipeline axes span hosts. On a
        TPU slice every chip, whatever its host, sits on the same ICI torus (MaxText's ici_tensor_parallelism
        spans hosts), so up to TORUS_MAX_TENSOR ways: with 4 chips a host, a 70B model's weights (35 GB a
        chip at 4 ways) could never be held for generation on a 32 GB v4 chip. The cost model prices the
        all-reduces over the torus's links; the search weighs them."""
        return max(self.devices_per_host, TORUS_MAX_TENSOR) if self.torus_dims else self.devices_per_host

    def with_inter_host_bandwidth(self, bytes_per_s: float) -> "HardwareProfile":
        """This profile with another per-node NIC bandwidth (a cluster's own network)."""
        if not bytes_per_s > 0 or bytes_per_s == float("inf"):
            raise ValueError(f"inter-node bandwidth must be a positive number of bytes/s, got {bytes_per_s}")
        return dataclasses.replace(self, inter_host_bandwidth=float(bytes_per_s))

    @property
    def usable_memory(self) -> float:
        return self.hbm_capacity * (1.0 - self.memory_reserve)

    # ---- files -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "measured"}
        d["flops"] = dict(self.flops)
        if self.measured:
            d["measured"] = self.measured.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "hardware profile") -> "HardwareProfile":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; valid keys are {sorted(fields)}")
        measured = Measured.from_dict(d.get("measured"), where)
        try:
            return cls(**{**d, "flops": {str(k): float(v) for k, v in dict(d["flops"]).items()},
                          "measured": measured or None})
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: incomplete profile ({e})") from None

    def save(self, path: str) -> None:
        """Write as JSON (`.json`) or YAML (anything else)."""
        with open(path, "w") as f:
            if path.endswith(".json"):
                json.dump(self.to_dict(), f, indent=2)
            else:
                yaml.safe_dump(self.to_dict(), f, sort_keys=False)

    @classmethod
    def load(cls, path: str) -> "HardwareProfile":
        with open(path) as f:
            text = f.read()
        if path.endswith(".json"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON (line {e.lineno}): {e.msg}") from None
        else:
            data = read_yaml(text, path)
        if not isinstance(data, Mapping):
            raise ValueError(f"{path}: expected a mapping of profile fields")
        return cls.from_dict(data, where=path)


# What jaxrlhf's runtime reached on one H200, as fractions of its datasheet peaks: `python
# scripts/calibrate_gpu_profiles.py` derives them from docs/results/h200_validate_estimator.json.
GPU_MATMUL_KERNEL = 0.660  # FLOP/s of its matmul kernels
# the memory-bound work of a whole train or inference call (norms, softmax, casts, masks), in seconds per second
# of the call's matmuls at the kernels' rate: whole calls ran at 1 / (1 + 0.419) of that rate
GPU_CALL_OVERHEAD = 0.419
GPU_MEMORY_EFFICIENCY = 0.593  # bytes/s of decode steps
H200_BF16_PEAK, H200_HBM_PEAK = 989e12, 4.8e12  # the datasheet the fractions are of


def gpu_matmul_efficiency(bf16: float, hbm_bw: float) -> float:
    """The fraction of a GPU's datasheet FLOP/s whole train and inference calls reach: the matmuls at
    GPU_MATMUL_KERNEL of it, and the call's memory-bound work, GPU_CALL_OVERHEAD x the matmuls' seconds on the
    H200, the same bytes per FLOP on any chip: its seconds scale with the chip's FLOP/s per byte/s. A chip whose
    tensor cores are slow for its memory spends less of a call on it (H20: 37 FLOP a byte against the H200's
    206, 0.614), one with less bandwidth more (H100: 295, 0.412); the H200 itself 0.465."""
    return GPU_MATMUL_KERNEL / (1 + GPU_CALL_OVERHEAD * (bf16 / hbm_bw) / (H200_BF16_PEAK / H200_HBM_PEAK))


def _gpu(name: str, bf16: float, tf32: float, hbm_bw: float, hbm_gb: float, nvlink: float,
         inter_host: float, **kw: Any) -> HardwareProfile:
    return HardwareProfile(
        name=name, flops={"bfloat16": bf16, "float16": bf16, "float32": tf32}, hbm_bandwidth=hbm_bw,
        hbm_capacity=hbm_gb * GB, intra_host_bandwidth=nvlink, inter_host_bandwidth=inter_host, devices_per_host=8,
        matmul_efficiency=round(gpu_matmul_efficiency(bf16, hbm_bw), 3), memory_efficiency=GPU_MEMORY_EFFICIENCY,
        **kw,
    )


def _tpu(name: str, bf16: float, hbm_bw: float, hbm_gb: float, ici: float, per_host: int, links: int, dims: int,
         **kw: Any) -> HardwareProfile:
    # Inside a pod slice hosts talk over the same ICI torus (`link_bandwidth` ignores host boundaries there);
    # inter-host is stated as ICI x chips per host for tools that read it.
    return HardwareProfile(
        name=name, flops={"bfloat16": bf16, "float16": bf16, "float32": bf16 / 2}, hbm_bandwidth=hbm_bw,
        hbm_capacity=hbm_gb * GB, intra_host_bandwidth=ici, inter_host_bandwidth=ici * per_host,
        devices_per_host=per_host, host_bandwidth=16 * GB, collective_latency=5e-6, kernel_latency=2e-6,
        ici_links=links, torus_dims=dims, **kw,
    )


# NVLink as in the ReaLHF paper's cluster (~1800 Gb/s per device). Across nodes the
# profile states the whole node's NICs: a current H100 / H200 node has 8 x 400 Gb/s
# (400 GB/s), an A100 node 8 x 200 Gb/s. Clusters differ: `python -m jaxrlhf.plan
# --inter-node-gbps` overrides it.
PROFILES: dict[str, HardwareProfile] = {
    "h100": _gpu("h100", 989e12, 495e12, 3.35e12, 80, 225 * GB, 400 * GB,
                 notes="H100 SXM; 1800 Gb/s NVLink per device, 8x400 Gb/s NICs per node"),
    "h200": _gpu("h200", 989e12, 495e12, 4.8e12, 141, 450 * GB, 400 * GB,
                 notes="H200 SXM; NVLink 4 (900 GB/s bidirectional), 8x400 Gb/s per node"),
    "a100-80g": _gpu("a100-80g", 312e12, 156e12, 2.04e12, 80, 225 * GB, 200 * GB,
                     notes="A100 SXM 80 GB; 1800 Gb/s NVLink per device, 8x200 Gb/s NICs per node"),
    # The export variants of peers' published runs (docs/results/published_cases_notes.md gives the sources):
    # A800 and H800 are the A100 and H100 with NVLink cut to 400 GB/s both ways; H20 a Hopper with 96 GB of
    # HBM3 at 4.0 TB/s and a seventh of the H100's tensor FLOP/s. Nodes of 8; the NICs as those clusters state
    # (AReaL's H800 nodes: RoCE 3.2 Tb/s), else 8 x 400 Gb/s.
    "a800-80g": _gpu("a800-80g", 312e12, 156e12, 2.04e12, 80, 200 * GB, 200 * GB,
                     notes="A800 SXM 80 GB; NVLink 400 GB/s bidirectional, 8x200 Gb/s NICs per node"),
    "h800": _gpu("h800", 989e12, 495e12, 3.35e12, 80, 200 * GB, 400 * GB,
                 notes="H800 SXM; NVLink 400 GB/s bidirectional, RoCE 3.2 Tb/s per node"),
    "h20": _gpu("h20", 148e12, 74e12, 4.0e12, 96, 450 * GB, 400 * GB,
                notes="H20 96 GB; 148 TFLOP/s bf16, HBM3 4.0 TB/s, NVLink 900 GB/s bidirectional"),
    # Chips per host: 4 on every multi-host slice of these (a single-host v5litepod-8 has 8; a run on TPU
    # takes the count JAX shows each process, `jaxrlhf.train` -> `planning.hardware_profile`).
    "tpu-v4": _tpu("tpu-v4", 275e12, 1.2e12, 32, 135 * GB, 4, 6, 3, notes="TPU v4; 6 ICI links, 3D torus"),
    "tpu-v5e": _tpu("tpu-v5e", 197e12, 0.82e12, 16, 100 * GB, 4, 4, 2, notes="TPU v5e; 4 ICI links, 2D torus"),
    "tpu-v5p": _tpu("tpu-v5p", 459e12, 2.76e12, 95, 300 * GB, 4, 6, 3, notes="TPU v5p; 6 ICI links, 3D torus"),
    # Uncalibrated guess for one simulated CPU device; run `calibrate()` for real numbers.
    "cpu": HardwareProfile(
        name="cpu", flops={"float32": 50e9, "bfloat16": 10e9, "float16": 5e9}, hbm_bandwidth=10 * GB,
        hbm_capacity=4 * GB, intra_host_bandwidth=5 * GB, inter_host_bandwidth=1 * GB, devices_per_host=8,
        host_bandwidth=5 * GB, matmul_efficiency=1.0, memory_efficiency=1.0, link_efficiency=1.0,
        collective_latency=50e-6, kernel_latency=20e-6, memory_reserve=0.0, host_flops=50e9,
        host_memory_bandwidth=10 * GB, notes="uncalibrated; see jaxrlhf.placement.calibrate",
    ),
}
ALIASES = {"h100-80g": "h100", "a100": "a100-80g", "a800": "a800-80g", "v4": "tpu-v4", "v5e": "tpu-v5e", "v5p": "tpu-v5p", "local": "cpu"}


def known_profiles() -> list[str]:
    return sorted(PROFILES)


def get_profile(name: str) -> HardwareProfile:
    """A profile by registry name (case-insensitive, a few aliases) or from a .json/.yaml file."""
    if os.path.isfile(name):
        return HardwareProfile.load(name)
    key = name.lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in PROFILES:
        raise KeyError(
            f"unknown hardware {name!r}; known profiles: {known_profiles()} "
            f"(aliases {sorted(ALIASES)}), or a path to a profile file"
        )
    return PROFILES[key]
