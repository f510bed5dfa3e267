"""`python -m jaxrlhf.plan`: search an execution plan for a training config and explain it.

    python -m jaxrlhf.plan --config configs/x.yaml [--hardware h100] [--devices 64] [key=value ...]
    python -m jaxrlhf.plan --model-preset llama2-7b --algorithm grpo --devices 8 --gen-len 384 --json
    python -m jaxrlhf.plan --model-preset llama2-70b --devices 128 --inter-node-gbps 1600   # 8 x 200 Gb/s nodes

The config is resolved exactly as `python -m jaxrlhf.train` resolves it (the
same file, defaults and `key=value` overrides; `--model-preset` is applied
before the config is validated), and the plan is chosen by the same code
(`jaxrlhf.run.planning`) with the same defaults, as if `plan.strategy=auto`: the
planner plans the graph of the algorithm it names (`algorithm.name`: PPO,
GRPO, DPO, ... each has its own calls) with the workload that algorithm reads
from the config, on every process's devices (`run.devices` per process times
`distributed.num_processes` for a multi-process run). Prints the chosen plan,
each call's time and per-device memory, and every strategy preset's step
estimate next to the searched one; writes `plan.yaml` (usable as `plan.file=`
in training) and `timeline.png` (calls per device group over two steps) into
a folder it names after the question and prints (`--out` to choose it; an
earlier plan there is kept unless `--overwrite`). Only model dimensions are read, so a 70B plan for
128 GPUs is searched on a laptop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Sequence

from jaxrlhf import config as cfglib
from jaxrlhf.errors import run_cli
from jaxrlhf.planner.budget import budget_line
from jaxrlhf.planner.hardware import GB
from jaxrlhf.planner.plan import seconds_text
from jaxrlhf.planner.search import DEFAULT_EVALUATIONS, DEFAULT_ITERATIONS, SearchResult
from jaxrlhf.planner.simulator import Timeline
from jaxrlhf.run import planning

GiB = 2**30

# CLI flag -> training-config key it sets (the one place that maps flags onto the config).
FLAG_KEYS = {
    "hardware": "plan.hardware",
    "algorithm": "algorithm.name",
    "batch": "data.batch_size",
    "prompt_len": "data.max_prompt_len",
    "gen_len": "generation.max_new_tokens",
    "minibatches": "algorithm.minibatches",
    "seed": "run.seed",
}
PLAN_FILES = ("plan.yaml", "timeline.png")
REPORTS = ("report.txt", "report.json")  # the answer as printed, kept beside the plan for the same question asked again


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxrlhf.plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="training config YAML (defaults apply to anything it leaves out)")
    p.add_argument("--hardware", help="hardware profile name or profile file (default: plan.hardware, else h100)")
    p.add_argument("--devices", type=_positive_int, help="number of devices (default: run.devices, else 8)")
    p.add_argument("--model-preset", help="one model preset for every role with its own weights")
    p.add_argument("--algorithm", help="algorithm.name: ppo, grpo, rloo, reinforce_pp, remax, sft, rm, dpo")
    p.add_argument("--gen-len", type=_positive_int, help="generated tokens per sequence (generation.max_new_tokens)")
    p.add_argument("--prompt-len", type=_positive_int, help="prompt tokens per sequence (data.max_prompt_len)")
    p.add_argument("--batch", type=_positive_int, help="prompts (or pairs) per step (data.batch_size)")
    p.add_argument("--minibatches", type=_positive_int, help="optimizer steps per train call (algorithm.minibatches)")
    p.add_argument("--inter-node-gbps", metavar="GBPS",
                   help="all NICs of one node together, Gb/s one direction (e.g. 3200 for 8 x 400 Gb/s); "
                        "overrides the hardware profile's inter-node bandwidth")
    p.add_argument("--iterations", type=_positive_int, default=DEFAULT_ITERATIONS,
                   help="annealing iterations (shared by the successive-halving rounds over the seeds)")
    p.add_argument("--evaluations", type=_positive_int, default=DEFAULT_EVALUATIONS,
                   help="plans the search evaluates at most: its budget, the same on any machine (as `train`'s)")
    p.add_argument("--time-budget", type=float, default=planning.SEARCH_TIME_BUDGET_S,
                   help="wall-clock safety net in seconds (as `train`'s): hit, the answer depends on the machine")
    p.add_argument("--seed", type=int, help="search seed (run.seed, as in training)")
    p.add_argument("--out", help="folder for plan.yaml and timeline.png (default: plans/<algorithm>-<model>-"
                                 "<devices>x<hardware>-<hash of the rest of the question>)")
    p.add_argument("--overwrite", action="store_true", help="replace plan.yaml and timeline.png already in --out")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. algorithm.group_size=8")
    return p.parse_args(argv)


def resolve_config(args: argparse.Namespace, searching: bool = False) -> cfglib.Config:
    """The training config these flags describe: the file, then the flags, then `--model-preset` for
    every role with its own weights (init_from roles follow their source), then `key=value`s;
    validated once, at the end. `searching` (this command's own question): checked as `plan.strategy=auto`,
    whatever strategy the training config runs with, since the command is the search (an off-policy budget,
    say, needs it); the file's own plan (`plan.file`) is not read."""
    data = cfglib.read_yaml(args.config) if args.config else {}
    flags = [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None]
    data = cfglib.apply_overrides(data, flags + list(args.overrides))
    if args.model_preset:
        from jaxrlhf.models.config import PRESETS

        if args.model_preset not in PRESETS:
            raise cfglib.ConfigError(f"--model-preset: {PRESETS.unknown(args.model_preset)}")
        models = cfglib.with_defaults(data)["model"]
        presets = []
        for role in cfglib.ROLES:
            if models[role].get("init_from") is None:  # its own weights: the preset replaces any path
                presets += [f"model.{role}.preset={args.model_preset}", f"model.{role}.path=null"]
        data = cfglib.apply_overrides(data, presets + list(args.overrides))
    if searching:
        data = cfglib.apply_overrides(data, ["plan.strategy=auto", "plan.file=null"])
    return cfglib.from_dict(data)


def out_folder(args: argparse.Namespace, cfg: cfglib.Config, devices: int, hardware: str) -> tuple[str, dict | None]:
    """Where the plan files go: `--out`, else a folder named after the question: algorithm, model, devices
    and hardware to read, and a hash of everything else the plan depends on (`question_hash`), so another
    workload gets another folder and the same question the same one. An earlier answer to the same question
    there is returned ({"text": ..., "json": ...}: printed again, nothing searched or written); an earlier
    plan of another question is kept (a ConfigError, nothing written) unless `--overwrite`."""
    if args.out:
        out = args.out
    else:
        actor = cfg.model.actor
        model = args.model_preset or actor.preset or os.path.basename(os.path.normpath(actor.path or "model"))
        out = os.path.join("plans", f"{cfg.algorithm.name}-{model}-{devices}x{os.path.basename(hardware)}-"
                                    f"{question_hash(args, cfg, devices, hardware)}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise cfglib.ConfigError(f"--out {out!r} is a file, not a folder; choose another --out")
    earlier = [f for f in PLAN_FILES if os.path.exists(os.path.join(out, f))]
    if earlier and not args.overwrite:
        stored = stored_answer(out, question_hash(args, cfg, devices, hardware))
        if stored is not None:
            return out, stored
        if not args.out:
            raise cfglib.ConfigError(f"{out} already holds {', '.join(earlier)} from an earlier plan of this same "
                                     "question (config, devices, hardware and search settings); nothing was "
                                     "changed. Read them there, or search again and replace them with --overwrite")
        raise cfglib.ConfigError(f"{out} already holds {', '.join(earlier)} from an earlier plan; nothing was "
                                 "changed. Choose another --out, or replace them with --overwrite")
    return out, None


def stored_answer(out: str, question: str) -> dict | None:
    """The answer kept in `out` (`REPORTS`) when it answers `question` (its `question_hash`), else None."""
    try:
        with open(os.path.join(out, "report.json")) as f:
            answer = json.load(f)
        with open(os.path.join(out, "report.txt")) as f:
            text = f.read()
    except (OSError, ValueError):
        return None
    return {"text": text, "json": answer} if answer.get("question") == question else None


# Keys of the run section that say where a run writes and what it logs: no plan depends on them.
_UNPLANNED_RUN_KEYS = ("output_dir", "steps", "resume", "overwrite", "checkpoint_every", "keep_checkpoints",
                       "save_checkpoints", "log_every", "eval_every", "profile_steps", "compile_cache",
                       "tensorboard", "wandb", "export_hf")


def question_hash(args: argparse.Namespace, cfg: cfglib.Config, devices: int, hardware: str) -> str:
    """8 hex digits that name what a plan answers: the resolved config (less the run keys no plan reads),
    the devices, the hardware and the search settings, with the contents of the hardware and profile
    files named. The same on every machine and Python process (a SHA-256 of sorted JSON)."""
    import hashlib

    config = cfglib.to_dict(cfg)
    config["run"] = {k: v for k, v in config["run"].items() if k not in _UNPLANNED_RUN_KEYS}
    files = {}
    for path in (cfg.plan.hardware, cfg.plan.profile, hardware):
        if path and os.path.isfile(os.path.expanduser(path)):
            with open(os.path.expanduser(path), "rb") as f:
                files[path] = hashlib.sha256(f.read()).hexdigest()
    question = {"config": config, "devices": devices, "hardware": hardware, "files": files,
                "inter_node_gbps": args.inter_node_gbps, "iterations": args.iterations,
                "evaluations": args.evaluations}
    return hashlib.sha256(json.dumps(question, sort_keys=True, default=str).encode()).hexdigest()[:8]


# ---- output ----------------------------------------------------------------------------------

def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{seconds_text(x)} s"


def report_text(res: SearchResult, devices: int, hardware: str, unstreamed: SearchResult | None = None,
                run_setup: Any = None) -> str:
    best = res.best
    lines = [best.plan.table(), "", "per call:"]
    rows = [("call", "time", "from", "move", "memory/device")]
    for name, c in best.calls.items():
        rows.append((name, _fmt_s(c.seconds + best.reloads.get(name, 0.0)), c.source,
                     _fmt_s(best.moves.get(name) or None)
                     + (f" ({best.move_sources.get(name, 'formula')})" if best.moves.get(name) else ""),
                     f"{best.memory.call_bytes[name] / GiB:.1f} GiB"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    if best.memory.offloaded:
        lines.append(f"  offloaded to host between calls: {', '.join(best.memory.offloaded)}")
    if best.memory.offloaded_optimizers:
        lines.append("  optimizer state in host memory between train calls (its copies in the train call's time): "
                     + ", ".join(best.memory.offloaded_optimizers))
    if run_setup is not None:
        lines += context_lines(res, run_setup)
        lines += expert_lines(res, run_setup)
    lines += ["", f"step estimate ({devices} x {hardware}):"]
    for name, p in res.presets.items():
        if isinstance(p, str):
            lines.append(f"  {name:14s} n/a   ({p})")
        elif p.feasible:
            lines.append(f"  {name:14s} {seconds_text(p.step_s)} s  ({p.step_s / best.step_s:.2f}x searched)")
        else:
            lines.append(f"  {name:14s} infeasible ({p.reason})")
    lines.append(f"  {'searched':14s} {seconds_text(best.step_s)} s")
    lines.append(async_line(res) if unstreamed is None else streamed_line(res, unstreamed))
    if budget_line(res):
        lines.append(budget_line(res))
    lines.append(f"search: {res.seconds:.1f} s, {res.evaluations} plans evaluated"
                 + (" (the wall-clock safety net stopped it: this answer depends on the machine)" if res.budget_hit
                    else ""))
    return "\n".join(lines)


def chosen_workload(res: SearchResult, wl: Any, call: Any) -> Any:
    """`wl` as `call` runs it in the searched plan: under the memory knobs the search chose for it."""
    knobs = res.best.knobs.get(call.name)
    return wl.for_call(call, knobs.micro, knobs.remat, knobs.slots, knobs.packing) if knobs else wl


def context_lines(res: SearchResult, run_setup: Any) -> list[str]:
    """Why each call the plan splits over a context axis does so: the memory of the same call with the
    context devices on the data axis instead (one device holding whole sequences), against the usable
    memory (`planner.memory.working_set` plus the role's parameter shard), and where that fits, both
    layouts' estimated times."""
    from jaxrlhf.planner.memory import params_per_device, working_set
    from jaxrlhf.planner.plan import Layout

    plan, wl, hw = res.best.plan, run_setup.algorithm.workload(), run_setup.hardware
    if plan.token_budget and wl.token_budget is None:  # the packed micro-batches the search chose
        wl = dataclasses.replace(wl, token_budget=plan.token_budget)
    lines = []
    for name, placement in plan.calls.items():
        lay = placement.layout
        if lay.context == 1:
            continue
        call = run_setup.graph[name]
        cfg = run_setup.models[call.role]
        whole = Layout(lay.data * lay.context, lay.fsdp, lay.tensor, lay.stage)
        # the whole-sequence layout packs its own batch: more shards than a packing shared with other calls has
        own = chosen_workload(res, wl, call)
        wl_of = {lay: own, whole: dataclasses.replace(own, packing=None)}
        need = {layout: sum(working_set(call, cfg, layout, wl_of[layout]).values())
                + params_per_device(cfg, call.head, layout) for layout in (lay, whole)}
        if need[whole] > hw.usable_memory:
            verdict = "does not fit"
        else:
            from jaxrlhf.planner.cost import call_cost

            group = plan.groups[placement.group]
            t = {layout: call_cost(call, cfg, group, layout, wl_of[layout], hw).seconds for layout in (lay, whole)}
            verdict = f"fits; estimated {seconds_text(t[whole])} s there against {seconds_text(t[lay])} s with the context axis"
        lines.append(f"  {name}: its {wl.seq_len}-token sequences over {lay.context} devices (context "
                     f"{lay.context}) need {need[lay] / GiB:.1f} GiB per device; whole on one device "
                     f"({whole}) they need {need[whole] / GiB:.1f} GiB of {hw.usable_memory / GiB:.1f} usable: "
                     f"{verdict}")
    return ["", "context parallelism:", *lines] if lines else []


def expert_lines(res: SearchResult, run_setup: Any) -> list[str]:
    """Why each call the plan splits over an expert axis does so: its estimated time, the share of it the
    expert axis' token gathers and scatters take, and its memory, against the same call with the expert
    devices on the FSDP axis instead (every device a shard of every expert), where that layout can run."""
    from jaxrlhf.planner.cost import call_cost
    from jaxrlhf.planner.memory import optimizer_per_device, params_per_device, working_set
    from jaxrlhf.planner.plan import Layout, layout_misfit

    plan, wl, hw = res.best.plan, run_setup.algorithm.workload(), run_setup.hardware
    lines = []
    for name, placement in plan.calls.items():
        lay = placement.layout
        if lay.expert == 1:
            continue
        call = run_setup.graph[name]
        cfg = run_setup.models[call.role]
        call_wl = chosen_workload(res, wl, call)
        group = plan.groups[placement.group]
        # generation is never FSDP: there the expert devices go to the data axis
        other = Layout(lay.data * lay.expert, lay.fsdp, lay.tensor, lay.stage, lay.context) if call.kind == "generate" \
            else Layout(lay.data, lay.fsdp * lay.expert, lay.tensor, lay.stage, lay.context)
        # the call alone: its parameters (and optimizer state, training) and working set
        need = {layout: sum(working_set(call, cfg, layout, call_wl).values()) + params_per_device(cfg, call.head, layout)
                + (optimizer_per_device(cfg, call.head, layout, wl, call.role) if call.kind == "train" else 0.0)
                for layout in (lay, other)}
        cost = call_cost(call, cfg, group, lay, call_wl, hw)
        comm = cost.parts.get("expert_comm", 0.0)
        head = (f"  {name}: {cfg.num_experts} experts over {lay.expert} devices ({cfg.num_experts // lay.expert} "
                f"each): {seconds_text(cost.seconds)} s, of which the expert axis' token gathers and scatters {seconds_text(comm)} s, "
                f"{need[lay] / GiB:.1f} GiB per device alone; ")
        if layout_misfit(other, cfg, wl.call_batch(call.kind), kind=call.kind):
            lines.append(head + f"{other} cannot run this call")
        elif need[other] > hw.usable_memory:
            lines.append(head + f"without the expert axis ({other}) it needs {need[other] / GiB:.1f} GiB of "
                         f"{hw.usable_memory / GiB:.1f} usable: does not fit")
        else:
            t = call_cost(call, cfg, group, other, call_wl, hw).seconds
            lines.append(head + f"without the expert axis ({other}) {seconds_text(t)} s and {need[other] / GiB:.1f} GiB")
    return ["", "expert parallelism:", *lines] if lines else []


def async_line(res: SearchResult) -> str:
    """What the generator running ahead of the trainer buys, as the search found it."""
    if not res.offpolicy_searched:
        return ("asynchronous plans (the generator ahead of the trainer) not searched: algorithm.max_staleness=0; "
                "set it to 1 or more to let the planner weigh them")
    if res.best_sync is None:
        return "asynchronous: only plans with the generator ahead of the trainer fit"
    # the search writes the eta it chose on the plan when the budget left it a choice; else it is 1
    ahead = f" (generator ahead, eta = {res.best.plan.staleness or 1})" if res.best.plan.offpolicy else " (on-policy)"
    return (f"asynchronous vs synchronous: best plan {seconds_text(res.best.step_s)} s/step"
            f"{ahead}, best on-policy plan "
            f"{seconds_text(res.best_sync.step_s)} s/step: predicted gain {res.async_gain:.2f}x")


def streamed_line(res: SearchResult, unstreamed: SearchResult) -> str:
    """What partial rollouts buy (`generation.partial_rollout`): the best streamed plan against the best
    plan of the same run without a stream and without a staleness budget."""
    how = "the generator ahead, decoding during training" if res.best.plan.offpolicy else \
        "the stream refilled ahead, decoding between updates"
    return (f"partial rollouts vs synchronous: best streamed plan {seconds_text(res.best.step_s)} s/step ({how}), "
            f"best synchronous plan {seconds_text(unstreamed.best.step_s)} s/step: predicted gain "
            f"{unstreamed.best.step_s / res.best.step_s:.2f}x")


def report_json(res: SearchResult, algorithm: str, unstreamed: SearchResult | None = None) -> dict[str, Any]:
    presets: dict[str, Any] = {}
    for name, p in res.presets.items():
        if isinstance(p, str):
            presets[name] = {"step_s": None, "reason": p}
        elif p.feasible:
            presets[name] = {"step_s": p.step_s}
        else:
            presets[name] = {"step_s": None, "reason": p.reason}
    return {
        "algorithm": algorithm,
        "searched": {"step_s": res.best.step_s, "plan": res.best.plan.to_dict(),
                     "calls": {n: {"seconds": c.seconds, "source": c.source, "move_s": res.best.moves.get(n, 0.0),
                                   "move_source": res.best.move_sources.get(n, "formula")}
                               for n, c in res.best.calls.items()}},
        "presets": presets,
        "sync_step_s": (unstreamed.best.step_s if unstreamed else res.best_sync.step_s if res.best_sync else None),
        "async_gain": unstreamed.best.step_s / res.best.step_s if unstreamed else res.async_gain,
        "search_s": res.seconds,
        "evaluations": res.evaluations,
    }


def draw_timeline(timeline: Timeline, path: str, steps: int = 2, title: str = "") -> None:
    """Gantt chart: one row per device group, a bar per call; moves hatched across both groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [s for s in timeline.spans if s.op.step < steps]
    rows = sorted({r for s in spans for r in s.op.ranges})
    row_of = {r: i for i, r in enumerate(rows)}
    calls = sorted({s.op.call for s in spans})
    colors = {c: plt.cm.tab10(i % 10) for i, c in enumerate(calls)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * len(rows)))
    for s in spans:
        for r in s.op.ranges:
            ax.barh(row_of[r], s.end - s.start, left=s.start, height=0.8, color=colors[s.op.call],
                    hatch="//" if s.op.kind != "call" else None, edgecolor="black", linewidth=0.4,
                    alpha=0.6 if s.op.kind != "call" else 1.0)
            if s.op.kind == "call" and s.end > s.start:
                ax.text((s.start + s.end) / 2, row_of[r], f"{s.op.call.split('.')[0]}.{s.op.call.split('.')[1][:3]}"
                        f"@{s.op.step}", ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)), [f"dev {a}-{b - 1}" for a, b in rows])
    ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[c]) for c in calls]
    ax.legend(handles, calls, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or "timeline (hatched: reallocation / shadow sync)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse turns the ValueError into a usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number (at least 1), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _bandwidth_gbps(text: str) -> float:
    """--inter-node-gbps as a number: finite and > 0 (ValueError with the fix otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--inter-node-gbps: expected a number of Gb/s (e.g. 3200 for 8 x 400 Gb/s), "
                         f"got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"--inter-node-gbps: must be a positive number of Gb/s (e.g. 3200), got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxrlhf.plan`: exit 0, or 2 with one line for a user's mistake (see jaxrlhf.errors)."""
    return run_cli("jaxrlhf.plan", _main, argv)


def _main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    import dataclasses

    from jaxrlhf.planner.search import NoPlanFits
    from jaxrlhf.run.assembly import Machine, setup

    default_devices = None
    try:
        cfg = resolve_config(args, searching=True)
        # the algorithm's roles, graph and workload, declared: the planner needs no runtime and no JAX
        run_setup = setup(cfg, machine=Machine.described(cfg, args.devices), runtime=False)
        if args.devices is None and cfg.run.devices is None:  # the count nobody gave: say so where nothing fits
            default_devices = run_setup.machine.devices
        if args.inter_node_gbps is not None:
            hw = run_setup.hardware.with_inter_host_bandwidth(_bandwidth_gbps(args.inter_node_gbps) * GB / 8)
            run_setup = dataclasses.replace(run_setup, hardware=hw)
        devices, hw, graph = run_setup.machine.devices, run_setup.hardware, run_setup.graph
        out, stored = out_folder(args, cfg, devices, hw.name)
        if stored is not None:  # the same question, answered before: its answer again, nothing searched
            where = f"answered from the earlier plan of this same question in {out} (--overwrite searches again)"
            print(json.dumps(stored["json"] | {"stored": True}) if args.json else stored["text"] + where)
            return 0
        res = run_setup.search(time_budget_s=args.time_budget, iterations=args.iterations,
                               evaluations=args.evaluations)
        unstreamed = None
        if cfg.generation.partial_rollout and cfg.staleness_budget:  # the baseline: no stream, on-policy
            from jaxrlhf import config as cfglib

            sync_cfg = cfglib.with_overrides(cfg, ["generation.partial_rollout=false", "algorithm.max_staleness=0",
                                                   "plan.offpolicy=false"])
            sync_setup = dataclasses.replace(run_setup, cfg=sync_cfg,
                                             algorithm=setup(sync_cfg, machine=run_setup.machine, runtime=False).algorithm)
            unstreamed = sync_setup.search(time_budget_s=args.time_budget, iterations=args.iterations,
                                           evaluations=args.evaluations)
    except ValueError as e:  # ConfigError and PlanError are ValueErrors: one line, no traceback
        default = (f"; this question assumed {default_devices} devices, the default where neither --devices nor "
                   "run.devices gives a count: pass --devices with your cluster's"
                   if isinstance(e, NoPlanFits) and default_devices else "")
        print(f"error: {e}{default}", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    res.best.plan.save(os.path.join(out, "plan.yaml"))
    draw_timeline(res.best.timeline, os.path.join(out, "timeline.png"),
                  title=f"searched plan: {seconds_text(res.best.step_s)} s/step on {devices} x {hw.name}")
    answer = report_json(res, cfg.algorithm.name, unstreamed) | {"out": out}
    text = (f"algorithm: {cfg.algorithm.name}; calls: {', '.join(graph.names)}\n"
            f"{report_text(res, devices, hw.name, unstreamed, run_setup)}\n")
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(answer | {"question": question_hash(args, cfg, devices, hw.name)}, f)
    with open(os.path.join(out, "report.txt"), "w") as f:
        f.write(text)
    if args.json:
        print(json.dumps(answer))
    else:
        print(text + f"wrote {os.path.join(out, 'plan.yaml')} and {os.path.join(out, 'timeline.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
