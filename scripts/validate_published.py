"""The planner's cost model held to peers' published step times: re-price their runs, and search them.

    python scripts/validate_published.py [--cases docs/results/published_cases.yaml] [--out F.json]
        [--plans DIR] [--evaluations N] [--only NAME,...] [--jobs N]

Each case (a YAML list under `cases:`; docs/results/published_cases.yaml ships them with their citations)
is a published RL step time of another system: its models, hardware, devices, algorithm, batch (prompts,
samples per prompt, optimizer steps), prompt and response lengths, its own placement (colocated, or
generation and training split over disjoint GPUs, each side's tensor / pipeline / context / expert /
data sizes; per model where the source gives them) and staleness. For each case this prints

- the peer's placement priced by jaxrlhf's cost model, simulator and memory model (the same code the
  planner searches with; the GPU efficiencies from jaxrlhf's own H200 measurements,
  scripts/calibrate_gpu_profiles.py, never fitted to these cases): predicted / published;
- the planner's pick for the same cluster and workload (`planner.search`, evaluating as many plans as
  `python -m jaxrlhf.plan` does unless `--evaluations` says otherwise; its memory knobs its own: the
  peer's token budget, engine pool and remat are how the peer runs, not the workload) and its predicted
  gain over the peer's placement;

then the median |log(predicted / published)| over the cases, and for cases published in pairs (the same
workload synchronous and asynchronous) the predicted against the published ratio. A pair whose source
publishes no lengths has its mean length fitted on its colocated row: on that row's trainer stages where its
breakdown prints them (the colocated row's step, generation above all, is then checked too, counted apart),
else on its step. With `--plans` each case's peer plan and searched plan are written there as plan files
(`plan.file=` for a run).

How a case's placement maps onto jaxrlhf's layouts:
- an FSDP or ZeRO-3 trainer shards parameters over every device outside its tensor / pipeline / context
  / expert axes (`fsdp_size` limits the sharding group, HSDP; the rest is data parallel); a Megatron
  trainer's remaining devices are data parallel; context parallelism is Megatron's CP or verl's Ulysses
  sequence parallelism (the runtime's ring attention);
- generation runs the engine's data x tensor layout; `slots` caps the rows each engine replica decodes at
  once (vLLM's max_num_seqs, a hybrid engine's micro-batch), as jaxrlhf's continuous engine does;
- a split placement keeps a shadow copy of the actor on the generation devices, synchronised after every
  update; a staleness of at least one step makes it off-policy (the generator that many steps ahead), and
  partial rollouts (`partial_rollout`) stream responses across steps;
- a trainer that packs sequences (dynamic batch size, sequence packing) runs packed calls;
- a trainer that recomputes the old policy's log-probs before its update (`placement.training.recompute_logprobs`,
  or a published breakdown with an `old_log_prob` stage that took time) runs that forward (`recomputes_logprobs`);
- knobs the source states (gradient checkpointing) are kept; others are the planner's choice for that
  placement (the fewest micro-batches and the least remat that fit: the peer at its best).

Response lengths are log-normal with the case's `sigma` (0.8 where it states none) and a median that gives
the published mean under the cap (`length_distribution`: a mean too close to the cap for that spread keeps the
median at the cap and narrows the spread). A peer's paged engine (vLLM, SGLang) reads only the tokens each row
holds (`Workload.live_kv`), and every peer's trainer and prefill run FlashAttention, which skips the causal
mask's empty half and recomputes scores in the backward (`Workload.flash_attention`). A bad case file is one
line naming the case and the field.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxrlhf import config as cfglib  # noqa: E402
from jaxrlhf.models.config import PRESETS  # noqa: E402
from jaxrlhf.planner.hardware import PROFILES  # noqa: E402
from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement, PlanError, layout_misfit  # noqa: E402
from jaxrlhf.planner.search import DEFAULT_EVALUATIONS  # noqa: E402
from jaxrlhf.yaml_input import read as read_yaml  # noqa: E402

DEFAULT_SIGMA = 0.8  # spread of response lengths where a case states none
REQUIRED = ("name", "source", "models", "hardware", "devices", "algorithm", "prompts_per_step",
            "samples_per_prompt", "optimizer_steps_per_step", "prompt_len", "response_len", "placement",
            "staleness", "published")
ALGORITHMS = {"ppo": "ppo", "grpo": "grpo", "dapo": "dapo"}
FSDP_BACKENDS = ("fsdp", "deepspeed")  # parameters sharded over the data devices


class CaseError(ValueError):
    """A case the script cannot price: the message names the case and the field."""


# ---- reading cases --------------------------------------------------------------------------------

def load_cases(path: str) -> list[dict]:
    try:
        data = read_yaml(Path(path).read_text(), path)
    except OSError as e:
        raise CaseError(f"--cases {path}: {e.strerror}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise CaseError(f"{path}: expected a mapping with a list under 'cases:'")
    cases = data["cases"]
    for i, case in enumerate(cases):
        if not isinstance(case, dict):
            raise CaseError(f"{path}: case {i} is not a mapping")
        check_case(case)
    names = [c["name"] for c in cases]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise CaseError(f"{path}: case names repeat: {dup}")
    return cases


def _field_or_none(case: dict, dotted: str) -> Any:
    value: Any = case
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _field(case: dict, dotted: str) -> Any:
    value: Any = case
    for key in dotted.split("."):
        if not isinstance(value, dict) or value.get(key) is None:
            raise CaseError(f"case {case.get('name', '?')!r}: missing field {dotted!r}")
        value = value[key]
    return value


def _number(case: dict, dotted: str, whole: bool = False) -> float:
    """A field that must be a number > 0 (a whole one where `whole`): one line naming it otherwise."""
    value = _field(case, dotted)
    kind = int if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise CaseError(f"case {case.get('name', '?')!r}: field {dotted!r} must be a "
                        f"{'whole number' if whole else 'number'} > 0, got {value!r}")
    return value


def check_case(case: dict) -> None:
    """One line naming the case and the field for a case that cannot be priced."""
    name = case.get("name") or "?"
    for key in REQUIRED:
        if key not in case or case[key] is None and key != "staleness":
            raise CaseError(f"case {name!r}: missing field {key!r}")
    if case["hardware"] not in PROFILES:
        raise CaseError(f"case {name!r}: field 'hardware': unknown hardware {case['hardware']!r}; "
                        f"known: {sorted(PROFILES)}")
    for role, preset in _field(case, "models").items():
        if preset is not None and preset not in PRESETS:
            raise CaseError(f"case {name!r}: field 'models.{role}': unknown model preset {preset!r} "
                            f"({PRESETS.unknown(preset)})")
    if case["algorithm"] not in ALGORITHMS:
        raise CaseError(f"case {name!r}: field 'algorithm': {case['algorithm']!r} is not one of {sorted(ALGORITHMS)}")
    for key in ("devices", "prompts_per_step", "samples_per_prompt", "optimizer_steps_per_step"):
        if not isinstance(case[key], int) or case[key] < 1:
            raise CaseError(f"case {name!r}: field {key!r} must be a whole number >= 1, got {case[key]!r}")
    prompt, cap = _number(case, "prompt_len.mean"), _number(case, "response_len.max", whole=True)
    if case["response_len"].get("mean") is None and ":" not in str(case.get("pair") or ""):
        raise CaseError(f"case {name!r}: field 'response_len.mean' is missing and the case has no pair to fit it on "
                        "(pair: KEY:colocated or KEY:split)")
    for key in ("response_len.mean", "response_len.sigma"):
        if _field_or_none(case, key) is not None:
            _number(case, key)
    actor = _field(case, "models.actor")
    positions = PRESETS.get(actor).max_position_embeddings
    if int(prompt) + cap > positions:
        raise CaseError(f"case {name!r}: field 'response_len.max': prompt_len.mean + response_len.max = "
                        f"{int(prompt) + cap} tokens is past {actor}'s {positions} positions")
    kind = _field(case, "placement.kind")
    if kind not in ("colocated", "split"):
        raise CaseError(f"case {name!r}: field 'placement.kind' must be colocated or split, got {kind!r}")
    _number(case, "published.step_s")
    n = case["devices"]
    sides = [case["placement"].get("generation") or {}, case["placement"].get("training") or {}]
    for side, spec in zip(("generation", "training"), sides):
        for axis in ("devices", "tp", "pp", "cp", "ep"):
            if isinstance(spec, dict) and spec.get(axis) is not None:
                _number(case, f"placement.{side}.{axis}", whole=True)
    if kind == "split" and sum(_field(case, f"placement.{s}.devices") for s in ("generation", "training")) != n:
        raise CaseError(f"case {name!r}: field 'placement': generation and training devices must add up to "
                        f"devices={n}")
    graphs = sides[0].get("cuda_graphs")
    if graphs is not None and not isinstance(graphs, bool):
        raise CaseError(f"case {name!r}: field 'placement.generation.cuda_graphs' must be true or false (whether the "
                        f"engine decoded with CUDA graphs), got {graphs!r}")
    for side, spec in zip(("generation", "training"), sides):
        size = spec.get("devices", n) if kind == "split" else n
        ways = math.prod(int(spec.get(a) or 1) for a in ("tp", "pp", "cp", "ep"))
        if size % ways:
            raise CaseError(f"case {name!r}: field 'placement.{side}': tp x pp x cp x ep = {ways} does not "
                            f"divide its {size} devices")


# ---- a case as jaxrlhf's question -----------------------------------------------------------------

def _capped_mean(median: float, sigma: float, cap: int) -> float:
    """The mean of log-normal lengths (median, sigma) with every length above `cap` cut to it."""
    if sigma == 0:
        return min(median, cap)
    z = (math.log(cap) - math.log(median)) / sigma
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    return median * math.exp(sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))


def length_distribution(mean: float, cap: int, sigma: float) -> tuple[int, float]:
    """(median, sigma) of log-normal lengths whose mean under the cap is `mean`: the median found by bisection
    at the stated `sigma`; where even a median at the cap keeps the mean below `mean` (a wide spread cut at
    the cap cannot average that close to it: NeMo-RL's Qwen3 runs average 3,200 of 3,968 tokens), the median
    is the cap and sigma the spread, narrower than stated, that gives `mean` (bisection). A mean at or above
    the cap: every response at the cap (sigma 0)."""
    if mean >= cap:
        return cap, 0.0
    if sigma == 0:
        return int(round(mean)), 0.0
    if _capped_mean(cap, sigma, cap) < mean:  # narrow the spread, the median at the cap
        lo, hi = 0.0, sigma
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if _capped_mean(cap, mid, cap) < mean else (mid, hi)
        return cap, round(lo, 4)
    lo, hi = 1.0, float(cap)
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _capped_mean(mid, sigma, cap) < mean else (lo, mid)
    return max(1, min(cap, int(round(lo)))), sigma


def run_config(case: dict, peer_knobs: bool = True) -> cfglib.Config:
    """The jaxrlhf config of the case's workload (what `python -m jaxrlhf.plan` would be asked); with
    `peer_knobs` also the memory knobs the peer states (its token budget, engine pool, remat), which its own
    placement is priced with; without them the planner chooses its own for its pick, as for any run."""
    models, alg = case["models"], ALGORITHMS[case["algorithm"]]
    sigma = float(case["response_len"].get("sigma", DEFAULT_SIGMA))
    cap = int(case["response_len"]["max"])
    median, sigma = length_distribution(float(case["response_len"]["mean"]), cap, sigma)
    training = case["placement"].get("training") or {}
    overrides = [
        f"algorithm.name={alg}", f"data.batch_size={case['prompts_per_step']}",
        f"algorithm.minibatches={case['optimizer_steps_per_step']}", "algorithm.epochs=1",
        f"data.max_prompt_len={int(case['prompt_len']['mean'])}", f"generation.max_new_tokens={cap}",
        f"plan.response_length_median={median}", f"plan.response_length_sigma={sigma}",
        "generation.engine=continuous", f"plan.hardware={case['hardware']}", "run.devices=8", "plan.strategy=auto",
        f"algorithm.kl_coef={0.01 if models.get('ref') else 0.0}",
        f"algorithm.pack_sequences={str(bool(training.get('packed'))).lower()}",
        f"model.actor.preset={models['actor']}", "model.actor.path=null",
    ]
    if alg != "ppo":
        overrides.append(f"algorithm.group_size={case['samples_per_prompt']}")
    if alg == "dapo":
        overrides.append("algorithm.dynamic_sampling=false")
    if peer_knobs and training.get("packed") and training.get("tokens_per_gpu"):  # the budget counts every shard's
        overrides.append(f"algorithm.max_tokens_per_micro_batch={int(training['tokens_per_gpu']) * batch_ways(case)}")
    slots = (case["placement"].get("generation") or {}).get("slots")
    if peer_knobs and slots:
        overrides.append(f"generation.slots={int(slots)}")
    if peer_knobs and recomputes_logprobs(case):  # the peer's trainer forward for the old policy's log-probs
        overrides.append("algorithm.rollout_correction=decoupled")
    if peer_knobs and training.get("remat"):
        overrides += [f"model.{role}.remat=full" for role in ("actor", "critic")
                      if models.get(role) and role != "ref"]
    if PRESETS.get(models["actor"]).num_experts:  # the peers' engines and trainers run each token through its k experts
        overrides += [f"model.{role}.overrides={{moe_dispatch: grouped}}" for role in ("actor", "ref") if models.get(role)]
    for role in ("critic", "ref", "reward"):
        if models.get(role) and (models[role] != models["actor"] or role == "reward"):  # a reward model: its own
            overrides += [f"model.{role}.preset={models[role]}", f"model.{role}.path=null",
                          f"model.{role}.init_from=null"]
    if models.get("reward"):
        overrides.append("rewards.model=true")
    if case["staleness"]:
        overrides.append(f"algorithm.max_staleness={staleness_of(case)}")
        if isinstance(case["staleness"], dict) and case["staleness"].get("partial_rollout"):
            overrides.append("generation.partial_rollout=true")
    try:
        return cfglib.load_config(None, overrides)
    except ValueError as e:
        raise CaseError(f"case {case['name']!r}: its workload is not a valid jaxrlhf config: {e}") from None


def recomputes_logprobs(case: dict) -> bool:
    """Whether the peer's trainer recomputes the rollout's log-probs under the weights before the update (a
    forward over the batch, jaxrlhf's `actor.inference` of a rollout correction), where jaxrlhf's own run takes
    the engine's: as `placement.training.recompute_logprobs` says, else where the published breakdown has an
    `old_log_prob` stage that took time (verl's synchronous trainer; its fully-async trainer uses the rollout's)."""
    stated = (case["placement"].get("training") or {}).get("recompute_logprobs")
    if stated is not None:
        return bool(stated)
    return bool(((case["published"].get("breakdown_s") or {}).get("old_log_prob") or 0) > 0)


def batch_ways(case: dict) -> int:
    """The devices a training call's batch is split over (all but its tensor, pipeline and context ones)."""
    spec = case["placement"].get("training") or {}
    size = int(spec.get("devices") or case["devices"])
    return size // math.prod(int(spec.get(a) or 1) for a in ("tp", "pp", "cp"))


def staleness_of(case: dict) -> int:
    """Steps the generator runs ahead: 0 synchronous; a system's own steps-behind bound; 1 for a fraction of a
    batch ahead (verl's staleness_threshold)."""
    s = case["staleness"]
    if not s:
        return 0
    if isinstance(s, int):
        return s
    for key in ("max_trajectory_age_steps", "max_staleness_eta", "steps"):
        if key in s:
            return int(s[key])
    return 1 if float(s.get("staleness_threshold", 0)) > 0 else 0


def _train_layout(spec: dict, size: int, where: str) -> Layout:
    t, p, c, e = (int(spec.get(a) or 1) for a in ("tp", "pp", "cp", "ep"))
    rest = size // (t * p * c * e)
    backend = str(spec.get("backend", "")).lower()
    # an FSDP group counts the sequence-parallel devices too (verl's Ulysses groups live inside it); jaxrlhf
    # shards parameters over the devices outside the context axis, at most fsdp_size of them
    fsdp = math.gcd(int(spec.get("fsdp_size") or rest), rest) if backend.startswith(FSDP_BACKENDS) else 1
    return Layout(data=rest // fsdp, fsdp=fsdp, tensor=t, stage=p, context=c, expert=e)


def peer_plan(case: dict, graph, n: int) -> ExecutionPlan:
    """The case's own placement as a jaxrlhf plan (see the module docstring)."""
    name, placement = case["name"], case["placement"]
    gen_spec, train_spec = placement.get("generation") or {}, placement.get("training") or {}
    per_model = placement.get("per_model") or {}
    if placement["kind"] == "colocated":
        gen_size = train_size = n
        groups = {"all": DeviceGroup("all", 0, n)}
        gen_group = train_group = "all"
    else:
        gen_size, train_size = int(gen_spec["devices"]), int(train_spec["devices"])
        groups = {"gen": DeviceGroup("gen", 0, gen_size), "train": DeviceGroup("train", gen_size, train_size)}
        gen_group, train_group = "gen", "train"
    tg = int(gen_spec.get("tp") or 1)
    gen_layout = Layout(data=gen_size // tg, tensor=tg)
    calls: dict[str, Placement] = {}
    start = gen_size if placement["kind"] == "split" else 0
    role_groups: dict[str, str] = {}
    if per_model:  # each model on its own devices (OpenRLHF): in the order the case lists them
        for role, spec in per_model.items():
            if role in graph.roles:
                size = int(spec["devices"])
                groups[role] = DeviceGroup(role, start, size)
                role_groups[role] = role
                start += size
        if start != n:
            raise CaseError(f"case {name!r}: field 'placement.per_model': its devices and generation's add up to "
                            f"{start}, not devices={n}")
    for c in graph.calls:
        if c.kind == "generate":
            calls[c.name] = Placement(gen_group, gen_layout)
            continue
        group = role_groups.get(c.role, train_group)
        spec = per_model.get(c.role) or train_spec
        calls[c.name] = Placement(group, _train_layout({**train_spec, **spec}, groups[group].size,
                                                       f"case {name!r}: field 'placement.training'"))
    shadow = ("actor",) if placement["kind"] == "split" else ()
    offpolicy = bool(shadow) and staleness_of(case) > 0
    plan = ExecutionPlan("published", n, groups, calls, shadow_roles=shadow, offpolicy=offpolicy,
                         staleness=staleness_of(case) if offpolicy else None,
                         notes=f"{name}: the peer's own placement")
    return plan


def check_layouts(case: dict, plan: ExecutionPlan, graph, models, wl) -> None:
    for c in graph.calls:
        lay = plan.calls[c.name].layout
        # a peer's engine replicas share a batch however it divides (vLLM's router): no even split asked there
        # (nor for packed calls: the packer spreads sequences over the shards by their tokens)
        rows = None if c.kind == "generate" or wl.packed else wl.call_batch(c.kind)
        why = layout_misfit(lay, models[c.role], rows, kind=c.kind,
                            seq_len=wl.seq_len if lay.context > 1 else None)
        if why:
            raise CaseError(f"case {case['name']!r}: field 'placement': {c.name} cannot run {lay}: {why}")


# ---- pricing ---------------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    name: str
    source: str
    published_s: float
    predicted_s: float | None
    reason: str | None
    pick_s: float | None
    pick: ExecutionPlan | None
    peer: ExecutionPlan
    calls: dict[str, float]  # seconds a step of each call (the steady-state timeline's mean)
    pair: str | None
    over_memory: bool = False  # jaxrlhf's runtime would not hold the peer's placement (priced for time anyway)
    mean: float | None = None  # the mean response length priced with
    # what its mean length was fitted to (a check of its pair, not of that): "step" (its published step time,
    # so the row matches by construction) or "trainer stages" (its published trainer stages: the step is then
    # still a check of the rest, generation above all); None where the length is published or was fitted on
    # its pair's colocated row
    fitted: str | None = None
    fit_note: str | None = None  # the fit of its pair's length stopped at a bound
    generate: tuple[str, ...] = ()  # the generate calls among `calls`
    published_generation_s: float | None = None  # the published breakdown's generation stage
    # whether the peer's engine decoded with CUDA graphs (`placement.generation.cuda_graphs`; None: not known).
    # Without them (vLLM's enforce_eager) every decode step pays its kernels' launches from the host, which the
    # cost model does not price: its decode is calibrated on compiled steps
    cuda_graphs: bool | None = None

    @property
    def ratio(self) -> float | None:
        return self.predicted_s / self.published_s if self.predicted_s else None

    @property
    def gain(self) -> float | None:
        return self.predicted_s / self.pick_s if self.predicted_s and self.pick_s else None

    @property
    def trainer_s(self) -> float:
        """Seconds a step of every call but generation: the published breakdowns' trainer stages."""
        return sum(s for c, s in self.calls.items() if c not in self.generate)

    @property
    def generate_s(self) -> float:
        return sum(self.calls[c] for c in self.generate)


def engine_slots(case: dict, cfg_model, hw, wl, generate) -> int:
    """Rows the peer's generation engine (`generate`, the call) decodes at once over all its replicas: each
    replica (a tensor-parallel group) runs up to `max_num_seqs` (vLLM's default 256 where the case states none; a hybrid engine's
    micro-batch as `slots`), as many as its KV cache holds at the mean context (vLLM pages the cache by
    the tokens a row holds, not by the cap): `gpu_memory_utilization` of the device (0.6 colocated, where
    the trainer's state is offloaded meanwhile, 0.9 on generation's own devices, where none is stated) less
    the replica's weights."""
    from jaxrlhf.planner.sizes import kv_bytes_per_token, param_bytes

    spec = case["placement"].get("generation") or {}
    tp = int(spec.get("tp") or 1)
    size = int(spec.get("devices") or case["devices"]) if case["placement"]["kind"] == "split" else case["devices"]
    replicas = size // tp
    if spec.get("slots"):
        return int(spec["slots"]) * replicas
    util = float(spec.get("gpu_memory_utilization") or (0.6 if case["placement"]["kind"] == "colocated" else 0.9))
    kv_budget = util * hw.hbm_capacity * tp - param_bytes(cfg_model, "lm")
    context = wl.prompt_len + float(case["response_len"]["mean"])
    fits = int(kv_budget // (kv_bytes_per_token(cfg_model) * context))
    # the rows its engine may hold: the batch (prompts x samples), or for a generator streaming partial rollouts
    # ahead of the trainer the rows of staleness + 1 batches, as jaxrlhf's stream holds them (`engine_rows`)
    rows = wl.engine_rows(generate, 1)
    per_replica = max(1, min(int(spec.get("max_num_seqs") or 256), fits, rows // replicas))
    return per_replica * replicas


PAGED_ENGINES = ("vllm", "sglang")  # engines whose attention reads only the tokens a row holds (paged attention)


def paged_engine(case: dict) -> bool:
    """Whether the case's generation engine is a paged one (`PAGED_ENGINES`; `Workload.live_kv`): vLLM and
    SGLang page the KV cache and attend over each row's own tokens; a hybrid engine decodes HF-style."""
    engine = str((case["placement"].get("generation") or {}).get("engine") or "").lower()
    return engine.startswith(PAGED_ENGINES)


def price(case: dict, evaluations: int, mean: float | None = None, search: bool | None = None) -> Result:
    """The case's own placement priced as the peer runs it, and the planner's pick for its cluster.

    The peer's time: jaxrlhf's cost model and simulator on the peer's placement with the knobs the peer
    states (remat, a token budget or micro-batch size; none where it states none), its engine's
    concurrency (`engine_slots`) and, for a trainer that packs (dynamic batch size, sequence packing), its
    packer: no padding and attention inside each sequence (`Workload.varlen`; jaxrlhf's own packer pads a
    shard's one row to whole blocks, or rows to the longest sequence, which the planner prices for jaxrlhf's runs). Memory is the peer's business here: peers offload or free the trainer's
    parameters while generating and run Adam on the host (DeepSpeed's CPU Adam), which jaxrlhf's runtime
    does not (it splits the optimizer state over data, ZeRO-1, and keeps frozen roles and optimizer state in
    host memory between their calls, `plan.offload`, `plan.offload_optimizer`), so the time is priced on
    devices with room to spare, and `over_memory` says when jaxrlhf's own memory model would not hold the
    placement."""
    from jaxrlhf.planner.simulator import estimate_plan
    from jaxrlhf.run.assembly import Machine, setup

    if mean is not None:
        case = {**case, "response_len": {**case["response_len"], "mean": mean}}
    cfg = run_config(case)
    run = setup(cfg, machine=Machine.described(cfg, case["devices"]), runtime=False)
    wl, graph, models, hw = run.algorithm.workload(), run.graph, run.planned_models, run.hardware
    peer = peer_plan(case, graph, case["devices"])
    check_layouts(case, peer, graph, models, wl)
    remat = "full" if (case["placement"].get("training") or {}).get("remat") else "none"
    slots = engine_slots(case, models["actor"], hw, wl, graph["actor.generate"]) if wl.gen_engine == "continuous" \
        else wl.gen_slots
    peer_wl = dataclasses.replace(
        wl, gen_slots=slots, micro_batch=None if wl.micro_batch == "auto" else wl.micro_batch, varlen=wl.packed,
        live_kv=paged_engine(case), flash_attention=True,
        remat={r: (remat if r in ("actor", "critic") else "none") for r in models})
    roomy = dataclasses.replace(hw, hbm_capacity=hw.hbm_capacity * 1e3)
    est = estimate_plan(peer, graph, models, peer_wl, roomy)
    own = estimate_plan(peer, graph, models, wl, hw)
    peer = dataclasses.replace(peer, micro_batch_size={}, remat={r: p for r, p in peer_wl.remat.items()
                                                                   if graph.train_call(r) is not None},
                               gen_slots=slots, token_budget=wl.token_budget if wl.packed else None)
    pick_s, pick_plan = None, None
    try:
        if search if search is not None else evaluations > 0:
            free = run_config(case, peer_knobs=False)  # the pick chooses its own knobs: the workload is the same
            searcher = setup(free, machine=Machine.described(free, case["devices"]), runtime=False)
            pick = searcher.search(evaluations=evaluations).best
            pick_s, pick_plan = pick.step_s, pick.plan
    except PlanError:
        pass
    return Result(case["name"], str(case["source"].get("ref", "")), float(case["published"]["step_s"]),
                  est.step_s if est.feasible else None, est.reason or own.reason, pick_s, pick_plan, peer,
                  step_seconds(est), case.get("pair"), not own.feasible, float(case["response_len"]["mean"]),
                  generate=tuple(c.name for c in graph.calls if c.kind == "generate"),
                  published_generation_s=published_stages(case, GENERATION_STAGES),
                  cuda_graphs=(case["placement"].get("generation") or {}).get("cuda_graphs"))


def step_seconds(est) -> dict[str, float]:
    """Seconds a step of each call on the plan's steady-state timeline (a generate call's mean over the
    batches of drawn lengths it cycles through), as the published breakdowns time their stages."""
    if est.timeline is None:
        return {c: v.seconds for c, v in est.calls.items()}
    runs: dict[str, list[float]] = {}
    for span in est.timeline.spans:
        if span.op.kind == "call":
            runs.setdefault(span.op.call, []).append(span.op.duration)
    return {c: statistics.fmean(runs[c]) if c in runs else v.seconds for c, v in est.calls.items()}


# The published breakdowns' stages of the trainer's device calls (verl: the old policy's log-probs, the
# reference, the update; OpenRLHF: logits and rewards, training), and of generation. Weight sync, validation
# and a split trainer's wait for samples are neither.
TRAINER_STAGES = ("old_log_prob", "ref", "update_actor", "logits_and_reward", "training")
GENERATION_STAGES = ("gen", "generation")


def published_stages(case: dict, stages: tuple[str, ...]) -> float | None:
    """Seconds of the published breakdown's `stages` together; None where it prints none of them."""
    breakdown = case["published"].get("breakdown_s") or {}
    times = [float(breakdown[k]) for k in stages if breakdown.get(k) is not None]
    return sum(times) if times else None


FIT_FLOOR = 16.0  # the shortest mean response a fit tries


def fitted_mean(case: dict) -> tuple[float, str, str | None]:
    """The mean response length (for a workload whose source publishes no lengths) at which the case's own
    placement is priced at its published trainer stages (`TRAINER_STAGES`) where its breakdown prints them and
    its trainer packs, else at its published step time: (mean, what it was fitted to, a note when no length
    reaches the target and the fit stops at the cap or the floor). Bisection, the time growing with the length.

    The trainer's stages come first because the cost model prices them from arithmetic (a forward and backward
    over the batch's tokens): the length that fills them is the batch's. A whole step also holds generation,
    whose time a long-tailed run sets by its longest responses at a handful of rows; fitted on the step, any error
    in that tail moves the length, and the split row (its trainer on fewer devices) inherits it. A trainer that
    pads its rows to the cap takes the same time whatever the mean: there only the step says the length."""
    packs = bool((case["placement"].get("training") or {}).get("packed"))
    trainer = published_stages(case, TRAINER_STAGES) if packs else None
    target, fitted_to = (trainer, "trainer stages") if trainer else (float(case["published"]["step_s"]), "step")

    def at(mean: float) -> float | None:
        r = price(case, 0, mean=mean, search=False)
        return (r.trainer_s if trainer else r.predicted_s) if r.predicted_s else None

    lo, hi = FIT_FLOOR, float(case["response_len"]["max"])
    top = at(hi)
    if top is not None and top < target:
        return hi, fitted_to, f"priced below the published {fitted_to} even at the cap: the fit stops there"
    bottom = at(lo)
    if bottom is not None and bottom > target:
        return lo, fitted_to, f"priced above the published {fitted_to} even at the floor: the fit stops there"
    for _ in range(14):
        mid = math.sqrt(lo * hi)
        step = at(mid)
        lo, hi = (mid, hi) if step is not None and step < target else (lo, mid)
    return math.sqrt(lo * hi), fitted_to, None


def _pair(case: dict) -> tuple[str, str]:
    """(pair key, side) of a case's `pair: key:side`; ("", "") for a case without one."""
    key, _, side = str(case.get("pair") or "").partition(":")
    return key, side


def price_all(cases: list[dict], evaluations: int, report=lambda r: None, jobs: int = 1) -> list[Result]:
    """Every case priced: with its published mean length, or (none published) with the length fitted on its
    pair's colocated row (`fitted_mean`: on its trainer's published stages where it can, which leaves that row's
    step to check as well, else on its step), which then checks the pair's split row. With `jobs` > 1 the pairs
    (and lone cases) are priced in that many processes at once: the same numbers, as each search counts
    plans, not seconds."""
    for case in cases:
        key = _pair(case)[0]
        if case["response_len"].get("mean") is None and not any(
                _pair(o) == (key, "colocated") and o["response_len"].get("mean") is None for o in cases):
            raise CaseError(f"case {case['name']!r}: field 'response_len.mean': none published and its pair "
                            f"{key!r} has no colocated row to fit it on")
    units: dict[str, list[dict]] = {}  # a pair's rows together: the split row needs the colocated row's fit
    for case in cases:
        units.setdefault(_pair(case)[0] or case["name"], []).append(case)
    price_unit = functools.partial(_price_unit, evaluations=evaluations)
    by_name: dict[str, Result] = {}
    with multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        for priced in (pool.imap(price_unit, units.values()) if pool else map(price_unit, units.values())):
            for r in priced:  # each unit reported as it is done, in the file's order
                report(r)
                by_name[r.name] = r
    return [by_name[case["name"]] for case in cases]


def _price_unit(cases: list[dict], evaluations: int) -> list[Result]:
    """`price_all` of one pair's rows (or one case)."""
    fits: dict[str, tuple[float, str, str | None]] = {}
    for case in cases:
        key, side = _pair(case)
        if case["response_len"].get("mean") is None and side == "colocated":
            fits[key] = fitted_mean(case)
    results = []
    for case in cases:
        key, side = _pair(case)
        if case["response_len"].get("mean") is not None:
            results.append(price(case, evaluations))
        else:
            mean, fitted_to, note = fits[key]
            results.append(dataclasses.replace(price(case, evaluations, mean=mean), fit_note=note,
                                               fitted=fitted_to if side == "colocated" else None))
    return results


def summarize(results: list[Result]) -> dict:
    priced = [r for r in results if r.ratio and not r.fitted]  # a fitted row matches (in part) by construction
    logs = [abs(math.log(r.ratio)) for r in priced]
    # the colocated rows whose length was fitted on their trainer's stages: their steps check the rest
    staged = [r for r in results if r.ratio and r.fitted == "trainer stages"]
    pairs: dict[str, dict[str, Result]] = {}
    for r in results:
        if r.pair:
            key, side = r.pair.split(":")
            pairs.setdefault(key, {})[side] = r
    ratios = {}
    for key, sides in pairs.items():
        colocated, split = sides.get("colocated"), sides.get("split")
        if colocated and split and colocated.predicted_s and split.predicted_s:
            published = colocated.published_s / split.published_s
            predicted = colocated.predicted_s / split.predicted_s
            ratios[key] = {"published": published, "predicted": predicted, "off": predicted / published - 1}
    return {
        "cases": len(results), "priced": len(priced),
        "median_abs_log_ratio": statistics.median(logs) if logs else None,
        "within_0.67_1.5": sum(1 for r in priced if 0.67 <= r.ratio <= 1.5),
        "median_gain": statistics.median([r.gain for r in priced if r.gain]) if any(r.gain for r in priced) else None,
        "pair_ratios": ratios,
        "trainer_fitted": {
            "rows": len(staged),
            "median_abs_log_ratio_with_them": statistics.median(logs + [abs(math.log(r.ratio)) for r in staged])
            if staged else None,
            "within_0.67_1.5_with_them": sum(1 for r in priced + staged if 0.67 <= r.ratio <= 1.5),
            "steps": {r.name: {"published": r.published_s, "predicted": r.predicted_s, "ratio": r.ratio,
                               "generation_published": r.published_generation_s,
                               "generation_predicted": r.generate_s, "cuda_graphs": r.cuda_graphs}
                      for r in staged},
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=str(ROOT / "docs" / "results" / "published_cases.yaml"))
    ap.add_argument("--out", help="write every case's numbers and the summary here (JSON)")
    ap.add_argument("--plans", help="write each case's peer plan and searched plan into this folder")
    ap.add_argument("--evaluations", type=int, default=DEFAULT_EVALUATIONS,
                    help="plans the planner's search evaluates per case (default: as `python -m jaxrlhf.plan`; "
                         "0: price the peers' placements only, no pick)")
    ap.add_argument("--only", help="comma-separated case names")
    ap.add_argument("--jobs", type=int, default=1, help="price this many pairs of cases at once (processes)")
    args = ap.parse_args(argv)
    try:
        cases = load_cases(args.cases)
        if args.only:
            wanted = args.only.split(",")
            unknown = sorted(set(wanted) - {c["name"] for c in cases})
            if unknown:
                raise CaseError(f"--only: no case named {unknown}")
            cases = [c for c in cases if c["name"] in wanted]
        results = price_all(cases, args.evaluations, _print_row, jobs=args.jobs)
    except CaseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(results)
    print()
    med = summary["median_abs_log_ratio"]
    print(f"{summary['priced']} of {summary['cases']} cases priced; median |log(predicted / published)| = "
          f"{med:.3f} ({math.exp(med):.2f}x); {summary['within_0.67_1.5']} within 0.67-1.5x" if med is not None
          else "no case priced")
    staged = summary["trainer_fitted"]
    if staged["rows"]:
        print(f"with the {staged['rows']} colocated rows whose length was fitted on their trainer's stages: median "
              f"{staged['median_abs_log_ratio_with_them']:.3f}, {staged['within_0.67_1.5_with_them']} within 0.67-1.5x")
        for name, r in staged["steps"].items():
            gen = (f"; generation {r['generation_predicted']:.0f} / {r['generation_published']:.0f} s"
                   f"{EAGER_NOTE[r['cuda_graphs']]}" if r["generation_published"] else "")
            print(f"  {name}: step {r['predicted']:.0f} / {r['published']:.0f} s ({r['ratio']:.2f}){gen}")
    for key, r in summary["pair_ratios"].items():
        print(f"{key}: colocated / split step published {r['published']:.2f}, predicted "
              f"{r['predicted']:.2f} ({r['off'] * 100:+.0f} %)")
    if args.plans:
        os.makedirs(args.plans, exist_ok=True)
        for r in results:
            r.peer.save(os.path.join(args.plans, f"{r.name}.peer.yaml"))
            if r.pick is not None:
                r.pick.save(os.path.join(args.plans, f"{r.name}.searched.yaml"))
    if args.out:
        rows = [{"name": r.name, "source": r.source, "published_s": r.published_s, "predicted_s": r.predicted_s,
                 "ratio": r.ratio, "reason": r.reason, "pick_s": r.pick_s, "gain": r.gain, "calls_s": r.calls,
                 "mean_response": r.mean, "mean_fitted_here": r.fitted, "fit_note": r.fit_note,
                 "over_jaxrlhf_memory": r.over_memory, "cuda_graphs": r.cuda_graphs,
                 "peer_plan": r.peer.to_dict(), "searched_plan": r.pick.to_dict() if r.pick else None}
                for r in results]
        with open(args.out, "w") as f:
            json.dump({"command": "python scripts/validate_published.py " + " ".join(argv or sys.argv[1:]),
                       "summary": summary, "rows": rows}, f, indent=1)
    print(json.dumps({"summary": summary}))
    return 0


# what a row says of its engine's CUDA graphs (`Result.cuda_graphs`)
EAGER_NOTE = {False: "  (decoded without CUDA graphs: the steps' host launches are not priced)", True: "", None: ""}


def _print_row(r: Result) -> None:
    pred = f"{r.predicted_s:8.1f}" if r.predicted_s else f"{'n/a':>8}"
    ratio = f"{r.ratio:5.2f}" if r.ratio else "  n/a"
    pick = f"{r.pick_s:8.1f}" if r.pick_s else f"{'n/a':>8}"
    gain = f"{r.gain:5.2f}x" if r.gain else "   n/a"
    how = f"  (mean length fitted here, on its {r.fitted})" if r.fitted else ""
    how += f"  ({r.fit_note})" if r.fit_note else ""
    how += EAGER_NOTE[r.cuda_graphs]
    print(f"{r.name:46s} published {r.published_s:8.1f}  predicted {pred}  ratio {ratio}  searched {pick}  "
          f"gain {gain}  mean response {r.mean:6.0f}{how}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
