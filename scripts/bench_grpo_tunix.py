"""GRPO throughput of jaxrlhf vs google-tunix's GRPO learner on CPU: same workload, at 1 and 8 devices.

    python scripts/bench_grpo_tunix.py [--config configs/quickstart-grpo.yaml] [--devices 1,8]
        [--steps 5] [--warmup 2] [--tunix-python PATH] [--skip-tunix] [--device cpu|cuda]
        [--out results.json] [--workdir DIR] [key=value ...]
    python scripts/bench_grpo_tunix.py --engines static,continuous [--devices 1] [--rounds 2] [key=value ...]

`--engines`: jaxrlhf only, once per generation engine (`generation.engine`) and round (`--rounds`, the
engines' order alternating: A B, B A, ...), same workload and seed;
prints step time, the `actor.generate` call's time and generated tokens per engine and the speedup of
each over the first (table, then one JSON line; `--out` writes all per-step results).

Workload: the config (default: the GRPO quickstart) with the benchmark's
settings (`WORKLOAD`: the `small` actor, 16 prompts x G=8 samples, 32 new
tokens, one policy update per batch) and then trailing `key=value` overrides.
Both sides get the same:

- model: tunix's `Llama3` built from jaxrlhf's `model.actor` (hidden ->
  embed_dim, intermediate -> hidden_dim, layers, heads, KV heads, head dim,
  vocab, rope theta, norm eps, tied embeddings), loaded from the HF checkpoint
  jaxrlhf writes of its own initial actor, so both start from the same weights;
  the reference is a second copy (KL in the loss: tunix `beta` = jaxrlhf
  `kl_coef`, both the k3 / "low_var_kl" estimator);
- batch: the prompts jaxrlhf's `PromptDataset` draws (same byte tokenizer, BOS
  first, left-padded to `data.max_prompt_len`), G samples each at the config's
  temperature, up to `generation.max_new_tokens`, stopping at EOS;
- update: one AdamW step on all 16 x G sequences per batch (jaxrlhf
  `algorithm.minibatches=1`, `epochs=1`; tunix `num_iterations=1`,
  `mini_batch_size` = the whole batch), same learning rate, clip epsilon and
  gradient clipping; rewards: jaxrlhf's rule rewards on the decoded text;
  with `algorithm.micro_batch_size=R` (rows, a multiple of G) both sides
  accumulate gradients and compute reference log-probs over R rows at a time
  (tunix `train_micro_batch_size` = `compute_logps_micro_batch_size` = R / G
  prompts) and generate the whole batch at once;
- devices: each side in its own process with N simulated CPU devices (jaxrlhf
  `run.devices=N` with the config's plan; tunix one ("fsdp", "tp") = (N, 1)
  mesh for actor, reference and rollout, its colocated setup).

Generated tokens per step are counted on both sides the same way: response
tokens up to and including EOS (all of them when no EOS came). jaxrlhf:
`response/length_mean` x sequences (its response mask includes EOS). tunix:
the sampler returns each completion cut before its first EOS, so a completion
shorter than the limit generated its length + 1 tokens. tunix's dataset yields
numpy arrays (with Python lists its learner silently samples one completion
per prompt instead of G); the script asserts 16 x G sequences per tunix step.

Step time: jaxrlhf's `time/step_s` from `metrics.jsonl`; tunix: wall time
between the ends of consecutive GRPO global steps (generation, reference
forward, rewards and advantages, the update), each end waiting until the
actor's parameters are computed. The first `--warmup` steps (compilation) are
dropped on both sides; the table shows medians over the measured steps and the
ratio of generated tokens/s (jaxrlhf / tunix).

`--device cuda`: both sides on the GPU(s) instead (`--devices 1` by default), bf16: tunix loads the
checkpoint as bfloat16, jaxrlhf runs with `run.platform=gpu` and every role's `dtype` and `param_dtype`
bfloat16 (fp32 master weights), as `bench_ppo.py --device cuda`; this process then uses the CPU alone
(it only draws prompts and writes the checkpoint), so each side's process has the GPU's memory.

tunix is optional and needs not share jaxrlhf's environment: `--tunix-python`
runs its side with another interpreter (a venv made with
`--system-site-packages`, see TUNIX_MISSING). When tunix cannot be imported,
the script says how to install it and runs the jaxrlhf side only.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
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
    _median,
    byte_tokenizer_hf,
    finish,
    hf_special_ids,
    on_device,
    prompt_rows,
    run_jaxrlhf,
)

TUNIX_VERSION = "0.1.7"
TUNIX_MISSING = (
    f"google-tunix is not importable with {{python}} (a benchmark-only dependency, not a jaxrlhf one).\n"
    "  Install it in its own venv so it cannot change jax/flax/optax/orbax/numpy in yours:\n"
    "    python -m venv --system-site-packages /path/venv-tunix\n"
    f"    /path/venv-tunix/bin/pip install --no-deps google-tunix=={TUNIX_VERSION} google-metrax\n"
    "    /path/venv-tunix/bin/pip install clu ml_collections sentencepiece perfetto\n"
    "  (check each with `pip install --dry-run` first: it must not replace jax, flax, optax, orbax or numpy)\n"
    "  and pass --tunix-python /path/venv-tunix/bin/python (or --skip-tunix)."
)
# The benchmark's workload, applied after the config and before the command line's overrides.
WORKLOAD = [
    "model.actor.preset=small", "data.batch_size=16", "algorithm.group_size=8", "algorithm.minibatches=1",
    "algorithm.epochs=1", "generation.max_new_tokens=32",
]


def generated_tokens(completion_lengths, max_new: int) -> int:
    """Tokens a sampler generated for completions cut before their first EOS: + 1 for the EOS if one came."""
    return sum(n + 1 if n < max_new else max_new for n in completion_lengths)


# --------------------------------------------------------------------------- tunix side (subprocess)


def tunix_worker(spec_path: str, out_path: str) -> None:
    """Runs tunix's GRPOLearner as the spec says and writes per-step times and generated-token counts."""
    spec = json.loads(Path(spec_path).read_text())
    n_dev, cuda = spec["devices"], spec.get("device", "cpu") == "cuda"
    import jax

    if cuda:
        jax.config.update("jax_platforms", "cuda")
    else:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n_dev)  # before tunix touches a backend
    from importlib.metadata import version

    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from tunix.models.llama3 import model as llama3
    from tunix.models.llama3 import params as llama3_params
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    from jaxrlhf.rewards.rules import CombinedReward

    m, alg, opt = spec["model"], spec["algorithm"], spec["optimizer"]
    B, G, max_new = spec["batch_size"], alg["group_size"], spec["max_new_tokens"]
    n_steps = spec["warmup"] + spec["steps"]
    assert len(jax.devices()) == n_dev if not cuda else len(jax.devices()) >= n_dev, (jax.devices(), n_dev)

    tok = byte_tokenizer_hf()
    for key, value in hf_special_ids(len(tok), spec["pad_id"], spec["eos_id"]).items():
        setattr(tok, key, value)
    tok.bos_token_id = spec["bos_id"]
    for r in spec["prompts"]:  # tunix's sampler tokenizes the text and puts BOS first: same ids as jaxrlhf's
        assert [spec["bos_id"]] + tok.encode(r["prompt"], add_special_tokens=False) == r["ids"], r

    config = llama3.ModelConfig(
        num_layers=m["layers"], vocab_size=m["vocab"], embed_dim=m["hidden"], hidden_dim=m["ffn"],
        num_heads=m["heads"], head_dim=m["head_dim"], num_kv_heads=m["kv_heads"], rope_theta=m["rope_theta"],
        norm_eps=m["norm_eps"], weight_tying=m["tied"],
    )
    devices = np.array(jax.devices()[:n_dev]).reshape(n_dev, 1)
    mesh = jax.sharding.Mesh(devices, ("fsdp", "tp"))
    dtype = jnp.bfloat16 if cuda else None  # None: the checkpoint's own (fp32 on the CPU)
    policy = llama3_params.create_model_from_safe_tensors(spec["model_dir"], config, mesh, dtype=dtype)
    ref = llama3_params.create_model_from_safe_tensors(spec["model_dir"], config, mesh, dtype=dtype)
    n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(policy, nnx.Param)))
    assert n_params == m["params"], (n_params, m["params"])

    optimizer = optax.chain(
        optax.clip_by_global_norm(opt["max_grad_norm"]) if opt["max_grad_norm"] else optax.identity(),
        optax.adamw(opt["lr"], b1=opt["b1"], b2=opt["b2"], eps=opt["eps"], weight_decay=opt["weight_decay"]),
    )
    micro = spec["micro_batch_prompts"] or B  # jaxrlhf's algorithm.micro_batch_size, in prompts
    training = rl.RLTrainingConfig(
        actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=n_steps,
        mini_batch_size=B,  # one update on the whole batch of B prompts x G samples
        # gradient accumulation and reference log-probs in micro-batches as jaxrlhf's, generation whole
        train_micro_batch_size=micro, compute_logps_micro_batch_size=micro, rollout_micro_batch_size=B,
    )
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=max_new, max_prompt_length=spec["prompt_width"], temperature=spec["temperature"],
        top_p=spec["top_p"], top_k=spec["top_k"] or None, kv_cache_size=spec["prompt_width"] + max_new,
        eos_tokens=[spec["eos_id"]],
    )
    cluster = rl.RLCluster(
        actor=policy, reference=ref, tokenizer=tok,
        cluster_config=rl.ClusterConfig(
            role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training, rollout_config=rollout,
        ),
    )
    rules = CombinedReward([tuple(r) for r in spec["rules"]])

    def reward(prompts, completions, answers=None, **_):
        return [float(x) for x in rules.batch(list(prompts), list(completions), list(answers))]

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=reward,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=G, num_iterations=1, beta=alg["kl_coef"], kl_loss_mode="low_var_kl",
            epsilon=alg["clip_eps"],
        ),
    )

    gen_stats: list[dict] = []
    generate = cluster.generate

    def counted_generate(*a, **kw):
        out = generate(*a, **kw)
        lengths = [len(t) for t in out.tokens]
        repeats = collections.Counter(kw["prompts"] if "prompts" in kw else a[0]).values()
        gen_stats.append({"sequences": len(lengths), "generated_tokens": generated_tokens(lengths, max_new),
                          "eos_frac": sum(n < max_new for n in lengths) / len(lengths),
                          "samples_per_prompt_ok": all(r % G == 0 for r in repeats)})
        return out

    cluster.generate = counted_generate
    ends: list[float] = []
    global_step = learner._run_global_step

    def timed_global_step(*a, **kw):
        out = global_step(*a, **kw)
        jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        ends.append(time.perf_counter())
        return out

    learner._run_global_step = timed_global_step
    # numpy arrays, not lists: the learner repeats each prompt G times with np.repeat over the batch's leaves.
    batches = [{"prompts": np.array([r["prompt"] for r in rows]), "answers": np.array([r["answer"] or "" for r in rows])}
               for rows in (spec["prompts"][i * B:(i + 1) * B] for i in range(n_steps))]
    t0 = time.perf_counter()
    learner.train(batches)
    total = time.perf_counter() - t0

    starts = [t0] + ends[:-1]
    assert len(ends) == n_steps and len(gen_stats) == n_steps, (len(ends), len(gen_stats), n_steps)
    for g in gen_stats:
        assert g["sequences"] == B * G, f"tunix sampled {g['sequences']} sequences in a step, expected {B} x {G}"
        assert g.pop("samples_per_prompt_ok"), f"tunix did not sample every prompt {G} times"
    steps = [{"step": i + 1, "step_s": e - s, **g} for i, (s, e, g) in enumerate(zip(starts, ends, gen_stats))]
    Path(out_path).write_text(json.dumps({
        "steps": steps, "total_train_s": total, "params": n_params, "devices": len(jax.devices()),
        "versions": {"tunix": version("google-tunix"), "jax": jax.__version__, "flax": version("flax")},
    }, indent=1))


# --------------------------------------------------------------------------- jaxrlhf side (subprocess)


def jax_worker(spec_path: str, out_path: str) -> None:
    """Runs jaxrlhf's GRPO (`jaxrlhf.train.run`) on `devices` simulated CPU devices."""
    spec = json.loads(Path(spec_path).read_text())

    # on cuda the spec's overrides hold the GPU's (jaxrlhf_device_overrides): one process sees its GPUs
    overrides = spec["overrides"] + ([] if spec.get("device") == "cuda" else [f"run.devices={spec['devices']}"])
    cfg = _cfg(spec["config"], overrides, [])
    from jaxrlhf.run.backend import setup_devices

    setup_devices(cfg.run)
    import jax

    workdir = Path(spec["workdir"]) / f"jaxrlhf_{spec['devices']}dev"
    r = run_jaxrlhf(spec["config"], cfg.plan.strategy, overrides, spec["warmup"] + spec["steps"], spec["warmup"],
                    workdir)
    rows = spec["batch_size"] * spec["algorithm"]["group_size"]
    for s in r["steps"]:
        s["sequences"] = rows
        s["generated_tokens"] = round(s["response/length_mean"] * rows)
        s["eos_frac"] = s.get("response/eos_frac")
    r.update({"devices": len(jax.devices()), "strategy": cfg.plan.strategy,
              "versions": {"jax": jax.__version__}})
    Path(out_path).write_text(json.dumps(r, indent=1))


# --------------------------------------------------------------------------- driver


def summarize(steps: list[dict], warmup: int) -> dict:
    measured = [s for s in steps if s["step"] > warmup]
    return {
        "measured_steps": len(measured),
        "step_s": _median([s["step_s"] for s in measured]),
        "step_s_min": min((s["step_s"] for s in measured), default=float("nan")),
        "step_s_max": max((s["step_s"] for s in measured), default=float("nan")),
        "generated_tokens_per_step": _median([s["generated_tokens"] for s in measured]),
        "tokens_per_s": _median([s["generated_tokens"] / s["step_s"] for s in measured]),
        "eos_frac": _median([s["eos_frac"] for s in measured if s.get("eos_frac") is not None]),
    }


def _tunix_problem(python: str) -> str | None:
    """None when `python` can import tunix's GRPO learner, else what to do."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    try:
        p = subprocess.run([python, "-c", "import tunix.rl.grpo.grpo_learner"], env=env, capture_output=True,
                           text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run {python}: {e}\n" + TUNIX_MISSING.format(python=python)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return f"{last}\n" + TUNIX_MISSING.format(python=python)
    return None


def _run_worker(kind: str, python: str, spec: dict, workdir: Path) -> dict:
    tag = f"{kind}_{spec['devices']}dev"
    spec_path, out_path = workdir / f"{tag}_spec.json", workdir / f"{tag}_result.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, JAX_PLATFORMS="cuda" if spec.get("device") == "cuda" else "cpu",
               TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    proc = subprocess.run([python, __file__, f"--{kind}-worker", str(spec_path), str(out_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    (workdir / f"{tag}_log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        print(f"{kind} on {spec['devices']} device(s) failed (exit {proc.returncode}); last output:\n{tail}",
              file=sys.stderr, flush=True)
        return {"error": tail}
    r = json.loads(out_path.read_text())
    r["wall_s"] = time.perf_counter() - t0
    r["summary"] = summarize(r["steps"], spec["warmup"])
    return r


def compare_engines(engines: list[str], spec: dict, devices: list[int], workdir: Path, out: str | None,
                    own_workdir: bool, rounds: int = 1) -> int:
    """jaxrlhf's GRPO once per generation engine and round (`--engines`, `--rounds`): step time,
    generate-call time, tokens. Rounds alternate the engines' order (A B, B A, ...) so that a machine
    slowing down or speeding up over the runs hits every engine alike; each row is the median over
    all of an engine's measured steps."""
    results: dict = {"workload": {k: v for k, v in spec.items() if k not in ("prompts", "workdir", "model_dir")},
                     "host": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}, "rows": [], "runs": {},
                     "rounds": rounds}
    for n in devices:
        steps: dict[str, list[dict]] = {engine: [] for engine in engines}
        for round_ in range(rounds):
            for engine in engines if round_ % 2 == 0 else engines[::-1]:
                print(f"jaxrlhf, generation.engine={engine}, on {n} device(s), round {round_ + 1} ...", flush=True)
                tag = f"{engine}_{n}dev" + (f"_round{round_ + 1}" if rounds > 1 else "")
                r = _run_worker("jaxrlhf", sys.executable, dict(spec, devices=n, overrides=spec["overrides"] + [
                    f"generation.engine={engine}"], workdir=str(workdir / tag)), workdir)
                results["runs"][tag] = r
                if "summary" not in r:
                    return finish(results, out, workdir if own_workdir else None) or 1
                steps[engine] += [s for s in r["steps"] if s["step"] > spec["warmup"]]
        for engine in engines:
            measured = steps[engine]
            summary = summarize(measured, spec["warmup"])
            row = {"devices": n, "engine": engine, "steps": len(measured), **{k: summary[k] for k in (
                "step_s", "generated_tokens_per_step", "tokens_per_s", "eos_frac")},
                "generate_s": _median([s["actor.generate"] for s in measured if "actor.generate" in s])}
            base = next((b for b in results["rows"] if b["devices"] == n), row)
            row["step_speedup"] = base["step_s"] / row["step_s"]
            row["generate_speedup"] = base["generate_s"] / row["generate_s"]
            results["rows"].append(row)
    results["host"]["loadavg_end"] = os.getloadavg()
    print(f"\n{'devices':>7} {'engine':>10} | {'step s':>7} {'generate s':>10} {'tok/step':>8} {'tok/s':>7} | "
          f"{'step x':>6} {'generate x':>10}")
    for row in results["rows"]:
        print(f"{row['devices']:>7} {row['engine']:>10} | {row['step_s']:>7.3f} {row['generate_s']:>10.3f} "
              f"{row['generated_tokens_per_step']:>8.0f} {row['tokens_per_s']:>7.0f} | {row['step_speedup']:>6.2f} "
              f"{row['generate_speedup']:>10.2f}")
    print(f"\nmedians of {spec['steps']} steps after {spec['warmup']} x {rounds} round(s), engines' order alternating; "
          f"x: speedup over {engines[0]} (time ratio). "
          f"Load average {results['host']['loadavg_start'][0]:.2f} at the start, "
          f"{results['host']['loadavg_end'][0]:.2f} at the end, on {os.cpu_count()} CPUs")
    print(json.dumps(results["rows"]))
    return finish(results, out, workdir if own_workdir else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart-grpo.yaml"))
    ap.add_argument("--devices", default=None,
                    help="simulated CPU device counts, comma separated (default 1,8); with --device cuda GPUs (1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: simulated CPU devices, fp32; cuda: GPUs, bf16 (the script's docstring says how)")
    ap.add_argument("--steps", type=int, default=5, help="measured GRPO steps per side (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps dropped (compilation)")
    ap.add_argument("--tunix-python", default=sys.executable,
                    help="interpreter that can import tunix (default: this one)")
    ap.add_argument("--skip-tunix", action="store_true")
    ap.add_argument("--engines", default=None,
                    help="compare jaxrlhf's generation engines instead (e.g. static,continuous); no tunix")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--engines: runs per engine, the engines' order alternating each round (default 1)")
    ap.add_argument("--out", default=None, help="write the rows and all per-step results as JSON here")
    ap.add_argument("--workdir", default=None, help="run outputs and logs (default: a temp dir, removed afterwards)")
    ap.add_argument("--tunix-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--jaxrlhf-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config key=value overrides (after the benchmark's workload)")
    args = ap.parse_args()
    if args.tunix_worker:
        tunix_worker(*args.tunix_worker)
        return 0
    if args.jaxrlhf_worker:
        jax_worker(*args.jaxrlhf_worker)
        return 0

    args.devices = args.devices or ("1,8" if args.device == "cpu" else "1")
    try:
        devices = [int(d) for d in args.devices.split(",") if d.strip()]
    except ValueError:
        devices = []
    if not devices or any(d < 1 for d in devices):
        ap.error(f"--devices={args.devices!r}: give positive integers, comma separated, e.g. 1,8")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    engines = [e.strip() for e in (args.engines or "").split(",") if e.strip()]
    if args.engines is not None and len(engines) < 2:
        ap.error(f"--engines={args.engines!r}: name two or more generation engines, e.g. static,continuous")
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds}: run each engine at least once (1 or more)")
    args.skip_tunix = args.skip_tunix or bool(engines)
    overrides = on_device(args.config, WORKLOAD + ["sft.steps=0"] + list(args.overrides), args.device)
    cfg = _cfg(args.config, overrides, [])
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.run.backend import setup_devices
    from jaxrlhf.run.planning import role_configs

    # this process only draws prompts and writes the HF checkpoint: on the CPU, leaving a GPU to the workers
    setup_devices(dataclasses.replace(cfg.run, platform="cpu", devices=1) if args.device == "cuda" else cfg.run)
    mc = role_configs(cfg, ["actor"])["actor"]
    alg, data, gen = cfg.algorithm, cfg.data, cfg.generation
    problems = [
        (alg.name != "grpo", f"algorithm.name={alg.name!r}: this benchmark compares GRPO; use a grpo config"),
        (alg.minibatches != 1 or alg.epochs != 1,
         f"algorithm.minibatches={alg.minibatches}, epochs={alg.epochs}: tunix's num_iterations=1 with one "
         "mini-batch is one update per batch; keep minibatches=1 and epochs=1"),
        (alg.micro_batch_size is not None and alg.micro_batch_size % alg.group_size != 0,
         f"algorithm.micro_batch_size={alg.micro_batch_size}: tunix micro-batches whole prompts; use a multiple "
         f"of group_size={alg.group_size}"),
        (cfg.model.tokenizer != "byte", f"model.tokenizer={cfg.model.tokenizer!r}: the benchmark runs the byte "
         "tokenizer on both sides; set model.tokenizer=byte"),
        (mc.architecture != "llama" or mc.attention_bias or mc.sliding_window or mc.rope_scaling,
         f"model.actor ({mc.architecture}, attention_bias={mc.attention_bias}, sliding_window={mc.sliding_window}, "
         f"rope_scaling={mc.rope_scaling}): tunix's Llama3 has none of these; use a plain llama shape"),
        (not cfg.rewards.rules or cfg.rewards.model,
         "rewards: the benchmark scores with rule rewards only (rewards.rules, rewards.model=false)"),
    ]
    for bad, msg in problems:
        if bad:
            print(f"error: {msg}", file=sys.stderr)
            return 2

    tunix_problem = None if args.skip_tunix else _tunix_problem(args.tunix_python)
    if tunix_problem:
        print(tunix_problem, file=sys.stderr)
        print("continuing with jaxrlhf only (no ratio)\n", file=sys.stderr, flush=True)
    run_tunix = not args.skip_tunix and not tunix_problem

    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_grpo_tunix_"))
    workdir.mkdir(parents=True, exist_ok=True)
    n_steps = args.warmup + args.steps
    rows, width = prompt_rows(cfg, n_steps)
    B, G = data.batch_size, alg.group_size
    shape = {"hidden": mc.hidden_size, "layers": mc.num_layers, "heads": mc.num_heads, "kv_heads": mc.num_kv_heads,
             "head_dim": mc.dim_per_head, "ffn": mc.intermediate_size, "vocab": mc.vocab_size,
             "rope_theta": mc.rope_theta, "norm_eps": mc.rms_norm_eps, "tied": mc.tie_word_embeddings,
             "params": mc.num_params()}
    spec = {
        "config": args.config, "overrides": overrides, "workdir": str(workdir), "model": shape,
        "model_dir": str(workdir / "hf_actor"), "prompts": rows, "prompt_width": width, "batch_size": B,
        "warmup": args.warmup, "steps": args.steps, "max_new_tokens": gen.max_new_tokens,
        "temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k,
        "pad_id": mc.pad_token_id if mc.pad_token_id is not None else 0, "eos_id": mc.eos_token_id,
        "bos_id": load_tokenizer(cfg.model.tokenizer).bos_id,  # what the prompts start with (not the model's)
        "device": args.device,
        # the clip epsilon jaxrlhf's GRPO uses (the config holds GRPO's default, 0.2, unless set)
        "algorithm": {"group_size": G, "kl_coef": alg.kl_coef, "clip_eps": alg.clip_eps},
        "optimizer": {k: getattr(cfg.optimizer.actor, k) for k in ("lr", "b1", "b2", "eps", "weight_decay",
                                                                   "max_grad_norm")},
        "rules": [(r.name, r.weight, dict(r.args)) for r in cfg.rewards.rules],
        "micro_batch_prompts": alg.micro_batch_size // G if alg.micro_batch_size else None,
    }
    print(f"workload: {mc.num_params() / 1e6:.2f}M-param Llama (hidden {mc.hidden_size}, {mc.num_layers} layers, "
          f"{mc.num_heads} heads / {mc.num_kv_heads} KV, ffn {mc.intermediate_size}, vocab {mc.vocab_size}), "
          f"{B} prompts x G={G}, prompt {width}, up to {gen.max_new_tokens} new tokens, one update per batch; "
          f"{args.warmup} warm-up + {args.steps} measured steps; devices {devices}", flush=True)
    if engines:
        return compare_engines(engines, spec, devices, workdir, args.out, own_workdir, args.rounds)
    if run_tunix:
        from jaxrlhf.models.hf_io import save_hf_checkpoint
        from jaxrlhf.models.transformer import build_model

        save_hf_checkpoint(build_model(mc, "lm", seed=cfg.run.seed), mc, spec["model_dir"])

    results: dict = {"workload": {k: v for k, v in spec.items() if k not in ("prompts", "workdir", "model_dir")},
                     "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                              "python": platform.python_version(), "loadavg_start": os.getloadavg()},
                     "rows": [], "runs": {}}
    for n in devices:
        row: dict = {"devices": n}
        sides = [("jaxrlhf", sys.executable)] + ([("tunix", args.tunix_python)] if run_tunix else [])
        for kind, python in sides:
            print(f"{kind} on {n} device(s) ...", flush=True)
            r = _run_worker(kind, python, dict(spec, devices=n), workdir)
            results["runs"][f"{kind}_{n}dev"] = r
            if "summary" not in r:
                row[f"{kind}_error"] = r["error"][-300:]
                continue
            sm = r["summary"]
            row.update({f"{kind}_step_s": sm["step_s"], f"{kind}_generated_tokens_per_step":
                        sm["generated_tokens_per_step"], f"{kind}_tokens_per_s": sm["tokens_per_s"],
                        f"{kind}_eos_frac": sm["eos_frac"]})
            print(f"  {kind}: {sm['step_s']:.3f} s/step, {sm['generated_tokens_per_step']:.0f} generated tokens/step, "
                  f"{sm['tokens_per_s']:.0f} tokens/s (wall {r['wall_s']:.0f} s)", flush=True)
        if "jaxrlhf_tokens_per_s" in row and "tunix_tokens_per_s" in row:
            row["ratio"] = row["jaxrlhf_tokens_per_s"] / row["tunix_tokens_per_s"]
        results["rows"].append(row)
    results["host"]["loadavg_end"] = os.getloadavg()

    print()
    print(f"{'devices':>7} | {'jaxrlhf s':>9} {'tok/step':>8} {'tok/s':>7} | {'tunix s':>8} {'tok/step':>8} "
          f"{'tok/s':>7} | {'x tunix':>7}")
    print("-" * 80)
    for row in results["rows"]:
        def side(kind, width):
            if f"{kind}_step_s" not in row:
                return f"{'failed' if f'{kind}_error' in row else '-':>{width + 17}}"
            return (f"{row[f'{kind}_step_s']:>{width}.3f} {row[f'{kind}_generated_tokens_per_step']:>8.0f} "
                    f"{row[f'{kind}_tokens_per_s']:>7.0f}")
        ratio = f"{row['ratio']:>7.2f}" if "ratio" in row else f"{'n/a':>7}"
        print(f"{row['devices']:>7} | {side('jaxrlhf', 9)} | {side('tunix', 8)} | {ratio}")
    print(f"\ntok/step: generated tokens per step (responses up to and including EOS, {B} x {G} sequences); "
          f"x tunix: ratio of generated tokens/s. Load average {results['host']['loadavg_start'][0]:.2f} at the "
          f"start, {results['host']['loadavg_end'][0]:.2f} at the end, on {os.cpu_count()} CPUs")
    return finish(results, args.out, workdir if own_workdir else None)


if __name__ == "__main__":
    sys.exit(main())
