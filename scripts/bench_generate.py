"""Decode throughput of jaxrlhf generation vs `transformers` `generate`, same weights, same run;
and (`--workload rl`) the static vs the continuous engine on an RL rollout's lengths.

    python scripts/bench_generate.py [--preset llama-100m] [--prompt-len 32] [--new-tokens 64]
        [--batches 1,8,32] [--repeats 2] [--dtype float32] [--out bench.json]
    python scripts/bench_generate.py --workload rl [--preset small] [--prompt-len 256] [--new-tokens 512]
        [--groups 8] [--group-size 8] [--median-len 64] [--sigma 1.0] [--slots N] [--kv-pages N]
        [--out bench.json]
    python scripts/bench_generate.py --workload grpo [--preset small] [--groups 16] [--group-size 8]
        [--prompt-len 16] [--new-tokens 32] [--out bench.json]

RL workload: `--groups` random prompts of `--prompt-len` tokens, each repeated `--group-size` times
(GRPO's G samples); row r's response is cut at a length drawn from a log-normal (median
`--median-len`, log-space std `--sigma`, clipped to [1, --new-tokens], fixed seed) through the engines'
per-row `max_lengths`, which ends a row exactly as an EOS at that length would. Both engines decode
greedily; the run checks they return the same tokens. Reported per engine: generated tokens/s and the
time to the last row (one call returns every row), the prefill time (both engines prefill each distinct
prompt once: static into a cache with room for the response, continuous into its prefix pages), and the
KV-cache bytes it allocates (`peak_kv_bytes`; static: the batch's cache plus the one row per group it is
copied from; continuous: the page pool plus the prefill's prefix it is built from), and for the continuous engine
the pool (`kv_pool_bytes`, `--kv-pages` response pages, default `--slots` x 2 x the median length) and
the most of it in use at once (`kv_used_peak_bytes`: prompt pages + the most response pages in use).
The JSON holds `tokens_per_s_ratio` and `prefill_ratio` (continuous over static, and static time over
continuous time).

GRPO workload (`--workload grpo`): the generate call of GRPO on the bundled task as
`scripts/bench_grpo_tunix.py` runs it (the `small` actor, 16 prompts x G = 8, prompt 16, up to 32 new
tokens, temperature 1, EOS = the byte tokenizer's), both engines in this process, interleaved, best of
`--repeats`; it prints the response lengths and each engine's time, the prefill it runs and its KV
bytes. `python scripts/bench_grpo_tunix.py --engines static,continuous` is the end-to-end twin.

A random model of the preset is written as a HF checkpoint to a temp dir and
loaded by both sides. Both decode greedily for exactly `--new-tokens` tokens
(jaxrlhf: no EOS; transformers: `min_new_tokens` = `max_new_tokens`).
tokens/s = batch * new_tokens / wall time of the whole `generate` (prompt
included), best of `--repeats` after one warm-up call; the jaxrlhf
decode-only rate excludes the prefill call.

On a GPU it also reports the fraction of the HBM roofline: bytes per decode
step = parameter bytes + the KV cache that holds real tokens (average context
prompt_len + new_tokens/2), divided by the measured time per step, over
`--hbm-gbps` (default from the device kind: H100 3350, H200 4800 GB/s).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxrlhf.models import generation as gen  # noqa: E402
from jaxrlhf.models.config import ModelConfig, preset  # noqa: E402
from jaxrlhf.models.continuous import continuous_fn, kv_cache_bytes, kv_column_bytes  # noqa: E402
from jaxrlhf.models.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from jaxrlhf.models.sampling import GREEDY, SamplingParams  # noqa: E402
from jaxrlhf.models.slots import kv_columns, page_size, pool_size  # noqa: E402
from jaxrlhf.models.transformer import build_model  # noqa: E402

HBM_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def _best(fn, repeats: int) -> float:
    fn()  # warm-up (compile, allocator)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_jax(graphdef, state, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict:
    """Times prefill and decode as the Generator runs them (two jitted calls, no per-token sync)."""
    tokens, mask = jnp.asarray(prompts), jnp.ones(prompts.shape, bool)
    bucket = gen.bucket_length(prompts.shape[1])
    rng = jax.random.key(0)

    def prefill():
        return jax.block_until_ready(gen.prefill_fn(
            graphdef, state, tokens, mask, bucket=bucket, max_new_tokens=new_tokens, pad_id=0))

    def full():
        p_tokens, p_mask, logits, cache = prefill()
        return jax.block_until_ready(gen.decode_fn(
            graphdef, state, p_tokens, p_mask, logits, cache, rng,
            max_new_tokens=new_tokens, sampling=GREEDY, eos_ids=(), pad_id=0))

    out = full()
    assert bool(out.response_mask.all()), "jax generation stopped early"
    t_total = _best(full, repeats)
    t_prefill = _best(prefill, repeats)
    return {"seconds": t_total, "prefill_seconds": t_prefill, "tokens": np.asarray(out.response_tokens)}


def bench_hf(model_dir: Path, prompts: np.ndarray, new_tokens: int, repeats: int, dtype: str, device: str) -> dict:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, pad_token_id=0)
    result = {}

    def run():
        with torch.inference_mode():
            result["out"] = hf.generate(ids, **kwargs)
        if device != "cpu":
            torch.cuda.synchronize()

    t = _best(run, repeats)
    out = result["out"][:, prompts.shape[1]:].cpu().numpy()
    assert out.shape[1] == new_tokens, "transformers generation stopped early"
    return {"seconds": t, "tokens": out}


def rl_lengths(rows: int, median: float, sigma: float, max_len: int, seed: int = 0) -> np.ndarray:
    """Long-tailed response lengths: log-normal with the given median, clipped to [1, max_len]."""
    lengths = np.random.default_rng(seed).lognormal(np.log(median), sigma, rows)
    return np.clip(np.rint(lengths), 1, max_len).astype(np.int32)


def bench_rl(graphdef, state, config: ModelConfig, args: argparse.Namespace) -> dict:
    """Static vs continuous engine on grouped prompts with long-tailed lengths (see the module docstring)."""
    g, n = args.group_size, args.new_tokens
    rng = np.random.default_rng(0)
    distinct = rng.integers(3, config.vocab_size, size=(args.groups, args.prompt_len)).astype(np.int32)
    prompts = jnp.asarray(np.repeat(distinct, g, axis=0))
    mask = jnp.ones(prompts.shape, bool)
    lengths = rl_lengths(prompts.shape[0], args.median_len, args.sigma, n)
    limits = jnp.asarray(lengths)
    bucket = gen.bucket_length(args.prompt_len)
    key = jax.random.key(0)

    def prefill(tokens, m, new_tokens):
        return jax.block_until_ready(gen.prefill_fn(graphdef, state, tokens, m, bucket=bucket,
                                                    max_new_tokens=new_tokens, pad_id=0))

    def static():  # the engine as a rollout runs it
        return jax.block_until_ready(_static_fn(graphdef, state, prompts, mask, key, max_new_tokens=n,
                                                sampling=GREEDY, eos_id=(), pad_id=0, max_lengths=limits,
                                                group_size=g))

    rows = prompts.shape[0]
    pages = args.kv_pages or pool_size(rows, args.slots) * -(-2 * int(args.median_len) // page_size(bucket))

    def continuous():
        return jax.block_until_ready(continuous_fn(graphdef, state, prompts, mask, key, max_new_tokens=n,
                                                   sampling=GREEDY, eos_id=(), pad_id=0, group_size=g,
                                                   slots=args.slots, kv_pages=pages, max_lengths=limits))

    old, new = static(), continuous()
    assert np.array_equal(np.asarray(old.lengths), lengths), "static engine ignored the forced lengths"
    same = float(np.mean(np.asarray(old.response_tokens) == np.asarray(new.response_tokens)))
    generated = int(lengths.sum())
    t_old, t_new = _best(static, args.repeats), _best(continuous, args.repeats)
    p_old = _best(lambda: prefill(prompts[::g], mask[::g], n), args.repeats)
    p_new = _best(lambda: prefill(prompts[::g], mask[::g], 0), args.repeats)
    kv = {e: kv_cache_bytes(config, rows, bucket, n, engine=e, group_size=g, slots=args.slots, kv_pages=pages)
          for e in ("static", "continuous")}
    prefix_cols, pool_cols = kv_columns(bucket, n, rows, g, args.slots, pages)
    used_cols = pool_cols - (pages - int(new.kv_pages_used)) * page_size(bucket)
    return {
        "rows": int(prompts.shape[0]), "group_size": g, "generated_tokens": generated,
        "length_median": float(np.median(lengths)), "length_mean": float(lengths.mean()),
        "length_max": int(lengths.max()), "same_tokens": same,
        "static": {"seconds": t_old, "time_to_last_row_s": t_old, "tokens_per_s": generated / t_old,
                   "prefill_seconds": p_old, "peak_kv_bytes": kv["static"]},
        "continuous": {"seconds": t_new, "time_to_last_row_s": t_new, "tokens_per_s": generated / t_new,
                       "prefill_seconds": p_new, "peak_kv_bytes": kv["continuous"],
                       "slots": pool_size(rows, args.slots), "kv_pages": pages,
                       "kv_pages_used_peak": int(new.kv_pages_used),
                       "kv_pool_bytes": pool_cols * kv_column_bytes(config),
                       "kv_used_peak_bytes": used_cols * kv_column_bytes(config)},
        "tokens_per_s_ratio": t_old / t_new, "prefill_ratio": p_old / p_new,
        "kv_bytes_ratio": kv["static"] / kv["continuous"],
    }


_static_fn = jax.jit(gen.generate_tokens, static_argnums=0,
                     static_argnames=("max_new_tokens", "sampling", "eos_id", "pad_id", "min_bucket", "group_size"))


def bench_grpo(graphdef, state, config: ModelConfig, args: argparse.Namespace) -> dict:
    """Static vs continuous engine on GRPO's generate call (see the module docstring): sampled, each row
    ends at EOS or the cap; the two engines' calls alternate so load changes hit both alike."""
    g, n = args.group_size, args.new_tokens
    distinct = np.random.default_rng(0).integers(3, config.vocab_size, size=(args.groups, args.prompt_len))
    prompts = jnp.asarray(np.repeat(distinct.astype(np.int32), g, axis=0))
    mask = jnp.ones(prompts.shape, bool)
    rows, bucket = prompts.shape[0], gen.bucket_length(args.prompt_len)
    sampling, key, eos = SamplingParams(temperature=1.0), jax.random.key(0), config.eos_token_ids
    calls = {
        "static": lambda: _static_fn(graphdef, state, prompts, mask, key, max_new_tokens=n, sampling=sampling,
                                     eos_id=eos, pad_id=0, group_size=g),
        "continuous": lambda: continuous_fn(graphdef, state, prompts, mask, key, max_new_tokens=n,
                                            sampling=sampling, eos_id=eos, pad_id=0, group_size=g,
                                            slots=args.slots, kv_pages=args.kv_pages),
    }
    outs = {name: jax.block_until_ready(fn()) for name, fn in calls.items()}  # compile
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    prefill = {
        "static": lambda: gen.prefill_fn(graphdef, state, prompts[::g], mask[::g], bucket=bucket, max_new_tokens=n,
                                         pad_id=0),
        "continuous": lambda: gen.prefill_fn(graphdef, state, prompts[::g], mask[::g], bucket=bucket,
                                             max_new_tokens=0, pad_id=0),
    }
    result: dict = {"rows": rows, "group_size": g}
    for name, out in outs.items():
        lengths = np.asarray(out.lengths)
        t = min(times[name])
        result[name] = {
            "seconds": t, "seconds_all": times[name], "generated_tokens": int(lengths.sum()),
            "tokens_per_s": float(lengths.sum()) / t, "at_cap_frac": float(np.mean(lengths == n)),
            "prefill_seconds": _best(lambda f=prefill[name]: jax.block_until_ready(f()), args.repeats),
            "peak_kv_bytes": kv_cache_bytes(config, rows, bucket, n, engine=name, group_size=g, slots=args.slots,
                                            kv_pages=args.kv_pages),
        }
    result["speedup"] = result["static"]["seconds"] / result["continuous"]["seconds"]
    result["tokens_per_s_ratio"] = result["continuous"]["tokens_per_s"] / result["static"]["tokens_per_s"]
    return result


def print_grpo(result: dict) -> None:
    print(f"{result['rows']} rows ({result['rows'] // result['group_size']} prompts x G={result['group_size']}), "
          "sampled at temperature 1 until EOS or the cap")
    print(f"{'engine':>10} {'call s':>8} {'gen tokens':>10} {'at cap':>6} {'tok/s':>8} {'prefill s':>9} {'KV MiB':>7}")
    for name in ("static", "continuous"):
        r = result[name]
        print(f"{name:>10} {r['seconds']:>8.3f} {r['generated_tokens']:>10} {r['at_cap_frac']:>6.2f} "
              f"{r['tokens_per_s']:>8.1f} {r['prefill_seconds']:>9.4f} {r['peak_kv_bytes'] / 2**20:>7.2f}")
    print(f"generate call: continuous x{result['speedup']:.2f} faster; tokens/s x{result['tokens_per_s_ratio']:.2f}")


def print_rl(result: dict) -> None:
    print(f"{result['rows']} rows ({result['rows'] // result['group_size']} prompts x G={result['group_size']}); "
          f"lengths median {result['length_median']:.0f}, mean {result['length_mean']:.1f}, "
          f"max {result['length_max']}; same greedy tokens: {result['same_tokens']:.3f}")
    print(f"{'engine':>10} {'tok/s':>9} {'last row s':>10} {'prefill s':>9} {'KV MiB':>8}")
    for name in ("static", "continuous"):
        r = result[name]
        print(f"{name:>10} {r['tokens_per_s']:>9.1f} {r['time_to_last_row_s']:>10.3f} "
              f"{r['prefill_seconds']:>9.4f} {r['peak_kv_bytes'] / 2**20:>8.1f}")
    c = result["continuous"]
    print(f"tokens/s x{result['tokens_per_s_ratio']:.2f}, prefill x{result['prefill_ratio']:.2f}, "
          f"KV bytes /{result['kv_bytes_ratio']:.2f}; continuous: {c['slots']} slots, pool of {c['kv_pages']} "
          f"response pages ({c['kv_pool_bytes'] / 2**20:.1f} MiB with the prompt pages), at most "
          f"{c['kv_pages_used_peak']} in use ({c['kv_used_peak_bytes'] / 2**20:.1f} MiB)")


def decode_bytes_per_step(config: ModelConfig, batch: int, context: float) -> float:
    """Parameter bytes + KV bytes of `context` real tokens per row: what one decode step must read."""
    kv = 2 * config.num_layers * batch * context * config.num_kv_heads * config.dim_per_head
    return (config.num_params() * config.jnp_param_dtype.itemsize + kv * config.jnp_dtype.itemsize)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="decode", choices=["decode", "rl", "grpo"],
                   help="decode: jaxrlhf vs transformers; rl: static vs continuous engine on long-tailed lengths; "
                        "grpo: static vs continuous on GRPO's generate call on the bundled task")
    p.add_argument("--preset", default=None, help="model preset (default llama-100m; rl, grpo: small)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 32 (rl: 256, grpo: 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (rl: 512, the longest response; grpo: 32)")
    p.add_argument("--groups", type=int, default=None, help="rl, grpo: distinct prompts (default 8; grpo: 16)")
    p.add_argument("--group-size", type=int, default=8, help="rl: samples per prompt (G)")
    p.add_argument("--median-len", type=float, default=64.0, help="rl: median response length")
    p.add_argument("--sigma", type=float, default=1.0, help="rl: log-space std of the response lengths")
    p.add_argument("--slots", type=int, default=None, help="rl: continuous engine's slots (default the batch)")
    p.add_argument("--kv-pages", type=int, default=None,
                   help="rl: continuous engine's response pages (default slots x 2 x median length / page)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth for the roofline (GPU only)")
    p.add_argument("--skip-hf", action="store_true", help="only time jaxrlhf")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    rl, grpo = args.workload == "rl", args.workload == "grpo"
    args.preset = args.preset or ("small" if rl or grpo else "llama-100m")
    args.prompt_len = args.prompt_len or (256 if rl else 16 if grpo else 32)
    args.new_tokens = args.new_tokens or (512 if rl else 32 if grpo else 64)
    args.groups = args.groups or (16 if grpo else 8)
    batches = [int(b) for b in args.batches.split(",")]

    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    hbm = args.hbm_gbps
    if on_gpu and hbm is None:
        hbm = next((v for k, v in HBM_GBPS.items() if k in dev.device_kind), HBM_GBPS["H100"])
    torch_device = "cpu"
    run_hf = not args.skip_hf
    if run_hf and on_gpu:
        import torch

        if torch.cuda.is_available():
            torch_device = "cuda"
        else:
            print("note: torch has no CUDA here; skipping transformers on GPU", file=sys.stderr)
            run_hf = False

    config = preset(args.preset, param_dtype=args.dtype, dtype=args.dtype, eos_token_id=2, pad_token_id=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(build_model(config, seed=0), config, tmp)
        model, config = load_hf_checkpoint(tmp)
        from flax import nnx

        graphdef, state = nnx.split(model)
        if grpo:
            result = bench_grpo(graphdef, state, config, args)
            print(f"{args.preset} ({config.num_params() / 1e6:.1f}M params, {args.dtype}) on {dev.device_kind}; "
                  f"prompt {args.prompt_len}, up to {args.new_tokens} new tokens, best of {args.repeats}")
            print_grpo(result)
            print(json.dumps(result))
            if args.out:
                meta = {"workload": "grpo", "preset": args.preset, "prompt_len": args.prompt_len,
                        "new_tokens": args.new_tokens, "groups": args.groups, "group_size": args.group_size,
                        "slots": args.slots, "kv_pages": args.kv_pages, "repeats": args.repeats,
                        "device": dev.device_kind, "jax": jax.__version__}
                Path(args.out).write_text(json.dumps({"meta": meta, **result}, indent=2) + "\n")
            return 0
        if rl:
            result = bench_rl(graphdef, state, config, args)
            print(json.dumps(result), file=sys.stderr, flush=True)
            print(f"{args.preset} ({config.num_params() / 1e6:.0f}M params, {args.dtype}) on {dev.device_kind}; "
                  f"prompt {args.prompt_len}, up to {args.new_tokens} new tokens, best of {args.repeats}")
            print_rl(result)
            if args.out:
                meta = {"workload": "rl", "preset": args.preset, "params": config.num_params(), "dtype": args.dtype,
                        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "groups": args.groups,
                        "group_size": args.group_size, "median_len": args.median_len, "sigma": args.sigma,
                        "slots": args.slots, "kv_pages": args.kv_pages, "repeats": args.repeats, "device": dev.device_kind,
                        "platform": dev.platform, "jax": jax.__version__}
                Path(args.out).write_text(json.dumps({"meta": meta, **result}, indent=2) + "\n")
            return 0
        rng = np.random.default_rng(0)
        for batch in batches:
            prompts = rng.integers(3, config.vocab_size, size=(batch, args.prompt_len)).astype(np.int32)
            ours = bench_jax(graphdef, state, prompts, args.new_tokens, args.repeats)
            n_tok = batch * args.new_tokens
            decode_s = max(ours["seconds"] - ours["prefill_seconds"], 1e-9)
            row = {
                "batch": batch,
                "jax_seconds": ours["seconds"],
                "jax_tokens_per_s": n_tok / ours["seconds"],
                "jax_decode_only_tokens_per_s": batch * (args.new_tokens - 1) / decode_s,
            }
            if on_gpu:
                step_s = decode_s / (args.new_tokens - 1)
                bytes_step = decode_bytes_per_step(config, batch, args.prompt_len + args.new_tokens / 2)
                row["hbm_gbps_achieved"] = bytes_step / step_s / 1e9
                row["hbm_roofline_fraction"] = row["hbm_gbps_achieved"] / hbm
            if run_hf:
                ref = bench_hf(Path(tmp), prompts, args.new_tokens, args.repeats, args.dtype, torch_device)
                row["hf_seconds"] = ref["seconds"]
                row["hf_tokens_per_s"] = n_tok / ref["seconds"]
                row["ratio_jax_over_hf"] = row["jax_tokens_per_s"] / row["hf_tokens_per_s"]
                row["greedy_tokens_agree"] = float(np.mean(ours["tokens"] == ref["tokens"]))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

    header = f"{'batch':>5} {'jax tok/s':>10} {'jax decode tok/s':>17}"
    if run_hf:
        header += f" {'hf tok/s':>10} {'jax/hf':>7} {'same tokens':>11}"
    if on_gpu:
        header += f" {'HBM GB/s':>9} {'roofline':>8}"
    print(f"{args.preset} ({config.num_params() / 1e6:.0f}M params, {args.dtype}) on {dev.device_kind}; "
          f"prompt {args.prompt_len}, new tokens {args.new_tokens}, best of {args.repeats}")
    print(header)
    for r in rows:
        line = f"{r['batch']:>5} {r['jax_tokens_per_s']:>10.1f} {r['jax_decode_only_tokens_per_s']:>17.1f}"
        if run_hf:
            line += f" {r['hf_tokens_per_s']:>10.1f} {r['ratio_jax_over_hf']:>7.2f} {r['greedy_tokens_agree']:>11.2f}"
        if on_gpu:
            line += f" {r['hbm_gbps_achieved']:>9.0f} {r['hbm_roofline_fraction']:>8.2f}"
        print(line)
    if args.out:
        meta = {
            "preset": args.preset, "params": config.num_params(), "dtype": args.dtype,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "device": dev.device_kind, "platform": dev.platform, "hbm_gbps": hbm,
            "jax": jax.__version__, "python": platform.python_version(),
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
