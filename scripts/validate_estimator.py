"""Run model calls for real on the local devices and compare with the cost model.

For several placements (group size x layout) of a small LLaMA-style model it
times generate (prefill + a jitted decode step per token), inference (one
forward) and train (gradient + AdamW per minibatch), estimates the same calls
with a hardware profile calibrated on this machine, and prints
estimated / measured per call with the median and max error.

    python scripts/validate_estimator.py [--devices 8] [--json out.json] [--profile cpu.yaml]

On CPU, simulated devices share the host's cores (the calibrated profile
caps their combined FLOP/s and bandwidth accordingly).
"""

from __future__ import annotations

import argparse
import os
import sys


def _setup_devices(n: int) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if jax.config.jax_platforms in (None, "", "cpu") or os.environ["JAX_PLATFORMS"] == "cpu":
        jax.config.update("jax_num_cpu_devices", n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--profile", help="calibrated profile file to use (calibrated and written here if missing)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    _setup_devices(args.devices)

    import json
    import statistics

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding

    from jaxrlhf.planner.cost import Workload, call_cost
    from jaxrlhf.graph import CallSpec
    from jaxrlhf.placement.calibrate import best_time, calibrate
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.placement.layout import activation_resolver, batch_spec, make_mesh, param_shardings
    from jaxrlhf.planner.plan import DeviceGroup, Layout
    from jaxrlhf.models import axes as ax
    from jaxrlhf.models.config import preset
    from jaxrlhf.models.transformer import KVCache, build_model

    if args.profile and os.path.exists(args.profile):
        hw = get_profile(args.profile)
    else:
        hw = calibrate("cpu" if jax.devices()[0].platform == "cpu" else "h100")
        if args.profile:
            hw.save(args.profile)
    print(f"profile: {hw.name}: {hw.flops['float32'] / 1e9:.1f} GFLOP/s per device, host cap "
          f"{(hw.host_flops or 0) / 1e9:.1f}, mem {hw.hbm_bandwidth / 1e9:.1f} GB/s, "
          f"latency {hw.kernel_latency * 1e6:.0f} us")

    cfg = preset("small", hidden_size=512, intermediate_size=1376, vocab_size=4096, num_layers=4)
    wl = Workload(batch_size=16, prompt_len=64, gen_len=16, minibatches=2, remat="none")
    n = args.devices
    placements = [(n, Layout(data=n)), (n, Layout(fsdp=n)), (n, Layout(data=n // 2, tensor=2)),
                  (n, Layout(data=n // 4, tensor=4)), (n // 2, Layout(data=n // 2)),
                  (n // 2, Layout(data=n // 8 or 1, tensor=4) if n >= 8 else Layout(tensor=n // 2)),
                  (n // 4, Layout(data=n // 4)), (1, Layout())]
    placements = [(s, lay) for s, lay in placements if s >= 1 and lay.num_devices == s]

    model = build_model(cfg, "lm")
    graphdef, params0 = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-4)

    rows = []
    for size, layout in placements:
        group = DeviceGroup("g", 0, size)
        mesh = make_mesh(group, layout)
        shard = param_shardings(params0, mesh)
        params = jax.device_put(params0, shard)
        resolver = activation_resolver(mesh)
        bsh = NamedSharding(mesh, batch_spec(2, mesh))

        def data(b: int, t: int):
            tok = jax.device_put(jnp.ones((b, t), jnp.int32), bsh)
            pos = jax.device_put(jnp.broadcast_to(jnp.arange(t), (b, t)), bsh)
            return tok, pos, jax.device_put(jnp.ones((b, t), bool), bsh)

        def fwd(p, tok, pos, mask, cache=None):
            with ax.activation_sharding(resolver):
                return nnx.merge(graphdef, p)(tok, pos, mask, cache)

        # inference: one forward over the whole batch
        tok, pos, mask = data(wl.batch_size, wl.seq_len)
        infer = jax.jit(lambda p, t, q, m: fwd(p, t, q, m)[0])
        t_inf = best_time(lambda: infer(params, tok, pos, mask).block_until_ready(), args.repeats)

        # train: grad + AdamW per minibatch
        mtok, mpos, mmask = data(wl.minibatch_size, wl.seq_len)

        def step(p, s, t, q, m):
            g = jax.grad(lambda p: -jax.nn.log_softmax(fwd(p, t, q, m)[0]).mean())(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        train = jax.jit(step)
        state = opt.init(params)
        t_train = best_time(lambda: jax.block_until_ready(train(params, state, mtok, mpos, mmask)), args.repeats)
        t_train *= wl.minibatches * wl.ppo_epochs

        # generate: prefill, then one jitted decode step per new token
        ptok, ppos, pmask = data(wl.batch_size, wl.prompt_len)
        dtok, dpos, dmask = data(wl.batch_size, 1)
        prefill = jax.jit(lambda p, t, q, m, c: fwd(p, t, q, m, c))
        decode = jax.jit(lambda p, t, q, m, c: fwd(p, t, q, m, c), donate_argnums=4)

        def generate():
            cache = KVCache.init(cfg, wl.batch_size, wl.seq_len)
            logits, cache = prefill(params, ptok, ppos, pmask, cache)
            for _ in range(wl.gen_len):
                logits, cache = decode(params, dtok, dpos, dmask, cache)
            logits.block_until_ready()

        t_gen = best_time(generate, args.repeats)

        for kind, measured in (("generate", t_gen), ("inference", t_inf), ("train", t_train)):
            est = call_cost(CallSpec(f"actor.{kind}", "actor", kind), cfg, group, layout, wl, hw).seconds
            rows.append({"call": kind, "devices": size, "layout": str(layout), "measured_s": measured,
                         "estimated_s": est, "ratio": est / measured})
            print(f"{kind:10s} {size:2d} dev {str(layout):9s} measured {measured * 1e3:8.1f} ms  "
                  f"estimated {est * 1e3:8.1f} ms  ratio {est / measured:5.2f}", flush=True)

    errs = [abs(r["ratio"] - 1) for r in rows]
    by_kind = {k: [abs(r["ratio"] - 1) for r in rows if r["call"] == k] for k in ("generate", "inference", "train")}
    print(f"\n|estimated/measured - 1|: median {statistics.median(errs):.2f}, max {max(errs):.2f}")
    for k, e in by_kind.items():
        print(f"  {k:10s} median {statistics.median(e):.2f}, max {max(e):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": hw.to_dict(), "workload": wl.__dict__, "rows": rows,
                       "median_error": statistics.median(errs), "max_error": max(errs),
                       "by_call": {k: {"median": statistics.median(e), "max": max(e)} for k, e in by_kind.items()}},
                      f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
