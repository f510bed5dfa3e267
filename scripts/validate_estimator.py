"""Run model calls for real on the local devices and compare with the cost model.

For several placements (group size x layout) of a LLaMA-style model it times
generate (a prefill, then decode steps in one on-device loop, as the engines run
them; the profiler's `Timer`), inference (one forward) and train (gradient +
AdamW per minibatch), estimates the same calls with a
hardware profile calibrated on this machine, and prints estimated / measured
per call. The placements are a tensor-parallel sweep (tensor 1 / 2 / 4 / 8 on
as many devices, where the devices and heads allow) and data / FSDP / mixed
layouts on the whole machine and on parts of it. For generation it also
prints the decode time per token next to the HBM roofline (weight shard +
KV cache bytes per step / memory bandwidth). Summary per call kind: median
and max |estimated / measured - 1| and the rank correlation (Spearman) of
estimated vs measured over placements: the search only needs the ranking.

    python scripts/validate_estimator.py [--devices 8] [--json out.json] [--profile cpu.yaml]
    python scripts/validate_estimator.py --hidden 4096 --layers 8 --heads 32 --dtype bfloat16 \
        --batch 64 --prompt-len 512 --gen-len 128          # on a GPU host

On CPU, simulated devices share the host's cores (the calibrated profile
caps their combined FLOP/s and bandwidth accordingly). Pipelined layouts
(stage > 1) run train and inference (never generation) as the runtime does:
GPipe over micro-batches of a quarter minibatch, estimated with the same
micro-batch count.
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
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8, help="attention heads (kv heads too)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    _setup_devices(args.devices)

    import dataclasses
    import json
    import statistics

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding

    from jaxrlhf.graph import CallSpec
    from jaxrlhf.models import axes as ax
    from jaxrlhf.models import pipeline
    from jaxrlhf.models.config import preset
    from jaxrlhf.models.transformer import build_model
    from jaxrlhf.placement.calibrate import best_time, calibrate
    from jaxrlhf.placement.layout import STAGE_AXIS, activation_resolver, batch_spec, make_mesh, param_shardings
    from jaxrlhf.planner.cost import call_cost
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.plan import DeviceGroup, Layout
    from jaxrlhf.planner.sizes import kv_bytes_per_token, param_bytes
    from jaxrlhf.planner.workload import Workload
    from jaxrlhf.profile import Timer

    if args.profile and os.path.exists(args.profile):
        hw = get_profile(args.profile)
    else:
        kind = jax.devices()[0].device_kind
        hw = calibrate("cpu" if jax.devices()[0].platform == "cpu" else "h200" if "H200" in kind else "h100")
        if args.profile:
            hw.save(args.profile)
    print(f"profile: {hw.name}: {hw.flops['float32'] / 1e9:.1f} GFLOP/s per device "
          f"({hw.flops[args.dtype] / 1e9:.1f} in {args.dtype}), host cap "
          f"{(hw.host_flops or 0) / 1e9:.1f}, mem {hw.hbm_bandwidth / 1e9:.1f} GB/s, "
          f"kernel latency {hw.kernel_latency * 1e6:.1f} us, collective latency {hw.collective_latency * 1e6:.1f} us")

    cfg = preset("small", hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4 // 8 * 8,
                 vocab_size=args.vocab, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.heads,
                 param_dtype=args.dtype, dtype=args.dtype)
    wl = Workload(batch_size=args.batch, prompt_len=args.prompt_len, gen_len=args.gen_len, minibatches=2,
                  remat="none")
    n = args.devices
    sweep = [(t, Layout(tensor=t)) for t in (1, 2, 4, 8) if t <= n and args.heads % t == 0]
    mixed = [(n, Layout(data=n)), (n, Layout(fsdp=n)), (n, Layout(data=n // 2, tensor=2)),
             (n, Layout(data=n // 4, tensor=4)), (n // 2, Layout(data=n // 2)),
             (n // 2, Layout(data=n // 8 or 1, tensor=4) if n >= 8 else Layout(tensor=n // 2)),
             (n // 4, Layout(data=n // 4))]
    # Pipelines: micro-batches of a quarter minibatch, whose rows must still split over data x fsdp.
    staged_wl = dataclasses.replace(wl, micro_batch=max(wl.minibatch_size // 4, 1))
    staged = [(n, Layout(data=2, tensor=n // 4, stage=2)), (n, Layout(tensor=n // 2, stage=2)),
              (n, Layout(data=2, tensor=n // 8 or 1, stage=4)), (n, Layout(tensor=n // 4 or 1, stage=4))]
    placements = list(dict.fromkeys(
        (s, lay) for s, lay in sweep + mixed + staged
        if s >= 1 and lay.num_devices == s and args.heads % lay.tensor == 0 and args.layers % lay.stage == 0
        and ((staged_wl.micro_batch if lay.stage > 1 else None) or wl.minibatch_size) % (lay.data * lay.fsdp) == 0))

    model = build_model(cfg, "lm")
    graphdef, params0 = nnx.split(model, nnx.Param)
    opt = optax.adamw(1e-4)

    def compare(kind: str, measured: float, size: int, group, layout, call_wl, decode=None, roofline=None) -> dict:
        """One row: the cost model's estimate of the call next to its measured time (printed)."""
        cost = call_cost(CallSpec(f"actor.{kind}", "actor", kind), cfg, group, layout, call_wl, hw)
        est = cost.seconds
        # Model FLOP utilisation: the call's FLOPs (the cost model's count: 6 N tokens plus attention
        # for training) over the measured time, against the matmul rate measured on these devices.
        peak = min(hw.flops[args.dtype] * size, hw.host_flops or float("inf"))  # simulated devices share cores
        mfu = cost.flops / measured / peak
        row = {"call": kind, "devices": size, "layout": str(layout), "stage": layout.stage,
               "micro_batch": call_wl.micro_batch, "measured_s": measured, "estimated_s": est,
               "ratio": est / measured, "flops": cost.flops, "mfu": mfu}
        extra = f"  MFU {mfu:5.1%}"
        if decode is not None:
            est_decode = cost.parts["decode"] / call_wl.gen_len
            row.update(decode_s_per_token=decode, decode_est_s_per_token=est_decode,
                       decode_roofline_s_per_token=roofline)
            extra += f"  decode/token {decode * 1e3:6.2f} ms (est {est_decode * 1e3:6.2f}, roofline {roofline * 1e3:6.2f})"
        print(f"{kind:10s} {size:2d} dev {str(layout):11s} measured {measured * 1e3:8.1f} ms  "
              f"estimated {est * 1e3:8.1f} ms  ratio {est / measured:5.2f}{extra}", flush=True)
        return row

    rows = []
    for size, layout in placements:
        call_wl = staged_wl if layout.stage > 1 else wl
        micro = {k: call_wl.micro_batches(CallSpec(f"actor.{k}", "actor", k)) if layout.stage > 1 else 1
                 for k in ("inference", "train")}
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

        def fwd(p, tok, pos, mask, cache=None, micro=1):
            with ax.activation_sharding(resolver), pipeline.staged(layout.stage, STAGE_AXIS), \
                    pipeline.microbatches(micro):
                return nnx.merge(graphdef, p)(tok, pos, mask, cache)

        # inference: one forward over the whole batch (a pipeline over its micro-batches when staged)
        tok, pos, mask = data(wl.batch_size, wl.seq_len)
        infer = jax.jit(lambda p, t, q, m: fwd(p, t, q, m, micro=micro["inference"])[0])
        t_inf = best_time(lambda: infer(params, tok, pos, mask).block_until_ready(), args.repeats)

        # train: grad + AdamW per minibatch
        mtok, mpos, mmask = data(wl.minibatch_size, wl.seq_len)

        def step(p, s, t, q, m):
            g = jax.grad(lambda p: -jax.nn.log_softmax(fwd(p, t, q, m, micro=micro["train"])[0]).mean())(p)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        train = jax.jit(step)
        state = opt.init(params)
        t_train = best_time(lambda: jax.block_until_ready(train(params, state, mtok, mpos, mmask)), args.repeats)
        t_train *= wl.minibatches * wl.ppo_epochs

        kinds = (("inference", t_inf), ("train", t_train))
        if layout.stage > 1:  # generation is never pipelined (the runtime refuses it)
            for kind, measured in kinds:
                rows.append(compare(kind, measured, size, group, layout, call_wl))
            continue

        # generate as the engines run it (timed by the profiler's Timer, one source of truth): a prefill
        # into a cache with room for the response, then decode steps in one on-device loop
        timer = Timer(cfg, "lm", group, layout, args.repeats)
        t_prefill = timer.time("prefill", wl.batch_size, wl.prompt_len, free_slots=wl.gen_len)
        decode = timer.time("decode", wl.batch_size, wl.seq_len)
        t_gen = t_prefill + wl.gen_len * decode
        del timer

        # decode per token vs the HBM roofline of one decode step
        seqs = wl.batch_size / (layout.data * layout.fsdp)
        kv = seqs * (wl.prompt_len + wl.gen_len / 2) * kv_bytes_per_token(cfg) / min(layout.tensor, cfg.num_kv_heads)
        roof = (param_bytes(cfg, "lm") / (layout.tensor * layout.fsdp) + kv) / hw.memory_bandwidth(size)
        rows.append(compare("generate", t_gen, size, group, layout, wl, decode=decode, roofline=roof))
        for kind, measured in kinds:
            rows.append(compare(kind, measured, size, group, layout, wl))

    errs = [abs(r["ratio"] - 1) for r in rows]
    kinds = ("generate", "inference", "train")
    by_kind = {}
    for k in kinds:
        kr = [r for r in rows if r["call"] == k]
        e = [abs(r["ratio"] - 1) for r in kr]
        by_kind[k] = {"median": statistics.median(e), "max": max(e),
                      "spearman": spearman([r["estimated_s"] for r in kr], [r["measured_s"] for r in kr])}
    print(f"\n|estimated/measured - 1|: median {statistics.median(errs):.2f}, max {max(errs):.2f}")
    for k, v in by_kind.items():
        print(f"  {k:10s} median {v['median']:.2f}, max {v['max']:.2f}, rank correlation {v['spearman']:+.2f}")
    piped = [r for r in rows if r["stage"] > 1]
    if piped:
        e = [abs(r["ratio"] - 1) for r in piped]
        print(f"  pipelined placements (stage > 1, train and inference): median {statistics.median(e):.2f}, "
              f"max {max(e):.2f} over {len(piped)} calls")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": hw.to_dict(), "workload": wl.__dict__, "model": cfg.__dict__, "rows": rows,
                       "median_error": statistics.median(errs), "max_error": max(errs), "by_call": by_kind,
                       "pipelines": "stage > 1 rows: train and inference"}, f, indent=1, default=str)


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long lists (average ranks for ties)."""
    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


if __name__ == "__main__":
    sys.exit(main())
