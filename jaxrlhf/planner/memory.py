"""Per-device memory of a plan: what stays resident and what each call adds.

Resident on a device between calls: the parameter shards of every role whose
home placement covers it, the AdamW state of trained roles (sharded like the
parameters, ZeRO style) and persistent shadow copies. While a call runs it
adds its working set: gradients and saved activations (train), one layer's
activations and the logits (inference), the KV cache (generate), and a
reallocated parameter copy when the call runs away from its role's home.
A device's peak is its resident bytes plus the largest working set of the
calls that run on it. When that exceeds the usable capacity, frozen roles
(no train call: reference, reward) are offloaded to host memory and
reloaded for their own calls; then, where the search allows it, trained
roles' optimizer state waits in host memory between their train calls (on
device only while its own train call runs); if it still does not fit the
plan is infeasible, with the reason.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping

import numpy as np

from jaxrlhf.graph import CallGraph, CallSpec
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.logit_sizes import chunk_positions
from jaxrlhf.planner.hardware import HardwareProfile
from jaxrlhf.planner.plan import ExecutionPlan, Layout
from jaxrlhf.planner.sizes import (
    DTYPE_BYTES,
    expert_split_count,
    kv_bytes_per_token,
    matmul_params,
    mlp_width,
    optimizer_bytes_per_param,
    optimizer_shard_count,
    shard_bytes,
    trained_dtype,
)
from jaxrlhf.planner.workload import Workload

if TYPE_CHECKING:
    from jaxrlhf.planner.knobs import CallKnobs

GiB = 2**30
LOGIT_COPIES_INFER = 1  # float32 logits (XLA fuses the log-softmax into their consumer)
LOGIT_COPIES_TRAIN = 3  # plus their gradient
# Dense attention's float32 [T, S] score matrices per head live at once (XLA:CPU, one 16k-token sequence a
# device, scripts/check_memory_model.py; at 512 tokens it holds 2): three in a forward (scores,
# exponentials, probabilities); in the backward of a rematerialised layer, beside the two it recomputes
# (`layer_saved_bytes`), XLA's peak holds two more and the bool mask. Logits built a chunk at a time
# (`algorithm.logit_chunk_tokens`, the default) leave them no buffers to share: two more (+0.8 % at 16k,
# check_memory_model's f8 row); whole logits share some, and the model then over-counts.
SCORE_COPIES_INFER = 3
SCORE_COPIES_BACKWARD = 2
# ... but only for long sequences: at 128 tokens (tests/planner/test_memory.py) one copy fits XLA's
# totals. llama3.2-1b's inference, 8 rows a device (check_memory_model --micro-batch 0): at 1024, 1536 and
# 2304 keys XLA holds three (the model's forward then within -3 %, +15 % and +10 %), as at 16k; below
# this many keys a forward counts one (between 128 and 1024 not measured).
LONG_SCORES_KEYS = 1024
# The backward's two more from 2k keys: llama3.2-1b's train call under remat, 16k tokens a device (1024-position
# logit chunks): XLA 23.23 / 40.29 GiB at 2k / 4k keys, the model 25.19 / 41.19 (+8.4 / +2.2 %); without them
# it was -26 % at 2k (at 1k not measured). Rows of `ModelConfig.blockwise_attention_from` tokens and more
# attend blockwise and hold none of these (BLOCK_SCORE_COPIES_*).
BACKWARD_SCORES_KEYS = 2048


def dense_score_copies(keys: float) -> float:
    """Float32 [T, S] score matrices per head a dense attention forward holds at `keys` keys."""
    return SCORE_COPIES_INFER if keys >= LONG_SCORES_KEYS else 1
# Ring attention under a train call (models/context.py): each chunk pair's mask depends only on slots, padding
# and segments, so autodiff's partial evaluation computes it once, ahead of the layers' loop, and keeps it
# for the backward, stacked over the ring's steps: one bool per query-key pair of each of the c blocks a
# device's queries meet (`context._masked` ties the mask to the scores before it is broadcast over the heads:
# kept broadcast, as bool and float32, it was 9 bytes per score element: XLA's total per device for
# llama3.2-1b's train call at 16k tokens, context 8, fell from 31.24 to 23.02 GiB). A forward keeps none.
RING_MASK_BYTES = 1.0
# Expert parallelism (models/moe.py `expert_parallel`): a device's sparse MLP runs on its expert group's tokens,
# e x its own, gathered over the expert axis. Its intermediates per token are the dense dispatch's (num_experts
# / e experts for e x the tokens), so they are counted as they were; what is new is gathered-token sized: a
# forward holds the gathered tokens, their combine weights and the partial sums before the reduce-scatter; a
# train call keeps the gathered tokens and combine weights of every layer for the backward, whose gathered
# output gradient and input gradient (before its reduce-scatter) live at once (fitted on XLA:CPU, 8 devices,
# expert 8 and 4 x data 2: within 1 % of the compiled peak, tests/models/test_expert_parallel.py).
EXPERT_BACKWARD_COPIES = 2


def expert_gather_bytes(cfg: ModelConfig, tokens: float, layout: Layout, train: bool) -> float:
    """Bytes of a device's expert-group token gathers (see EXPERT_BACKWARD_COPIES) for `tokens` of its own."""
    e = layout.expert
    if e == 1 or not cfg.num_experts:
        return 0.0
    ab, d = DTYPE_BYTES[cfg.dtype], cfg.hidden_size
    gathered = e * tokens * ab
    if not train:
        return gathered * (2 * d + cfg.num_experts)
    return gathered * (cfg.num_layers * (d + cfg.num_experts) + EXPERT_BACKWARD_COPIES * d)


def _tokens_per_micro(call: CallSpec, seqs_dev: float, seq_len: int, wl: Workload) -> float:
    """Tokens one device feeds through one forward (one micro-batch) of `call`."""
    return seqs_dev * seq_len / wl.micro_batches(call)


def _per_token_widths(cfg: ModelConfig, t: int) -> tuple[float, float, float, float]:
    """(hidden, query, key+value, mlp) widths one device holds per token under tensor size `t`."""
    q = cfg.num_heads * cfg.dim_per_head / t
    kv = 2 * cfg.num_kv_heads * cfg.dim_per_head / max(min(t, cfg.num_kv_heads), 1)
    return cfg.hidden_size, q, kv, mlp_width(cfg) / t


def layer_live_bytes(cfg: ModelConfig, tokens: float, keys: int, t: int, copies: float | None = None) -> float:
    """Bytes live at the peak of one layer's forward when nothing is kept for a backward pass:
    the residual stream, its norm and the attention output, q/k/v, the MLP's gate and up
    projections, and `copies` float32 score matrices of `keys` (a ring's: `_ring_score_copies`; None:
    dense attention's, `dense_score_copies`)."""
    d, q, kv, f = _per_token_widths(cfg, t)
    ab = DTYPE_BYTES[cfg.dtype]
    copies = dense_score_copies(keys) if copies is None else copies
    return tokens * (ab * (3 * d + q + kv + 2 * f) + keys * cfg.num_heads / t * 4 * copies)


def layer_saved_bytes(cfg: ModelConfig, tokens: float, keys: int, t: int, copies: float = 2) -> float:
    """Bytes one layer keeps for its backward pass: every projection input and output (norms,
    q/k/v, attention output, residuals, the MLP's gate, up, activation and product), the
    float32 attention scores and probabilities (`copies` of `keys`; a ring's: `_ring_score_copies`),
    and the token-flattened inputs of the down and output
    projections that the 2-D matmuls (`models.transformer.dense`) keep beside their 3-D forms (measured
    on XLA:CPU: one more embed-wide and one more mlp-wide row per token)."""
    d, q, kv, f = _per_token_widths(cfg, t)
    ab = DTYPE_BYTES[cfg.dtype]
    return tokens * (ab * (9 * d + 2 * q + kv + 6 * f) + keys * cfg.num_heads / t * 4 * copies)


def _ring_score_copies(seq_len: int, c: int, train: bool) -> float:
    """Ring attention's float32 scores, in blocks of T / c keys for a device's T / c queries: it scores one
    chunk pair at a time (`models.context._attend`; in zig-zag order, where 2c divides T, a chunk is half a
    block, so a pair is a quarter): the scores and probabilities in a forward, and its backward's
    recomputed ones with their gradients (`_block_grads`)."""
    parts = 2 if seq_len % (2 * c) == 0 else 1
    return (4 if train else 2) / parts**2


# Blockwise attention (`models.blockwise`, rows of at least `ModelConfig.blockwise_attention_from` tokens on one
# device): a forward holds one query block's float32 scores against one key block per head (scores,
# exponentials, probabilities), a layer keeps each query's float32 log-sum-exp per head for its backward,
# and the backward of one layer at a time adds its float32 query and output gradients beside one block
# pair's recomputed scores, probabilities and their gradients.
BLOCK_SCORE_COPIES_INFER = 3
BLOCK_SCORE_COPIES_BACKWARD = 4


def _block_score_copies(cfg: ModelConfig, width: int, train: bool) -> float:
    """Blockwise attention's score matrices, as `copies` of a [T, block] matrix per query: one query block
    of `width` at a time."""
    return (BLOCK_SCORE_COPIES_BACKWARD if train else BLOCK_SCORE_COPIES_INFER) * cfg.attention_block / width


def _blockwise_backward_bytes(cfg: ModelConfig, tokens: float, width: int, t: int) -> float:
    """What one blockwise layer's backward adds while it runs (see BLOCK_SCORE_COPIES_*): a block pair's
    float32 score-sized temporaries and the float32 query and output gradients of every token."""
    _, q, _, _ = _per_token_widths(cfg, t)
    scores = tokens * cfg.attention_block * cfg.num_heads / t * 4 * _block_score_copies(cfg, width, True)
    return scores + tokens * 2 * q * 4


def layer_matmul_bytes(cfg: ModelConfig, tokens: float, t: int) -> float:
    """Bytes of one layer's matmul outputs (q, k, v, attention output, gate, up, down): what the
    dots-saveable remat policy keeps for the backward pass."""
    d, q, kv, f = _per_token_widths(cfg, t)
    return tokens * DTYPE_BYTES[cfg.dtype] * (q + kv + 2 * d + 2 * f)


def _logit_bytes(cfg: ModelConfig, head: str, tokens: float, t: int, copies: int) -> float:
    return tokens * cfg.vocab_size / t * 4 * copies if head == "lm" else 0.0


def params_per_device(cfg: ModelConfig, head: str, layout: Layout) -> float:
    """A device's parameter shard: its stage's layers (all of them without a pipeline) plus the
    embedding and head, over fsdp x tensor."""
    return shard_bytes(cfg, head, layout)


def optimizer_per_device(cfg: ModelConfig, head: str, layout: Layout, wl: Workload, role: str | None = None) -> float:
    """AdamW state of what the role trains (under LoRA: the adapters only), its parameter shard's split
    further over the data-parallel axes (ZeRO-1, `sizes.optimizer_shard_count`; an array no dimension of
    which they divide stays whole there, a norm scale of an odd width: under 0.1 % of a model)."""
    return optimizer_shard_count(cfg, head, layout) * optimizer_bytes_per_param(cfg, wl, role)


def _logit_tokens(call: CallSpec, tokens: float, wl: Workload) -> float:
    """Of `tokens` fed through a forward, how many get full-vocabulary logits (see CallSpec)."""
    if call.kind == "generate":  # the prefill's last position only
        return tokens / wl.prompt_len
    return tokens if call.logit_positions == "all" else tokens * wl.gen_len / wl.seq_len


def head_gather_bytes(cfg: ModelConfig, head: str, layout: Layout) -> float:
    """The LM head (or tied embedding) gathered whole over FSDP for the logits matmul."""
    if head != "lm" or layout.fsdp == 1:
        return 0.0
    return cfg.hidden_size * cfg.vocab_size * DTYPE_BYTES[cfg.param_dtype] / layout.tensor


def working_set(call: CallSpec, cfg: ModelConfig, layout: Layout, wl: Workload) -> dict[str, float]:
    """Bytes one device needs on top of resident parameters while `call` runs.

    Context parallelism (layout.context = c > 1, train and inference) divides every activation by c: a
    device holds T / c tokens of each sequence, and ring attention scores its queries against one block
    of T / c keys at a time (its backward recomputes them, keeping no score matrix), with a second
    key/value block arriving beside the one it attends to. A train call adds the ring's masks, c blocks of
    them (a bool per query-key pair), which autodiff hoists out of the layers' loop (`RING_MASK_BYTES`)."""
    head = call.head
    t = layout.tensor
    batch_ways = layout.batch_ways
    ab = DTYPE_BYTES[cfg.dtype]
    # FSDP: two decoder layers gathered at a time (the one computing, the next one arriving); a generate call
    # all of them: the engines decode from weights split into layers once, outside the token loop
    # (`transformer.split_layers`), so each layer's all-gather is loop-invariant and XLA hoists them all out
    # of the loop, every layer's weights gathered for the whole call (scripts/check_memory_model.py, XLA:CPU)
    layer_bytes = (matmul_params(cfg, "value") - cfg.hidden_size - expert_split_count(cfg, layout)) / cfg.num_layers \
        * DTYPE_BYTES[cfg.param_dtype]  # (this device's experts only, under expert parallelism)
    gathered_layers = cfg.num_layers if call.kind == "generate" else 2
    gathered = gathered_layers * layer_bytes / t if layout.fsdp > 1 else 0.0
    head_gathered = head_gather_bytes(cfg, head, layout)
    seqs = wl.call_seqs(call) / batch_ways
    if call.kind == "generate":  # the engine's cache as it allocates it (`Workload.generate_kv_columns`)
        prompts, rows, _ = wl.generate_shape(call, batch_ways)
        kv = wl.generate_kv_columns(call, batch_ways) * kv_bytes_per_token(cfg) / max(min(t, cfg.num_kv_heads), 1)
        tok = _tokens_per_micro(call, prompts, wl.prompt_len, wl)
        prefill = layer_live_bytes(cfg, tok, wl.prompt_len, t) + _logit_bytes(
            cfg, head, _logit_tokens(call, tok, wl), t, 1)
        out = {"kv_cache": kv, "activations": prefill, "fsdp_buffers": gathered + head_gathered}
        if layout.expert > 1:
            out["expert_gathers"] = expert_gather_bytes(cfg, tok, layout, train=False)
        return out
    micro = wl.micro_batches(call)
    tok = _tokens_per_micro(call, seqs, wl.seq_len, wl) / layout.context
    logit_tok = _logit_tokens(call, tok, wl)
    rows = tok * layout.context / wl.seq_len  # a micro-batch's rows on this device
    keys = wl.seq_len / layout.context  # the keys one score matrix holds: a ring's block
    width = wl.seq_len  # a row's tokens
    if wl.packed:  # the largest drawn micro-batch's packed rows; logits only where read (real response tokens)
        shape = wl.packed_peak(call, batch_ways, cfg, layout.context)
        micro, keys, width = shape.micro_batches, shape.width / layout.context, shape.width
        tok = shape.rows * shape.width / layout.context
        logit_tok, rows = shape.reads, shape.rows
    ring = tok * _per_token_widths(cfg, t)[2] * ab if layout.context > 1 else 0.0  # the block arriving
    # Pipeline: the current micro-batch's activation and the one arriving from the previous stage.
    hand_off = 2 * tok * cfg.hidden_size * ab if layout.stage > 1 else 0.0
    staged_micro = micro if layout.stage > 1 else 1
    if layout.stage > 1:
        # The runtime pipelines inside one forward over the whole minibatch (models/pipeline.py):
        # the embedded input and the M + S - 1 collected outputs are whole-batch arrays on every
        # stage, and the head and loss see the re-assembled minibatch, so micro-batches do not
        # shrink the logits.
        m = staged_micro
        hand_off += (1 + (m + layout.stage - 1) / m) * m * tok * cfg.hidden_size * ab
        logit_tok, rows = logit_tok * m, rows * m
    # the RL log-prob calls build their logits a chunk of positions at a time (`models.logit_chunks`)
    logit_tok = chunk_positions(logit_tok, rows, wl.logit_chunk)
    blocked = cfg.attends_blockwise(width, layout.context)
    if blocked:  # one block of keys a score matrix holds (`models.blockwise`)
        keys = cfg.attention_block
    if call.kind == "inference":
        copies = _ring_score_copies(width, layout.context, False) if layout.context > 1 else None
        copies = _block_score_copies(cfg, width, False) if blocked else copies
        # the head runs after the last layer, so a forward's peak is the larger of a layer's and the logits'
        # (the residual stream, in both, is counted in the layer's)
        act = max(layer_live_bytes(cfg, tok, keys, t, copies),
                  _logit_bytes(cfg, head, logit_tok, t, LOGIT_COPIES_INFER))
        out = {"activations": act + hand_off + ring, "fsdp_buffers": gathered + head_gathered}
        if layout.expert > 1:
            out["expert_gathers"] = expert_gather_bytes(cfg, tok, layout, train=False)
        if cfg.unrolls_layers and layout.stage == 1:
            # an unrolled layer loop slices every layer's weights out of the stack before the first
            # layer runs (`models.config.UNROLL_MAX_LAYERS`): one more copy of this device's layer shards
            out["layer_copies"] = layer_bytes * cfg.num_layers / (layout.fsdp * t)
        return out
    if layout.context > 1:
        layer = layer_saved_bytes(cfg, tok, keys, t, _ring_score_copies(width, layout.context, True))
    elif blocked:  # a layer keeps no score matrix, only each query's float32 log-sum-exp per head
        layer = layer_saved_bytes(cfg, tok, keys, t, 0.0) + tok * cfg.num_heads / t * 4
    else:
        layer = layer_saved_bytes(cfg, tok, keys, t)
    if layout.context == 1 and not blocked and wl.remat_for(call.role) != "none" and keys >= BACKWARD_SCORES_KEYS:
        # the backward's own score-sized temporaries in the layer it recomputes and differentiates
        # (measured under remat at 2k, 4k and 16k keys, BACKWARD_SCORES_KEYS; without remat unmeasured, and not counted)
        layer += tok * keys * cfg.num_heads / t * 4 * SCORE_COPIES_BACKWARD
    # GPipe keeps every iteration's saved activations of the stage's layers until the backward:
    # M + S - 1 micro-batch passes of num_layers / S layers (M passes of all layers unpipelined
    # keep only one micro-batch's, as gradient accumulation frees them after each).
    kept = (micro + layout.stage - 1) * cfg.num_layers / layout.stage if layout.stage > 1 \
        else cfg.num_layers
    remat = wl.remat_for(call.role)
    if remat == "full":  # layer inputs kept, one layer recomputed at a time
        saved, recomputed = kept * tok * cfg.hidden_size * ab, layer
    elif remat == "dots":  # matmul outputs kept, elementwise results recomputed
        saved, recomputed = kept * layer_matmul_bytes(cfg, tok, layout.tensor), layer
    else:
        saved, recomputed = kept * layer, 0.0
    # Two phases of the backward that never overlap: the head's (its logits and their gradient, and under
    # FSDP the gathered head and its gradient at full size) and then each layer's (the layer it recomputes,
    # blockwise attention's temporaries). Without a pipeline the peak is the larger, beside what the forward
    # kept (XLA's temporaries for llama3.2-1b's blockwise train call at 8k-32k tokens a device, 1024- and
    # 4096-position logit chunks: the sum over-counted them by 25-40 %; scripts/check_memory_model.py). A
    # pipelined call's stages interleave micro-batches, and both are counted.
    layer_phase = recomputed + (_blockwise_backward_bytes(cfg, tok, width, t) if blocked else 0.0)
    head_phase = _logit_bytes(cfg, head, logit_tok, t, LOGIT_COPIES_TRAIN) + 2 * head_gathered
    phases = layer_phase + head_phase if layout.stage > 1 else max(layer_phase, head_phase)
    act = saved + phases + hand_off + ring
    # under LoRA: the adapters' gradients only. Split like the optimizer state they feed (ZeRO-1):
    # the compiler carries that split back into the backward, each layer's summed gradient sliced as it is
    # made, and into the accumulator (XLA's temporaries for llama3.2-1b's train call on 8 devices at data 8,
    # data 4 x fsdp 2, data 2 x fsdp 4, data 2 x tensor 4 were 0.96-1.06x this count; scripts/check_memory_model.py)
    grads = optimizer_shard_count(cfg, head, layout) * DTYPE_BYTES[trained_dtype(cfg)]
    # (the gathered head and its gradient: in the head's phase, above)
    out = {"gradients": grads, "activations": act, "fsdp_buffers": gathered}
    if layout.expert > 1:
        out["expert_gathers"] = expert_gather_bytes(cfg, tok, layout, train=True)
    if layout.context > 1:  # every block's mask, hoisted out of the layers (RING_MASK_BYTES; not per head)
        out["ring_masks"] = layout.context * tok * keys * RING_MASK_BYTES
    if micro > 1 and staged_micro == 1:
        # the fp32 accumulated gradient beside each micro-batch's own (a staged call has one backward)
        out["gradient_accumulator"] = optimizer_shard_count(cfg, head, layout) * 4
    # After the backward (its activations freed) the optimizer computes its update beside the gradients: one
    # more gradient-sized buffer, which sets the peak where the gradients outweigh the backward's working
    # set (large models, few tokens per device: XLA's temporaries for Qwen3-30B-A3B's train call on 8
    # devices, 256 tokens each, were 2.0x the gradients at expert 8, expert 4 x data 2, fsdp 8 and data 8;
    # scripts/check_memory_model.py). Counted as far as it exceeds that working set.
    update = grads - sum(out.values()) + grads
    if update > 0:
        out["optimizer_update"] = update
    if not wl.donate:  # new params and optimizer state are written beside the old ones
        out["undonated_state"] = params_per_device(cfg, head, layout) + optimizer_per_device(
            cfg, head, layout, wl, call.role)
    return out


_params_per_device, _optimizer_per_device = params_per_device, optimizer_per_device


@dataclasses.dataclass
class MemoryReport:
    """Peak bytes per device (indexed by global device), what was offloaded, and why a plan fails."""

    peak: np.ndarray
    resident: np.ndarray
    capacity: float
    offloaded: tuple[str, ...]
    call_bytes: dict[str, float]  # per-device peak while each call runs (on its busiest device)
    reason: str | None = None
    offloaded_optimizers: tuple[str, ...] = ()  # trained roles whose optimizer state waits in host memory
    # infeasible only: whether parking some optimizer state could lower an overflowing device's peak (its
    # memory resident beside a call there that is not its own train call); when not, no offload helps
    parkable: bool = False

    @property
    def feasible(self) -> bool:
        return self.reason is None

    @property
    def max_peak(self) -> float:
        return float(self.peak.max()) if self.peak.size else 0.0


def plan_memory(plan: ExecutionPlan, graph: CallGraph, models: Mapping[str, ModelConfig], wl: Workload,
                hw: HardwareProfile, memo: dict | None = None,
                knobs: Mapping[str, "CallKnobs"] | None = None, offload_optimizers: bool = False) -> MemoryReport:
    """Peak per-device memory of `plan`, offloading frozen roles to host when that makes it fit, and with
    `offload_optimizers`, when those are not enough, trained roles' optimizer state.

    The roles the plan already offloads (`plan.offload_roles`, `plan.offload_optimizer`) start offloaded;
    `MemoryReport.offloaded` and `.offloaded_optimizers` are what the runtime must offload for the estimate
    to hold. An offloaded optimizer state is on device only during its role's train call (the executor
    brings it back for the call, and the update runs on device), so it is counted in that call's working
    set: it frees the memory of every other call on those devices (generation's KV cache, the other models'
    calls), never the train call's own.
    `memo` keeps per-(call, layout) byte counts between calls for the same models and
    workload (the search evaluates thousands of plans). `knobs` gives calls their own
    micro-batch counts and remat policies (`planner.knobs`, `Workload.for_call`).
    """
    knobs = knobs or {}
    memo = {} if memo is None else memo
    workloads: dict = memo.setdefault(("workloads",), {})

    def for_call(call: CallSpec, k: "CallKnobs | None") -> Workload:  # `Workload.for_call`, made once per setting
        if k is None:
            return wl
        if (call.name, k) not in workloads:
            workloads[(call.name, k)] = wl.for_call(call, k.micro, k.remat, k.slots, k.packing)
        return workloads[(call.name, k)]

    def cached(key: tuple, fn, *args) -> float:
        if key not in memo:
            memo[key] = fn(*args)
        return memo[key]

    def params_per_device(cfg, head, layout):  # noqa: F811 - the memoised form of the module function
        return cached(("params", id(cfg), head, layout), _params_per_device, cfg, head, layout)

    def optimizer_per_device(cfg, head, layout, wl, role):  # noqa: F811
        return cached(("opt", role, head, layout), _optimizer_per_device, cfg, head, layout, wl, role)

    n = plan.num_devices
    cap = hw.usable_memory
    calls = [c for c in graph.calls if c.name in plan.calls]
    trained = {c.role for c in graph.calls if c.kind == "train"}
    roles = list(dict.fromkeys(c.role for c in calls))
    views = {r: src for r, src in wl.base_views if r in roles and src in roles}
    homes = {r: plan.home_call(views.get(r, r)) for r in roles}  # a base view lives where its source does
    heads = {c.role: c.head for c in calls}
    # Devices between consecutive group boundaries hold the same bytes: compute per such segment
    # (a handful) rather than per device (hundreds), and expand to devices at the end.
    cuts = sorted({0, n, *(x for c in plan.calls for x in (plan.group_of(c).start, plan.group_of(c).stop))})
    index = {x: i for i, x in enumerate(cuts)}
    segments = len(cuts) - 1

    def span(call_name: str) -> range:
        g = plan.group_of(call_name)
        return range(index[g.start], index[g.stop])

    # Resident contributions per role (home params + optimizer state + persistent shadows).
    resident_by_role: dict[str, list[float]] = {}
    for role in roles:
        cfg, head = models[role], heads[role]
        home_call = homes[role]
        home = plan.calls[home_call]
        arr = [0.0] * segments
        if role in views:  # its weights are the source's, counted there
            resident_by_role[role] = arr
            continue
        per = params_per_device(cfg, head, home.layout)
        for i in span(home_call):
            arr[i] += per
        if role in trained:
            state = [0.0] * segments
            for i in span(home_call):
                state[i] = optimizer_per_device(cfg, head, home.layout, wl, role)
            resident_by_role[f"optimizer:{role}"] = state
        if role in plan.shadow_roles:
            seen = {(plan.group_of(home_call).start, plan.group_of(home_call).size, home.layout)}
            for c in calls:
                if c.role != role or c.fresh_weights:  # those read the trained weights, moved for them
                    continue
                g, lay = plan.group_of(c.name), plan.calls[c.name].layout
                if (g.start, g.size, lay) not in seen:
                    seen.add((g.start, g.size, lay))
                    for i in span(c.name):
                        arr[i] += params_per_device(cfg, head, lay)
        resident_by_role[role] = arr

    # A partial-rollout stream keeps its page pool on the generate call's devices between steps
    # (`Workload.stream_columns`, at the pool its knobs chose): resident there during every other call,
    # and part of (not added to) the generate call's own working set.
    stream: dict[str, float] = {}
    for c in calls:
        lay = plan.calls[c.name].layout
        cols = for_call(c, knobs.get(c.name)).stream_columns(c, lay.batch_ways) if c.kind == "generate" else 0.0
        if cols:
            cfg = models[c.role]
            stream[c.name] = cols * kv_bytes_per_token(cfg) / max(min(lay.tensor, cfg.num_kv_heads), 1)
            arr = [0.0] * segments
            for i in span(c.name):
                arr[i] += stream[c.name]
            resident_by_role[f"stream:{c.name}"] = arr

    # Working sets per call; a call away from home without a shadow holds a temporary copy.
    work: dict[str, float] = {}
    for c in calls:
        cfg, lay = models[c.role], plan.calls[c.name].layout
        k = knobs.get(c.name)
        w = cached(("work", c.name, lay, k), lambda: sum(working_set(c, cfg, lay, for_call(c, k)).values()))
        home_call = homes[c.role]
        home = plan.calls[home_call]
        moved = (plan.group_of(c.name), lay) != (plan.group_of(home_call), home.layout)
        if moved and (c.role not in plan.shadow_roles or c.role in views or c.fresh_weights):
            w += params_per_device(cfg, c.head, lay)
        work[c.name] = w - stream.get(c.name, 0.0)

    widths = np.diff(cuts)

    def per_device(values: list[float]) -> np.ndarray:
        return np.repeat(np.asarray(values, dtype=float), widths)

    offloaded: list[str] = [r for r in plan.offload_roles if r in resident_by_role and r not in views]
    for r in offloaded:
        resident_by_role[r] = [0.0] * segments
    frozen = [r for r in roles if r not in trained and r not in plan.shadow_roles and r not in views]
    # in the graph's order of roles (not the set's, whose order varies between processes): ties park the same role
    state_of = {r: resident_by_role[f"optimizer:{r}"] for r in roles if f"optimizer:{r}" in resident_by_role}
    parked: list[str] = [r for r in plan.offload_optimizer if r in state_of]
    for r in parked:
        resident_by_role[f"optimizer:{r}"] = [0.0] * segments
    while True:
        resident = [sum(col) for col in zip(*resident_by_role.values())] if resident_by_role else [0.0] * segments
        peak = list(resident)
        peak_call: list[CallSpec | None] = [None] * segments
        call_bytes: dict[str, float] = {}
        for c in calls:
            name, role = c.name, c.role
            extra = work[name]
            if role in offloaded:  # reloaded for its own call
                extra += params_per_device(models[role], c.head, plan.calls[name].layout)
            if c.kind == "train" and role in parked:  # its optimizer state, back on device for the update
                extra += max(state_of[role][i] for i in span(name))
            worst = 0.0
            for i in span(name):
                worst = max(worst, resident[i] + extra)
                if resident[i] + extra > peak[i]:
                    peak[i], peak_call[i] = resident[i] + extra, c
            call_bytes[name] = worst
        over = [i for i in range(segments) if peak[i] > cap]
        if not over:
            return MemoryReport(per_device(peak), per_device(resident), cap, tuple(offloaded), call_bytes,
                                offloaded_optimizers=tuple(parked))
        candidates = [r for r in frozen if r not in offloaded and any(resident_by_role[r][i] for i in over)]
        # then optimizer state (two host copies of it per step, where a frozen role's costs one of its weights),
        # where it is resident beside a call that overflows other than its own train call (which holds it anyway)
        states = [r for r in state_of if r not in parked
                  and any(state_of[r][i] and not (peak_call[i] and peak_call[i].kind == "train"
                                                  and peak_call[i].role == r) for i in over)]
        if states and offload_optimizers and not candidates:
            largest = max(states, key=lambda r: max(state_of[r][i] for i in over))
            parked.append(largest)
            resident_by_role[f"optimizer:{largest}"] = [0.0] * segments
            continue
        if not candidates:
            seg = max(range(segments), key=lambda i: (peak[i], -i))
            dev = cuts[seg]
            worst = max((nm for nm in work if seg in span(nm)), key=lambda nm: call_bytes[nm], default=None)
            reason = (
                f"out of memory on device {dev}: needs {peak[seg] / GiB:.1f} GiB of {cap / GiB:.1f} GiB usable "
                f"(resident {resident[seg] / GiB:.1f} GiB"
                + (f"; largest call {worst} adds {(call_bytes[worst] - resident[seg]) / GiB:.1f} GiB" if worst else "")
                + (f"; offloaded {offloaded}" if offloaded else "")
                + (f"; optimizer state offloaded {parked}" if parked else "")
                + ")"
            )
            return MemoryReport(per_device(peak), per_device(resident), cap, tuple(offloaded), call_bytes, reason,
                                tuple(parked), parkable=bool(states))
        largest = max(candidates, key=lambda r: max(resident_by_role[r][i] for i in over))
        offloaded.append(largest)
        resident_by_role[largest] = [0.0] * segments
