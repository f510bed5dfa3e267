"""Decode throughput of jaxrlhf generation vs `transformers` `generate`, same weights, same run.

    python scripts/bench_generate.py [--preset llama-100m] [--prompt-len 32] [--new-tokens 64]
        [--batches 1,8,32] [--repeats 2] [--dtype float32] [--out bench.json]

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
from jaxrlhf.models.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from jaxrlhf.models.sampling import GREEDY  # noqa: E402
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
            max_new_tokens=new_tokens, sampling=GREEDY, eos_id=None, pad_id=0))

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


def decode_bytes_per_step(config: ModelConfig, batch: int, context: float) -> float:
    """Parameter bytes + KV bytes of `context` real tokens per row: what one decode step must read."""
    kv = 2 * config.num_layers * batch * context * config.num_kv_heads * config.dim_per_head
    return (config.num_params() * config.jnp_param_dtype.itemsize + kv * config.jnp_dtype.itemsize)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-100m")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--hbm-gbps", type=float, default=None, help="HBM bandwidth for the roofline (GPU only)")
    p.add_argument("--skip-hf", action="store_true", help="only time jaxrlhf")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
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
