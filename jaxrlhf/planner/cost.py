"""Analytic time of one model call under a placement, in seconds.

Every phase is a roofline (max of matmul time and memory-traffic time) plus
the layout's collectives and a per-kernel dispatch cost:

- generate: prefill is a forward over the prompts; each of the `gen_len`
  decode steps reads the weight shard and the KV cache filled so far, so a
  decode step's time grows with the KV length and shrinks with tensor
  parallelism (fewer bytes per device), while FSDP would all-gather the
  weights on every step.
- inference: one forward over prompt + response.
- train: forward + backward (+ a recomputed forward with remat) for every
  minibatch of every PPO epoch, the AdamW update, FSDP all-gathers /
  reduce-scatters per micro-batch and the data-parallel gradient all-reduce
  per optimizer step; each data replica updates its 1/data of the optimizer
  state (ZeRO-1; the weights outside a mixture's experts split over the
  expert axis too) and the new parameters are all-gathered back.
- pipelines (layout.stage = S > 1, train and inference only): each stage
  holds num_layers / S consecutive layers (embedding and heads on every
  stage); a GPipe schedule over the call's M micro-batches runs M + S - 1
  iterations, in each every stage runs its block on one micro-batch and
  sends the activation [micro rows, seq, hidden] to the next stage, so the
  block time is paid M + S - 1 times (bubble (S - 1) / (M + S - 1)); the
  backward repeats the schedule in reverse. Gradients are reduced over
  data / fsdp inside a stage; the replicated embedding and head over stages.
- context parallelism (layout.context = c > 1, train and inference only):
  each device holds T / c tokens of every sequence (per-device tokens divided
  by c; a query still attends over all T keys), and ring attention
  (`models/context.py`) passes each device's key/value block to its
  neighbour c - 1 times per layer and forward (the backward passes the block
  and its K/V gradients c times: twice the bytes), each pass overlapping the
  attention over the block before it, so only what a pass takes beyond that
  block's attention is paid (`context_comm`); where 2c divides T the zig-zag
  order's trades (half of q, k, v before the ring, half of the output after,
  once per forward and once more in the backward) are paid in full.
- attention: jaxrlhf's dense attention computes every [T, T] score, the
  causal mask's empty half too; its blockwise attention (rows of
  `ModelConfig.blockwise_attention_from` tokens and more, `models.blockwise`)
  skips the key blocks wholly in the future and its backward recomputes one
  q.k^T product per block pair; a peer's FlashAttention (`Workload.
  flash_attention`) is priced the same way in its tiles, and ring attention
  by its zig-zag order's share and recompute (`attention_kind`).
- expert parallelism (layout.expert = e > 1, mixture-of-experts models):
  the batch is split over e more devices, each holding num_experts / e
  experts (their weights and FSDP gathers divided by e); in every MoE layer
  of every forward (and, transposed, every backward) a device all-gathers
  its expert group's tokens and their combine weights and reduce-scatters
  the experts' partial sums back (`models.moe.expert_parallel`):
  (e - 1) x tokens x (2 x hidden + num_experts) activation bytes per layer
  (`expert_comm`); FLOPs per device are the dense dispatch's over its own
  tokens (e x the tokens through num_experts / e experts); under tensor
  parallelism the partial sums' all-reduce is over e x the tokens.
- reallocation / shadow sync: the receiving devices' shard bytes over the
  link between the two groups (NVLink inside a host, the NICs across).

Network: inside a host a ring runs at one device's NVLink/ICI share; across
hosts a host's NICs are shared by its devices that send at once, and a ring
pools the shares of its members on that host (`HardwareProfile.link_bandwidth`).
- host offload / reload: shard bytes over the device <-> host link (a frozen role's weights once per
  call; an offloaded optimizer state there and back per train call).

Device order inside a group follows the mesh (stage, data, fsdp, context, tensor):
tensor neighbours are adjacent devices, so tensor collectives stay inside a
host whenever the tensor size fits in one, and stages are the outermost
blocks, so stage boundaries are the ones that cross hosts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Mapping

import numpy as np

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.planner.episodes import rollout_cost
from jaxrlhf.planner.hardware import HardwareProfile
from jaxrlhf.planner.knobs import knob_tag
from jaxrlhf.planner.measured import model_key, timed_placement
from jaxrlhf.planner.plan import MESH_AXES, DeviceGroup, Layout
from jaxrlhf.planner.sizes import (
    DTYPE_BYTES,
    adapter_shard_bytes,
    attention_flops,
    expert_param_count,
    expert_split_count,
    flop_params,
    kv_bytes_per_token,
    layer_param_count,
    optimizer_bytes_per_param,
    optimizer_shard_count,
    param_count,
    shard_bytes,
    trained_dtype,
    trained_shard_bytes,
)
from jaxrlhf.planner.workload import Workload

if TYPE_CHECKING:
    from jaxrlhf.planner.knobs import CallKnobs

FLASH_TILE = 128  # the key tile of a peer's FlashAttention (FlashAttention-2's block size on Hopper and Ampere)
OPS_PER_LAYER = 10  # dispatched kernels per decoder layer per forward (norms, projections, attention, mlp)
TP_ALLREDUCES_PER_LAYER = 2  # attention output and MLP output


# ---- device geometry -------------------------------------------------------------------------

AXES = MESH_AXES  # every mesh axis, in the mesh's order


@functools.lru_cache(maxsize=65536)
def _geometry(start: int, size: int, layout: Layout, devices_per_host: int
              ) -> tuple[tuple[bool, ...], tuple[int, ...], int, int]:
    """(axis crosses hosts, fewest members one ring of the axis has on a host it touches) per mesh
    axis, devices per host used, hosts used."""
    shape = tuple(layout.axis_sizes[a] for a in AXES)
    hosts = (np.arange(start, start + size) // devices_per_host).reshape(shape)
    crosses, members = [], []
    for i, k in enumerate(shape):
        rings = np.moveaxis(hosts, i, -1).reshape(-1, k)
        crosses.append(bool(np.any(rings != rings[:, :1])))
        # Rings with the same host pattern (relative to their first host) have the same counts.
        patterns = np.unique(rings - rings[:, :1], axis=0)
        members.append(min(int(np.unique(r, return_counts=True)[1].min()) for r in patterns))
    _, counts = np.unique(hosts, return_counts=True)
    return tuple(crosses), tuple(members), int(counts.max()), len(counts)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """How a layout over a group sits on hosts: what each mesh axis' collectives cross."""

    crosses: Mapping[str, bool]
    members: Mapping[str, int]  # members of one ring of the axis on one host (they share its NICs)
    devices_on_host: int
    hosts: int

    @classmethod
    def of(cls, group: DeviceGroup, layout: Layout, hw: HardwareProfile) -> "Geometry":
        if layout.num_devices != group.size:
            raise ValueError(f"layout {layout} has {layout.num_devices} devices but group {group.name!r} has {group.size}")
        crosses, members, per_host, hosts = _geometry(group.start, group.size, layout, hw.devices_per_host)
        return cls(dict(zip(AXES, crosses)), dict(zip(AXES, members)), per_host, hosts)


def _ring_allreduce(nbytes: float, k: int, bw: float, hw: HardwareProfile, count: float = 1) -> float:
    if k <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (k - 1) / k * nbytes / bw + count * hw.collective_latency


def _ring_gather(nbytes: float, k: int, bw: float, hw: HardwareProfile, count: float = 1) -> float:
    """All-gather (or reduce-scatter) of a tensor whose full size is `nbytes`."""
    if k <= 1 or nbytes <= 0:
        return 0.0
    return (k - 1) / k * nbytes / bw + count * hw.collective_latency


@dataclasses.dataclass(frozen=True)
class CallCost:
    """Seconds of one call and where they go; byte and FLOP counts are per device."""

    seconds: float
    flops: float
    hbm_bytes: float
    collective_bytes: float
    parts: Mapping[str, float]  # seconds: compute / memory-bound phases, collectives, overhead
    # "formula"; "measured": interpolated from the hardware profile's tables (`planner.measured`);
    # "calibrated": the formulas scaled by how far they are off on the placements those tables cover; "run": a
    # training run's own time of this call here; "formula x run" / "measured x run": corrected by runs elsewhere
    source: str = "formula"
    # A generate call: the share of a decode step's seconds that grows with the rows it runs (the rest, the
    # weights' reads and the launches, every step pays alike): what a narrow step of the continuous
    # engine's tail costs (`Workload.decode_fractions`). 1.0: a step costs in proportion to its rows.
    decode_width_share: float = 1.0
    # A generate call whose steps read only the columns their rows filled (`Workload.decode_reads`, `aged_reads`): the
    # share of a full-width step's row part that grows with the columns read (the KV reads and scores), by which a
    # step's cost follows its read (`Workload.decode_fractions`). 0.0: every step reads the whole cache.
    decode_context_share: float = 0.0


class _Ctx:
    """Per-(call, placement) quantities shared by the phase formulas."""

    def __init__(self, cfg: ModelConfig, head: str, layout: Layout, geo: Geometry, hw: HardwareProfile):
        self.cfg, self.head, self.layout, self.geo, self.hw = cfg, head, layout, geo, hw
        self.t = layout.tensor
        self.c = layout.context
        self.stages = layout.stage
        self.shards = layout.fsdp * layout.tensor  # a parameter's shards inside a stage
        self.e = layout.expert
        self.batch_ways = layout.data * layout.fsdp * layout.expert  # the batch's shards
        self.flops_s = hw.matmul_flops(cfg.dtype, geo.devices_on_host)
        self.mem_bw = hw.memory_bandwidth(geo.devices_on_host)
        self.bw = {a: hw.link_bandwidth(geo.crosses[a], geo.devices_on_host, geo.members[a]) for a in AXES}
        # Stage hand-offs are point to point: every device sends its own activation at once.
        self.bw_hand_off = hw.link_bandwidth(geo.crosses["stage"], geo.devices_on_host)
        pb = DTYPE_BYTES[cfg.param_dtype]
        # all layers, one tensor shard (and this device's experts), FSDP gathered
        self.w_layers = (layer_param_count(cfg) - expert_split_count(cfg, layout)) * pb / self.t
        self.w_rest = (param_count(cfg, head) - layer_param_count(cfg)) * pb / self.t  # embedding, norm, head
        self.act_bytes = DTYPE_BYTES[cfg.dtype]
        self.mm_head = cfg.hidden_size * cfg.vocab_size if head == "lm" else cfg.hidden_size
        self.mm_layer = (flop_params(cfg, head) - self.mm_head) / cfg.num_layers

    def _block(self, tokens: float, keys: float, layers: float, runs: int, attention: tuple[float, bool]
               ) -> dict[str, float]:
        """`runs` passes of `tokens` tokens per device through `layers` decoder layers; `attention`: the share
        of the [T, keys] scores computed and whether a backward recomputes them (`attention_kind`)."""
        cfg, hw = self.cfg, self.hw
        w = self.w_layers * layers / cfg.num_layers
        share, recomputed = attention
        attend = runs * attention_flops(cfg, tokens, keys) * share * layers / cfg.num_layers / self.t
        flops = runs * 2 * self.mm_layer * layers * tokens / self.t + attend
        hbm = runs * (w + tokens * cfg.hidden_size * self.act_bytes * layers * 4)
        tp_bytes = TP_ALLREDUCES_PER_LAYER * layers * tokens * cfg.hidden_size * self.act_bytes * runs
        return {
            "flops": flops, "hbm": hbm, "recomputed_scores_flops": attend / 2 if recomputed else 0.0,
            "tensor_comm": _ring_allreduce(tp_bytes, self.t, self.bw["tensor"], hw,
                                           count=TP_ALLREDUCES_PER_LAYER * layers * runs),
            "fsdp_comm": _ring_gather(runs * w, self.layout.fsdp, self.bw["fsdp"], hw, count=layers * runs),
            "overhead": runs * layers * OPS_PER_LAYER * hw.kernel_latency,
            "tp_bytes": 2 * (self.t - 1) / self.t * tp_bytes,
            "fsdp_bytes": (self.layout.fsdp - 1) / self.layout.fsdp * runs * w,
            **self._ring(tokens, keys, layers, runs),
            **self._experts(tokens, layers, runs),
        }

    def _experts(self, tokens: float, layers: float, runs: int) -> dict[str, float]:
        """Expert parallelism (e > 1): per MoE layer and run, the all-gather of the expert group's tokens
        and their combine weights ([e x tokens, hidden + num_experts]) and the reduce-scatter of the
        experts' partial sums ([e x tokens, hidden]) over the expert axis; under tensor parallelism the
        partial sums' all-reduce covers e x the tokens (the dense MLP's all-reduce, priced in `_block`, the
        device's own tokens only)."""
        e, cfg, hw = self.e, self.cfg, self.hw
        if e == 1 or not cfg.num_experts:
            return {"expert_comm": 0.0, "expert_bytes": 0.0}
        ab, d = self.act_bytes, cfg.hidden_size
        gather, scatter = e * tokens * (d + cfg.num_experts) * ab, e * tokens * d * ab
        n = runs * layers
        seconds = n * (_ring_gather(gather, e, self.bw["expert"], hw) + _ring_gather(scatter, e, self.bw["expert"], hw))
        sent = n * (e - 1) / e * (gather + scatter)
        if self.t > 1:
            extra = (e - 1) * tokens * d * ab
            seconds += n * _ring_allreduce(extra, self.t, self.bw["tensor"], hw)
            sent += n * 2 * (self.t - 1) / self.t * extra
        return {"expert_comm": seconds, "expert_bytes": sent}

    def _ring(self, tokens: float, keys: float, layers: float, runs: int) -> dict[str, float]:
        """Ring attention under context parallelism (c > 1): in every layer of every run, c - 1 passes of
        the device's key/value block (its `tokens` tokens' keys and values) to the next device of the ring,
        each overlapping the attention of the local queries over the block before it (keys / c keys): the
        seconds a pass takes beyond that attention are exposed."""
        c, cfg = self.c, self.cfg
        if c == 1:
            return {"context_comm": 0.0, "context_bytes": 0.0, "trade_comm": 0.0, "trade_bytes": 0.0}
        kv_ways = max(min(self.t, cfg.num_kv_heads), 1)
        block = tokens * 2 * cfg.num_kv_heads * cfg.dim_per_head / kv_ways * self.act_bytes
        send = block / self.bw["context"] + self.hw.collective_latency
        attend = attention_flops(cfg, tokens, keys / c) / cfg.num_layers / self.t / self.flops_s
        passes = runs * layers * (c - 1)
        # zig-zag order (models/context.py) where 2c divides the sequence: per layer, half of the block's
        # q, k, v traded before the ring and half of its output after (8 permutes), not overlapped
        trade = 0.0
        if keys % (2 * c) == 0:
            trade = tokens * (cfg.num_heads / self.t + cfg.num_kv_heads / kv_ways) * cfg.dim_per_head * self.act_bytes
        trade_s = runs * layers * (trade / self.bw["context"] + 8 * self.hw.collective_latency) if trade else 0.0
        return {"context_comm": passes * max(send - attend, 0.0), "context_bytes": passes * block,
                "trade_comm": trade_s, "trade_bytes": runs * layers * trade}

    def _head(self, tokens: float, runs: int) -> dict[str, float]:
        """The embedding lookup and output head for `runs` passes of `tokens` tokens per device."""
        flops = runs * 2 * self.mm_head * tokens / self.t
        hbm = runs * self.w_rest
        return {"flops": flops, "hbm": hbm, "recomputed_scores_flops": 0.0, "tensor_comm": 0.0,
                "fsdp_comm": _ring_gather(runs * self.w_rest, self.layout.fsdp, self.bw["fsdp"], self.hw, count=runs),
                "overhead": runs * OPS_PER_LAYER * self.hw.kernel_latency,
                "tp_bytes": 0.0, "fsdp_bytes": (self.layout.fsdp - 1) / self.layout.fsdp * runs * self.w_rest,
                "context_comm": 0.0, "context_bytes": 0.0, "trade_comm": 0.0, "trade_bytes": 0.0,
                "expert_comm": 0.0, "expert_bytes": 0.0}

    def attention_kind(self, keys: float, cached: bool, flash: bool, blockwise: bool | None = None
                       ) -> tuple[float, bool]:
        """(share of the [T, keys] score blocks a forward computes, whether its backward recomputes them):
        jaxrlhf's dense attention computes every score, the causal mask's empty half too, and autodiff keeps
        them; its blockwise attention (`ModelConfig.attends_blockwise`: rows of `blockwise_attention_from`
        tokens and more, no KV cache, no context split) skips the key blocks wholly in the future, n (n + 1) / 2
        of n x n blocks, and its backward recomputes a block pair's scores (one more q.k^T product); a peer's
        FlashAttention (`flash`) does the same in tiles of FLASH_TILE tokens. The ring (c > 1, `models.context`)
        recomputes too, and in zig-zag order (where 2c divides the row) each device scores (2c + 1) / 4c of its
        queries' [T / c, T] scores; in contiguous order every step waits for the device that scores them all.
        `blockwise`: whether the rows attend blockwise where `keys` (a packed row's own sequences') is not the
        row's width, which decides it (`forward_shape`); None: decided by `keys`."""
        if blockwise is None:
            blockwise = not cached and self.cfg.attends_blockwise(int(keys), self.c)
        if flash:
            n = max(math.ceil(keys / FLASH_TILE), 1)
        elif self.c > 1:
            return ((2 * self.c + 1) / (4 * self.c) if keys % (2 * self.c) == 0 else 1.0), True
        elif blockwise:
            n = math.ceil(keys / self.cfg.attention_block)
        else:
            return 1.0, False
        return (n + 1) / (2 * n), True

    def forward(self, tokens_dev: float, keys: float, seqs_dev: float, micro: int,
                head_tokens: float | None = None, cached: bool = False, flash: bool = False,
                blockwise: bool | None = None) -> dict[str, float]:
        """One forward over `tokens_dev` tokens per device in `micro` micro-batches, the output head over
        `head_tokens` of them (default all: a packed call reads only its real response tokens); `cached`:
        a prefill writing a KV cache, `flash`: a peer's FlashAttention (`attention_kind`).

        Pipelined (S stages): M + S - 1 iterations of a block of num_layers / S layers,
        each followed by the hand-off of one micro-batch's activation to the next stage.
        """
        cfg, S = self.cfg, self.stages
        tok = tokens_dev / micro
        runs = micro + S - 1
        head_tok = tok if head_tokens is None else head_tokens / micro
        attention = self.attention_kind(keys, cached, flash, blockwise)
        parts = [self._block(tok, keys, cfg.num_layers / S, runs, attention), self._head(head_tok, micro)]
        out = {k: sum(p[k] for p in parts) for k in parts[0]}
        out["compute"] = max(out["flops"] / self.flops_s, out["hbm"] / self.mem_bw)
        hand_off = tok * cfg.hidden_size * self.act_bytes
        out["stage_comm"] = runs * (hand_off / self.bw_hand_off + self.hw.collective_latency) if S > 1 else 0.0
        out["stage_bytes"] = runs * hand_off if S > 1 else 0.0
        out["bubble"] = (S - 1) / runs
        return out


def _finish(parts: dict[str, float], flops: float, hbm: float, comm_bytes: float) -> CallCost:
    return CallCost(sum(parts.values()), flops, hbm, comm_bytes, parts)


def generate_cost(c: _Ctx, wl: Workload, call: CallSpec) -> CallCost:
    cfg, hw = c.cfg, c.hw
    if c.stages > 1:
        raise ValueError(f"{call.name}: generation is never pipelined; layout {c.layout} has stage={c.stages}")
    if c.c > 1:
        raise ValueError(f"{call.name}: generation is never context-parallel; layout {c.layout} has context={c.c}")
    prompts, seqs, n = wl.generate_shape(call, c.batch_ways)
    pre = c.forward(prompts * wl.prompt_len, wl.prompt_len, prompts, 1, cached=True, flash=wl.flash_attention)
    # Decode: `seqs` rows per step, n steps (rounds of gen_len steps). jaxrlhf's engines attend over every column
    # of a row's cache at every step, masked (prompt_len + gen_len columns: a dense cache, or a block table's
    # pages gathered whole, `transformer._read_pages`; the continuous engine: of its read, below). A
    # `live_kv` engine (a peer's paged attention) reads the row's own tokens: prompt_len + s at its step s, a
    # context growing linearly (the steps' sums, and the sum of each step's roofline, the larger of two linear
    # terms, in closed form); with drawn lengths each row's own, so every step is priced at the drawn rows' mean
    # context (`live_context`), `decode_fractions` scaling the steps by the rows they run.
    # The continuous engine whose pool starts every row at once reads, at each step, only the narrowest span of
    # response columns that holds its rows' tokens (`Workload.decode_reads`): a context of prompt_len + that span.
    rounds = n // wl.gen_len
    reads = None if wl.live_kv else wl.decode_reads(call, c.batch_ways)
    if reads:
        contexts, counts = np.unique(wl.read_context(reads), return_counts=True)
        segments: tuple[tuple[float, int], ...] | None = tuple(zip(contexts.tolist(), counts.tolist()))
    elif not wl.live_kv:
        segments = ((wl.prompt_len + wl.gen_len, wl.gen_len),)
    elif wl.lengths_vary and not wl.multi_turn:
        segments = ((wl.live_context(), wl.gen_len),)
    else:
        segments = None  # growing, step by step
    kv_heads_ways = min(c.t, cfg.num_kv_heads)
    w_tensor = c.w_layers + c.w_rest

    def steps(rows: float, segments=segments) -> tuple[float, float, float, float]:
        """The decode steps of `rows` rows: their FLOPs, bytes and seconds summed, and the tensor collectives'."""
        # per step: flops = f0 + f1 * ctx, bytes = h0 + h1 * ctx, ctx = prompt_len + s for s in 0..gen_len-1 (growing)
        # or each segment's context for its steps
        f0, f1 = 2 * flop_params(cfg, c.head) * rows / c.t, attention_flops(cfg, rows, 1.0) / c.t
        h0, h1 = w_tensor, rows * kv_bytes_per_token(cfg) / kv_heads_ways
        tp = _ring_allreduce(TP_ALLREDUCES_PER_LAYER * cfg.num_layers * rows * cfg.hidden_size * c.act_bytes * n,
                             c.t, c.bw["tensor"], hw, count=TP_ALLREDUCES_PER_LAYER * cfg.num_layers * n)
        if segments is not None:
            flops = rounds * sum(k * (f0 + f1 * x) for x, k in segments)
            hbm = rounds * sum(k * (h0 + h1 * x) for x, k in segments)
            seconds = rounds * sum(k * max((f0 + f1 * x) / c.flops_s, (h0 + h1 * x) / c.mem_bw) for x, k in segments)
            return flops, hbm, seconds, tp
        lo, hi = wl.prompt_len, wl.prompt_len + wl.gen_len - 1
        seconds = rounds * _sum_of_max(f0 / c.flops_s, f1 / c.flops_s, h0 / c.mem_bw, h1 / c.mem_bw, lo, hi)
        return rounds * _linear_sum(f0, f1, lo, hi), rounds * _linear_sum(h0, h1, lo, hi), seconds, tp

    flops_steps, hbm_steps, decode, tp = steps(seqs)
    _, _, decode_half, tp_half = steps(seqs / 2)
    fsdp = _ring_gather(n * w_tensor, c.layout.fsdp, c.bw["fsdp"], hw, count=cfg.num_layers * n)
    parts = {
        "prefill": pre["compute"],
        "decode": decode,
        "tensor_comm": pre["tensor_comm"] + tp,
        "fsdp_comm": pre["fsdp_comm"] + fsdp,
        "overhead": pre["overhead"] + n * cfg.num_layers * OPS_PER_LAYER * hw.kernel_latency,
    }
    if c.e > 1:  # the prefill's and every decode step's token gathers and scatters over the expert axis
        steps_e = c._experts(seqs, cfg.num_layers, n)
        parts["expert_comm"] = pre["expert_comm"] + steps_e["expert_comm"]
        pre["tp_bytes"] += pre["expert_bytes"] + steps_e["expert_bytes"]
    comm = pre["tp_bytes"] + pre["fsdp_bytes"] + (
        2 * (c.t - 1) / c.t * TP_ALLREDUCES_PER_LAYER * cfg.num_layers * seqs * cfg.hidden_size * c.act_bytes * n
    ) + (c.layout.fsdp - 1) / c.layout.fsdp * n * w_tensor
    cost = _finish(parts, pre["flops"] + flops_steps, pre["hbm"] + hbm_steps, comm)
    grows = 2 * (decode + tp - decode_half - tp_half)  # of the steps' seconds, what is in proportion to rows
    context_share = 0.0
    if reads or (not wl.live_kv and wl.aged_reads(call, c.batch_ways)):
        # of a full-context step's row part, what grows with the columns read (`decode_fractions`; where rows
        # start at different steps, a step reads by its oldest active row)
        def row_part(context: float) -> float:
            whole = ((context, wl.gen_len),)
            return steps(seqs, whole)[2] - steps(seqs / 2, whole)[2]
        context_share = _share(row_part(wl.seq_len) - row_part(0.0), row_part(wl.seq_len))
    return dataclasses.replace(cost, decode_width_share=_share(grows, cost.seconds - parts["prefill"]),
                               decode_context_share=context_share)


def _linear_sum(a: float, b: float, lo: int, hi: int) -> float:
    """Sum of a + b x over the integers x in lo..hi."""
    count = hi - lo + 1
    return count * a + b * (lo + hi) * count / 2 if count > 0 else 0.0


def _sum_of_max(a1: float, b1: float, a2: float, b2: float, lo: int, hi: int) -> float:
    """Sum of max(a1 + b1 x, a2 + b2 x) over the integers x in lo..hi: the two lines cross at most once, so each
    side of the crossing is a linear sum."""
    if b1 == b2:
        return _linear_sum(max(a1, a2), b1, lo, hi)
    cross = (a2 - a1) / (b1 - b2)  # the first line is above the second for x > cross when b1 > b2
    split = min(max(math.floor(cross), lo - 1), hi)  # x <= split on one side, x > split on the other
    below, above = ((a2, b2), (a1, b1)) if b1 > b2 else ((a1, b1), (a2, b2))
    return _linear_sum(*below, lo, split) + _linear_sum(*above, split + 1, hi)


def _share(grows: float, total: float) -> float:
    return float(min(max(grows / total, 0.0), 1.0)) if total > 0 else 1.0


def forward_shape(c: _Ctx, wl: Workload, call: CallSpec) -> tuple[float, float, float, float, bool | None]:
    """(tokens, attention keys per token, sequences, micro-batches, blockwise) of one forward of a train
    call's update or of an inference call, per device: padded rows of prompt_len + gen_len, or packed rows
    (`Workload.packed_shape`: every micro-batch's rows, padding in them included, the drawn batches' mean;
    each token attends over its row's width, masked, where the row attends densely; blockwise, a block pair
    with no query and key of one sequence is skipped (`models.blockwise`), so a token meets about its own
    sequence's keys, sum L^2 / sum L over the drawn sequences, as a varlen kernel's do, and a block more).
    Context parallelism splits each row's tokens over its c devices. `blockwise`: set where the keys are not the row's width
    (`_Ctx.attention_kind`)."""
    seqs = wl.call_seqs(call) / c.batch_ways
    if not wl.packed:
        return seqs * wl.seq_len / c.c, wl.seq_len, seqs, wl.micro_batches(call), None
    if wl.varlen:
        tokens, keys, micro, _ = wl.varlen_shape(call, c.batch_ways)
        return tokens / c.c, keys, seqs, micro, None
    shape = wl.packed_shape(call, c.batch_ways, c.cfg, c.c)
    tokens = shape.micro_batches * shape.rows * shape.width / c.c
    if c.cfg.attends_blockwise(shape.width, c.c):  # plus a block: a sequence's ends rarely meet block edges
        keys = min(wl.varlen_shape(call, c.batch_ways)[1] + c.cfg.attention_block, shape.width)
        return tokens, keys, seqs, shape.micro_batches, True
    return tokens, shape.width, seqs, shape.micro_batches, None


def head_tokens(c: _Ctx, wl: Workload, call: CallSpec) -> float | None:
    """Tokens per device one forward's output head runs over: a packed call's read positions (its real
    response tokens, `PackedShape.reads` per micro-batch); None: every token of `forward_shape`."""
    if not wl.packed:
        return None
    if wl.varlen:
        return wl.varlen_shape(call, c.batch_ways)[3] / c.c
    shape = wl.packed_shape(call, c.batch_ways, c.cfg, c.c)
    return shape.micro_batches * shape.reads / c.c


def inference_cost(c: _Ctx, wl: Workload, call: CallSpec) -> CallCost:
    tokens, keys, seqs, micro, blockwise = forward_shape(c, wl, call)
    f = c.forward(tokens, keys, seqs, micro, head_tokens(c, wl, call), flash=wl.flash_attention, blockwise=blockwise)
    parts = {"forward": f["compute"], "tensor_comm": f["tensor_comm"], "fsdp_comm": f["fsdp_comm"],
             "stage_comm": f["stage_comm"], "overhead": f["overhead"]}
    if c.c > 1:
        parts["context_comm"] = f["context_comm"] + f["trade_comm"]
    if c.e > 1:
        parts["expert_comm"] = f["expert_comm"]
    return _finish(parts, f["flops"], f["hbm"],
                   f["tp_bytes"] + f["fsdp_bytes"] + f["stage_bytes"] + f["context_bytes"] + f["trade_bytes"]
                   + f["expert_bytes"])


def train_cost(c: _Ctx, wl: Workload, call: CallSpec) -> CallCost:
    cfg, hw, lay = c.cfg, c.hw, c.layout
    steps = wl.minibatches * wl.ppo_epochs
    tokens, keys, seqs, micro, blockwise = forward_shape(c, wl, call)
    f = c.forward(tokens, keys, seqs, micro, head_tokens(c, wl, call), flash=wl.flash_attention, blockwise=blockwise)
    recompute = {"none": 0.0, "dots": 0.3, "full": 1.0}[wl.remat_for(call.role)]  # share of a forward redone
    # forward, backward = 2 forwards (input and weight gradients), recomputed forward; under LoRA the
    # frozen base has no weight gradients, so the backward is about one forward (the adapters are tiny)
    passes = (2 if cfg.lora else 3) + recompute
    tp_passes = 2 + recompute  # forward, backward, recomputed forward all-reduce activations
    # ring attention: the forward's and the recomputed forward's rings, and the backward's (each block with
    # its key/value gradients: twice the bytes)
    ring_passes = 3 + recompute
    # FSDP: gather weights for forward and backward, reduce-scatter gradients, per micro-batch run.
    fsdp = 3 * f["fsdp_comm"]
    pb = DTYPE_BYTES[cfg.param_dtype]
    grad_shard = trained_shard_bytes(cfg, c.head, lay)
    dp = _ring_allreduce(grad_shard, lay.data, c.bw["data"], hw)
    # The embedding and head live on every stage: their gradients are summed over stages (frozen under LoRA).
    rest_shard = 0.0 if cfg.lora else (param_count(cfg, c.head) - layer_param_count(cfg)) * pb / c.shards
    stage_ar = _ring_allreduce(rest_shard, c.stages, c.bw["stage"], hw)
    # Expert parallelism splits the batch: the weights outside the experts are summed over the expert axis too.
    outside = grad_shard if cfg.lora else (param_count(cfg, c.head) - expert_param_count(cfg)) * pb / c.shards
    expert_ar = _ring_allreduce(outside, lay.expert, c.bw["expert"], hw)
    # ZeRO-1: each data replica updates its 1/data of the optimizer state (the weights outside the experts'
    # 1/(data x expert)), then the new parameters are all-gathered back (`placement.layout.optimizer_spec`)
    n_params_dev = optimizer_shard_count(cfg, c.head, lay)
    tb = DTYPE_BYTES[trained_dtype(cfg)]
    opt_bytes = n_params_dev * (3 * tb + 2 * optimizer_bytes_per_param(cfg, wl, call.role))
    param_gather = (_ring_gather(grad_shard, lay.data, c.bw["data"], hw)
                    + _ring_gather(outside, lay.expert, c.bw["expert"], hw))  # weights outside the experts
    per_step = {
        # blockwise (or flash) attention's backward recomputes each block pair's scores
        "compute": passes * f["compute"] + f["recomputed_scores_flops"] / c.flops_s,
        "tensor_comm": tp_passes * f["tensor_comm"],
        "fsdp_comm": fsdp,
        "grad_allreduce": dp + stage_ar + expert_ar,
        "param_gather": param_gather,
        "stage_comm": 2 * f["stage_comm"],  # activations forward, their gradients backward
        "optimizer": opt_bytes / c.mem_bw + hw.kernel_latency * OPS_PER_LAYER,
        "overhead": passes * f["overhead"],
    }
    if c.c > 1:
        # the zig-zag trades once per forward (and recomputed forward) and once, transposed, in the backward
        per_step["context_comm"] = ring_passes * f["context_comm"] + tp_passes * f["trade_comm"]
    if c.e > 1:  # forward, recomputed forward, and the backward's transposes (reduce-scatter, all-gather)
        per_step["expert_comm"] = tp_passes * f["expert_comm"]
    parts = {k: v * steps for k, v in per_step.items()}
    comm = steps * (tp_passes * f["tp_bytes"] + 3 * f["fsdp_bytes"] + 2 * f["stage_bytes"]
                    + ring_passes * f["context_bytes"] + tp_passes * f["trade_bytes"] + tp_passes * f["expert_bytes"]
                    + (3 * (lay.data - 1) / lay.data * grad_shard if lay.data > 1 else 0.0)
                    + ((lay.expert - 1) / lay.expert * outside if lay.expert > 1 else 0.0)
                    + (2 * (c.stages - 1) / c.stages * rest_shard if c.stages > 1 else 0.0)
                    + (2 * (lay.expert - 1) / lay.expert * outside if lay.expert > 1 else 0.0))
    return _finish(parts, steps * (passes * f["flops"] + f["recomputed_scores_flops"]),
                   steps * (passes * f["hbm"] + opt_bytes), comm)


def generate_durations(cost: CallCost, wl: Workload, call: CallSpec, batch_ways: int,
                       streamed: bool = False, eta: int | None = None) -> tuple[float, ...]:
    """Seconds of a generate call for each of the LENGTH_BATCHES batches of response lengths: the
    prefill as priced, everything else (decode, its collectives and kernel launches) scaled by the
    batch's decode steps, narrow ones at what a step of their width costs (`Workload.decode_fractions`
    with the call's `decode_width_share`; `streamed` and `eta` as there). A per-step scale, not a re-pricing: a
    short batch's steps attend to a shorter cache, which this leaves out (it errs towards the longer
    time)."""
    prefill = cost.parts.get("prefill", 0.0)
    fractions = wl.decode_fractions(call, batch_ways, streamed, cost.decode_width_share, eta,
                                    cost.decode_context_share)
    return tuple(prefill + (cost.seconds - prefill) * f for f in fractions)


CALL_COSTS = {"generate": generate_cost, "inference": inference_cost, "train": train_cost}


def call_cost(call: CallSpec, cfg: ModelConfig, group: DeviceGroup, layout: Layout, wl: Workload,
              hw: HardwareProfile) -> CallCost:
    """Seconds of `call` (one RLHF step's worth of it) with its role's model `cfg` on `group` x `layout`:
    a training run's own time of exactly this call and placement when the profile holds one
    (`source` "run"), else the profile's measured tables when they cover it (`measured_cost`), else
    the formulas; the latter two scaled by how far they were off for this call in runs on other
    placements (`Measured.correction`; `source` then says "measured x run" or "formula x run")."""
    base = profile_call_cost(call, cfg, group, layout, wl, hw)
    if not hw.measured or not hw.measured.runs:
        return base
    key = model_key(cfg, call.head)
    run = hw.measured.run(call.name, key, group.size, str(layout), wl.call_seqs(call), wl.seq_len,
                          wl.micro_batches(call), knob_tag(call, wl))
    if run is not None:
        scale = run.seconds / base.seconds if base.seconds > 0 else 0.0  # the estimate's parts, in the run's time
        parts = {k: v * scale for k, v in base.parts.items()} if scale else {"run": run.seconds}
        return dataclasses.replace(base, seconds=run.seconds, parts=parts, source="run")
    factor = hw.measured.correction(call.name, key, base.source)
    if factor is None:
        return base
    return dataclasses.replace(base, seconds=base.seconds * factor,
                               parts={k: v * factor for k, v in base.parts.items()}, source=f"{base.source} x run")


def profile_call_cost(call: CallSpec, cfg: ModelConfig, group: DeviceGroup, layout: Layout, wl: Workload,
                      hw: HardwareProfile) -> CallCost:
    """`call_cost` from the profile alone (its tables, else the formulas), no run's times: what a
    run's time of the call is compared with (`Run.estimate`)."""
    formula = formula_cost(call, cfg, group, layout, wl, hw)
    cost = measured_cost(call, cfg, group, layout, wl, hw, formula) or formula
    return rollout_cost(cost, wl) if call.kind == "generate" else cost


def formula_cost(call: CallSpec, cfg: ModelConfig, group: DeviceGroup, layout: Layout, wl: Workload,
                 hw: HardwareProfile) -> CallCost:
    """`call` priced by the formulas alone (`CALL_COSTS`), whatever the profile measured."""
    return CALL_COSTS[call.kind](_Ctx(cfg, call.head, layout, Geometry.of(group, layout, hw), hw), wl, call)


def measured_cost(call: CallSpec, cfg: ModelConfig, group: DeviceGroup, layout: Layout, wl: Workload,
                  hw: HardwareProfile, formula: CallCost) -> CallCost | None:
    """`call` from `hw.measured` (None when it holds nothing for it): timed on this placement
    (`_table_parts`, source "measured"), else `formula` scaled by how far the formulas are off where
    the profile timed the call (`_layout_calibration`, source "calibrated"). FLOP and byte counts stay
    the formulas' (they are counts)."""
    if not hw.measured:
        return None
    parts = _table_parts(call, cfg, group.size, layout, wl, hw)
    if parts is not None:
        share = formula.decode_width_share
        if call.kind == "generate":  # a full-width step against a half-width one, both timed
            step = lambda rows: hw.measured.find(model_key(cfg, call.head), "decode", group.size,  # noqa: E731
                                                 str(layout)).seconds(rows, wl.seq_len)
            rows = wl.call_seqs(call)
            share = _share(2 * (step(rows) - step(rows / 2)), step(rows))
        return CallCost(sum(parts.values()), formula.flops, formula.hbm_bytes, formula.collective_bytes, parts,
                        source="measured", decode_width_share=share)
    factor = _layout_calibration(call, cfg, group, layout, wl, hw)
    if factor is None:
        return None
    return dataclasses.replace(formula, seconds=formula.seconds * factor,
                               parts={k: v * factor for k, v in formula.parts.items()}, source="calibrated")


def _table_parts(call: CallSpec, cfg: ModelConfig, devices: int, layout: Layout, wl: Workload,
                 hw: HardwareProfile) -> dict[str, float] | None:
    """Seconds of `call` from the tables of exactly this placement (None when a phase it needs has
    none): generate = prefill + gen_len decode steps over a cache of prompt + response slots,
    inference = one forward, train = one optimizer step per minibatch and epoch; a micro-batched call
    as `Table.split_seconds` prices it. A pipelined layout (S stages, M micro-batches) from the
    tables of one stage's placement (devices / S, the layout without stages): M + S - 1 iterations
    (`models.pipeline.gpipe`), in each every stage runs its 1/S of the layers on one micro-batch, the
    stages side by side, or one after another where they share a host's cores (on 8 CPU devices
    that priced a 2-stage call 1.66 s against 1.77 s measured; the formulas, scaled, gave 0.55 s)."""
    key = model_key(cfg, call.head)
    rows, length, micro = wl.call_seqs(call), wl.seq_len, wl.micro_batches(call)
    if wl.packed and call.kind != "generate":  # the packed rows of every micro-batch, as wide as they are
        ways = layout.batch_ways
        shape = wl.packed_shape(call, ways, cfg, layout.context)
        rows, length, micro = shape.micro_batches * shape.rows * ways, shape.width, shape.micro_batches
    stages = layout.stage
    devices, layout = timed_placement(devices, layout)

    def table(phase: str):
        return hw.measured.find(key, phase, devices, str(layout))

    def passes(t) -> float:
        if stages == 1:
            return t.split_seconds(rows, length, micro)
        at_once = 1 if hw.shares_cores else stages
        return (micro + stages - 1) * t.seconds(rows / micro, length) / at_once

    if call.kind == "generate":
        pre, dec = table("prefill"), table("decode")
        if pre is None or dec is None:
            return None
        ways = layout.batch_ways
        prompts, width, steps = wl.generate_shape(call, ways)  # each group's prompt prefilled once; the pool's
        return {"prefill": pre.seconds(prompts * ways, wl.prompt_len),  # rows per decode step, over its steps
                "decode": steps * dec.seconds(width * ways, wl.seq_len)}
    t = table(call.kind)
    if t is None:
        return None
    if call.kind == "inference":
        return {"forward": passes(t)}
    return {"compute": wl.minibatches * wl.ppo_epochs * passes(t)}


def _layout_calibration(call: CallSpec, cfg: ModelConfig, group: DeviceGroup, layout: Layout, wl: Workload,
                        hw: HardwareProfile) -> float | None:
    """How far the formulas are off for `call` (measured / formula seconds) where the profile timed it:
    on the single-axis layouts (all of `group` on one axis) that `layout` combines, averaged in log space
    with weights log(ways on that axis) (data 4 x tensor 2 on 8 devices takes 2/3 of data 8's error and
    1/3 of tensor 8's); otherwise (another group size, a staged layout) the median over every placement
    the profile timed the call on (one placement timed wrong does not move the others). None when it
    timed none."""
    ways = {"data": layout.data, "fsdp": layout.fsdp, "tensor": layout.tensor}
    weights = {axis: math.log(n) for axis, n in ways.items() if n > 1}
    if layout.stage == 1 and len(weights) > 1:
        errors = [_formula_error(call, cfg, group, Layout(**{axis: group.size}), wl, hw) for axis in weights]
        if None not in errors:
            return math.exp(sum(w * math.log(e) for w, e in zip(weights.values(), errors)) / sum(weights.values()))
    key = model_key(cfg, call.head)
    timed = {(t.devices, t.layout) for t in hw.measured.tables.values() if t.model == key}
    errors = [_formula_error(call, cfg, DeviceGroup("timed", 0, n), Layout.parse(lay), wl, hw)
              for n, lay in sorted(timed)]
    errors = [e for e in errors if e is not None]
    return float(np.median(errors)) if errors else None


def _formula_error(call: CallSpec, cfg: ModelConfig, group: DeviceGroup, layout: Layout, wl: Workload,
                   hw: HardwareProfile) -> float | None:
    """Measured / formula seconds of `call` on a placement the profile's tables cover (else None)."""
    parts = _table_parts(call, cfg, group.size, layout, wl, hw)
    if parts is None:
        return None
    formula = formula_cost(call, cfg, group, layout, wl, hw)
    measured = sum(parts.values())
    return measured / formula.seconds if formula.seconds > 0 and measured > 0 else None


# ---- moving parameters -----------------------------------------------------------------------

def _hosts(group: DeviceGroup, hw: HardwareProfile) -> set[int]:
    return set(range(group.start // hw.devices_per_host, (group.stop - 1) // hw.devices_per_host + 1))


def realloc_cost(cfg: ModelConfig, head: str, src: DeviceGroup, src_layout: Layout, dst: DeviceGroup,
                 dst_layout: Layout, hw: HardwareProfile, adapters_only: bool = False) -> float:
    """Seconds to reshard a role's parameters from one placement to another (0 if identical);
    `adapters_only`: just its LoRA adapters (the sync of a shadow whose frozen base is already there).

    Receivers pull their shard over NVLink/ICI when their host also holds source
    devices, else over the host's NICs shared by its receiving devices; senders
    are bounded by their own link. A congruent reshard on the source (one read
    and write of its shard) precedes the move.
    """
    if (src.start, src.size, src_layout) == (dst.start, dst.size, dst_layout):
        return 0.0
    shard = (lambda lay: adapter_shard_bytes(cfg, lay)) if adapters_only else (lambda lay: shard_bytes(cfg, head, lay))
    recv = shard(dst_layout)
    total = recv * dst.size
    crosses = not _hosts(dst, hw) <= _hosts(src, hw)
    dst_on_host = min(dst.size, hw.devices_per_host)
    bw_recv = hw.link_bandwidth(crosses, dst_on_host)
    bw_send = hw.link_bandwidth(crosses, min(src.size, hw.devices_per_host))
    src_shard = shard(src_layout)
    reshard = 2 * src_shard / hw.memory_bandwidth(min(src.size, hw.devices_per_host))
    if src.start == dst.start and src.size == dst.size:
        # Same devices, other layout: a reshuffle among the group's own devices.
        move = recv / hw.link_bandwidth(len(_hosts(dst, hw)) > 1, dst_on_host)
    else:
        move = max(recv / bw_recv, total / (src.size * bw_send))
    return reshard + move + cfg.num_layers * hw.collective_latency


def offload_cost(cfg: ModelConfig, head: str, layout: Layout, hw: HardwareProfile) -> float:
    """Seconds to bring a device's shard back from host memory (the host copy stays, so offload is free)."""
    return shard_bytes(cfg, head, layout) / hw.host_bandwidth


def optimizer_offload_cost(state_bytes: float, hw: HardwareProfile) -> float:
    """Seconds a train call adds when its role's optimizer state waits in host memory between train calls
    (`ExecutionPlan.offload_optimizer`): a device's `state_bytes` come over the host link before the call and
    go back after it. Both are counted in the call: the copy back shares the device's link and memory with
    whatever runs next there."""
    return 2 * state_bytes / hw.host_bandwidth


class CostCache:
    """Memoised call and move costs for one (models, workload, hardware): the search asks for the
    same placements many times."""

    def __init__(self, models: Mapping[str, ModelConfig], wl: Workload, hw: HardwareProfile):
        self.models, self.wl, self.hw = models, wl, hw
        self._calls: dict[tuple, CallCost] = {}
        self._workloads: dict[tuple, Workload] = {}
        self._moves: dict[tuple, float] = {}
        self.move_sources: dict[tuple, str] = {}  # move key -> "measured" (the profile timed it) or "formula"
        self.memory: dict = {}  # per-(call, layout) byte counts for `memory.plan_memory`

    def call(self, call: CallSpec, group: DeviceGroup, layout: Layout, knobs: "CallKnobs | None" = None) -> CallCost:
        """Cost of `call` on `group` x `layout` under `knobs` (`planner.knobs`; None: the workload's own)."""
        key = (call.name, group.start, group.size, layout, knobs)
        if key not in self._calls:
            self._calls[key] = call_cost(call, self.models[call.role], group, layout, self.for_call(call, knobs),
                                         self.hw)
        return self._calls[key]

    def step_seconds(self, call: CallSpec, group: DeviceGroup, layout: Layout, knobs: "CallKnobs | None" = None
                     ) -> float:
        """`call`'s seconds in a step as the simulator prices them: a generate call's mean over the drawn
        batches of response lengths where they vary (`generate_durations`: a pool's tail and refill rounds,
        which its own seconds, priced at the cap, leave out), else `call`'s seconds. What a knob is ranked by.
        A partial-rollout stream's pools stay ranked at the cap: simulating the stream for every pool of every
        layout the search weighs took a streamed 64-device question from 56 to 127 s."""
        cost = self.call(call, group, layout, knobs)
        wl = self.for_call(call, knobs)
        if call.kind != "generate" or wl.streams or not wl.priced_per_batch(call, layout.batch_ways):
            return cost.seconds
        durations = generate_durations(cost, wl, call, layout.batch_ways, wl.gen_stream)
        return sum(durations) / len(durations)

    def for_call(self, call: CallSpec, knobs: "CallKnobs | None") -> Workload:
        """The workload as `call` runs it under `knobs` (`Workload.for_call`), made once per setting."""
        if knobs is None:
            return self.wl
        key = (call.name, knobs)
        if key not in self._workloads:
            self._workloads[key] = self.wl.for_call(call, knobs.micro, knobs.remat, knobs.slots, knobs.packing)
        return self._workloads[key]

    def move(self, call: CallSpec, src: DeviceGroup, src_layout: Layout, dst: DeviceGroup,
             dst_layout: Layout, adapters_only: bool = False) -> float:
        """Seconds to bring `call`'s role's parameters (or only its adapters) from (src, src_layout) to
        (dst, dst_layout)."""
        return self.move_cost(call, src, src_layout, dst, dst_layout, adapters_only)[0]

    def move_cost(self, call: CallSpec, src: DeviceGroup, src_layout: Layout, dst: DeviceGroup,
                  dst_layout: Layout, adapters_only: bool = False) -> tuple[float, str]:
        """`move` and what priced it: "measured" where the profile timed this parameter move
        (`Measured.move`; adapters-only syncs are never timed), else "formula" (`realloc_cost`)."""
        key = (call.role, call.head, src.start, src.size, src_layout, dst.start, dst.size, dst_layout, adapters_only)
        if key not in self._moves:
            seconds, source = None, "formula"
            same = (src.start, src.size, src_layout) == (dst.start, dst.size, dst_layout)
            if self.hw.measured and self.hw.measured.moves and not adapters_only and not same:
                seconds = self.hw.measured.move(model_key(self.models[call.role], call.head), "params",
                                                f"{src.start}+{src.size}:{src_layout}",
                                                f"{dst.start}+{dst.size}:{dst_layout}")
                source = "formula" if seconds is None else "measured"
            if seconds is None:
                seconds = realloc_cost(self.models[call.role], call.head, src, src_layout, dst, dst_layout,
                                       self.hw, adapters_only)
            self._moves[key], self.move_sources[key] = seconds, source
        return self._moves[key], self.move_sources[key]
