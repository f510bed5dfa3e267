"""Time a pipelined train call against unpipelined ones on simulated CPU devices.

One SFT update (`jaxrlhf.algorithms.sft.sft_train`, token-mean NLL, AdamW) of a
LLaMA-shaped model on all devices, under each layout: stage x data x fsdp x
tensor, with the call's micro-batches (M = rows / micro-batch; a pipelined call
runs them as a GPipe schedule, an unpipelined one accumulates gradients over
them). Reports compile seconds, the median step seconds, XLA's per-device
memory (arguments + temporaries, `compiled.memory_analysis()`) and the loss,
which must agree across layouts. Prints a table and writes JSON (`--out`).

    python scripts/bench_pipeline.py --out docs/results/bench_pipeline.json

CPU devices are simulated and share the host's cores, so a pipeline cannot
overlap its stages here: the times show the schedule's overheads (bubble,
shifts), not the speed-up a pipeline gives on real accelerators.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# name: (stage, data, fsdp, tensor)
LAYOUTS = {
    "data8": (1, 8, 1, 1),
    "fsdp8": (1, 1, 8, 1),
    "stage2 x data4": (2, 4, 1, 1),
    "stage4 x data2": (4, 2, 1, 1),
    "stage2 x fsdp2 x tensor2": (2, 1, 2, 2),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="model preset (jaxrlhf.models.config.PRESETS)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (must divide by every stage count)")
    p.add_argument("--batch", type=int, default=32, help="rows per train call")
    p.add_argument("--length", type=int, default=128, help="tokens per row")
    p.add_argument("--micro-batches", default="1,4", help="comma-separated M values")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per layout (after one warm-up)")
    p.add_argument("--cpu-devices", type=int, default=8)
    p.add_argument("--out", default="", help="write results as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import functools

    import numpy as np
    import optax
    from flax import nnx

    from jaxrlhf.algorithms.sft import sft_train
    from jaxrlhf.models.config import preset
    from jaxrlhf.models.transformer import build_model
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement

    config = preset(args.preset).replace(num_layers=args.layers)
    graphdef, state = nnx.split(build_model(config, seed=0))
    host = jax.tree_util.tree_map(np.asarray, state)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, config.vocab_size, size=(args.batch, args.length), dtype=np.int32)
    mask = np.ones_like(tokens, bool)
    inputs = {"tokens": tokens, "mask": mask, "positions": np.cumsum(mask, axis=1, dtype=np.int32) - 1,
              "loss_mask": mask}
    opt = optax.adamw(1e-4)
    n = args.cpu_devices
    rows = []
    for m in (int(v) for v in args.micro_batches.split(",")):
        for name, (stage, data, fsdp, tensor) in LAYOUTS.items():
            layout = Layout(data=data, fsdp=fsdp, tensor=tensor, stage=stage)
            if layout.num_devices != n or args.layers % stage or (args.batch // m) % (data * fsdp):
                continue
            plan = ExecutionPlan("bench", n, {"all": DeviceGroup("all", 0, n)},
                                 {"actor.train": Placement("all", layout)})
            cache = CallCache(plan)
            placed = cache.placed("actor.train")
            fn = functools.partial(sft_train, graphdef, opt, args.batch // m if m > 1 else None)
            call = cache.function("actor.train", fn, in_shardings=None, out_shardings=None, donate_argnums=(0, 1),
                                  kind="train")
            params = jax.device_put(host, placed.param_shardings(host))
            opt_state = jax.jit(opt.init, out_shardings=placed.opt_state_shardings(opt, params))(params)
            batch = {k: jax.device_put(v, placed.batch_sharding(v.ndim)) for k, v in inputs.items()}
            batch["rng_actor"] = jax.device_put(jax.random.key(0), placed.replicated())
            t0 = time.perf_counter()
            compiled = call.compiled(params, opt_state, batch)
            compile_s = time.perf_counter() - t0
            mem = compiled.memory_analysis()
            params, opt_state, out = call(params, opt_state, batch)  # warm-up
            loss = float(out["actor_stats"]["loss/sft"])
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                params, opt_state, out = call(params, opt_state, batch)
                jax.block_until_ready(params)
                times.append(time.perf_counter() - t0)
            rows.append({
                "layout": name, "stage": stage, "micro_batches": m, "compile_s": round(compile_s, 2),
                "step_s": round(statistics.median(times), 4), "first_loss": loss,
                "argument_mib": round(mem.argument_size_in_bytes / 2**20, 2) if mem else None,
                "temp_mib": round(mem.temp_size_in_bytes / 2**20, 2) if mem else None,
            })
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    header = ("layout", "M", "compile s", "step s", "args MiB/dev", "temp MiB/dev", "first loss")
    table = [header] + [(r["layout"], str(r["micro_batches"]), f"{r['compile_s']:.1f}", f"{r['step_s']:.3f}",
                         str(r["argument_mib"]), str(r["temp_mib"]), f"{r['first_loss']:.5f}") for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(header))]
    for i, t in enumerate(table):
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if args.out:
        meta = {"preset": args.preset, "layers": args.layers, "batch": args.batch, "length": args.length,
                "devices": n, "backend": jax.default_backend(), "jax": jax.__version__}
        with open(args.out, "w") as f:
            json.dump({"config": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
