"""Model arithmetic the cost and memory models share: parameter counts, a device's shard of them under a
layout (stages, experts, FSDP x tensor), LoRA adapters, optimizer state per parameter, FLOPs of attention
and KV-cache bytes. Counts only: no time, no hardware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.planner.plan import Layout

if TYPE_CHECKING:
    from jaxrlhf.planner.workload import Workload

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def mlp_width(cfg: ModelConfig) -> int:
    """The MLP width a token's matmuls run through, as the runtime computes it: the dense MLP's, or for a
    mixture of experts every expert's (`models.moe` dispatches densely: each token through all
    num_experts experts, the unpicked ones weighted 0) plus a shared expert's. A grouped dispatch runs
    num_experts_per_tok of them per token: `flop_params` prices that, memory stays every expert's."""
    if not cfg.num_experts:
        return cfg.intermediate_size
    return cfg.num_experts * cfg.expert_intermediate_size + (cfg.shared_expert_intermediate_size or 0)


def matmul_params(cfg: ModelConfig, head: str) -> int:
    """Weights that take part in a matmul per token (embedding lookup excluded); a mixture of experts'
    router and experts as `mlp_width` runs them."""
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
    layer = 2 * d * h * hd + 2 * d * kv * hd + 3 * d * mlp_width(cfg)
    if cfg.num_experts:
        layer += d * cfg.num_experts + (d if cfg.shared_expert_intermediate_size else 0)  # router, shared gate
    out = d * cfg.vocab_size if head == "lm" else d
    return cfg.num_layers * layer + out


def flop_params(cfg: ModelConfig, head: str) -> int:
    """Weights each token multiplies (2 FLOPs each): `matmul_params`, less the experts a grouped dispatch
    (`model.moe_dispatch="grouped"`, `models.moe.grouped`) does not run for a token (all but its k picked).
    Memory still holds every expert: weight bytes come from `matmul_params`."""
    skipped = 0
    if cfg.num_experts and cfg.moe_dispatch == "grouped":
        skipped = cfg.num_layers * 3 * cfg.hidden_size * cfg.expert_intermediate_size * \
            (cfg.num_experts - cfg.num_experts_per_tok)
    return matmul_params(cfg, head) - skipped


def param_count(cfg: ModelConfig, head: str) -> int:
    """All parameters of the model with the given head."""
    if head == "lm":
        return cfg.num_params()
    return cfg.num_params(with_lm_head=False) + cfg.hidden_size + 1


def param_bytes(cfg: ModelConfig, head: str) -> float:
    return param_count(cfg, head) * DTYPE_BYTES[cfg.param_dtype]


def layer_param_count(cfg: ModelConfig) -> int:
    """Parameters of the stacked decoder layers: what pipeline stages split."""
    return cfg.num_params(with_lm_head=False) - cfg.vocab_size * cfg.hidden_size - cfg.hidden_size


def stage_param_count(cfg: ModelConfig, head: str, stage: int) -> float:
    """Parameters one pipeline stage holds: its share of the layers plus the embedding, final norm
    and head, which every stage keeps (the runtime replicates them over the stage axis)."""
    layers = layer_param_count(cfg)
    return layers / stage + (param_count(cfg, head) - layers)


def expert_param_count(cfg: ModelConfig) -> int:
    """Parameters the expert axis splits: every layer's stacked experts (gate, up, down) and router."""
    if not cfg.num_experts:
        return 0
    return cfg.num_layers * cfg.num_experts * cfg.hidden_size * (3 * cfg.expert_intermediate_size + 1)


def expert_split_count(cfg: ModelConfig, layout: Layout) -> float:
    """Of a stage's parameters, how many the expert axis takes off each device: (1 - 1/e) of the experts'."""
    return expert_param_count(cfg) / layout.stage * (1 - 1 / layout.expert)


def shard_count(cfg: ModelConfig, head: str, layout: Layout) -> float:
    """Parameters one device holds under `layout` (stage, then its num_experts / expert of the experts, then
    fsdp x tensor shards)."""
    return (stage_param_count(cfg, head, layout.stage) - expert_split_count(cfg, layout)) / (layout.fsdp * layout.tensor)


def lora_param_count(cfg: ModelConfig) -> int:
    """LoRA adapter parameters of all layers: rank x (fan_in + fan_out) per targeted projection."""
    if cfg.lora is None:
        return 0
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.dim_per_head, \
        cfg.num_kv_heads * cfg.dim_per_head
    widths = {"q_proj": d + q, "k_proj": d + kv, "v_proj": d + kv, "o_proj": q + d,
              "gate_proj": d + f, "up_proj": d + f, "down_proj": f + d}
    return cfg.num_layers * cfg.lora.rank * sum(widths[t] for t in cfg.lora.targets)


def trained_dtype(cfg: ModelConfig) -> str:
    """The dtype of what the optimizer updates: the adapters under LoRA, else the parameters."""
    return cfg.lora.dtype if cfg.lora else cfg.param_dtype


def trained_shard_count(cfg: ModelConfig, head: str, layout: Layout) -> float:
    """Parameters one device trains (gradients, optimizer state): all of its shard, or under LoRA its
    share of the adapters (split like the layers) plus a critic's or reward model's scalar head."""
    if cfg.lora is None:
        return shard_count(cfg, head, layout)
    heads = 0 if head == "lm" else cfg.hidden_size + 1
    return (lora_param_count(cfg) / layout.stage + heads) / (layout.fsdp * layout.tensor)


def optimizer_shard_count(cfg: ModelConfig, head: str, layout: Layout) -> float:
    """Trained parameters whose optimizer state (and gradients) one device holds: its trained shard split over
    data, and the part outside the experts, replicated over the expert axis, over expert too (ZeRO-1,
    `placement.layout.optimizer_spec`; LoRA adapters lie outside the experts)."""
    trained = trained_shard_count(cfg, head, layout)
    experts = 0.0 if cfg.lora is not None else \
        (expert_param_count(cfg) / layout.stage - expert_split_count(cfg, layout)) / (layout.fsdp * layout.tensor)
    return experts / layout.data + (trained - experts) / (layout.data * layout.expert)


def shard_bytes(cfg: ModelConfig, head: str, layout: Layout) -> float:
    """A device's parameter bytes: its shard of the base, plus its adapters (their own dtype) under LoRA."""
    adapters = lora_param_count(cfg) * DTYPE_BYTES[trained_dtype(cfg)] / (layout.stage * layout.fsdp * layout.tensor)
    return shard_count(cfg, head, layout) * DTYPE_BYTES[cfg.param_dtype] + adapters


def trained_shard_bytes(cfg: ModelConfig, head: str, layout: Layout) -> float:
    """A device's gradient bytes: its trained parameters in their dtype."""
    return trained_shard_count(cfg, head, layout) * DTYPE_BYTES[trained_dtype(cfg)]


def attention_flops(cfg: ModelConfig, queries: float, keys: float) -> float:
    """Scores + weighted values for `queries` tokens attending to `keys` slots each."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * queries * keys


def kv_bytes_per_token(cfg: ModelConfig) -> float:
    return 2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.dim_per_head * DTYPE_BYTES[cfg.dtype]


def optimizer_bytes_per_param(cfg: ModelConfig, wl: Workload, role: str | None = None) -> float:
    """AdamW state per parameter: m and v in the param dtype, or with mixed precision an fp32
    master copy and fp32 m and v (what `jaxrlhf.algorithms.optim` builds). Per trained parameter:
    under LoRA only the adapters (`trained_shard_count`), in their dtype."""
    pb = DTYPE_BYTES[trained_dtype(cfg)]
    return 3 * 4 if wl.master_for(role) and pb < 4 else 2 * pb


def adapter_shard_bytes(cfg: ModelConfig, layout: Layout) -> float:
    """A device's LoRA adapter bytes under `layout` (what a LoRA shadow sync sends)."""
    return lora_param_count(cfg) * DTYPE_BYTES[trained_dtype(cfg)] / (layout.stage * layout.fsdp * layout.tensor)
