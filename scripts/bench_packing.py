"""Packed vs padded-and-trimmed train and inference calls on a long-tailed rollout batch, and the
planner's estimates of both.

    python scripts/bench_packing.py --out F [--rows 64] [--median 64] [--sigma 1] [--cap 512]
        [--model small] [--repeats 3] [--budget TOKENS] [--quick]

The batch: `--rows` sequences of the bundled task's shape (prompts of 8-16 tokens, left-padded to 16)
whose responses have the log-normal lengths the planner draws for this workload (median 64, sigma 1,
cap 512: `planner.workload.Workload.response_lengths`, its first batch, so the planner prices the batch
measured). Both sides run the runtime's own call functions (`algorithms.rollout`) jitted on one device
(every core): the reference log-probs (`policy_logprobs`: an inference call) and the actor update with
the GRPO loss (`actor_train`, 4 minibatches, 1 epoch; REINFORCE++ advantages, which need no groups).

- padded: the batch cut to its longest response (`rollout.trim_responses`, what a run does by default):
  every row as wide as the longest sequence.
- packed: `algorithm.pack_sequences` (`models.packing.pack_batch`, one shard): each sequence's real
  tokens back to back in rows as wide as the batch; with `--budget`, micro-batches of at most that many
  real tokens. The model attends densely (`blockwise_attention_from` unset): rows as wide as the batch are
  then what the runtime packs and the planner prices (one row a shard is `bench_one_row.py`'s question).

Each call is compiled first, then timed `--repeats` times (the median). Real tokens/s = the batch's
real tokens (prompt + response, once per epoch) / seconds, the same count on both sides, so the ratio
is the time ratio. The planner's estimate of each packed call comes from the formulas with this machine's
calibration (`placement.calibrate`), as `python -m jaxrlhf.plan` prices it, and from call tables measured
here as `python -m jaxrlhf.profile` measures a packed workload: padded rows at the packed shape the
planner prices (every micro-batch's rows x their width, `Workload.packed_shape` over its own draws of
the lengths, not this batch's packing) and at half the rows and half the width.

JSON (`--out`, never overwritten): `padded_tokens_per_s`, `packed_tokens_per_s`, `ratio` (train and
inference together), and per call the same three plus the seconds, the planner's estimates and their
errors. Run it alone on a quiet machine; `--quick` (tiny model, 16 rows, cap 128) is a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrlhf.algorithms import rollout  # noqa: E402
from jaxrlhf.algorithms.update import minibatch_indices  # noqa: E402
from jaxrlhf.graph import CallSpec  # noqa: E402
from jaxrlhf.models.config import preset  # noqa: E402
from jaxrlhf.models.packing import pack_batch  # noqa: E402
from jaxrlhf.models.sampling import SamplingParams  # noqa: E402
from jaxrlhf.models.transformer import build_model, positions_from_mask  # noqa: E402
from jaxrlhf.planner.cost import call_cost  # noqa: E402
from jaxrlhf.planner.measured import Measured, Table, model_key  # noqa: E402
from jaxrlhf.planner.plan import DeviceGroup, Layout  # noqa: E402
from jaxrlhf.planner.workload import Workload  # noqa: E402

PROMPT = 16
MINIBATCHES = 4
CALLS = {"inference": CallSpec("ref.inference", "ref", "inference"), "train": CallSpec("actor.train", "actor", "train")}


def rollout_batch(rows: int, lengths: np.ndarray, cap: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A generated batch as the generate call returns it: [rows, PROMPT + cap], prompts left-padded."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(8, PROMPT + 1, rows)
    mask = np.zeros((rows, PROMPT + cap), bool)
    mask[:, :PROMPT] = np.arange(PROMPT)[None, :] >= (PROMPT - prompt_lens)[:, None]
    response_mask = np.arange(cap)[None, :] < lengths[:, None]
    mask[:, PROMPT:] = response_mask
    tokens = np.where(mask, rng.integers(3, 300, mask.shape), 0).astype(np.int32)
    return {
        "tokens": tokens, "mask": mask, "positions": np.asarray(positions_from_mask(jnp.asarray(mask))),
        "response_tokens": tokens[:, PROMPT:], "response_mask": response_mask,
        "behaviour_logp": np.where(response_mask, -rng.uniform(1, 6, response_mask.shape), 0).astype(np.float32),
        "ended_with_eos": np.ones(rows, bool), "rule_scores": rng.uniform(0, 1, rows).astype(np.float32),
    }


def timed(fn, args, repeats: int) -> float:
    """Median seconds of `fn(*args)` after one call that compiles it."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--median", type=int, default=64)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap", type=int, default=512)
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=None, help="algorithm.max_tokens_per_micro_batch of the packed calls")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, 16 rows, cap 128, 1 repeat")
    ap.add_argument("--out", help="write the results as JSON here (never overwritten)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.cap, args.model, args.repeats, args.median = 16, 128, "tiny", 1, 16
    if args.out and Path(args.out).exists():
        print(f"--out {args.out} exists; choose another path (results are never overwritten)", file=sys.stderr)
        return 2

    cfg = preset(args.model).replace(blockwise_attention_from=None)  # dense: rows as wide as the batch
    wl = Workload(batch_size=args.rows, prompt_len=PROMPT, gen_len=args.cap, minibatches=MINIBATCHES,
                  remat="none", gen_len_median=args.median, gen_len_sigma=args.sigma)
    lengths = wl.response_lengths(args.rows)[0]
    full = rollout_batch(args.rows, lengths, args.cap)
    padded = rollout.trim_responses(full, args.cap)
    width = padded["response_mask"].shape[1]
    real = int(padded["mask"].sum())
    key = jax.random.key(0)
    updates = np.asarray(minibatch_indices(key, args.rows, MINIBATCHES, 1))
    pack = functools.partial(pack_batch, padded["mask"], padded["tokens"], padded["positions"], width,
                             shards=1, budget=args.budget)
    packed_inference, _ = pack(np.arange(args.rows)[None])
    packed_train, train_stats = pack(updates)

    graphdef, params = nnx.split(build_model(cfg, seed=0))
    sampling = SamplingParams(temperature=1.0)
    # the GRPO loss with the REINFORCE++ advantage (no groups: the table's row counts need not be whole
    # groups; advantages are a negligible part of the call either way)
    settings = rollout.RLSettings(estimator="reinforce_pp", loss="grpo", loss_agg="seq-mean-token-mean",
                                  minibatches=MINIBATCHES, max_new_tokens=args.cap, kl_in_reward=False)
    optimizer = optax.adamw(1e-5)
    fns = {"inference": jax.jit(functools.partial(rollout.policy_logprobs, graphdef, sampling, None)),
           "train": jax.jit(functools.partial(rollout.actor_train, graphdef, optimizer, settings))}
    common = {"kl_coef": jnp.float32(0.0), "rng_actor": key}
    response = {k: jnp.asarray(padded[k]) for k in ("response_tokens", "response_mask", "behaviour_logp",
                                                    "ended_with_eos", "rule_scores")}
    inputs = {
        "padded": {**response, **common, **{k: jnp.asarray(padded[k]) for k in ("tokens", "mask", "positions")}},
        "packed": {**response, **common, "packed_inference": jax.tree_util.tree_map(jnp.asarray, packed_inference),
                   "packed_actor": jax.tree_util.tree_map(jnp.asarray, packed_train)},
    }

    def run(kind: str, side: str) -> float:
        x = inputs[side]
        if kind == "inference":
            return timed(fns[kind], (params, x), args.repeats)
        state = optimizer.init(params)
        # train calls donate nothing here: the same parameters are timed again
        return timed(fns[kind], (params, state, x), args.repeats)

    # the planner: formulas on this machine's calibration, and call tables measured here as
    # `python -m jaxrlhf.profile` measures them (padded rows: half and all of the batch, half and full width)
    from jaxrlhf.placement.calibrate import calibrate

    hw = calibrate("cpu")
    group, layout = DeviceGroup("all", 0, 1), Layout()
    wl_padded = Workload(**{**wl.__dict__, "gen_len": width, "gen_len_median": None, "gen_len_sigma": 0.0})
    wl_packed = Workload(**{**wl.__dict__, "packed": True, "token_budget": args.budget})
    results, tables = {}, []
    for kind, call in CALLS.items():
        seconds = {side: run(kind, side) for side in ("padded", "packed")}
        steps = 1 if kind == "inference" else MINIBATCHES  # a train table holds one optimizer step
        # as `python -m jaxrlhf.profile` measures a packed workload's calls: padded rows at the packed shape
        # the planner prices (all micro-batches' rows x their width) and at half the rows and half the width
        shape = wl_packed.packed_shape(call, 1)
        packed_rows = math.ceil(shape.micro_batches * shape.rows) * (1 if kind == "inference" else MINIBATCHES)
        half = packed_rows // 2 if kind == "inference" else max(packed_rows // 2 // MINIBATCHES, 1) * MINIBATCHES
        points = []
        for rows, cut in ((packed_rows, width), (half, width), (packed_rows, width // 2), (half, width // 2)):
            if rows > args.rows:
                raise SystemExit(f"the packed shape has {rows} rows, more than the batch's {args.rows}: "
                                 "measure with a larger --rows")
            part = rollout.trim_responses({k: v[:rows] for k, v in full.items()}, cut) if cut < width else \
                {k: v[:rows] for k, v in padded.items()}
            part = {k: (v[:, :PROMPT + cut] if k in ("tokens", "mask", "positions") else v[:, :cut] if v.ndim == 2
                        else v) for k, v in part.items()}
            x = {**{k: jnp.asarray(v) for k, v in part.items() if k not in ("full_tokens",)}, **common}
            fn = fns[kind]
            args_of = (params, x) if kind == "inference" else (params, optimizer.init(params), x)
            points.append((rows // (1 if kind == "inference" else MINIBATCHES), PROMPT + cut,
                           timed(fn, args_of, args.repeats) / steps))
        tables.append(Table(model_key(cfg, "lm"), kind, 1, str(layout), tuple(map(tuple, points))))
        measured_hw = dataclasses.replace(hw, measured=Measured(tables=[tables[-1]]))
        estimate = call_cost(call, cfg, group, layout, wl_packed, measured_hw)
        results[kind] = {
            "padded_s": seconds["padded"], "packed_s": seconds["packed"],
            "padded_tokens_per_s": real / seconds["padded"], "packed_tokens_per_s": real / seconds["packed"],
            "ratio": seconds["padded"] / seconds["packed"],
            "table_packed_s": estimate.seconds, "table_source": estimate.source,
            "table_packed_error": estimate.seconds / seconds["packed"] - 1,
            "formula_padded_s": call_cost(call, cfg, group, layout, wl_padded, hw).seconds,
            "formula_packed_s": call_cost(call, cfg, group, layout, wl_packed, hw).seconds,
            "packed_shape": dataclasses.asdict(shape), "table": tables[-1].to_dict(),
        }
        r = results[kind]
        r["formula_packed_error"] = r["formula_packed_s"] / r["packed_s"] - 1
        r["formula_padded_error"] = r["formula_padded_s"] / r["padded_s"] - 1
    total = {side: sum(results[k][f"{side}_s"] for k in results) for side in ("padded", "packed")}
    summary = {
        "model": args.model, "rows": args.rows, "median": args.median, "sigma": args.sigma, "cap": args.cap,
        "budget": args.budget, "real_tokens": real, "padded_tokens": int(padded["mask"].size),
        "packed_fill": train_stats.real_tokens / max(train_stats.packed_tokens, 1),
        "longest_response": int(lengths.max()), "trimmed_width": width,
        "padded_tokens_per_s": 2 * real / total["padded"], "packed_tokens_per_s": 2 * real / total["packed"],
        "ratio": total["padded"] / total["packed"], "calls": results,
        "devices": str(jax.devices()[0].device_kind), "jax": jax.__version__,
    }
    print(f"batch: {args.rows} sequences, real tokens {real}, padded-and-trimmed {padded['mask'].size} "
          f"(prompt {PROMPT} + width {width}), packed fill {summary['packed_fill']:.2f}")
    print(f"{'call':<10} {'padded s':>9} {'packed s':>9} {'padded tok/s':>13} {'packed tok/s':>13} {'ratio':>6} "
          f"{'planner (tables) s':>19} {'err':>6} {'formulas s':>11} {'err':>6}")
    for kind, r in results.items():
        print(f"{kind:<10} {r['padded_s']:9.3f} {r['packed_s']:9.3f} {r['padded_tokens_per_s']:13.0f} "
              f"{r['packed_tokens_per_s']:13.0f} {r['ratio']:6.2f} {r['table_packed_s']:19.3f} "
              f"{r['table_packed_error']:+6.2f} {r['formula_packed_s']:11.3f} {r['formula_packed_error']:+6.2f}")
    print(f"{'both':<10} {total['padded']:9.3f} {total['packed']:9.3f} {summary['padded_tokens_per_s']:13.0f} "
          f"{summary['packed_tokens_per_s']:13.0f} {summary['ratio']:6.2f}")
    return write_summary(summary, args.out)


def write_summary(summary: dict, out: str | None) -> int:
    """Print the summary's JSON line (without its per-call detail, "calls") and write all of it to `out`."""
    print(json.dumps({k: v for k, v in summary.items() if k != "calls"}))
    if out:
        Path(out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
