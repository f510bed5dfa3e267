"""The planner's memory model against XLA's, at real model sizes, without weights.

For LLaMA-shaped models (default: a 1B and an 8B) on 8 devices under two
layouts, this compiles the runtime's own train, inference and generate
functions (the algorithm's `functions()`, through the executor's
`PlacedFunction`, with donation) for shape-only inputs, and compares the
per-device bytes XLA's `memory_analysis()` reports (arguments + outputs +
temporaries - donated aliases) with the planner's estimate (resident
parameters and optimizer state + the call's working set). Nothing is
allocated, so an 8B model checks on a laptop CPU.

    python scripts/check_memory_model.py [--models llama3.2-1b,llama3-8b] [--json out.json]

Layouts may split sequences over a context axis (ring attention): e.g. one 16k-token sequence
under context 8 against one sequence per device without it,

    python scripts/check_memory_model.py --models llama3.2-1b --layouts ctx8 --batch 1 \
        --prompt-len 1024 --gen-len 15360 --minibatches 1 --micro-batch 1 --calls actor.train,ref.inference

Packed calls (`--packed`, `algorithm.pack_sequences`; log-normal response lengths, `--median` and `--sigma`)
compile at the runtime packer's largest packing of the planner's drawn batches (`models.packing.pack_batch`
of each, the one with the most tokens in a micro-batch), against the memory model's, which holds the largest
drawn micro-batch (`Workload.packed_peak`): e.g. 64 sequences with a long tail of responses, each shard's
part one blockwise-attended row,

    python scripts/check_memory_model.py --models llama3.2-1b --layouts f8 --batch 64 --micro-batch 0 \
        --prompt-len 1024 --gen-len 15360 --minibatches 1 --packed --median 2048 --sigma 1 \
        --calls actor.train,ref.inference

Prints a table and JSON; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

LAYOUTS = {"fsdp8": dict(fsdp=8), "fsdp2_tp4": dict(fsdp=2, tensor=4)}
_AXES = {"d": "data", "data": "data", "f": "fsdp", "fsdp": "fsdp", "t": "tensor", "tp": "tensor",
         "c": "context", "ctx": "context", "p": "stage", "pp": "stage", "e": "expert", "ep": "expert"}


def parse_layout(name: str) -> dict[str, int]:
    """Axis sizes of a layout name: an entry of LAYOUTS, or `_`-joined axis-size pairs such as `ctx8`,
    `fsdp2_ctx4`, `d8`, `f8`, `fsdp2_tp4`, `ep8`, `d2_ep4` (d/data, f/fsdp, t/tp, c/ctx, p/pp, e/ep: expert)."""
    if name in LAYOUTS:
        return LAYOUTS[name]
    sizes = {}
    for part in name.split("_"):
        m = re.fullmatch(r"([a-z]+)(\d+)", part)
        if not m or m.group(1) not in _AXES:
            raise SystemExit(f"layout {name!r}: {part!r} is not an axis and size ({sorted(_AXES)})")
        sizes[_AXES[m.group(1)]] = int(m.group(2))
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama3.2-1b,llama3-8b")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="prompts per step")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch (0 = none)")
    ap.add_argument("--remat", default="full", choices=["none", "full", "dots"])
    ap.add_argument("--logit-chunk", type=int, default=4096,
                    help="algorithm.logit_chunk_tokens: response positions a device whose logits are built at once "
                         "(0 = all at once)")
    ap.add_argument("--calls", default="actor.train,ref.inference,actor.generate")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="parameter and compute dtype; float32 on CPU, whose XLA backend upcasts every bf16 "
                         "matmul operand to f32 (whole stacked weights, hoisted out of loops), which GPUs and "
                         "TPUs do not")
    ap.add_argument("--no-donate", action="store_true", help="compile train calls without donation")
    ap.add_argument("--packed", action="store_true", help="algorithm.pack_sequences: packed train and inference calls")
    ap.add_argument("--median", type=int, default=None, help="plan.response_length_median (log-normal lengths)")
    ap.add_argument("--sigma", type=float, default=0.0, help="plan.response_length_sigma")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)

    rows = []
    for model in args.models.split(","):
        for layout in args.layouts.split(","):
            rows += check(model, layout, args)
    errors = [abs(r["error"]) for r in rows]
    print(f"\n{'model':<12} {'layout':<10} {'call':<15} {'xla GiB':>8} {'model GiB':>9} {'error':>7} {'compile s':>9} "
          f"{'h100':>8}")
    for r in rows:
        print(f"{r['model']:<12} {r['layout']:<10} {r['call']:<15} {r['xla_gib']:8.2f} {r['estimate_gib']:9.2f} "
              f"{r['error']:+7.1%} {r['compile_s']:9.1f} {'fits' if r['fits_h100'] else 'refused':>8}")
    summary = {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}
    print(f"median |error| {summary['median_abs_error']:.1%}, max {summary['max_abs_error']:.1%}")
    out = {"settings": vars(args), "rows": rows, "summary": summary}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def _config(model: str, args):
    from jaxrlhf import config as cfglib
    from jaxrlhf.models.config import PRESETS

    micro = args.micro_batch or None
    seq = args.prompt_len + args.gen_len
    # a longer sequence than the preset's positions (16k on an 8k model): its rope extends, as a
    # long-context fine-tune's would; the shapes, which are all this measures, do not depend on it
    longer = [f"model.actor.overrides.max_position_embeddings={seq}"] \
        if seq > PRESETS[model].max_position_embeddings else []
    return cfglib.load_config(None, longer + [
        "algorithm.name=ppo", f"model.actor.preset={model}", f"model.actor.remat={args.remat}",
        f"model.actor.dtype={args.dtype}", f"model.actor.param_dtype={args.dtype}",
        f"model.critic.remat={args.remat}", f"data.batch_size={args.batch}",
        f"data.max_prompt_len={args.prompt_len}", f"generation.max_new_tokens={args.gen_len}",
        f"algorithm.minibatches={args.minibatches}", f"algorithm.micro_batch_size={micro if micro else 'null'}",
        f"algorithm.logit_chunk_tokens={args.logit_chunk or 'null'}", f"algorithm.pack_sequences={args.packed}",
        f"plan.response_length_median={args.median or 'null'}", f"plan.response_length_sigma={args.sigma}",
    ])


def _largest_packing(algorithm, wl, name: str, readers, shards: int, prompt: int, new: int):
    """Shape-only arrays of packing `name`: the runtime packer's (`pack_batch`, with the readers' one-row rule)
    of each of the planner's drawn batches of lengths (`Workload.response_lengths`, every prompt token real),
    the one with the most tokens in a micro-batch (then the most read positions)."""
    import jax
    import numpy as np

    from jaxrlhf.models.packing import pack_batch

    rows = algorithm.batch_rows
    train = name != "packed_inference"
    updates = np.arange(rows).reshape(wl.minibatches, -1) if train else np.arange(rows)[None]
    if train:
        updates = np.concatenate([updates] * wl.ppo_epochs)
    best, most = None, None
    for lengths in wl.response_lengths(rows):
        mask = np.arange(prompt + new)[None, :] < (prompt + lengths)[:, None]
        packed, _ = pack_batch(mask, np.ones(mask.shape, np.int32), np.cumsum(mask, axis=1) - 1, new, updates,
                               shards=shards, blockwise=algorithm.one_row(readers))
        size = (int(np.prod(packed["tokens"].shape[3:])), packed["take"].shape[-1])
        if most is None or size > most:
            best, most = packed, size
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in best.items()}


def _abstract_inputs(batch: int, prompt: int, new: int):
    """Shape-only values of every input a PPO call reads (a superset; each call takes its own)."""
    import jax
    import jax.numpy as jnp

    S = jax.ShapeDtypeStruct
    seq = prompt + new
    f32, i32, b = jnp.float32, jnp.int32, jnp.bool_
    key = jax.eval_shape(lambda: jax.random.key(0))
    return {
        "prompt_tokens": S((batch, prompt), i32), "prompt_mask": S((batch, prompt), b),
        "tokens": S((batch, seq), i32), "mask": S((batch, seq), b), "positions": S((batch, seq), i32),
        "response_tokens": S((batch, new), i32), "response_mask": S((batch, new), b),
        "behaviour_logp": S((batch, new), f32), "ref_logp": S((batch, new), f32), "values": S((batch, new), f32),
        "rewards": S((batch,), f32), "scores": S((batch,), f32),
        "rule_scores": S((batch,), f32), "ended_with_eos": S((batch,), b), "kl_coef": S((), f32),
        "value_moments": {"mean": S((), f32), "std": S((), f32), "count": S((), f32)},
        "rng_generate": key, "rng_actor": key, "rng_critic": key,
    }


def check(model: str, layout_name: str, args) -> list[dict]:
    import jax
    from flax import nnx

    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.models.transformer import build_model
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.placement.executor import Role
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.memory import optimizer_per_device, params_per_device, working_set
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement
    from jaxrlhf.run.assembly import setup
    from jaxrlhf.run.roles import build_optimizer_for

    cfg = _config(model, args)
    run_setup = setup(cfg)  # the algorithm and model configs as a run has them; roles built abstract below
    algorithm, graph, configs = run_setup.algorithm, run_setup.graph, run_setup.models
    specs = algorithm.roles()
    layout = Layout(**parse_layout(layout_name))
    plan = ExecutionPlan("check", args.devices, {"all": DeviceGroup("all", 0, args.devices)},
                         {c: Placement("all", layout) for c in graph.names})
    cache = CallCache(plan)
    wl = dataclasses.replace(algorithm.workload(), donate=not args.no_donate)
    roles = {}
    for name, spec in specs.items():
        remat = getattr(cfg.model, name).remat or "none"  # a frozen role's null: it never trains
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build_model(configs[name], spec.head, remat=remat)))
        role = Role(name, graphdef, abstract)
        if spec.trained:
            role.optimizer = build_optimizer_for(cfg, name, 100, configs[name])
        roles[name] = role
    # the plan's context degrees reach the packer's one-row rule, as a run's `Execution` carries them
    execution = dataclasses.replace(algorithm.configured_execution(),
                                    contexts={c: layout.context for c in graph.names if layout.context > 1})
    algorithm.bind(load_tokenizer(cfg.model.tokenizer), roles, configs, execution)
    functions = algorithm.functions()
    everything = _abstract_inputs(algorithm.batch_rows, args.prompt_len, args.gen_len)
    for name, readers in algorithm.packings.items():
        everything[name] = _largest_packing(algorithm, wl, name, readers, layout.batch_ways, args.prompt_len,
                                            args.gen_len)
    hw = get_profile("h100")
    rows = []
    for call in args.calls.split(","):
        spec = graph[call]
        role = roles[spec.role]
        placed = cache.placed(call)

        def shaped(tree, shardings):
            return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                          tree, shardings)

        params = shaped(role.params, placed.param_shardings(role.params))
        inputs = {}
        for name in spec.inputs:
            value = everything[name]
            inputs[name] = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed.batch_sharding(len(x.shape))
                                               if x.shape else placed.replicated()), value)
        if spec.kind == "train":
            opt_abstract = jax.eval_shape(role.optimizer.init, role.params)
            opt_state = shaped(opt_abstract, placed.opt_state_shardings(role.optimizer, role.params))
            fn_args, donate = (params, opt_state, inputs), (() if args.no_donate else (0, 1))
        else:
            fn_args, donate = (params, inputs), ()
        fn = cache.function(call, functions[call], in_shardings=None, out_shardings=None, donate_argnums=donate,
                            kind=spec.kind)
        t0 = time.perf_counter()
        mem = fn.compiled(*fn_args).memory_analysis()
        compile_s = time.perf_counter() - t0
        xla = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)
        cfg_m = configs[spec.role]
        estimate = params_per_device(cfg_m, spec.head, layout) + sum(working_set(spec, cfg_m, layout, wl).values())
        if spec.kind == "train":
            estimate += optimizer_per_device(cfg_m, spec.head, layout, wl, spec.role)
        rows.append({
            "model": model, "layout": layout_name, "call": call, "xla_gib": xla / 2**30,
            "estimate_gib": estimate / 2**30, "error": estimate / xla - 1, "compile_s": compile_s,
            "xla": {"arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
                    "temporaries": mem.temp_size_in_bytes, "aliased": mem.alias_size_in_bytes},
            "model_parts": {k: float(v) for k, v in working_set(spec, cfg_m, layout, wl).items()},
            "fits_h100": estimate < hw.usable_memory,  # the planner's verdict against h100's usable memory
            # a packed input's [shards, updates, micro-batches, rows, width] and read positions, as compiled
            "packed": {n: [*inputs[n]["tokens"].shape, inputs[n]["take"].shape[-1]] for n in spec.inputs
                       if n.startswith("packed_")},
            "h100_usable_gib": hw.usable_memory / 2**30,
        })
        print(f"{model} {layout_name} {call}: xla {xla / 2**30:.2f} GiB, model {estimate / 2**30:.2f} GiB, "
              f"compiled in {compile_s:.1f} s", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
