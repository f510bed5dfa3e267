"""Benchmark parameter reallocation against a plain device-to-device copy of the same bytes.

For a LLaMA-shaped parameter tree (default ~270M parameters, float32: about
1 GiB; `--size 1b` for ~1B) and several layout pairs, measures the seconds of
`jaxrlhf.transfer.realloc.reallocate` and, in the same run, of a plain
`jax.device_put` between two congruent shardings (same mesh shape and spec,
other devices) that moves exactly the bytes the target holds. Every measured
call runs under the device<->host transfer guards, so any byte through host
would abort the run. Prints a ratio table and writes JSON (`--out`).

    python scripts/bench_realloc.py --size 256m --repeats 3 --out /tmp/realloc.json

On CPU the devices are simulated (`--cpu-devices`, default 8) and share the
host's memory bandwidth, so absolute numbers say little; the ratio is the
point. 1B float32 needs ~16 GiB for the replicated targets; the default
256m fits a 24 GiB machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256m", choices=sorted(SIZES), help="parameter tree size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per pair (after one warm-up)")
    p.add_argument("--chunk-mb", type=int, default=256, help="reallocation chunk size (MiB)")
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices (CPU backend only)")
    p.add_argument("--pairs", default="", help="comma-separated pair names to run (default: all that fit)")
    p.add_argument("--out", default="", help="write results as JSON here")
    return p.parse_args(argv)


# name: (vocab, hidden, mlp, layers, heads, kv_heads) -> LLaMA-shaped trees
SIZES = {
    "16m": (8000, 512, 1376, 4, 8, 8),
    "256m": (32000, 1024, 2816, 16, 16, 8),
    "1b": (32000, 2048, 5632, 18, 16, 8),
}

# (name, (src start, size, data, fsdp, tensor), (dst start, size, data, fsdp, tensor))
PAIRS = [
    ("fsdp8 -> tensor2 x data4 (same devices; reallocated)", (0, 8, 1, 8, 1), (0, 8, 4, 1, 2)),
    ("fsdp4 -> tensor2 x data2 (disjoint; shadow sync)", (4, 4, 1, 4, 1), (0, 4, 2, 1, 2)),
    ("fsdp4 -> fsdp4 (disjoint; same layout)", (0, 4, 1, 4, 1), (4, 4, 1, 4, 1)),
    ("tensor4 -> fsdp2 (overlapping; 4 -> 2)", (0, 4, 1, 1, 4), (2, 2, 1, 2, 1)),
    ("fsdp2 -> fsdp4 (disjoint; 2 -> 4)", (0, 2, 1, 2, 1), (4, 4, 1, 4, 1)),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding

    from jaxrlhf.models.config import ModelConfig
    from jaxrlhf.models.transformer import build_model
    from jaxrlhf.placement.layout import make_mesh, param_shardings
    from jaxrlhf.planner.plan import DeviceGroup, Layout
    from jaxrlhf.transfer.realloc import reallocate, tree_bytes

    vocab, hidden, mlp, layers, heads, kv = SIZES[args.size]
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_layers=layers,
        num_heads=heads, num_kv_heads=kv, param_dtype=args.dtype, dtype=args.dtype,
    )
    abstract = nnx.state(nnx.eval_shape(lambda: build_model(cfg)), nnx.Param)
    n_dev = len(jax.devices())
    wanted = {s.strip() for s in args.pairs.split(",") if s.strip()}

    def sharding_of(spec):
        start, size, d, f, t = spec
        return make_mesh(DeviceGroup("g", start, size), Layout(d, f, t))

    def rolled(mesh):
        """Same mesh shape over other devices: shift by the group size (or half of all)."""
        devs = jax.devices()
        ids = [d.id for d in mesh.devices.flat]
        shift = len(ids) if len(ids) * 2 <= n_dev else n_dev // 2
        by_id = {d.id: d for d in devs}
        moved = np.array([by_id[(i + shift) % n_dev] for i in ids], dtype=object).reshape(mesh.devices.shape)
        return jax.sharding.Mesh(moved, mesh.axis_names, axis_types=mesh.axis_types)

    def materialise(shardings):
        """Random parameters created directly on their devices (nothing from host)."""
        leaves, treedef = jax.tree_util.tree_flatten(abstract)
        shs = jax.tree_util.tree_leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
        out = []
        for i, (leaf, sh) in enumerate(zip(leaves, shs)):
            f = jax.jit(
                lambda k, shape=leaf.shape, dt=leaf.dtype: jax.random.normal(k, shape, dt), out_shardings=sh
            )
            out.append(f(jax.random.key(i)))
        return jax.tree_util.tree_unflatten(treedef, out)

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        return out, time.perf_counter() - t0

    guards = lambda: (jax.transfer_guard_device_to_host("disallow"), jax.transfer_guard_host_to_device("disallow"))  # noqa: E731
    results = []
    nbytes = None
    print(f"{args.size}: {cfg.num_params() / 1e6:.0f}M parameters, {args.dtype}, {n_dev} {jax.devices()[0].platform} devices",
          flush=True)
    for name, src_spec, dst_spec in PAIRS:
        if wanted and name.split(" (")[0] not in wanted and name not in wanted:
            continue
        if max(src_spec[0] + src_spec[1], dst_spec[0] + dst_spec[1]) > n_dev:
            print(f"skip {name}: needs more than {n_dev} devices", flush=True)
            continue
        src_mesh, dst_mesh = sharding_of(src_spec), sharding_of(dst_spec)
        src_sh, dst_sh = param_shardings(abstract, src_mesh), param_shardings(abstract, dst_mesh)
        mirror_sh = param_shardings(abstract, rolled(dst_mesh))
        src = materialise(src_sh)
        nbytes = tree_bytes(src)
        target_bytes = sum(
            math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize * len(s.device_set)
            for x, s in zip(jax.tree_util.tree_leaves(abstract),
                            jax.tree_util.tree_leaves(dst_sh, is_leaf=lambda s: isinstance(s, NamedSharding)))
        )
        mirror, _ = reallocate(src, mirror_sh, chunk_bytes=args.chunk_mb * 2**20)

        realloc_s, copy_s, copied = [], [], 0
        for rep in range(args.repeats + 1):
            g1, g2 = guards()
            with g1, g2:
                out, stats = reallocate(src, dst_sh, chunk_bytes=args.chunk_mb * 2**20)
            del out
            g1, g2 = guards()
            with g1, g2:
                out, secs = timed(lambda m=mirror: jax.device_put(m, dst_sh))
            del out
            if rep:  # the first round compiles
                realloc_s.append(stats.seconds)
                copy_s.append(secs)
                copied = stats.bytes_copied
        del src, mirror
        r, c = statistics.median(realloc_s), statistics.median(copy_s)
        row = {
            "pair": name,
            "bytes": nbytes,
            "target_bytes": target_bytes,
            "bytes_copied_between_devices": copied,
            "host_bytes": 0,
            "realloc_s": r,
            "copy_s": c,
            "ratio": r / c,
            "realloc_gbps": target_bytes / r / 1e9,
            "copy_gbps": target_bytes / c / 1e9,
            "realloc_all_s": realloc_s,
            "copy_all_s": copy_s,
        }
        results.append(row)
        print(f"  {name}: realloc {r:.3f}s, copy {c:.3f}s, ratio {r / c:.2f}", flush=True)

    header = f"{'pair':56} {'GiB moved':>9} {'realloc s':>9} {'copy s':>8} {'ratio':>6}"
    print()
    print(header)
    print("-" * len(header))
    for row in results:
        print(f"{row['pair']:56} {row['target_bytes'] / 2**30:9.2f} {row['realloc_s']:9.3f} {row['copy_s']:8.3f} "
              f"{row['ratio']:6.2f}")
    print("host bytes: 0 in every reallocation (transfer guards on)")
    if args.out:
        meta = {
            "size": args.size, "params": cfg.num_params(), "dtype": args.dtype, "bytes": nbytes,
            "devices": n_dev, "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
            "jax": jax.__version__, "repeats": args.repeats, "chunk_mb": args.chunk_mb,
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
