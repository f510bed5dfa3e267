"""Compile times: scanned layers (depth-independent) and the persistent compilation cache.

Part 1 times XLA compilation of an actor's train step (loss, gradient, AdamW),
a forward, and generation (prefill + decode loop) for models of 2 and 12
layers (the quickstart's width), on 8 simulated CPU devices with FSDP. Run it
on a checkout before the scanned layers to get the "before" column.

Part 2 runs the quickstart twice as a user would (`python -m jaxrlhf.train`,
two steps) with an empty compilation cache folder, and reports the wall
time of each run: the second loads its executables from the cache.

    python scripts/bench_compile.py [--layers 2,12] [--skip-quickstart] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def compile_times(layers: int, devices: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxrlhf.models.config import preset
    from jaxrlhf.models.generation import generate_tokens
    from jaxrlhf.models.sampling import SamplingParams
    from jaxrlhf.models.transformer import build_model
    from jaxrlhf.placement.layout import make_mesh, param_shardings
    from jaxrlhf.planner.plan import DeviceGroup, Layout

    cfg = preset("small", num_layers=layers)
    graphdef, state = nnx.split(build_model(cfg, seed=0))
    mesh = make_mesh(DeviceGroup("all", 0, devices), Layout(fsdp=devices))
    params = jax.device_put(state, param_shardings(state, mesh))
    opt = optax.adamw(1e-4)
    tokens = jnp.zeros((devices * 2, 96), jnp.int32)
    mask = jnp.ones(tokens.shape, bool)
    positions = jnp.cumsum(mask, 1) - 1

    def loss(p):
        logits, _ = nnx.merge(graphdef, p)(tokens, positions, mask)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    def train(p, s):
        g = jax.grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def forward(p):
        return nnx.merge(graphdef, p)(tokens, positions, mask)[0]

    out = {}
    t0 = time.perf_counter()
    jax.jit(train).lower(params, opt.init(params)).compile()
    out["train_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.jit(forward).lower(params).compile()
    out["forward_s"] = time.perf_counter() - t0
    prompt = jnp.ones((devices * 2, 32), jnp.int32)

    def gen(p, rng):
        return generate_tokens(graphdef, p, prompt, jnp.ones(prompt.shape, bool), rng,
                               max_new_tokens=32, sampling=SamplingParams(), eos_id=None, pad_id=0)

    t0 = time.perf_counter()
    jax.jit(gen).lower(params, jax.random.key(0)).compile()
    out["generate_s"] = time.perf_counter() - t0
    return out


def quickstart_twice(steps: int) -> dict[str, float]:
    """Wall time of the quickstart run twice into fresh output folders, sharing an empty cache."""
    cache = tempfile.mkdtemp(prefix="jaxrlhf-cache-")
    times = []
    for i in range(2):
        out = tempfile.mkdtemp(prefix="jaxrlhf-run-")
        cmd = [sys.executable, "-m", "jaxrlhf.train", "--config", "configs/quickstart.yaml", f"run.steps={steps}",
               f"run.output_dir={out}/run", f"run.compile_cache={cache}", "run.export_hf=false"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return {"first_run_s": times[0], "second_run_s": times[1], "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="2,12")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--skip-quickstart", action="store_true")
    ap.add_argument("--quickstart-steps", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    rows = {int(n): compile_times(int(n), args.devices) for n in args.layers.split(",")}
    print(f"{'layers':>6} {'train s':>8} {'forward s':>9} {'generate s':>10}")
    for n, r in rows.items():
        print(f"{n:>6} {r['train_s']:8.2f} {r['forward_s']:9.2f} {r['generate_s']:10.2f}")
    result = {"compile": rows}
    if not args.skip_quickstart:
        q = quickstart_twice(args.quickstart_steps)
        print(f"quickstart ({q['steps']} steps): first run {q['first_run_s']:.1f} s, "
              f"second run (compilation cache) {q['second_run_s']:.1f} s")
        result["quickstart"] = q
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
