"""The JAX backend of a run: platform, simulated CPU devices, compile cache, multi-process start.

`setup_devices` must run before anything asks JAX for a device: JAX fixes its
platform and device count the first time a backend starts.
"""

from __future__ import annotations

import os

from jaxrlhf import config as cfglib
from jaxrlhf.errors import RunError


def setup_devices(run: cfglib.RunConfig, dist: cfglib.DistributedConfig | None = None) -> None:
    """Configure JAX for `run` (platform, devices, compile cache); `dist` says how the processes of a
    `run.distributed` run find each other (see `jaxrlhf.distributed`)."""
    import jax

    from jaxrlhf import distributed

    if run.platform == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        jax.config.update("jax_platforms", "cpu")
        if run.devices:
            jax.config.update("jax_num_cpu_devices", run.devices)
            _note_oversubscription(run.devices)
    elif run.platform in ("gpu", "tpu"):
        jax.config.update("jax_platforms", "cuda" if run.platform == "gpu" else "tpu")
    enable_compile_cache(run.compile_cache)
    if run.distributed:
        distributed.initialize(dist or cfglib.DistributedConfig(), run.platform)
    if run.platform in ("gpu", "tpu"):
        try:
            jax.devices()
        except Exception as e:  # RuntimeError, or an AssertionError from a backend that never initialised
            raise RunError(
                f"run.platform={run.platform}, but JAX has no {run.platform.upper()} backend here "
                f"({_first_line(e)}); set run.platform=cpu (or auto), or install jax with {run.platform} support"
            ) from None


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, so a container's or `taskset`'s limit counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _note_oversubscription(devices: int) -> None:
    """Say when simulated devices outnumber the cores: XLA's CPU client then runs one compute thread per
    device on too few cores, and every step slows (docs/profiling.md, "Simulated CPU devices")."""
    cores = available_cores()
    if devices > cores:
        print(f"note: run.devices={devices} simulates {devices} CPU devices on {cores} cores: XLA runs a compute "
              f"thread per device, so every step takes longer (the quickstart, 8 devices on 2 cores: 2.4-2.7x); "
              f"run.devices={cores} avoids it (docs/profiling.md, 'Simulated CPU devices')", flush=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def enable_compile_cache(folder: str | None) -> None:
    """JAX's persistent compilation cache in `folder` (None: off), so a second run of the same config
    loads its executables instead of compiling them. Any executable that took over 0.5 s is kept."""
    import jax

    if folder is None:
        return
    path = os.path.expanduser(folder)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise cfglib.ConfigError(f"run.compile_cache={folder!r}: cannot create the folder ({e.strerror}); "
                                 "choose another folder or set run.compile_cache=null") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
