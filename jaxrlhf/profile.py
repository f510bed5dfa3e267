"""Measure a config's model calls on the hardware at hand and write a profile the planner reads.

    python -m jaxrlhf.profile --config FILE --out profile.yaml [--repeats 2] [--sizes 4,8]
        [--calls actor.generate] [--search-budget 10] [key=value ...]

For every model the algorithm's graph uses (a role's dimensions and head; the
reference and the actor share one when their shapes match) and every phase its
calls need - generation as a prefill plus per-token decode steps, inference,
training per optimizer step - it times the phase on a small grid: placements
of all devices and of half of them in each single-axis layout that fits (data,
FSDP, the largest tensor size that divides the model), and on the placements
of the plans the planner weighs for the config (`planned_placements`: a short
search's pick, the presets, its runners-up), at half and full rows
of the config's batch and half and full lengths (prompt for prefill, cache
slots for decode, prompt + response otherwise; with `algorithm.pack_sequences`
the train and inference phases at the packed rows and width the planner prices,
`Workload.packed_shape`). Each point is the best of
`--repeats` runs after one warm-up (compilation); a prefill writes into a
cache with room for the config's response, as generation does, and decode
steps run as the config's engine runs them (`DECODE_TIMERS`): the static
engine's on-device loop over layers split out of the stack once (timed one
jitted call per token instead, a data-parallel decode on 8 simulated CPU
devices measured 2.6x the time per token the engine took in a run), or the
continuous engine itself, its paged cache, bookkeeping and sampling. The hardware numbers come from `jaxrlhf.placement.calibrate`
on the same devices; parameter moves between the placements
(`jaxrlhf.transfer.realloc.reallocate`) and batch moves (`jax.device_put` of a
token batch from one group to another) are recorded beside them as `moves`.

The file is a hardware profile with a `measured` section (`jaxrlhf.planner.measured`),
YAML, read back with the project's safe loader; set
`plan.profile: FILE` and plan choice prices every call the tables cover from
them (`CallCost.source == "measured"`), and the rest from its formulas scaled by
how far they are off where the tables reach (`"calibrated"`). The
same format holds profiles recorded on GPUs or TPUs elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Any, Sequence

from jaxrlhf import config as cfglib

SEARCH_BUDGET_S = 10.0  # seconds of the planner's search that proposes the placements timed beyond the grid


def grid_layouts(call, cfg, size: int, wl, max_tensor: int) -> list:
    """The single-axis layouts of `size` devices `call` can run under: data, FSDP and the largest
    tensor size that divides the model. Generation under FSDP too: the search never places it there,
    but a preset may run it at its role's FSDP home (interleaved), and no formula prices it well (on
    8 CPU devices they charged 8.6 s for 2.8 s measured: the weight gathers cost far less there)."""
    from jaxrlhf.planner.plan import Layout
    from jaxrlhf.planner.search import valid_layouts

    ok = [lay for lay in valid_layouts(call, cfg, size, wl, max_tensor) if lay.stage == 1]
    if call.kind == "generate" and size > 1 and not cfg.hidden_size % size and not wl.call_batch(call.kind) % size:
        ok.append(Layout(fsdp=size))
    pure = [lay for lay in ok if sum(v > 1 for v in (lay.data, lay.fsdp, lay.tensor)) <= 1]
    tensor = max((lay for lay in pure if lay.tensor > 1), key=lambda lay: lay.tensor, default=None)
    return [lay for lay in pure if lay.tensor == 1] + ([tensor] if tensor else [])


def halves(n: int, split: int = 1) -> list[int]:
    """n // 2 and n where n // 2 still divides over `split` shards (n alone otherwise)."""
    return sorted({m for m in (n // 2, n) if m >= 1 and m % split == 0}) or [n]


class Timer:
    """Times the phases of one model on one placement: jitted functions over sharded random inputs."""

    def __init__(self, cfg, head: str, group, layout, repeats: int, wl=None, sampling=None):
        import jax
        import optax
        from flax import nnx
        from jax.sharding import NamedSharding

        from jaxrlhf.models.sampling import SamplingParams
        from jaxrlhf.models.transformer import build_model
        from jaxrlhf.placement.layout import activation_resolver, batch_spec, make_mesh, param_shardings

        self.cfg, self.layout, self.repeats = cfg, layout, repeats
        self.wl, self.sampling = wl, sampling or SamplingParams()  # the engine decode runs (None: static)
        mesh = make_mesh(group, layout)
        graphdef, params = nnx.split(build_model(cfg, head), nnx.Param)
        self.graphdef, self.params = graphdef, jax.device_put(params, param_shardings(params, mesh))
        self.resolver = activation_resolver(mesh)
        self.batch_sharding = NamedSharding(mesh, batch_spec(2, mesh))
        self.opt = optax.adamw(1e-4)
        self.opt_state = self.opt.init(self.params)
        self.platform = mesh.devices.flat[0].platform

    def _inputs(self, rows: int, length: int):
        import jax
        import jax.numpy as jnp

        tok = jnp.ones((rows, length), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
        return [jax.device_put(x, self.batch_sharding) for x in (tok, pos, jnp.ones((rows, length), bool))]

    def _forward(self, p, tok, pos, mask, cache=None):
        from flax import nnx

        from jaxrlhf.models import axes as ax

        with ax.activation_sharding(self.resolver):
            model = nnx.merge(self.graphdef, p)
            if cache is None:  # value and reward models take no cache argument
                out = model(tok, pos, mask)
                return out if isinstance(out, tuple) else (out, None)
            return model(tok, pos, mask, cache)

    def _decode_loop(self, p, tok, pos, mask, cache, *, tokens: int):
        """`tokens` one-token steps in a `fori_loop`, the layers split once before it (as the engines do)."""
        import jax
        from flax import nnx

        from jaxrlhf.models import axes as ax
        from jaxrlhf.models.transformer import split_layers

        with ax.activation_sharding(self.resolver):
            model = nnx.merge(self.graphdef, p)
            layers = split_layers(model)

            def step(i, carry):
                logits, cache = model(tok, pos + i, mask, carry[1], layers_split=layers)
                return logits, cache

            logits, _ = model(tok, pos, mask, cache, layers_split=layers)
            return jax.lax.fori_loop(1, tokens, step, (logits, cache))[0]

    def time(self, phase: str, rows: int, length: int, free_slots: int = 0) -> float:
        """Seconds of `phase` at `rows` x `length` (decode: per token, with a cache of `length` slots;
        prefill: into a cache with `free_slots` more slots for the response)."""
        import jax
        import optax

        from jaxrlhf.models.transformer import KVCache
        from jaxrlhf.placement.calibrate import best_time
        from jaxrlhf.placement.calls import compile_lowered, compiler_options

        def compiled(fn, kind, *args):  # compiled as the runtime compiles a call of this kind
            return compile_lowered(jax.jit(fn).lower(*args), compiler_options(kind, self.platform))

        if phase == "inference":
            args = self._inputs(rows, length)
            f = compiled(lambda p, *x: self._forward(p, *x)[0], "inference", self.params, *args)
            return best_time(lambda: f(self.params, *args).block_until_ready(), self.repeats)
        if phase == "train":
            def step(p, s, tok, pos, mask):
                g = jax.grad(lambda p: self._forward(p, tok, pos, mask)[0].astype("float32").mean())(p)
                u, s = self.opt.update(g, s, p)
                return optax.apply_updates(p, u), s

            args = self._inputs(rows, length)
            f = compiled(step, "train", self.params, self.opt_state, *args)
            return best_time(lambda: jax.block_until_ready(f(self.params, self.opt_state, *args)), self.repeats)
        prefill = jax.jit(lambda p, t, q, m, c: self._forward(p, t, q, m, c))
        if phase == "prefill":
            args = self._inputs(rows, length)
            return best_time(lambda: jax.block_until_ready(
                prefill(self.params, *args, KVCache.init(self.cfg, rows, length + free_slots))), self.repeats)
        engine = self.wl.gen_engine if self.wl is not None else "static"
        return DECODE_TIMERS[engine](self, rows, length, prefill)

    def _dense_decode(self, rows: int, length: int, prefill) -> float:
        """Seconds per token of the static engine's decode over a dense cache of `length` slots."""
        import jax

        from jaxrlhf.models.transformer import KVCache

        # decode: `tokens` steps of one token into a cache of `length` slots filled by a prefill, run as the
        # static engine runs them: one on-device loop over the layers split out of the stack once
        tokens = max(length // 4, 1)
        decode = jax.jit(functools.partial(self._decode_loop, tokens=tokens), donate_argnums=4)
        pre = self._inputs(rows, length - tokens)
        one = self._inputs(rows, 1)

        def run() -> float:
            _, cache = prefill(self.params, *pre, KVCache.init(self.cfg, rows, length))
            jax.block_until_ready(cache)
            t0 = time.perf_counter()
            jax.block_until_ready(decode(self.params, *one, cache))
            return (time.perf_counter() - t0) / tokens

        run()
        return min(run() for _ in range(self.repeats))

    def _engine_decode(self, rows: int, length: int, prefill) -> float:
        """Seconds per full-width step of the continuous engine (`generate_continuous`, paged cache, its
        slot bookkeeping and per-row sampling) with `rows` rows, prompts of the workload's length and a
        cache of `length` columns (prompt + max_new_tokens): the whole engine run with every response
        capped at k + 2 tokens, less the run capped at 2 (the first token comes from the prefill, so both
        share one prefill and one full-width step), over k. Timed as one token per jitted call instead,
        or over a dense cache, the engine's own step costs (paging, compaction, sampling) are missed."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding

        from jaxrlhf.models import axes as ax
        from jaxrlhf.models.continuous import generate_continuous
        from jaxrlhf.placement.calibrate import best_time
        from jaxrlhf.placement.calls import compile_lowered, compiler_options
        from jaxrlhf.placement.layout import batch_spec

        prompt, new = self.wl.prompt_len, length - self.wl.prompt_len
        if new < 3:
            raise ValueError(f"decode of the continuous engine is timed over >= 3 new tokens, got {new}")
        k = max(1, min(new - 2, new // 4))
        group = math.gcd(self.wl.gen_group, rows)
        tok, _, mask = self._inputs(rows, prompt)
        mesh = self.batch_sharding.mesh
        caps = [jax.device_put(jnp.full((rows,), n, jnp.int32), NamedSharding(mesh, batch_spec(1, mesh)))
                for n in (2, k + 2)]

        def generate(p, tok, mask, cap):
            with ax.activation_sharding(self.resolver):
                return generate_continuous(self.graphdef, p, tok, mask, jax.random.key(0), max_new_tokens=new,
                                           sampling=self.sampling, eos_id=None, pad_id=0, group_size=group,
                                           max_lengths=cap).response_tokens

        f = compile_lowered(jax.jit(generate).lower(self.params, tok, mask, caps[0]),
                            compiler_options("generate", self.platform))
        short, long = (best_time(lambda c=c: f(self.params, tok, mask, c).block_until_ready(), self.repeats)
                       for c in caps)
        return max(long - short, 0.0) / k


DECODE_TIMERS = {"static": Timer._dense_decode, "continuous": Timer._engine_decode}  # by generation.engine


def measure_moves(models: dict, placements: list, repeats: int) -> list[dict[str, Any]]:
    """Seconds to reshard each model's parameters from its first placement to each other one, and to
    copy a token batch between the same two groups."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from jaxrlhf.models.transformer import build_model
    from jaxrlhf.placement.calibrate import best_time
    from jaxrlhf.placement.layout import batch_spec, make_mesh, param_shardings
    from jaxrlhf.transfer.realloc import reallocate, tree_bytes

    out = []
    for key, (cfg, head, rows, length) in models.items():
        params = nnx.state(build_model(cfg, head), nnx.Param)
        (g0, l0), rest = placements[0], placements[1:]
        m0 = make_mesh(g0, l0)
        src = jax.device_put(params, param_shardings(params, m0))
        batch = jax.device_put(jnp.ones((rows, length), jnp.int32), NamedSharding(m0, batch_spec(2, m0)))
        for g, lay in rest:
            mesh = make_mesh(g, lay)
            target = param_shardings(params, mesh)
            seconds = best_time(lambda: jax.block_until_ready(reallocate(src, target)[0]), repeats)
            bsh = NamedSharding(mesh, batch_spec(2, mesh))
            batch_s = best_time(lambda: jax.device_put(batch, bsh).block_until_ready(), repeats)
            where = {"src": f"{g0.start}+{g0.size}:{l0}", "dst": f"{g.start}+{g.size}:{lay}"}
            out.append({"model": key, "what": "params", **where, "bytes": float(tree_bytes(src)),
                        "seconds": seconds})
            out.append({"model": key, "what": "batch", **where, "bytes": float(rows * length * 4),
                        "seconds": batch_s})
    return out


def planned_placements(cfg: cfglib.Config, run_setup, hw, budget_s: float) -> list[tuple[str, int, Any]]:
    """(call, devices, layout) of every call of the plans the planner weighs for `cfg` on its devices under
    `hw` (the formulas): the search's pick, the colocated preset, then the other presets and the search's
    runners-up by predicted step time; each placement as the tables that price it are keyed
    (`measured.timed_placement`), without repeats. The single-axis grid misses the layouts that mix axes
    (colocated generation is data 2 x tensor 4 on 8 devices), and those the formulas price worst: on 8 CPU
    devices its generate call was priced 8 s from the other layouts' errors and measured 17.9 s."""
    from jaxrlhf.planner.measured import timed_placement
    from jaxrlhf.run import planning

    result = planning.search_plan(cfg, run_setup.algorithm, run_setup.models, run_setup.machine.devices, hw,
                                  time_budget_s=budget_s)
    presets = {k: e for k, e in result.presets.items() if not isinstance(e, str) and e.feasible}
    ranked = sorted([*(e for k, e in presets.items() if k != "colocated"), *result.runners_up],
                    key=lambda e: e.step_s if e.step_s is not None else float("inf"))
    out: list[tuple[str, int, Any]] = []
    for est in [result.best, *([presets["colocated"]] if "colocated" in presets else []), *ranked]:
        for name, placement in est.plan.calls.items():
            devices, layout = timed_placement(est.plan.groups[placement.group].size, placement.layout)
            if layout.context == 1 and (name, devices, layout) not in out:
                out.append((name, devices, layout))
    return out


def profile(cfg: cfglib.Config, repeats: int = 2, sizes: Sequence[int] | None = None,
            log=functools.partial(print, flush=True), calls: Sequence[str] | None = None,
            search_budget_s: float = SEARCH_BUDGET_S):
    """The calibrated hardware profile of the local devices with `cfg`'s calls measured into it: on groups
    of `sizes` devices (default: half and all of them) in the single-axis layouts (`grid_layouts`), and on
    the placements of the plans the planner weighs (`planned_placements`, per call 2 or half as many as
    the grid, whichever is more; with `sizes` given, only those of these sizes; `search_budget_s=0`: none). `calls`: only these
    calls of the graph (default: all)."""
    from jaxrlhf.algorithms.rollout import sampling_params
    from jaxrlhf.placement.calibrate import calibrate
    from jaxrlhf.planner.measured import CALL_PHASES, Measured, Table, model_key
    from jaxrlhf.planner.plan import DeviceGroup
    from jaxrlhf.run import planning
    from jaxrlhf.run.assembly import setup

    run_setup = setup(cfg)
    algorithm, graph, models, chip = run_setup.algorithm, run_setup.graph, run_setup.models, run_setup.machine.chip
    wl = algorithm.workload()
    hw = calibrate(planning.hardware_name(cfg, chip))
    n = run_setup.machine.devices
    max_tensor = hw.max_tensor
    chosen = sorted(set(sizes)) if sizes else halves(n)
    if any(not 1 <= k <= n for k in chosen):
        raise cfglib.ConfigError(f"--sizes {chosen}: group sizes must lie in 1..{n} (the local devices)")
    unknown = sorted(set(calls or ()) - {c.name for c in graph.calls})
    if unknown:
        raise cfglib.ConfigError(f"--calls {unknown}: not calls of this config's graph; "
                                 f"known: {','.join(c.name for c in graph.calls)}")
    planned = planned_placements(cfg, run_setup, hw, search_budget_s) if search_budget_s > 0 else []
    tables: dict[tuple, list] = {}
    moved: dict[str, tuple] = {}
    placements: list = []
    for call in graph.calls:
        if calls and call.name not in calls:
            continue
        cfg_m = models[call.role]
        key = model_key(cfg_m, call.head)
        grid = [(size, lay) for size in chosen for lay in grid_layouts(call, cfg_m, size, wl, max_tensor)]
        extra = [(d, lay) for name, d, lay in planned
                 if name == call.name and (d, lay) not in grid and (not sizes or d in chosen)]
        for size, lay in grid + extra[:max(2, len(grid) // 2)]:  # the pick's and colocated's at least
            group = DeviceGroup("profile", 0, size)
            if (group, lay) not in placements:
                placements.append((group, lay))
            phases = [p for p in CALL_PHASES[call.kind] if (key, p, size, str(lay)) not in tables]
            if not phases:
                continue
            timer = Timer(cfg_m, call.head, group, lay, repeats, wl, sampling_params(cfg))
            split = lay.batch_ways  # data x fsdp x expert
            for phase in phases:
                rows_all, lengths = wl.call_seqs(call), halves(wl.seq_len)
                if phase == "prefill":
                    lengths = halves(wl.prompt_len)
                elif phase == "decode" and wl.gen_engine == "continuous":  # the engine's cache: prompt + new
                    lengths = sorted({wl.prompt_len + max(m, 3) for m in halves(wl.gen_len)})
                elif phase == "decode":
                    lengths = halves(wl.seq_len, 2)
                elif wl.packed:  # the packed rows the train and inference calls run
                    shape = wl.packed_shape(call, split, cfg_m, lay.context)
                    rows_all = math.ceil(shape.micro_batches * shape.rows * split)
                    lengths = halves(math.ceil(shape.width))
                points = [(rows, length, timer.time(phase, rows, length, wl.gen_len))
                          for rows in halves(rows_all, split) for length in lengths]
                tables[(key, phase, size, str(lay))] = points
                log(f"{key} {phase:9s} {size} dev {str(lay):8s} "
                    + "  ".join(f"{r}x{n_}: {s * 1e3:.2f} ms" for r, n_, s in points))
            moved.setdefault(key, (cfg_m, call.head, wl.batch_size, wl.seq_len))
    moves = measure_moves(moved, placements, repeats) if len(placements) > 1 else []
    measured = Measured((Table(k[0], k[1], k[2], k[3], tuple(p)) for k, p in tables.items()), moves)
    notes = (f"{hw.notes}; calls measured by python -m jaxrlhf.profile on {n} {chip.platform} devices "
             f"({time.strftime('%Y-%m-%d')})")
    return dataclasses.replace(hw, name=f"{hw.name}-profiled", measured=measured, notes=notes)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxrlhf.profile", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="the training config whose calls to measure")
    ap.add_argument("--out", default="profile.yaml", help="profile file to write (never replaced)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per point, after one warm-up")
    ap.add_argument("--sizes", help="comma-separated group sizes to measure (default: half and all devices)")
    ap.add_argument("--calls", help="comma-separated calls of the graph to measure (default: all)")
    ap.add_argument("--search-budget", type=float, default=SEARCH_BUDGET_S,
                    help="seconds of the planner's search proposing the placements timed beyond the "
                         "single-axis grid (0: the grid alone)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    try:
        sizes = [int(k) for k in args.sizes.split(",")] if args.sizes else None
    except ValueError:
        print(f"error: --sizes {args.sizes!r}: give comma-separated integers, e.g. 4,8", file=sys.stderr)
        return 2
    if os.path.exists(args.out):
        print(f"error: --out {args.out} exists; choose another file (a profile is never replaced)", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.search_budget < 0:
        print("error: --repeats must be >= 1 and --search-budget >= 0", file=sys.stderr)
        return 2
    try:
        cfg = cfglib.load_config(args.config, args.overrides)
    except (cfglib.ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jaxrlhf.train import setup_devices

    setup_devices(cfg.run)
    t0 = time.perf_counter()
    try:
        calls = [c.strip() for c in args.calls.split(",") if c.strip()] if args.calls else None
        hw = profile(cfg, args.repeats, sizes, calls=calls, search_budget_s=args.search_budget)
    except cfglib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hw.save(args.out)
    print(f"wrote {args.out}: {len(hw.measured.tables)} measured tables, {len(hw.measured.moves)} moves "
          f"({time.perf_counter() - t0:.0f} s); use it with plan.profile={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
