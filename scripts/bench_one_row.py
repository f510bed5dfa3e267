"""Packed calls in one row a shard against rows as wide as the batch, where the model attends blockwise, and
the planner's estimates of both.

    python scripts/bench_one_row.py --out F [--rows 64] [--median 96] [--sigma 1.2] [--cap 2048]
        [--model small] [--blockwise-from 512] [--block 128] [--repeats 3] [--quick]

The batch: `--rows` sequences of the bundled task's shape (prompts of 8-16 tokens) with the log-normal
response lengths the planner draws (`planner.workload.Workload.response_lengths`, its first batch), cut to
the longest response (`rollout.trim_responses`), packed on one shard (`models.packing.pack_batch`):

- wide: rows as wide as the batch's longest sequence, first-fit (the packing before `packing.one_row_rule`);
- one row: each micro-batch's sequences in one row of `size_bucket` blocks (`pack_batch(blockwise=...)`).

The model (`--model` with `blockwise_attention_from` and `attention_block` set small, so rows of a CPU-sized
batch attend blockwise on both sides: each row skips its own block pairs of two sequences) runs the
runtime's call functions jitted on one device (every core): the reference log-probs (an inference call) and
the GRPO update (4 minibatches). Each is compiled, then timed `--repeats` times (the median).

The planner prices both from the formulas on this machine's calibration (`placement.calibrate`): the one-row
packing as `python -m jaxrlhf.plan` prices it, the wide rows with `Workload.packed_shape` given no model.
Its predicted ratio (wide / one row) is held to the measured one.

JSON (`--out`, never overwritten): per call the seconds of both sides, the measured and predicted ratios,
the packed shapes; and the same for both calls together. Run it alone on a quiet machine; `--quick` (tiny
model, 16 rows, cap 512, 1 repeat) is a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from bench_packing import CALLS, MINIBATCHES, PROMPT, rollout_batch, timed, write_summary  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrlhf.algorithms import rollout  # noqa: E402
from jaxrlhf.algorithms.update import minibatch_indices  # noqa: E402
from jaxrlhf.models.config import preset  # noqa: E402
from jaxrlhf.models.packing import one_row_rule, pack_batch  # noqa: E402
from jaxrlhf.models.sampling import SamplingParams  # noqa: E402
from jaxrlhf.models.transformer import build_model  # noqa: E402
from jaxrlhf.planner.cost import call_cost  # noqa: E402
from jaxrlhf.planner.plan import DeviceGroup, Layout  # noqa: E402
from jaxrlhf.planner.workload import Workload  # noqa: E402

SIDES = ("wide", "one_row")


class WideRows(Workload):
    """The workload priced in rows as wide as the batch whatever the model (`packed_shape` without one)."""

    def packed_shape(self, call, batch_ways, model=None, context=1):
        return super().packed_shape(call, batch_ways)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--median", type=int, default=96)
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--cap", type=int, default=2048)
    ap.add_argument("--model", default="small")
    ap.add_argument("--blockwise-from", type=int, default=512, help="model.*.blockwise_attention_from")
    ap.add_argument("--block", type=int, default=128, help="model.*.attention_block")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--draws", type=int, default=8, help="batches of drawn lengths measured (the planner prices 8)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, 16 rows, cap 512, 1 repeat")
    ap.add_argument("--out", help="write the results as JSON here (never overwritten)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.cap, args.model, args.repeats, args.median, args.draws = 16, 512, "tiny", 1, 48, 2
        args.blockwise_from, args.block = 128, 32
    if args.out and Path(args.out).exists():
        print(f"--out {args.out} exists; choose another path (results are never overwritten)", file=sys.stderr)
        return 2

    cfg = preset(args.model).replace(blockwise_attention_from=args.blockwise_from, attention_block=args.block)
    wl = Workload(batch_size=args.rows, prompt_len=PROMPT, gen_len=args.cap, minibatches=MINIBATCHES, remat="none",
                  gen_len_median=args.median, gen_len_sigma=args.sigma, packed=True)
    draws = wl.response_lengths(args.rows)[:args.draws]
    key = jax.random.key(0)
    updates = np.asarray(minibatch_indices(key, args.rows, MINIBATCHES, 1))
    blockwise = {"wide": None, "one_row": one_row_rule([cfg])}
    graphdef, params = nnx.split(build_model(cfg, seed=0))
    settings = rollout.RLSettings(estimator="reinforce_pp", loss="grpo", loss_agg="seq-mean-token-mean",
                                  minibatches=MINIBATCHES, max_new_tokens=args.cap, kl_in_reward=False)
    optimizer = optax.adamw(1e-5)
    fns = {"inference": jax.jit(functools.partial(rollout.policy_logprobs, graphdef, SamplingParams(), None)),
           "train": jax.jit(functools.partial(rollout.actor_train, graphdef, optimizer, settings))}

    from jaxrlhf.placement.calibrate import calibrate

    hw = calibrate("cpu")
    group, layout = DeviceGroup("all", 0, 1), Layout()
    priced = {"wide": WideRows(**wl.__dict__), "one_row": wl}
    results = {kind: {"seconds": {side: 0.0 for side in SIDES}, "tokens": {side: 0 for side in SIDES}}
                   for kind in CALLS}
    real = 0
    for lengths in draws:  # the planner prices the mean packing of these batches; each is measured
        padded = rollout.trim_responses(rollout_batch(args.rows, lengths, args.cap), args.cap)
        width = padded["response_mask"].shape[1]
        real += int(padded["mask"].sum())
        base = {k: jnp.asarray(padded[k]) for k in ("response_tokens", "response_mask", "behaviour_logp",
                                                    "ended_with_eos", "rule_scores")}
        base.update(kl_coef=jnp.float32(0.0), rng_actor=key)
        for kind in CALLS:
            name = "packed_inference" if kind == "inference" else "packed_actor"
            for side in SIDES:
                packed, _ = pack_batch(padded["mask"], padded["tokens"], padded["positions"], width,
                                       updates if kind == "train" else np.arange(args.rows)[None], shards=1,
                                       blockwise=blockwise[side])
                # both sides attend blockwise: the comparison is the rows' layout alone
                assert cfg.attends_blockwise(packed["tokens"].shape[-1]), (kind, side)
                x = {**base, name: jax.tree_util.tree_map(jnp.asarray, packed)}
                fn_args = (params, x) if kind == "inference" else (params, optimizer.init(params), x)
                results[kind]["seconds"][side] += timed(fns[kind], fn_args, args.repeats) / len(draws)
                results[kind]["tokens"][side] += int(np.prod(packed["tokens"].shape)) / len(draws)
    for kind, call in CALLS.items():
        r = results[kind]
        r["predicted_s"] = {side: call_cost(call, cfg, group, layout, priced[side], hw).seconds for side in SIDES}
        r["priced_shape"] = {side: dataclasses.asdict(priced[side].packed_shape(call, 1, cfg)) for side in SIDES}
        r["measured_ratio"] = r["seconds"]["wide"] / r["seconds"]["one_row"]
        r["predicted_ratio"] = r["predicted_s"]["wide"] / r["predicted_s"]["one_row"]
    both = {side: sum(results[k]["seconds"][side] for k in CALLS) for side in SIDES}
    both_pred = {side: sum(results[k]["predicted_s"][side] for k in CALLS) for side in SIDES}
    summary = {
        "model": args.model, "blockwise_from": args.blockwise_from, "block": args.block, "rows": args.rows,
        "median": args.median, "sigma": args.sigma, "cap": args.cap, "draws": len(draws),
        "real_tokens_per_batch": real / len(draws),
        "measured_ratio": both["wide"] / both["one_row"], "predicted_ratio": both_pred["wide"] / both_pred["one_row"],
        "calls": results, "devices": str(jax.devices()[0].device_kind), "jax": jax.__version__,
        "command": "python scripts/bench_one_row.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(f"{len(draws)} batches of {args.rows} sequences ({summary['real_tokens_per_batch']:.0f} real tokens each, cap "
          f"{args.cap}); {args.model} attending blockwise from {args.blockwise_from} tokens, blocks of {args.block}")
    print(f"{'call':<10} {'layout':<8} {'tokens/batch':>12} {'priced tokens':>14} {'measured s':>11} {'predicted s':>12}")
    for kind, r in results.items():
        for side in SIDES:
            sh = r["priced_shape"][side]
            print(f"{kind:<10} {side:<8} {r['tokens'][side]:12.0f} "
                  f"{sh['updates'] * sh['micro_batches'] * sh['rows'] * sh['width']:14.0f} "
                  f"{r['seconds'][side]:11.3f} {r['predicted_s'][side]:12.3f}")
        print(f"{kind:<10} wide / one row: measured {r['measured_ratio']:.2f}x, predicted {r['predicted_ratio']:.2f}x")
    print(f"both calls: measured {summary['measured_ratio']:.2f}x, predicted {summary['predicted_ratio']:.2f}x")
    return write_summary(summary, args.out)


if __name__ == "__main__":
    sys.exit(main())
