"""`python -m jaxrlhf.plan`: search an execution plan for a config and explain it.

    python -m jaxrlhf.plan --config configs/x.yaml [--hardware h100] [--devices 64]
    python -m jaxrlhf.plan --model-preset llama2-7b --devices 8 --gen-len 384 --json

Prints the chosen plan, each call's time and per-device memory, and every
strategy preset's step estimate next to the searched one; writes `plan.yaml`
(loadable with `ExecutionPlan.load`, usable as `plan.file=` in training) and
`timeline.png` (calls per device group over two steps) into `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Mapping, Sequence

import yaml

from jaxrlhf.mesh.cost import Workload
from jaxrlhf.mesh.graph import CallGraph
from jaxrlhf.mesh.hardware import get_profile
from jaxrlhf.mesh.search import SearchResult, search
from jaxrlhf.mesh.simulator import Timeline
from jaxrlhf.models.config import ModelConfig, preset
from jaxrlhf.ppo.graph import PPO_GRAPH

GiB = 2**30


@dataclasses.dataclass
class PlanSettings:
    """What the planner needs from a training config; CLI flags override it."""

    models: dict[str, str]  # role -> model preset name
    hardware: str = "h100"
    devices: int = 8
    batch_size: int = 512
    prompt_len: int = 128
    gen_len: int = 128
    minibatches: int = 4
    ppo_epochs: int = 1


def _get(d: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = d
    for k in dotted.split("."):
        if not isinstance(cur, Mapping) or k not in cur:
            return None
        cur = cur[k]
    return cur


# Training-config key -> PlanSettings field. The one place that knows the config layout.
CONFIG_KEYS = {
    "plan.hardware": "hardware",
    "plan.devices": "devices",
    "data.batch_size": "batch_size",
    "data.max_prompt_len": "prompt_len",
    "generation.max_new_tokens": "gen_len",
    "algorithm.minibatches": "minibatches",
    "algorithm.epochs": "ppo_epochs",
}


def settings_from_config(cfg: Mapping[str, Any]) -> PlanSettings:
    """Read model presets per role (`model.<role>.preset`, or `init_from` another role) and sizes."""
    models: dict[str, str] = {}
    model_cfg = cfg.get("model") or {}
    for role in ("actor", "critic", "ref", "reward"):
        spec = model_cfg.get(role)
        if isinstance(spec, Mapping) and spec.get("preset"):
            models[role] = str(spec["preset"])
    for role in ("critic", "ref", "reward"):
        spec = model_cfg.get(role)
        if role not in models and isinstance(spec, Mapping) and spec.get("init_from") in models:
            models[role] = models[spec["init_from"]]
    if "actor" not in models:
        raise ValueError("config has no model.actor.preset; give one or use --model-preset")
    values = {field: _get(cfg, key) for key, field in CONFIG_KEYS.items()}
    if values["devices"] is None:
        values["devices"] = _get(cfg, "run.devices")
    return PlanSettings(models=models, **{k: v for k, v in values.items() if v is not None})


def graph_for(roles: Sequence[str], graph: CallGraph = PPO_GRAPH) -> CallGraph:
    """The graph without calls of roles that have no model (e.g. a rule-based reward)."""
    keep = [c for c in graph.calls if c.role in roles]
    names = {c.name for c in keep}
    return CallGraph(tuple(dataclasses.replace(c, deps=tuple(d for d in c.deps if d in names)) for c in keep))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxrlhf.plan", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="training config YAML (model presets, plan.hardware, data, generation)")
    p.add_argument("--hardware", help="hardware profile name or profile file (default: config, else h100)")
    p.add_argument("--devices", type=int, help="number of devices")
    p.add_argument("--model-preset", help="one model preset for every role (no config file needed)")
    p.add_argument("--gen-len", type=int, help="generated tokens per sequence")
    p.add_argument("--prompt-len", type=int, help="prompt tokens per sequence")
    p.add_argument("--batch", type=int, help="sequences per PPO step")
    p.add_argument("--minibatches", type=int, help="optimizer steps per train call")
    p.add_argument("--iterations", type=int, default=4000, help="annealing iterations (split over seeds)")
    p.add_argument("--time-budget", type=float, default=60.0, help="seconds the search may take at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=".", help="directory for plan.yaml and timeline.png")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p.parse_args(argv)


def resolve_settings(args: argparse.Namespace) -> PlanSettings:
    if args.config:
        try:
            with open(args.config) as f:
                cfg = yaml.safe_load(f) or {}
        except OSError as e:
            raise ValueError(f"cannot read config {args.config}: {e.strerror}") from None
        s = settings_from_config(cfg)
    elif args.model_preset:
        s = PlanSettings(models={})
    else:
        raise ValueError("give --config FILE or --model-preset NAME")
    if args.model_preset:  # every role the config uses (all four without a config) gets this size
        s.models = {r: args.model_preset for r in (s.models or ("actor", "critic", "ref", "reward"))}
    for flag, field in (("hardware", "hardware"), ("devices", "devices"), ("gen_len", "gen_len"),
                        ("prompt_len", "prompt_len"), ("batch", "batch_size"), ("minibatches", "minibatches")):
        if getattr(args, flag) is not None:
            setattr(s, field, getattr(args, flag))
    return s


# ---- output ----------------------------------------------------------------------------------

def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g} s"


def report_text(res: SearchResult, settings: PlanSettings) -> str:
    best = res.best
    lines = [best.plan.table(), "", "per call:"]
    rows = [("call", "time", "move", "memory/device")]
    for name, c in best.calls.items():
        rows.append((name, _fmt_s(c.seconds + best.reloads.get(name, 0.0)), _fmt_s(best.moves.get(name) or None),
                     f"{best.memory.call_bytes[name] / GiB:.1f} GiB"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    if best.memory.offloaded:
        lines.append(f"  offloaded to host between calls: {', '.join(best.memory.offloaded)}")
    lines += ["", f"step estimate ({settings.devices} x {settings.hardware}):"]
    for name, p in res.presets.items():
        if isinstance(p, str):
            lines.append(f"  {name:14s} n/a   ({p})")
        elif p.feasible:
            lines.append(f"  {name:14s} {p.step_s:.3g} s  ({p.step_s / best.step_s:.2f}x searched)")
        else:
            lines.append(f"  {name:14s} infeasible ({p.reason})")
    lines.append(f"  {'searched':14s} {best.step_s:.3g} s")
    lines.append(f"search: {res.seconds:.1f} s, {res.evaluations} plans evaluated"
                 + (" (time budget hit)" if res.budget_hit else ""))
    return "\n".join(lines)


def report_json(res: SearchResult) -> dict[str, Any]:
    presets: dict[str, Any] = {}
    for name, p in res.presets.items():
        if isinstance(p, str):
            presets[name] = {"step_s": None, "reason": p}
        elif p.feasible:
            presets[name] = {"step_s": p.step_s}
        else:
            presets[name] = {"step_s": None, "reason": p.reason}
    return {
        "searched": {"step_s": res.best.step_s, "plan": res.best.plan.to_dict()},
        "presets": presets,
        "search_s": res.seconds,
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        s = resolve_settings(args)
        hw = get_profile(s.hardware)
        models: dict[str, ModelConfig] = {r: preset(name) for r, name in s.models.items()}
        wl = Workload(batch_size=s.batch_size, prompt_len=s.prompt_len, gen_len=s.gen_len,
                      minibatches=s.minibatches, ppo_epochs=s.ppo_epochs)
        res = search(models, wl, hw, s.devices, graph_for(list(models)), seed=args.seed,
                     iterations=args.iterations, time_budget_s=args.time_budget)
    except (KeyError, ValueError) as e:  # PlanError is a ValueError
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    res.best.plan.save(os.path.join(args.out, "plan.yaml"))
    draw_timeline(res.best.timeline, os.path.join(args.out, "timeline.png"),
                  title=f"searched plan: {res.best.step_s:.3g} s/step on {s.devices} x {hw.name}")
    if args.json:
        print(json.dumps(report_json(res)))
    else:
        print(report_text(res, s))
        print(f"wrote {os.path.join(args.out, 'plan.yaml')} and {os.path.join(args.out, 'timeline.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
