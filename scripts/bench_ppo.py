"""PPO throughput of jaxrlhf (per placement strategy) vs TRL's PPO trainer, same run, on the CPU or one GPU.

    python scripts/bench_ppo.py [--config configs/quickstart.yaml] [--steps 10] [--warmup 2]
        [--strategies auto,colocated,interleaved,disaggregated,reallocated] [--skip-trl]
        [--trl-threads 1,<cores>] [--device cpu|cuda] [--out results.json] [key=value ...]

The workload comes from the config (default: the quickstart), so the benchmark
stays matched when the quickstart changes: actor size (`model.actor`), batch
(`data.batch_size`), PPO minibatches and epochs (`algorithm.minibatches`,
`algorithm.epochs`), prompt length (`data.max_prompt_len`), response length
(`generation.max_new_tokens`), sampling temperature, learning rates, KL and
clip settings, rewards. Trailing `key=value` arguments override the config
(as for `python -m jaxrlhf.train`).

jaxrlhf: for each strategy, `jaxrlhf.train.run` with `sft.steps=0` for
`warmup + steps` PPO steps on the config's simulated CPU devices; the first
`warmup` steps (compilation) are dropped and the per-step
`time/step_s`, `throughput/tokens_per_s` and `time/<call>_s` from
`metrics.jsonl` are summarised by their median. The config's own
`plan.strategy` (the quickstart's: `auto`, the planner's pick) is the default
plan: the table marks it and the JSON names it (`default_strategy`).

TRL: `trl.experimental.ppo.PPOTrainer` (trl==1.9.2, the last release with PPO)
in a subprocess on PyTorch CPU, float32, no gradient checkpointing, with a
policy, reference and value model loaded from an HF checkpoint of the same
architecture and size (written by `jaxrlhf.models.hf_io.save_hf_checkpoint`
from the config's actor; value model = `AutoModelForSequenceClassification`,
num_labels=1). Batch: `per_device_train_batch_size = data.batch_size`,
`num_mini_batches = algorithm.minibatches`, `num_ppo_epochs = algorithm.epochs`,
`response_length = generation.max_new_tokens`, stop at EOS (with
`generation.ignore_eos=true`: `stop_token=None` and no EOS in the policy's
generation config, so both sides sample every response to the cap), prompts left-padded
to `data.max_prompt_len` (the same prompts jaxrlhf draws, tokenized by
jaxrlhf's tokenizer; a `PreTrainedTokenizerFast` with the same vocabulary
supplies pad/eos ids). Rewards: with rule rewards only (the quickstart), a
small torch module applies the same jaxrlhf rule functions and EOS-only
shaping that jaxrlhf applies on the host, so neither side runs a reward-model
forward; with `rewards.model=true` TRL gets a reward model of the same size.
Step times come from a `TrainerCallback` (time between consecutive
`on_step_end`), the first `warmup` steps are dropped.

TRL thread counts: TRL runs once per `--trl-threads` value, by default with 1
torch thread and with one thread per core (`os.cpu_count()`), side by side in
the same run, and every ratio is taken against the faster of them. Earlier
runs gave TRL one thread only, because on a loaded 2-core machine torch's
default thread pool made its tiny ops ~9x slower; but XLA uses every core, so
on a quiet machine a 1-thread TRL flatters jaxrlhf (at 23.6M parameters TRL
with 2 threads is ~1.5x faster than with 1). The table shows every TRL row;
`x_trl_best` in the JSON is each strategy's tokens/s over the faster TRL's.

Tokens per step (both systems): prompt tokens that are not padding plus
generated response tokens up to and including EOS (jaxrlhf's own
`throughput/tokens_per_s` definition: the sum of the sequence mask); every
sampled token under `generation.ignore_eos=true`. EOS ends a sampled response
at random, so without it the two sides generate different numbers of tokens
for the same padded work (a random model's response lengths vary by ~10 %
between runs); `generation.ignore_eos=true rewards.eos_only=false` makes the
work and the token count identical.
tokens/s = tokens of the step / wall time of the step; the table shows the
median over measured steps and the ratio of medians vs TRL. The JSON's `ratio`
is jaxrlhf's fastest strategy over the faster TRL (tokens/s), `per_call_s`
each side's median call seconds and `generate_share` each side's generate
seconds over its step seconds.

`--device cuda` (one GPU; the default `cpu` is the run described above): TRL
loads its models in bf16 (`dtype=torch.bfloat16`) and trains with `bf16=True`
on the GPU (no `use_cpu`), the rule-reward module's scores on the input's
device, once with torch's default threads; jaxrlhf runs with `run.platform=gpu`
and every role's parameters and compute in bf16 (`model.<role>.dtype` and
`param_dtype`; AdamW keeps fp32 master weights), `colocated` unless
`--strategies` says otherwise. This process then leaves GPU memory unreserved
(`XLA_PYTHON_CLIENT_PREALLOCATE=false`), so TRL's process, which runs first,
can have it. A model whose EOS id lies past the byte vocabulary (the
`llama3.2-1b` preset's 128001 with `model.tokenizer=byte`) keeps the HF
tokenizer's own EOS: the tokenizer cannot name that id.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRATEGIES = ("auto", "colocated", "interleaved", "disaggregated", "reallocated")
TRL_VERSION = "1.9.2"
TRL_MISSING = (
    "TRL is not installed (it is a benchmark-only dependency, not a jaxrlhf one).\n"
    f"  Install the last release that still has PPO:  pip install trl=={TRL_VERSION}\n"
    "  (check first that it does not change your torch/transformers: "
    f"pip install --dry-run trl=={TRL_VERSION}; if it would, use --no-deps and install "
    "accelerate, datasets and pandas yourself), or pass --skip-trl."
)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _trl_status() -> str | None:
    """None when TRL with `trl.experimental.ppo` is importable, else why not."""
    if importlib.util.find_spec("trl") is None:
        return TRL_MISSING
    try:
        from importlib.metadata import version

        v = version("trl")
    except Exception:  # noqa: BLE001
        v = "?"
    try:
        spec = importlib.util.find_spec("trl.experimental.ppo")
    except Exception:  # noqa: BLE001
        spec = None
    if spec is None:
        return f"trl {v} has no trl.experimental.ppo (PPO was removed).\n" + TRL_MISSING
    return None


# --------------------------------------------------------------------------- per-device choices (no torch, no JAX)


def torch_dtype_name(device: str) -> str:
    """TRL's dtype: bf16 on a GPU, as users train there; fp32 on the CPU, where torch emulates bf16 matmuls."""
    return "bfloat16" if device == "cuda" else "float32"


def jaxrlhf_device_overrides(device: str, roles) -> list[str]:
    """jaxrlhf's overrides that match TRL's device: on cuda one GPU and every role's parameters and compute
    in bf16 (AdamW keeps its fp32 master copy); none on cpu, whose run stays the config's own."""
    if device != "cuda":
        return []
    return ["run.platform=gpu", "run.devices=null"] + [
        f"model.{role}.{key}=bfloat16" for role in roles for key in ("dtype", "param_dtype")]


def on_device(config_path: str, overrides: list[str], device: str) -> list[str]:
    """`overrides` and then `jaxrlhf_device_overrides` for the roles the config's algorithm runs."""
    if device != "cuda":
        return list(overrides)
    from jaxrlhf.algorithms import declare

    roles = declare(_cfg(config_path, overrides, [])).graph().roles
    return list(overrides) + jaxrlhf_device_overrides(device, roles)


def hf_special_ids(vocab_size: int, pad_id: int, eos_id: int) -> dict[str, int]:
    """The pad and EOS ids to set on TRL's tokenizer: the model's, except an EOS past the tokenizer's
    vocabulary (the `llama3.2-1b` preset over the byte vocabulary), which the tokenizer cannot name and
    so keeps its own (with `ignore_eos` nothing stops at it anyway)."""
    ids = {"pad_token_id": pad_id}
    if eos_id < vocab_size:
        ids["eos_token_id"] = eos_id
    return ids


def trl_thread_counts(arg: str | None, device: str) -> list[int]:
    """torch thread counts to run TRL with: as given; else on cpu 1 and one per core (see the module's
    docstring), on cuda torch's default (0) once, as the GPU does the work."""
    if arg is None:
        arg = "0" if device == "cuda" else f"1,{os.cpu_count() or 1}"
    return list(dict.fromkeys(int(t) for t in arg.split(",") if t.strip()))


def ppo_config_kwargs(spec: dict) -> dict:
    """`PPOConfig`'s arguments for the spec: the workload's batch, lengths and PPO settings, bf16 on the
    GPU or fp32 on the CPU (`use_cpu`)."""
    alg, cuda = spec["algorithm"], spec.get("device", "cpu") == "cuda"
    n_steps, B = spec["warmup"] + spec["steps"], spec["batch_size"]
    return dict(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=B,  # micro batch = minibatch (B / num_mini_batches), one update each
        gradient_accumulation_steps=1,
        num_mini_batches=alg["minibatches"],
        num_ppo_epochs=alg["epochs"],
        total_episodes=B * n_steps,
        local_rollout_forward_batch_size=B,  # one generate call per step, as jaxrlhf
        response_length=spec["max_new_tokens"],
        stop_token=None if spec["ignore_eos"] else "eos",  # None: TRL sets no EOS to stop at
        temperature=spec["temperature"],
        learning_rate=spec["lr"],
        kl_coef=alg["kl_coef"],
        kl_estimator=alg["kl_estimator"] if alg["kl_estimator"] in ("k1", "k3") else "k1",
        cliprange=alg["clip_eps"],
        cliprange_value=alg["value_clip_eps"] if alg["value_clip_eps"] is not None else 1e6,
        gamma=alg["gamma"],
        lam=alg["lam"],
        whiten_rewards=False,
        missing_eos_penalty=None,
        num_sample_generations=0,
        bf16=cuda,
        fp16=False,
        gradient_checkpointing=False,
        **({} if cuda else {"use_cpu": True}),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=spec["seed"],
        dataloader_num_workers=0,
    )


def comparison(jax_summary: dict | None, trl_summary: dict | None, jax_generate: str = "actor.generate",
               trl_generate: str = "generate_s") -> dict:
    """The JSON's side-by-side numbers: `ratio` (jaxrlhf tokens/s over TRL's), each side's median step and
    call seconds, and each side's generate share (its generate seconds over its step seconds)."""
    out: dict = {"ratio": None, "step_s": {}, "per_call_s": {}, "generate_share": {}}
    for side, sm, gen in (("jaxrlhf", jax_summary, jax_generate), ("trl", trl_summary, trl_generate)):
        if not sm:
            continue
        out["step_s"][side] = sm["step_s"]
        out["per_call_s"][side] = dict(sm.get("calls_s", {}))
        if gen in out["per_call_s"][side]:
            out["generate_share"][side] = out["per_call_s"][side][gen] / sm["step_s"]
    if jax_summary and trl_summary:
        out["ratio"] = jax_summary["tokens_per_s"] / trl_summary["tokens_per_s"]
    return out


# --------------------------------------------------------------------------- TRL side (subprocess)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer_hf(add_bos: bool = False):
    """A `PreTrainedTokenizerFast` with jaxrlhf's byte vocabulary: pad 0, bos 1, eos 2, byte b -> b + 3;
    `add_bos`: BOS first when special tokens are added, as jaxrlhf encodes a prompt (for a trainer that
    tokenizes the prompt text itself)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({ch: b + 3 for b, ch in _bytes_to_unicode().items()})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def trl_worker(spec_path: str, out_path: str, threads: str = "0") -> None:
    """Runs TRL's PPOTrainer as the spec says and writes per-step timings and token counts."""
    import torch

    if int(threads) > 0:
        torch.set_num_threads(int(threads))
    import transformers
    import trl
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PreTrainedTokenizerFast,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    cuda = spec.get("device", "cpu") == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)  # a GPU's work ends when it is waited for
    StepTimer, RuleRewardModule = _trl_classes(sync)
    torch.manual_seed(spec["seed"])
    pad, eos, width = spec["pad_id"], spec["eos_id"], spec["prompt_width"]

    if spec["tokenizer"] == "byte":
        tok = byte_tokenizer_hf()
        from jaxrlhf.models.tokenizer import ByteTokenizer

        probe = "12+7="
        assert tok(probe, add_special_tokens=False)["input_ids"] == ByteTokenizer().encode(probe), "byte vocab mismatch"
    else:
        path = spec["tokenizer"]
        tok = PreTrainedTokenizerFast(
            tokenizer_file=path if os.path.isfile(path) else os.path.join(path, "tokenizer.json"), padding_side="left"
        )
    for key, value in hf_special_ids(len(tok), pad, eos).items():
        setattr(tok, key, value)
        assert getattr(tok, key) == value, (key, value)

    model_dir = spec["model_dir"]
    dtype = getattr(torch, torch_dtype_name(spec.get("device", "cpu")))
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    value = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=dtype)
    for m in (policy, ref, value):
        m.config.pad_token_id = pad
    policy.generation_config.pad_token_id = pad

    rows = spec["prompts"]  # [{"ids": [...], "prompt": str, "answer": str|None}]
    by_ids = {tuple(r["ids"]): r for r in rows}
    if spec["reward_model"]:
        reward = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=dtype)
        reward.config.pad_token_id = pad
    else:
        reward = RuleRewardModule(spec, by_ids)

    padded = [[pad] * (width - len(r["ids"])) + r["ids"] for r in rows]
    train = Dataset.from_dict({"input_ids": padded})

    n_steps = spec["warmup"] + spec["steps"]
    args = PPOConfig(**ppo_config_kwargs(spec))

    timer = StepTimer()
    trainer = PPOTrainer(
        args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
        value_model=value, train_dataset=train, eval_dataset=train, callbacks=[timer],
    )
    for cb in (transformers.PrinterCallback, transformers.ProgressCallback):
        trainer.remove_callback(cb)

    # Count tokens and time generation at the one generate call per step.
    gen_stats: list[dict] = []
    orig_generate = policy.generate

    def timed_generate(*a, **kw):
        sync()
        t0 = time.perf_counter()
        out = orig_generate(*a, **kw)
        sync()
        dt = time.perf_counter() - t0
        prompt_tokens = int(kw["attention_mask"].sum())
        resp = out.sequences[:, kw["input_ids"].shape[1]:]
        is_eos = resp == eos
        has_eos = is_eos.any(dim=1)
        if spec["ignore_eos"]:  # every row sampled to the cap, EOS or not
            assert resp.shape[1] == spec["max_new_tokens"], ("generation stopped early", resp.shape)
            first = torch.full_like(has_eos, resp.shape[1], dtype=torch.long)
        else:  # up to and including the first EOS
            first = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1,
                                torch.full_like(has_eos, resp.shape[1], dtype=torch.long))
        gen_stats.append({"generate_s": dt, "prompt_tokens": prompt_tokens, "response_tokens": int(first.sum()),
                          "eos_frac": float(has_eos.float().mean())})
        return out

    policy.generate = timed_generate
    t0 = time.perf_counter()
    trainer.train()
    total_s = time.perf_counter() - t0

    ends = timer.times
    step_s = [b - a for a, b in zip(ends, ends[1:])]
    assert len(step_s) == n_steps and len(gen_stats) == n_steps, (len(step_s), len(gen_stats), n_steps)
    steps = []
    for i, (s, g) in enumerate(zip(step_s, gen_stats)):
        tokens = g["prompt_tokens"] + g["response_tokens"]
        steps.append({"step": i + 1, "step_s": s, "tokens": tokens, "tokens_per_s": tokens / s, **g,
                      **{k: v for k, v in (timer.logs[i] if i < len(timer.logs) else {}).items()
                         if k in ("objective/kl", "objective/scores", "loss/policy_avg", "loss/value_avg")}})
    Path(out_path).write_text(json.dumps({
        "steps": steps, "total_train_s": total_s, "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).removeprefix("torch."),
        "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "trl_args": {"batch_size": args.batch_size, "mini_batch_size": args.mini_batch_size,
                     "per_device_train_batch_size": args.per_device_train_batch_size,
                     "num_mini_batches": args.num_mini_batches, "num_ppo_epochs": args.num_ppo_epochs,
                     "response_length": args.response_length, "num_total_batches": args.num_total_batches},
        "params": sum(p.numel() for p in policy.parameters()),
        "reward": "model" if spec["reward_model"] else "rule",
    }, indent=1))


def _trl_classes(sync=lambda: None):
    """The TRL-side helper classes, defined only in the worker (the main process never imports torch);
    `sync` waits for the device's queued work (the GPU's) so each step ends when its work does."""
    import types

    import numpy as np
    import torch
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall-clock time at train begin and at the end of every PPO step, plus the logged metrics."""

        def __init__(self):
            self.times: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kw):
            sync()
            self.times = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.times.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    class RuleRewardModule(torch.nn.Module):
        """Stands in for TRL's reward model when the config uses rule rewards only.

        TRL's `get_reward` calls `getattr(model, model.base_model_prefix)(...)` and
        `model.score(hidden_states[-1])`; this backbone decodes each query+response
        row and puts jaxrlhf's rule score (shaped as jaxrlhf shapes it: bias, scale,
        clip, EOS-only) on every position, and `score` is the identity.
        """

        base_model_prefix = "backbone"

        def __init__(self, spec: dict, by_ids: dict):
            from jaxrlhf.models.tokenizer import load_tokenizer
            from jaxrlhf.rewards.rules import CombinedReward

            super().__init__()
            self.rules = CombinedReward([tuple(r) for r in spec["rules"]])
            self.shape = spec["reward_shaping"]
            self.tokenizer = load_tokenizer(spec["tokenizer"])
            self.by_ids = by_ids
            self.width, self.pad, self.eos = spec["prompt_width"], spec["pad_id"], spec["eos_id"]
            self.ignore_eos = spec["ignore_eos"]
            self.score = torch.nn.Identity()
            self.backbone = self.forward

        def forward(self, input_ids=None, attention_mask=None, **kw):
            ids = input_ids.cpu().numpy()
            prompts, answers, texts, ended = [], [], [], []
            for row in ids:
                p = tuple(int(t) for t in row[: self.width] if t != self.pad)
                r = self.by_ids.get(p, {"prompt": self.tokenizer.decode(p), "answer": None})
                resp = [int(t) for t in row[self.width:]]
                done = self.eos in resp and not self.ignore_eos
                # past EOS (ignore_eos) the text is every sampled token but EOS, as jaxrlhf decodes it
                resp = resp[: resp.index(self.eos)] if done else [t for t in resp if t not in (self.pad, self.eos)]
                prompts.append(r["prompt"])
                answers.append(r["answer"])
                texts.append(self.tokenizer.decode(resp))
                ended.append(done)
            s = (np.asarray(self.rules.batch(prompts, texts, answers), np.float32) - self.shape["bias"])
            s = s * self.shape["scale"]
            if self.shape["clip"] is not None:
                s = np.clip(s, -self.shape["clip"], self.shape["clip"])
            if self.shape["eos_only"]:
                s = np.where(np.asarray(ended), s, 0.0)
            h = torch.as_tensor(s, dtype=torch.float32, device=input_ids.device)[:, None, None]
            h = h.expand(ids.shape[0], ids.shape[1], 1)
            return types.SimpleNamespace(hidden_states=(h,))

    return StepTimer, RuleRewardModule


# --------------------------------------------------------------------------- jaxrlhf side


def _cfg(config_path: str, extra: list[str], overrides: list[str]):
    from jaxrlhf.config import load_config

    return load_config(config_path, list(overrides) + list(extra))


def run_jaxrlhf(config_path: str, strategy: str, overrides: list[str], n_steps: int, warmup: int, workdir: Path) -> dict:
    from jaxrlhf import train

    out_dir = workdir / f"jax_{strategy}"
    shutil.rmtree(out_dir, ignore_errors=True)
    cfg = _cfg(config_path, overrides, [
        "sft.steps=0", f"run.steps={n_steps}", "run.save_checkpoints=false", "run.export_hf=false",
        "run.tensorboard=false", "run.resume=false", "run.eval_every=0", f"run.output_dir={out_dir}",
        f"plan.strategy={strategy}",
    ])
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out_dir / "log.txt", "w") as log, contextlib.redirect_stdout(log):
        train.run(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = []
    for m in rows:
        s = {"step": m["step"], "step_s": m["time/step_s"], "tokens_per_s": m["throughput/tokens_per_s"]}
        s["tokens"] = round(s["tokens_per_s"] * s["step_s"])
        s.update({k[5:-2]: v for k, v in m.items() if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"})
        s.update({k: m[k] for k in ("reward/mean", "kl/mean", "loss/policy", "loss/value", "response/length_mean",
                                    "response/eos_frac") if k in m})
        steps.append(s)
    return {"steps": steps, "wall_s": wall, "first_step_s": steps[0]["step_s"] if steps else None}


def summarize(steps: list[dict], warmup: int, calls: list[str]) -> dict:
    measured = [s for s in steps if s["step"] > warmup]
    out = {
        "measured_steps": len(measured),
        "step_s": _median([s["step_s"] for s in measured]),
        "tokens_per_s": _median([s["tokens_per_s"] for s in measured]),
        "tokens_per_step": _median([s["tokens"] for s in measured]),
        "tokens_per_s_aggregate": (sum(s["tokens"] for s in measured) / sum(s["step_s"] for s in measured))
        if measured else float("nan"),
        "step_s_min": min((s["step_s"] for s in measured), default=float("nan")),
        "step_s_max": max((s["step_s"] for s in measured), default=float("nan")),
    }
    out["calls_s"] = {c: _median([s[c] for s in measured if c in s]) for c in calls if any(c in s for s in measured)}
    return out


def prompt_rows(cfg, n_batches: int) -> tuple[list[dict], int]:
    """The prompts jaxrlhf's PromptDataset draws for the first n batches (ids without padding)."""
    from jaxrlhf.data import PromptDataset
    from jaxrlhf.models.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.model.tokenizer)
    data = PromptDataset.from_config(cfg, tok)
    rows, widths = [], []
    for _ in range(n_batches):
        b = data.next_batch()
        widths.append(int(b.input_ids.shape[1]))
        for ids, m, p, a in zip(b.input_ids, b.attention_mask, b.prompts, b.answers):
            rows.append({"ids": [int(t) for t in ids[m]], "prompt": p, "answer": a})
    return rows, max(widths)


def finish(results: dict, out: str | None, temp_workdir: Path | None) -> int:
    """Writes the results as JSON when asked and removes the run outputs when they were only temporary."""
    if out:
        Path(out).write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"wrote {out}")
    if temp_workdir is not None:
        shutil.rmtree(temp_workdir, ignore_errors=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    ap.add_argument("--steps", type=int, default=10, help="measured PPO steps per system (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps dropped (compilation, allocator warm-up)")
    ap.add_argument("--strategies", default=None,
                    help=f"jaxrlhf plans to run (default: {','.join(STRATEGIES)} on cpu, colocated on cuda)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: both sides on this machine's CPU (simulated JAX devices); cuda: both on one GPU, "
                         "bf16 (the script's docstring says how)")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    ap.add_argument("--workdir", default=None, help="run outputs (default: a temp dir, removed afterwards)")
    ap.add_argument("--trl-threads", default=None,
                    help="torch intra-op thread counts to run TRL with, comma separated (0 = torch's default); "
                         f"every ratio is taken against the fastest. Default on cpu: 1 and one per core "
                         f"(1,{os.cpu_count() or 1}), since XLA uses every core and one thread alone would flatter "
                         "jaxrlhf; on cuda: 0")
    ap.add_argument("--trl-worker", nargs=3, metavar=("SPEC", "OUT", "THREADS"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = ap.parse_args()

    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return 0

    strategies = [s for s in (args.strategies or (",".join(STRATEGIES) if args.device == "cpu" else "colocated")
                              ).split(",") if s]
    try:
        trl_threads = trl_thread_counts(args.trl_threads, args.device)
    except ValueError:
        ap.error(f"--trl-threads={args.trl_threads!r}: give comma-separated integers, e.g. 1,{os.cpu_count() or 1}")
    if any(t < 0 for t in trl_threads):
        ap.error(f"--trl-threads={args.trl_threads!r}: thread counts must be >= 0 (0 = torch's default)")
    for s in strategies:
        if s not in STRATEGIES:
            ap.error(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trl_problem = None if args.skip_trl else _trl_status()
    if trl_problem:
        print(trl_problem, file=sys.stderr)
        print("continuing with jaxrlhf only (no ratio)\n", file=sys.stderr)

    n_steps = args.warmup + args.steps
    args.overrides = on_device(args.config, args.overrides, args.device)
    cfg = _cfg(args.config, args.overrides, ["sft.steps=0"])
    if args.device == "cuda":  # TRL's process runs first and needs the GPU's memory: reserve none ahead
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from jaxrlhf.run.backend import setup_devices
    from jaxrlhf.run.planning import role_configs

    setup_devices(cfg.run)
    import jax

    from jaxrlhf.models.hf_io import save_hf_checkpoint
    from jaxrlhf.models.transformer import build_model

    own_workdir = args.workdir is None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_ppo_"))
    workdir.mkdir(parents=True, exist_ok=True)

    mc = role_configs(cfg, ["actor"])["actor"]
    alg, data, gen = cfg.algorithm, cfg.data, cfg.generation
    rows, jax_width = prompt_rows(cfg, n_steps)
    workload = {
        "config": os.path.relpath(args.config, ROOT) if args.config.startswith(str(ROOT)) else args.config,
        "overrides": args.overrides,
        "model": {"preset": cfg.model.actor.preset, "path": cfg.model.actor.path, "hidden": mc.hidden_size,
                  "layers": mc.num_layers, "heads": mc.num_heads, "kv_heads": mc.num_kv_heads,
                  "ffn": mc.intermediate_size, "vocab": mc.vocab_size, "params": mc.num_params(), "dtype": mc.dtype},
        "batch_size": data.batch_size * alg.group_size, "minibatches": alg.minibatches, "epochs": alg.epochs,
        "max_prompt_len": data.max_prompt_len, "jax_prompt_width": jax_width,
        "max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature,
        "reward": "model" if cfg.rewards.model else "rules: " + ",".join(r.name for r in cfg.rewards.rules),
        "devices": jax.device_count(), "warmup_steps": args.warmup, "measured_steps": args.steps,
        "ignore_eos": gen.ignore_eos, "device": args.device,
        "tokens": ("non-pad prompt tokens + " + ("every sampled response token (ignore_eos)" if gen.ignore_eos
                   else "response tokens up to and including EOS") + ", per PPO step"),
    }
    host = {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "jax": jax.__version__, "loadavg_start": os.getloadavg()}
    results: dict = {"workload": workload, "host": host, "default_strategy": cfg.plan.strategy, "jaxrlhf": {},
                     "trl": None}
    print(f"workload: {mc.num_params() / 1e6:.2f}M-param actor ({workload['model']['preset'] or 'checkpoint'}), "
          f"batch {workload['batch_size']}, {alg.minibatches} minibatches x {alg.epochs} epochs, prompt "
          f"{data.max_prompt_len} (jaxrlhf pads to {jax_width}), response {gen.max_new_tokens}, "
          f"{jax.device_count()} {jax.devices()[0].platform} devices; {args.warmup} warm-up + {args.steps} measured steps",
          flush=True)
    if jax_width != data.max_prompt_len:
        print(f"note: jaxrlhf batches are {jax_width} wide, TRL prompts are padded to max_prompt_len="
              f"{data.max_prompt_len}", flush=True)

    # TRL first, in its own process (no JAX thread pools, its own torch threads).
    if not args.skip_trl and not trl_problem:
        model_dir = Path(cfg.model.actor.path) if cfg.model.actor.path else workdir / "hf_actor"
        if not cfg.model.actor.path:
            save_hf_checkpoint(build_model(mc, "lm", seed=cfg.run.seed), mc, model_dir)
        spec = {
            "model_dir": str(model_dir), "tokenizer": cfg.model.tokenizer, "seed": cfg.run.seed,
            "pad_id": mc.pad_token_id if mc.pad_token_id is not None else 0, "eos_id": mc.eos_token_id,
            "prompt_width": data.max_prompt_len, "prompts": rows, "batch_size": workload["batch_size"],
            "warmup": args.warmup, "steps": args.steps, "max_new_tokens": gen.max_new_tokens,
            "temperature": gen.temperature, "lr": cfg.optimizer.actor.lr, "ignore_eos": gen.ignore_eos,
            "algorithm": {"minibatches": alg.minibatches, "epochs": alg.epochs, "kl_coef": alg.kl_coef,
                          # the config holds the algorithm's own defaults (jaxrlhf.config_schema)
                          "kl_estimator": alg.kl_estimator, "clip_eps": alg.clip_eps,
                          "value_clip_eps": alg.value_clip_eps, "gamma": alg.gamma, "lam": alg.lam},
            "reward_model": bool(cfg.rewards.model),
            "rules": [(r.name, r.weight, dict(r.args)) for r in cfg.rewards.rules],
            "reward_shaping": {"bias": cfg.rewards.bias, "scale": cfg.rewards.scale, "clip": cfg.rewards.clip,
                               "eos_only": cfg.rewards.eos_only},
            "output_dir": str(workdir / "trl_out"), "device": args.device,
        }
        spec_path = workdir / "trl_spec.json"
        spec_path.write_text(json.dumps(spec))
        results["trl"] = {}
        for threads in trl_threads:
            label = f"{threads} thr" if threads else "default thr"
            out_path = workdir / f"trl_result_{threads}.json"
            where = "PyTorch CPU" if args.device == "cpu" else "PyTorch CUDA, bf16"
            print(f"TRL PPOTrainer ({where}, torch threads: {threads or 'default'}) ...", flush=True)
            env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1")
            if threads:
                env["OMP_NUM_THREADS"] = str(threads)
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, __file__, "--trl-worker", str(spec_path), str(out_path), str(threads)],
                env=env, cwd=ROOT, capture_output=True, text=True,
            )
            (workdir / f"trl_log_{threads}.txt").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr)[-3000:]
                print(f"TRL run failed (exit {proc.returncode}); last output:\n{tail}", file=sys.stderr)
                results["trl"][label] = {"error": tail}
                continue
            r = json.loads(out_path.read_text())
            r["wall_s"] = time.perf_counter() - t0
            r["summary"] = summarize(r["steps"], args.warmup, ["generate_s"])
            results["trl"][label] = r
            print(f"  TRL ({label}): {r['summary']['step_s']:.3f} s/step, {r['summary']['tokens_per_s']:.0f} "
                  f"tokens/s ({r['params'] / 1e6:.2f}M params, {r['torch_threads']} torch threads, "
                  f"wall {r['wall_s']:.0f} s)", flush=True)

    calls = ["actor.generate", "reward.inference", "ref.inference", "critic.inference", "actor.train",
             "critic.train", "realloc", "transfer"]
    for s in strategies:
        print(f"jaxrlhf {s} ...", flush=True)
        try:
            r = run_jaxrlhf(args.config, s, args.overrides, n_steps, args.warmup, workdir)
        except Exception as e:  # noqa: BLE001 -- one failing strategy must not lose the others
            print(f"  {s} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            results["jaxrlhf"][s] = {"error": f"{type(e).__name__}: {e}"}
            continue
        r["summary"] = summarize(r["steps"], args.warmup, calls)
        results["jaxrlhf"][s] = r
        print(f"  {s}: {r['summary']['step_s']:.3f} s/step, {r['summary']['tokens_per_s']:.0f} tokens/s "
              f"(first step incl. compile {r['first_step_s']:.1f} s, wall {r['wall_s']:.0f} s)", flush=True)
    host["loadavg_end"] = os.getloadavg()

    # Table.
    trl_ok = {k: r["summary"] for k, r in (results["trl"] or {}).items() if "summary" in r}
    trl_best = max(trl_ok, key=lambda k: trl_ok[k]["tokens_per_s"]) if trl_ok else None
    trl_sum = trl_ok.get(trl_best)
    trl_tps = trl_sum["tokens_per_s"] if trl_sum else None
    results["trl_reference"] = trl_best
    print()
    print(f"{'system / strategy':<24} {'step s':>8} {'min-max s':>13} {'tok/step':>9} {'tokens/s':>9} {'x TRL':>7}")
    print("-" * 75)

    def line(name, sm):
        ratio = f"{sm['tokens_per_s'] / trl_tps:.2f}" if trl_tps else "n/a"
        print(f"{name:<24} {sm['step_s']:>8.3f} {sm['step_s_min']:>6.3f}-{sm['step_s_max']:<6.3f} "
              f"{sm['tokens_per_step']:>9.0f} {sm['tokens_per_s']:>9.0f} {ratio:>7}")
        return sm["tokens_per_s"] / trl_tps if trl_tps else None

    for k, sm in trl_ok.items():
        line(f"TRL PPO ({k})" + (" *" if k == trl_best and len(trl_ok) > 1 else ""), sm)
    ratios = {}
    for s, r in results["jaxrlhf"].items():
        if "summary" in r:
            ratios[s] = line(f"jaxrlhf {s}" + (" (default)" if s == cfg.plan.strategy else ""), r["summary"])
            r["x_trl_best"] = ratios[s]
        else:
            print(f"{'jaxrlhf ' + s:<24} failed: {r['error'][:45]}")
    print()
    print("median per-call seconds (jaxrlhf; dispatch to ready, calls may overlap):")
    used = [c for c in calls if any(c in r.get("summary", {}).get("calls_s", {}) for r in results["jaxrlhf"].values())]
    print(f"{'strategy':<15}" + "".join(f"{c:>17}" for c in used))
    for s, r in results["jaxrlhf"].items():
        if "summary" in r:
            cs = r["summary"]["calls_s"]
            print(f"{s:<15}" + "".join(f"{cs.get(c, float('nan')):>17.4f}" for c in used))
    for k, sm in trl_ok.items():
        print(f"TRL ({k}): generate {sm['calls_s'].get('generate_s', float('nan')):.4f} s/step; the rest of its "
              "step is the ref/value/reward forwards and the PPO epochs")
    jax_ok = {s: r["summary"] for s, r in results["jaxrlhf"].items() if "summary" in r}
    fastest = max(jax_ok, key=lambda s: jax_ok[s]["tokens_per_s"]) if jax_ok else None
    results.update(comparison(jax_ok.get(fastest), trl_sum), jaxrlhf_reference=fastest)
    if trl_tps and ratios and any(v is not None for v in ratios.values()):
        best = max((v, k) for k, v in ratios.items() if v is not None)
        results["ratio_vs_trl"] = {k: v for k, v in ratios.items()}
        results["best"] = {"strategy": best[1], "ratio": best[0]}
        print(f"\nbest: jaxrlhf {best[1]} = {best[0]:.2f}x the faster TRL ({trl_best}) tokens/s; "
              f"load average start {host['loadavg_start'][0]:.2f}, end {host['loadavg_end'][0]:.2f} "
              f"on {host['cpus']} CPUs")
    return finish(results, args.out, workdir if own_workdir else None)


if __name__ == "__main__":
    sys.exit(main())
