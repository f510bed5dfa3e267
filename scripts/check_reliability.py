"""Bad inputs and faults against the train, plan and generate commands, as a hostile new user would try them.

Each case runs the real command in a subprocess (in a scratch folder) and
records its exit code, whether a traceback was printed, the last line of its
error output, and whether the outcome is the expected one. Prints the
markdown table of docs/reliability.md and a JSON summary.

    python scripts/check_reliability.py [--only NAME,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.actor.preset=tiny", "run.tensorboard=false", "run.export_hf=false", "data.batch_size=8",
        "data.max_prompt_len=16", "generation.max_new_tokens=4", "sft.steps=0", "run.devices=8"]
TRAIN = [sys.executable, "-m", "jaxrlhf.train", "--config", "configs/quickstart.yaml"]
PLAN = [sys.executable, "-m", "jaxrlhf.plan"]
GENERATE = [sys.executable, "-m", "jaxrlhf.generate"]


@dataclasses.dataclass
class Case:
    name: str
    what: str
    command: Callable[[str], list[str]]  # scratch folder -> argv
    expect: str  # text the error output (or output) must contain
    code: int = 2
    setup: Callable[[str], None] | None = None
    signal_after_steps: int | None = None  # send SIGINT once metrics.jsonl has this many records


def _run_tiny(folder: str, *extra: str) -> None:
    subprocess.run([*TRAIN, *TINY, f"run.output_dir={folder}/run", *extra], cwd=ROOT, check=True,
                   capture_output=True, timeout=900)


def _write(path: str, text: str | bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)


def _tiny_hf(folder: str, edit=None) -> None:
    sys.path.insert(0, ROOT)
    from jaxrlhf.testing.models import save_tiny_hf_checkpoint

    path = save_tiny_hf_checkpoint(folder, "llama", seed=0)
    if edit is not None:
        cfg_file = os.path.join(path, "config.json")
        with open(cfg_file) as f:
            cfg = json.load(f)
        cfg = edit(cfg)
        with open(cfg_file, "w") as f:
            json.dump(cfg, f)
    os.replace(path, os.path.join(folder, "model"))


def _set(**kw):
    def edit(cfg):
        cfg.update(kw)
        return cfg

    return edit


def _damage_newest(folder: str) -> None:
    _run_tiny(folder, "run.steps=4", "run.checkpoint_every=2")
    shutil.rmtree(os.path.join(folder, "run", "checkpoints", "4", "arrays", "d"))
    with open(os.path.join(folder, "run", "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "rew')


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))

CASES = [
    Case("rerun_into_run_folder", "same command again into a folder holding a run (no run.resume)",
         lambda d: [*TRAIN, *TINY, f"run.output_dir={d}/run", "run.steps=1"], "holds another run",
         setup=lambda d: _run_tiny(d, "run.steps=1")),
    Case("output_dir_is_file", "run.output_dir names a file",
         lambda d: [*TRAIN, *TINY, f"run.output_dir={d}/file"], "is a file, not a folder",
         setup=lambda d: _write(f"{d}/file", "keep me")),
    Case("sigint", "Ctrl-C during training",
         lambda d: [*TRAIN, *TINY, f"run.output_dir={d}/run", "run.steps=200", "run.checkpoint_every=0"],
         "checkpoint saved", code=130, signal_after_steps=2),
    Case("damaged_checkpoint", "newest checkpoint's array files deleted, half-written metrics line; resume",
         lambda d: [*TRAIN, *TINY, f"run.output_dir={d}/run", "run.steps=4", "run.checkpoint_every=2",
                    "run.resume=true"], "using step 2", code=0, setup=_damage_newest),
    Case("resume_other_model", "resume after changing the model size",
         lambda d: [*TRAIN, *TINY, f"run.output_dir={d}/run", "run.steps=3", "run.resume=true",
                    "model.actor.overrides={hidden_size: 32}"], "but this config builds",
         setup=lambda d: _run_tiny(d, "run.steps=1")),
    Case("absurd_lr", "optimizer.actor.lr=1e30: every update non-finite",
         lambda d: [*TRAIN, *TINY, f"run.output_dir={d}/run", "run.steps=20", "optimizer.actor.lr=1e30",
                    "optimizer.critic.lr=1e30", "run.export_hf=true"], "every update of the last 5 steps"),
    Case("platform_gpu", "run.platform=gpu on a machine without one (the shipped Llama config)",
         lambda d: [sys.executable, "-m", "jaxrlhf.train", "--config", "configs/llama3-8b-gsm8k-8xh100.yaml",
                    f"run.output_dir={d}/run"], "no GPU backend"),
    Case("tpu_config_one_host", "the shipped Qwen2 TPU config on one host",
         lambda d: [sys.executable, "-m", "jaxrlhf.train", "--config", "configs/qwen2-1.5b-tpu-v5e-16.yaml",
                    f"run.output_dir={d}/run"], "no cluster was detected"),
    Case("hardware_typo", "plan.hardware typo with plan.strategy=auto",
         lambda d: [*TRAIN, *TINY, f"run.output_dir={d}/run", "plan.strategy=auto", "plan.hardware=h101"],
         "unknown hardware 'h101'"),
    Case("key_typo", "misspelt config key",
         lambda d: [*TRAIN, f"run.output_dir={d}/run", "algorithm.kl_cof=0.1"], "did you mean 'algorithm.kl_coef'"),
    Case("wrong_type", "a string for an integer key",
         lambda d: [*TRAIN, f"run.output_dir={d}/run", "run.steps=ten"], "run.steps"),
    Case("data_source_typo", "data.source typo",
         lambda d: [*TRAIN, *TINY, f"run.output_dir={d}/run", "data.source=arithmetc"], "did you mean"),
    Case("missing_data_file", "data.source names a missing file",
         lambda d: [*TRAIN, f"run.output_dir={d}/run", f"data.source={d}/none.jsonl"], "none.jsonl"),
    Case("yaml_bomb", "1 KB YAML of nested anchors (billion laughs)",
         lambda d: [sys.executable, "-m", "jaxrlhf.train", "--config", f"{d}/bomb.yaml"], "alias",
         setup=lambda d: _write(f"{d}/bomb.yaml", BOMB)),
    Case("duplicate_yaml_key", "a YAML config with a key given twice",
         lambda d: [sys.executable, "-m", "jaxrlhf.train", "--config", f"{d}/dup.yaml"], "duplicate",
         setup=lambda d: _write(f"{d}/dup.yaml", "run:\n  steps: 3\n  steps: 5\n")),
    Case("config_not_utf8", "a config file that is not UTF-8",
         lambda d: [sys.executable, "-m", "jaxrlhf.train", "--config", f"{d}/bin.yaml"], "bin.yaml",
         setup=lambda d: _write(f"{d}/bin.yaml", b"run:\n  steps: \xff\xfe\n")),
    Case("model_dir_missing", "model.actor.path names a missing folder",
         lambda d: [*TRAIN, f"run.output_dir={d}/run", f"model.actor.path={d}/nope"], "nope"),
    Case("header_example_path", "the config header's example: model.actor.path=DIR without preset=null",
         lambda d: [*TRAIN, *TINY, f"run.output_dir={d}/run", f"model.actor.path={d}/model", "run.steps=1",
                    "model.actor.preset=null"], "", code=0, setup=_tiny_hf),
    Case("hf_config_string_vocab", "config.json with a string vocab_size",
         lambda d: [*GENERATE, "--model", f"{d}/model", "--prompt", "hi"], "vocab_size",
         setup=lambda d: _tiny_hf(d, _set(vocab_size="abc"))),
    Case("hf_config_zero_heads", "config.json with zero attention heads",
         lambda d: [*GENERATE, "--model", f"{d}/model", "--prompt", "hi"], "num_attention_heads",
         setup=lambda d: _tiny_hf(d, _set(num_attention_heads=0))),
    Case("hf_config_kv_heads", "config.json whose KV heads do not divide the heads",
         lambda d: [*GENERATE, "--model", f"{d}/model", "--prompt", "hi"], "num_key_value_heads",
         setup=lambda d: _tiny_hf(d, _set(num_key_value_heads=3))),
    Case("hf_config_list", "config.json holding a JSON list",
         lambda d: [*GENERATE, "--model", f"{d}/model", "--prompt", "hi"], "config.json",
         setup=lambda d: _tiny_hf(d, lambda c: [c])),
    Case("plan_devices_0", "python -m jaxrlhf.plan --devices 0",
         lambda d: [*PLAN, "--devices", "0", "--model-preset", "tiny", "--out", d], "must be at least 1"),
    Case("plan_hardware_typo", "python -m jaxrlhf.plan --hardware h101",
         lambda d: [*PLAN, "--hardware", "h101", "--model-preset", "tiny", "--out", d], "unknown hardware"),
    Case("generate_missing_model", "python -m jaxrlhf.generate --model MISSING",
         lambda d: [*GENERATE, "--model", f"{d}/nope", "--prompt", "hi"], "not found"),
    Case("generate_past_positions", "generation longer than max_position_embeddings",
         lambda d: [*GENERATE, "--model", f"{d}/model", "--prompt", "hi", "--max-new-tokens", "100000"],
         "max_position_embeddings", setup=_tiny_hf),
]


def run_case(case: Case, scratch: str) -> dict:
    folder = os.path.join(scratch, case.name)
    os.makedirs(folder)
    if case.setup is not None:
        case.setup(folder)
    argv = case.command(folder)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if case.signal_after_steps is not None:
        log = os.path.join(folder, "run", "metrics.jsonl")
        while proc.poll() is None:
            if os.path.exists(log) and sum(1 for line in open(log) if line.strip()) >= case.signal_after_steps:
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.1)
    try:
        out, err = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [line for line in err.strip().splitlines() if line.strip() and "(run with --debug" not in line]
    last = lines[-1] if lines else (out.strip().splitlines() or [""])[-1]
    ok = proc.returncode == case.code and "Traceback" not in err and case.expect in (err + out)
    return {"name": case.name, "what": case.what, "command": " ".join(argv[1:]).replace(folder, "$D"),
            "exit": proc.returncode, "traceback": "Traceback" in err, "message": last.replace(folder, "$D")[:300],
            "seconds": round(time.perf_counter() - t0, 1), "ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--json")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    scratch = tempfile.mkdtemp(prefix="jaxrlhf-reliability-")
    rows = []
    for case in cases:
        row = run_case(case, scratch)
        rows.append(row)
        print(f"{'ok ' if row['ok'] else 'BAD'} {row['name']}: exit {row['exit']}, {row['message'][:150]}", flush=True)
    print("\n| case | what | exit | outcome |")
    print("|---|---|---|---|")
    for r in rows:
        outcome = ("clear error" if r["exit"] == 2 else "correct behaviour") if r["ok"] else "FAILED EXPECTATION"
        msg = r["message"].replace("|", "\\|")
        print(f"| `{r['name']}` | {r['what']} | {r['exit']} | {outcome}: {msg} |")
    summary = {"cases": len(rows), "ok": sum(r["ok"] for r in rows), "tracebacks": sum(r["traceback"] for r in rows)}
    print(json.dumps({"rows": rows, "summary": summary}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=2)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
