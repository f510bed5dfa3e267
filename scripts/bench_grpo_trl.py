"""GRPO throughput of jaxrlhf vs TRL's GRPOTrainer, same work, same run, on the CPU or one GPU.

    python scripts/bench_grpo_trl.py [--config configs/quickstart-grpo.yaml] [--steps 5] [--warmup 2]
        [--device cpu|cuda] [--skip-trl] [--out results.json] [--workdir DIR] [key=value ...]

TRL's GRPOTrainer is the most used RL trainer; this is the GRPO twin of
`bench_ppo.py`, with its conventions. The workload comes from the config
(default: the GRPO quickstart) and trailing `key=value` overrides, with
`WORKLOAD` applied in between: no SFT warm-up and every response sampled to
`generation.max_new_tokens` (`generation.ignore_eos=true`,
`rewards.eos_only=false`), so both sides do the same work whatever the model
samples. Both sides get:

- model: the HF checkpoint jaxrlhf writes of its own initial actor (or
  `model.actor.path`), so both start from the same weights; TRL loads it as
  policy and, with `algorithm.kl_coef > 0`, again as its reference (KL in the
  loss: TRL `beta` = `kl_coef`, both the k3 estimator);
- batch: the prompts jaxrlhf's `PromptDataset` draws, in its order (TRL's
  `shuffle_dataset=False`), tokenized alike (the script checks TRL's ids
  against jaxrlhf's, BOS first), `algorithm.group_size` samples each at the
  config's temperature, top-p and top-k, each `max_new_tokens` long (TRL:
  `min_new_tokens` = `max_completion_length`, so no EOS ends one early);
- update: `algorithm.minibatches` x `algorithm.epochs` AdamW steps per batch
  (TRL: `steps_per_generation` micro-batches, `num_iterations` = epochs,
  `algorithm.micro_batch_size` rows per micro-batch by gradient accumulation),
  the same learning rate, clip epsilon(s), advantage normalisation
  (`norm_adv_by_std` -> `scale_rewards`) and loss aggregation (`loss_agg` ->
  `loss_type`); no gradient checkpointing on either side (TRL's default is on);
- reward: jaxrlhf's rule rewards (`rewards.rules`, shaped by `rewards.bias`,
  `scale`, `clip`) on each side's decoded completions.

`--device cpu` (default): TRL on PyTorch CPU in fp32 (`use_cpu`), once per
`--trl-threads` count (1 and one per core, as `bench_ppo.py`: on a busy 2-core
machine torch's thread pool slowed a 0.12M model's step 40x, 0.09 -> 4.1 s),
the ratio against the faster; jaxrlhf on the config's simulated CPU devices
and plan.
`--device cuda`: one GPU, bf16 on both sides (TRL: `dtype=torch.bfloat16`,
`bf16=True`; jaxrlhf: `run.platform=gpu`, every role's `dtype` and
`param_dtype` bfloat16, fp32 master weights), as `bench_ppo.py --device cuda`.

Step time: jaxrlhf's `time/step_s` from `metrics.jsonl`; TRL: wall time over
the minibatches x epochs optimizer steps of one batch (generation, reference
and old log-probs, rewards, the updates), the GPU waited for at each step's end.
Tokens per step: non-pad prompt tokens + every sampled response token, as in
`bench_ppo.py`. The first `--warmup` steps (compilation) are dropped; the
table shows medians and the ratio of tokens/s; the JSON has `ratio`, each
side's median per-call seconds (`per_call_s`: jaxrlhf's calls, TRL's generate)
and `generate_share` (generate seconds over step seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ppo import (  # noqa: E402
    _cfg,
    byte_tokenizer_hf,
    comparison,
    finish,
    hf_special_ids,
    on_device,
    prompt_rows,
    run_jaxrlhf,
    summarize,
    torch_dtype_name,
    trl_thread_counts,
)

TRL_MISSING = (
    "TRL is not installed (it is a benchmark-only dependency, not a jaxrlhf one): pip install trl\n"
    "  (check first that it does not change your torch/transformers: pip install --dry-run trl), "
    "or pass --skip-trl."
)
# Applied after the config and before the command line's overrides: the same work on both sides.
WORKLOAD = ["sft.steps=0", "generation.ignore_eos=true", "rewards.eos_only=false"]
LOSS_TYPES = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}


def trl_problem() -> str | None:
    """None when TRL's GRPOTrainer is importable, else what to do."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return TRL_MISSING
    return None


def grpo_config_kwargs(spec: dict) -> dict:
    """`GRPOConfig`'s arguments for the spec: one generation of batch x group_size rows, then minibatches x
    epochs optimizer steps on it (micro-batches by gradient accumulation), bf16 on the GPU, fp32 on the CPU."""
    alg, cuda = spec["algorithm"], spec["device"] == "cuda"
    rows = spec["batch_size"] * alg["group_size"]
    minibatch = rows // alg["minibatches"]
    micro = alg["micro_batch_size"] or minibatch
    max_new = spec["max_new_tokens"]
    return dict(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=minibatch // micro,  # one optimizer step per minibatch
        steps_per_generation=rows // micro,  # the generation batch is the whole batch: every row once per epoch
        num_iterations=alg["epochs"],
        num_generations=alg["group_size"],
        max_steps=(spec["warmup"] + spec["steps"]) * alg["minibatches"] * alg["epochs"],
        max_completion_length=max_new,
        # ignore_eos: no EOS can end a completion early (nor cut its mask afterwards)
        generation_kwargs={"min_new_tokens": max_new} if spec["ignore_eos"] else None,
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=spec["top_k"] or 0,
        shuffle_dataset=False,  # jaxrlhf's prompts in jaxrlhf's order
        learning_rate=spec["lr"],
        beta=alg["kl_coef"],
        epsilon=alg["clip_eps"],
        epsilon_high=alg["clip_eps_high"] or alg["clip_eps"],
        loss_type=LOSS_TYPES[alg["loss_agg"]],
        scale_rewards="group" if alg["norm_adv_by_std"] else "none",
        mask_truncated_completions=False,
        disable_dropout=True,
        model_init_kwargs={"dtype": torch_dtype_name(spec["device"])},
        bf16=cuda,
        fp16=False,
        gradient_checkpointing=False,
        **({} if cuda else {"use_cpu": True}),
        remove_unused_columns=False,  # the reward reads the `answer` column
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        log_completions=False,
        disable_tqdm=True,
        seed=spec["seed"],
        dataloader_num_workers=0,
    )


def rl_step_times(ends: list[float], optimizer_steps_per_rl_step: int) -> list[float]:
    """Seconds of each RL step from the train start and the end of every optimizer step (`ends[0]` is the
    start): one RL step is its batch's minibatches x epochs optimizer steps."""
    k = optimizer_steps_per_rl_step
    return [ends[(i + 1) * k] - ends[i * k] for i in range((len(ends) - 1) // k)]


# --------------------------------------------------------------------------- TRL side (subprocess)


def trl_worker(spec_path: str, out_path: str, threads: str = "0") -> None:
    """Runs TRL's GRPOTrainer as the spec says and writes per-step times and token counts."""
    import torch

    if int(threads) > 0:
        torch.set_num_threads(int(threads))
    import transformers
    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from jaxrlhf.rewards.rules import CombinedReward

    spec = json.loads(Path(spec_path).read_text())
    cuda = spec["device"] == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # a GPU's work ends when it is waited for
    torch.manual_seed(spec["seed"])
    if spec["tokenizer"] == "byte":
        tok = byte_tokenizer_hf(add_bos=True)
    else:
        path = spec["tokenizer"]
        tok = PreTrainedTokenizerFast(
            tokenizer_file=path if os.path.isfile(path) else os.path.join(path, "tokenizer.json"), padding_side="left")
    tok.padding_side = "left"
    for key, value in hf_special_ids(len(tok), spec["pad_id"], spec["eos_id"]).items():
        setattr(tok, key, value)
    rows = spec["prompts"]
    for r in rows:  # TRL tokenizes the prompt text itself: it must give jaxrlhf's ids
        assert tok(r["prompt"])["input_ids"] == r["ids"], ("TRL's tokenizer differs from jaxrlhf's", r)

    rules = CombinedReward([tuple(r) for r in spec["rules"]])
    shape = spec["reward_shaping"]

    def rule_reward(prompts, completions, answer=None, **_):
        """jaxrlhf's rule score, shaped as jaxrlhf shapes it (bias, scale, clip)."""
        out = []
        for s in rules.batch(list(prompts), list(completions), list(answer or [None] * len(prompts))):
            s = (s - shape["bias"]) * shape["scale"]
            out.append(float(max(-shape["clip"], min(shape["clip"], s)) if shape["clip"] is not None else s))
        return out

    class StepTimer(TrainerCallback):
        """Wall-clock time at train begin and at the end of every optimizer step, the device waited for."""

        def __init__(self):
            self.times: list[float] = []

        def on_train_begin(self, args, state, control, **kw):
            sync()
            self.times = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.times.append(time.perf_counter())

    n_steps, B = spec["warmup"] + spec["steps"], spec["batch_size"]
    train = Dataset.from_dict({"prompt": [r["prompt"] for r in rows[: B * n_steps]],
                               "answer": [r["answer"] or "" for r in rows[: B * n_steps]]})
    args = GRPOConfig(**grpo_config_kwargs(spec))
    timer = StepTimer()
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=rule_reward, args=args, train_dataset=train,
                          processing_class=tok, callbacks=[timer])
    for cb in (transformers.PrinterCallback, transformers.ProgressCallback):
        trainer.remove_callback(cb)

    # Count tokens and time generation at the one generate call per batch.
    policy = trainer.model
    gen_stats: list[dict] = []
    generate = policy.generate
    max_new, G = spec["max_new_tokens"], spec["algorithm"]["group_size"]

    def timed_generate(*a, **kw):
        sync()
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        sync()
        dt = time.perf_counter() - t0
        seqs = out.sequences if hasattr(out, "sequences") else out
        resp = seqs[:, kw["input_ids"].shape[1]:]
        assert seqs.shape[0] == B * G, ("TRL generated", seqs.shape[0], "rows, expected", B * G)
        if spec["ignore_eos"]:
            assert resp.shape[1] == max_new, ("generation stopped early", resp.shape)
        gen_stats.append({"generate_s": dt, "prompt_tokens": int(kw["attention_mask"].sum()),
                          "response_tokens": int(resp.shape[0] * resp.shape[1])})
        return out

    policy.generate = timed_generate
    t0 = time.perf_counter()
    trainer.train()
    total_s = time.perf_counter() - t0

    per_rl_step = spec["algorithm"]["minibatches"] * spec["algorithm"]["epochs"]
    step_s = rl_step_times(timer.times, per_rl_step)
    assert len(step_s) == n_steps and len(gen_stats) == n_steps, (len(step_s), len(gen_stats), n_steps)
    steps = []
    for i, (s, g) in enumerate(zip(step_s, gen_stats)):
        tokens = g["prompt_tokens"] + g["response_tokens"]
        steps.append({"step": i + 1, "step_s": s, "tokens": tokens, "tokens_per_s": tokens / s, **g})
    Path(out_path).write_text(json.dumps({
        "steps": steps, "total_train_s": total_s, "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(policy.dtype).removeprefix("torch."),
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "trl_args": {k: getattr(args, k) for k in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "num_iterations", "num_generations", "max_steps", "loss_type", "beta", "bf16")},
        "params": sum(p.numel() for p in policy.parameters()),
    }, indent=1, default=str))


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart-grpo.yaml"))
    ap.add_argument("--steps", type=int, default=5, help="measured GRPO steps per side (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps dropped (compilation, allocator warm-up)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: both sides on this machine's CPU, fp32; cuda: both on one GPU, bf16")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    ap.add_argument("--workdir", default=None, help="run outputs (default: a temp dir, removed afterwards)")
    ap.add_argument("--trl-threads", default=None,
                    help="torch thread counts to run TRL with, comma separated (0 = torch's default), the ratio "
                         "against the fastest; default on cpu 1 and one per core, as bench_ppo.py (on a busy "
                         "2-core machine torch's spinning thread pool can slow TRL's tiny ops tens of times); "
                         "on cuda 0")
    ap.add_argument("--trl-worker", nargs=3, metavar=("SPEC", "OUT", "THREADS"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config key=value overrides (after the benchmark's workload)")
    args = ap.parse_args(argv)
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return 0
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    try:
        trl_threads = trl_thread_counts(args.trl_threads, args.device)
    except ValueError:
        ap.error(f"--trl-threads={args.trl_threads!r}: give comma-separated integers >= 0, e.g. 1,2")

    overrides = on_device(args.config, WORKLOAD + list(args.overrides), args.device)
    cfg = _cfg(args.config, overrides, [])
    alg, data, gen = cfg.algorithm, cfg.data, cfg.generation
    problems = [
        (alg.name not in ("grpo", "dr_grpo"), f"algorithm.name={alg.name!r}: this benchmark compares GRPO "
         "(grpo or dr_grpo); use a grpo config"),
        (cfg.rewards.model or not cfg.rewards.rules,
         "rewards: the benchmark scores with rule rewards only (rewards.rules, rewards.model=false)"),
        (alg.micro_batch_size is not None and (data.batch_size * alg.group_size // alg.minibatches)
         % alg.micro_batch_size != 0, f"algorithm.micro_batch_size={alg.micro_batch_size} must divide a minibatch"),
    ]
    for bad, msg in problems:
        if bad:
            print(f"error: {msg}", file=sys.stderr)
            return 2
    problem = None if args.skip_trl else trl_problem()
    if problem:
        print(problem + "\ncontinuing with jaxrlhf only (no ratio)\n", file=sys.stderr, flush=True)
    run_trl = not args.skip_trl and not problem

    if args.device == "cuda":  # TRL's process runs first and needs the GPU's memory: reserve none ahead
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from jaxrlhf.run.backend import setup_devices
    from jaxrlhf.run.planning import role_configs

    setup_devices(cfg.run)
    import jax

    mc = role_configs(cfg, ["actor"])["actor"]
    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_grpo_trl_"))
    workdir.mkdir(parents=True, exist_ok=True)
    n_steps = args.warmup + args.steps
    rows, width = prompt_rows(cfg, n_steps)
    B, G = data.batch_size, alg.group_size
    model_dir = Path(cfg.model.actor.path) if cfg.model.actor.path else workdir / "hf_actor"
    spec = {
        "model_dir": str(model_dir), "tokenizer": cfg.model.tokenizer, "seed": cfg.run.seed, "device": args.device,
        "pad_id": mc.pad_token_id if mc.pad_token_id is not None else 0, "eos_id": mc.eos_token_id,
        "prompts": rows, "batch_size": B, "warmup": args.warmup, "steps": args.steps,
        "max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k,
        "ignore_eos": gen.ignore_eos, "lr": cfg.optimizer.actor.lr,
        "algorithm": {"group_size": G, "minibatches": alg.minibatches, "epochs": alg.epochs,
                      "micro_batch_size": alg.micro_batch_size, "kl_coef": alg.kl_coef, "clip_eps": alg.clip_eps,
                      "clip_eps_high": alg.clip_eps_high, "loss_agg": alg.loss_agg,
                      "norm_adv_by_std": alg.norm_adv_by_std},
        "rules": [(r.name, r.weight, dict(r.args)) for r in cfg.rewards.rules],
        "reward_shaping": {"bias": cfg.rewards.bias, "scale": cfg.rewards.scale, "clip": cfg.rewards.clip},
        "output_dir": str(workdir / "trl_out"),
    }
    workload = {k: v for k, v in spec.items() if k not in ("prompts", "model_dir", "output_dir")}
    workload.update(config=args.config, overrides=overrides, jax_prompt_width=width, params=mc.num_params(),
                    dtype=mc.dtype, devices=jax.device_count(),
                    tokens="non-pad prompt tokens + every sampled response token, per GRPO step")
    results: dict = {"workload": workload, "host": {
        "machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "jax": jax.__version__, "loadavg_start": os.getloadavg()}, "jaxrlhf": None, "trl": None}
    print(f"workload: {mc.num_params() / 1e6:.2f}M-param actor ({cfg.model.actor.preset or 'checkpoint'}, {mc.dtype}), "
          f"{B} prompts x G={G}, {alg.minibatches} minibatches x {alg.epochs} epochs, prompt {width}, "
          f"{gen.max_new_tokens} new tokens (EOS ignored), {jax.device_count()} {jax.devices()[0].platform} "
          f"device(s); {args.warmup} warm-up + {args.steps} measured steps", flush=True)

    if run_trl:  # TRL first, in its own process (no JAX thread pools or GPU memory)
        if not cfg.model.actor.path:
            from jaxrlhf.models.hf_io import save_hf_checkpoint
            from jaxrlhf.models.transformer import build_model

            save_hf_checkpoint(build_model(mc, "lm", seed=cfg.run.seed), mc, model_dir)
        spec_path = workdir / "trl_spec.json"
        spec_path.write_text(json.dumps(spec))
        results["trl"] = {}
        for threads in trl_threads:
            label = f"{threads} thr" if threads else "default thr"
            where = "PyTorch CPU, fp32" if args.device == "cpu" else "PyTorch CUDA, bf16"
            print(f"TRL GRPOTrainer ({where}, torch threads: {threads or 'default'}) ...", flush=True)
            env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
            out_path = workdir / f"trl_result_{threads}.json"
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--trl-worker", str(spec_path), str(out_path),
                                   str(threads)], env=env, cwd=ROOT, capture_output=True, text=True)
            (workdir / f"trl_log_{threads}.txt").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr)[-3000:]
                print(f"TRL run failed (exit {proc.returncode}); last output:\n{tail}", file=sys.stderr, flush=True)
                results["trl"][label] = {"error": tail}
                continue
            r = json.loads(out_path.read_text())
            r["wall_s"] = time.perf_counter() - t0
            r["summary"] = summarize(r["steps"], args.warmup, ["generate_s"])
            results["trl"][label] = r
            print(f"  TRL ({label}): {r['summary']['step_s']:.3f} s/step, {r['summary']['tokens_per_s']:.0f} "
                  f"tokens/s ({r['params'] / 1e6:.2f}M params, {r['torch_threads']} torch threads, wall "
                  f"{r['wall_s']:.0f} s)", flush=True)

    strategy = cfg.plan.strategy
    print(f"jaxrlhf {strategy} ...", flush=True)
    try:
        r = run_jaxrlhf(args.config, strategy, overrides, n_steps, args.warmup, workdir)
    except Exception as e:  # noqa: BLE001 -- the TRL side's numbers are still worth writing
        print(f"  jaxrlhf failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        results["jaxrlhf"] = {"error": f"{type(e).__name__}: {e}"}
    else:
        calls = sorted({k for s in r["steps"] for k in s if "." in k and "/" not in k})  # actor.generate, ...
        r["summary"] = summarize(r["steps"], args.warmup, calls)
        results["jaxrlhf"] = r
        print(f"  jaxrlhf: {r['summary']['step_s']:.3f} s/step, {r['summary']['tokens_per_s']:.0f} tokens/s "
              f"(first step incl. compile {r['first_step_s']:.1f} s, wall {r['wall_s']:.0f} s)", flush=True)
    results["host"]["loadavg_end"] = os.getloadavg()

    jax_sum = (results["jaxrlhf"] or {}).get("summary")
    trl_ok = {k: r["summary"] for k, r in (results["trl"] or {}).items() if "summary" in r}
    results["trl_reference"] = max(trl_ok, key=lambda k: trl_ok[k]["tokens_per_s"]) if trl_ok else None
    trl_sum = trl_ok.get(results["trl_reference"])
    results.update(comparison(jax_sum, trl_sum))
    print(f"\n{'system':<22} {'step s':>8} {'min-max s':>13} {'tok/step':>9} {'tokens/s':>9} {'generate':>9} "
          f"{'x TRL':>7}")
    print("-" * 82)
    trl_rows = [(f"TRL GRPO ({k})" + (" *" if k == results["trl_reference"] and len(trl_ok) > 1 else ""),
                 trl_ok[k]) for k in trl_ok] or [("TRL GRPOTrainer", None)]
    for name, sm in trl_rows + [(f"jaxrlhf {strategy}", jax_sum)]:
        if not sm:
            print(f"{name:<22} failed or not run")
            continue
        share = sm["calls_s"].get("generate_s", sm["calls_s"].get("actor.generate", float("nan"))) / sm["step_s"]
        ratio = sm["tokens_per_s"] / trl_sum["tokens_per_s"] if trl_sum else None
        print(f"{name:<22} {sm['step_s']:>8.3f} {sm['step_s_min']:>6.3f}-{sm['step_s_max']:<6.3f} "
              f"{sm['tokens_per_step']:>9.0f} {sm['tokens_per_s']:>9.0f} "
              f"{share:>9.0%} {f'{ratio:.2f}' if ratio else 'n/a':>7}")
    if jax_sum:
        print("\njaxrlhf median per-call seconds (dispatch to ready, calls may overlap): " + ", ".join(
            f"{c} {s:.4f}" for c, s in jax_sum["calls_s"].items()))
    print(f"generate: each side's generate seconds over its step seconds; x TRL: against the faster TRL (*); "
          f"medians of {args.steps} steps after "
          f"{args.warmup}. Load average {results['host']['loadavg_start'][0]:.2f} at the start, "
          f"{results['host']['loadavg_end'][0]:.2f} at the end, on {os.cpu_count()} CPUs")
    print(json.dumps({k: results[k] for k in ("ratio", "step_s", "generate_share")}))
    return finish(results, args.out, workdir if own_workdir else None)


if __name__ == "__main__":
    sys.exit(main())
