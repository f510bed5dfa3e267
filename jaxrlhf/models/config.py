"""Model dimensions and named size presets.

A `ModelConfig` holds only shapes and numerics, never weights, so the planner
can reason about a 70B model on a laptop (this module imports JAX only when a
dtype is asked for, so the planner stays JAX-free). HF `config.json` files map
onto it (see `hf_families.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrlhf.registry import Registry

ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe", "mixtral")
# How a mixture-of-experts router turns its logits into the k experts' weights (`ModelConfig.router_order`):
# "softmax_then_topk": a softmax over every expert, the k largest probabilities kept (renormalised to sum
# to 1 with `norm_topk_prob`; transformers' Qwen3-MoE and Mixtral); "topk_then_softmax": the k largest
# logits, a softmax over those k (Mistral's reference Mixtral code; in exact arithmetic the same weights as
# "softmax_then_topk" with norm_topk_prob, so norm_topk_prob must be left false).
ROUTER_ORDERS = ("softmax_then_topk", "topk_then_softmax")
# The MLP's gate activations: ours -> the name HF configs give it (`hidden_act` / `hidden_activation`).
MLP_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


# Models with at most this many layers run the scan over their stacked layers unrolled, by platform
# (a platform not listed: "cpu"'s): the compiled program holds one copy of the layer body per layer,
# reading each layer's weights with a static slice. A rolled loop reads and writes the stacked weights,
# gradients and saved activations through dynamic slices, which XLA:CPU also zero-fills first
# (measured on a 23.6M-parameter, 8-layer model: forward 1.2x and forward + backward 1.1x faster
# unrolled, the backward compiling in 10.7 instead of 6.8 CPU s). On a GPU the rolled loop's copies
# were 15 % of a 1.2B, 16-layer model's train call: unrolled, an H200 ran that call in 1.18 instead of
# 1.43 s (a GRPO step in 1.87 instead of 2.13 s) for ~24 s more compiling, repaid after ~100 steps.
# At 28 layers a step took 1.75 instead of 1.98 s but compiling 102 s more (repaid after ~440 steps).
# Deeper models keep the rolled loop so that compile time does not grow with depth; a role's
# `unroll_layers` decides for it (long runs, and restarts that hit the compile cache, repay sooner).
# Unrolled, XLA slices every layer's weights out of the stack up front: a forward holds a second copy
# of the layer weights (the memory model counts it).
UNROLL_MAX_LAYERS = {"cpu": 8, "gpu": 16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent rope scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


# HF / PEFT module name -> (our sub-module, our parameter, how many leading axes of W are its input)
TARGETS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("attn", "q", 1), "k_proj": ("attn", "k", 1), "v_proj": ("attn", "v", 1), "o_proj": ("attn", "o", 2),
    "gate_proj": ("mlp", "gate", 1), "up_proj": ("mlp", "up", 1), "down_proj": ("mlp", "down", 1),
}
@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank, scaling (`alpha / rank`), targeted projections (HF names) and the adapters' dtype."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dtype: str = "float32"

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"lora.targets {list(self.targets)}: choose from {list(TARGETS)}")
        if self.rank < 1:
            raise ValueError(f"lora.rank={self.rank} must be >= 1")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets_of(self, module: str) -> list[str]:
        """Our parameter names (q, v, ...) targeted in `module` ("attn" or "mlp")."""
        return [TARGETS[t][1] for t in self.targets if TARGETS[t][0] == module]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Dimensions and numerics of a decoder-only transformer: Llama, and the families that differ from it
    by the switches below (Qwen2/3, Mistral, Gemma 2/3; docs/models.md)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # defaults to hidden_size // num_heads
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # HF rope_type 'linear': positions divided by this factor in the rotation of the global layers (Gemma 3
    # 4B and larger: 8); None: not scaled.
    rope_linear_factor: float | None = None
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # Mistral; None = full causal attention
    # Per-family switches (HF import sets them; see docs/models.md). Each is off by default (Llama).
    # With a sliding_window: layer i attends globally when (i + 1) % sliding_window_pattern == 0 and
    # through the window otherwise (Gemma 2: 2, one local layer then one global; Gemma 3: 6, five local
    # then one global); None: every layer slides.
    sliding_window_pattern: int | None = None
    # Rope base of the sliding-window (local) layers; None: rope_theta (Gemma 3: 10000 local, 1e6 global).
    local_rope_theta: float | None = None
    # RMSNorm of every query and key head over head_dim, before the rotation (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Every RMSNorm scales by (norm_offset + weight): Gemma stores the scale minus one (1.0).
    norm_offset: float = 0.0
    # Embeddings multiplied by sqrt(hidden_size) (rounded to the embedding's dtype) before the first layer
    # (Gemma); a tied LM head reads the unscaled table.
    scale_embeddings: bool = False
    # An RMSNorm on the attention output and one on the MLP output, before each residual add (Gemma 2/3:
    # four norms per layer).
    post_norms: bool = False
    mlp_activation: str = "silu"  # the MLP gate's activation, a key of MLP_ACTIVATIONS (Gemma: "gelu_tanh")
    # Attention scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma).
    query_pre_attn_scalar: float | None = None
    # Scaled attention scores squashed to cap * tanh(score / cap) before the mask (Gemma 2: 50); None: not.
    attn_logit_softcap: float | None = None
    # The output logits squashed the same way (Gemma 2: 30); None: not.
    final_logit_softcap: float | None = None
    # Mixture of experts (models/moe.py; docs/models.md): 0 = a dense MLP in every layer; otherwise every
    # layer's MLP is `num_experts` gated experts of width `moe_intermediate_size` (None: intermediate_size;
    # Qwen3-MoE keeps intermediate_size for the dense layers it does not use), each token through the
    # `num_experts_per_tok` experts its router picks (`router_order`, `norm_topk_prob`), none dropped.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    router_order: str = "softmax_then_topk"
    # "dense": every token through every expert, one-hot combine (num_experts / k times the useful FLOPs);
    # "grouped": assignments sorted by expert, `jax.lax.ragged_dot` (only the k picked experts' FLOPs; moe.py)
    moe_dispatch: str = "dense"
    norm_topk_prob: bool = False  # the k picked probabilities renormalised to sum to 1 (Mixtral; Qwen3-MoE: per config)
    # A shared expert every token goes through beside its k, of this width, its output scaled by
    # sigmoid(x @ shared_expert_gate) (Qwen2-MoE); None: none.
    shared_expert_intermediate_size: int | None = None
    # Weight of the load-balancing loss (`moe.load_balancing_loss`) where a training loss adds it (HF's
    # `router_aux_loss_coef`, kept so that a checkpoint round trip writes it back).
    router_aux_loss_coef: float = 0.001
    architecture: str = "llama"
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype; softmax and norms always run in float32
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2  # the primary EOS: what data appends after a completion
    # Further ids that also end a sequence (HF lists them all in `eos_token_id`, e.g. Llama 3.1's
    # [128001, 128008, 128009]); generation stops on any of `eos_token_ids`.
    extra_eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = 0
    lora: LoraConfig | None = None  # LoRA adapters on chosen projections (models/lora.py); None: none
    # run the layer loop unrolled (True) or rolled (False); None: by depth (`UNROLL_MAX_LAYERS`, see `on_platform`)
    unroll_layers: bool | None = None
    # Forwards without a KV cache over rows of at least this many tokens attend a block of `attention_block`
    # queries and keys at a time (`models.blockwise`: one block's scores live, recomputed in the backward)
    # instead of holding every [T, T] score matrix; None: always dense. Under context parallelism the ring does.
    blockwise_attention_from: int | None = 8192
    attention_block: int = 1024

    def __post_init__(self):
        self._normalize_eos()
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"model.architecture={self.architecture!r} is not supported; choose one of {ARCHITECTURES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"model.{name}={getattr(self, name)!r}: use float32, bfloat16 or float16")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"model.mlp_activation={self.mlp_activation!r}: choose one of {list(MLP_ACTIVATIONS)}")
        pattern = self.sliding_window_pattern
        if pattern is not None and (isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 2):
            raise ValueError(f"model.sliding_window_pattern={pattern!r} must be an integer >= 2 (or None)")
        if pattern is not None and self.sliding_window is None:
            raise ValueError("model.sliding_window_pattern needs a sliding_window")
        for name in ("attention_block", "blockwise_attention_from"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"model.{name}={value!r} must be a positive integer"
                                 + (" (or None: dense attention)" if name == "blockwise_attention_from" else ""))
        if self.rope_scaling is not None and self.rope_linear_factor is not None:
            raise ValueError("model.rope_scaling and model.rope_linear_factor: choose one rope scaling")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "local_rope_theta",
                     "rope_linear_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model.{name}={value!r} must be positive (or None)")
        self._check_experts()

    def _check_experts(self) -> None:
        """The mixture-of-experts fields: all at their dense values, or a consistent sparse MLP."""
        for name in ("num_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model.{name}={value!r} must be a non-negative integer")
        if self.moe_dispatch not in ("dense", "grouped"):
            raise ValueError(f"model.moe_dispatch={self.moe_dispatch!r}: choose 'dense' or 'grouped'")
        if self.router_order not in ROUTER_ORDERS:
            raise ValueError(f"model.router_order={self.router_order!r}: choose one of {list(ROUTER_ORDERS)}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"model.router_aux_loss_coef={self.router_aux_loss_coef!r} must be >= 0")
        if self.num_experts == 0:
            if self.num_experts_per_tok or self.moe_intermediate_size is not None or \
                    self.shared_expert_intermediate_size is not None:
                raise ValueError(
                    f"model.num_experts_per_tok={self.num_experts_per_tok!r} / moe_intermediate_size="
                    f"{self.moe_intermediate_size!r} / shared_expert_intermediate_size="
                    f"{self.shared_expert_intermediate_size!r} need experts: set num_experts (0 = a dense MLP)")
            return
        k, e = self.num_experts_per_tok, self.num_experts
        if not 1 <= k <= e:
            raise ValueError(f"model.num_experts_per_tok={k!r} must be between 1 and num_experts={e}")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            f = getattr(self, name)
            if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 1):
                raise ValueError(f"model.{name}={f!r} must be a positive integer (or None)")
        if self.router_order == "topk_then_softmax" and self.norm_topk_prob:
            raise ValueError("model.norm_topk_prob: a softmax over the top-k logits already sums to 1; "
                             "set norm_topk_prob=false with router_order='topk_then_softmax'")
        if self.lora is not None and self.lora.targets_of("mlp"):
            raise ValueError(f"model.lora.targets {list(self.lora.targets)}: LoRA on the MLP projections of "
                             "a mixture of experts is not supported; target the attention projections")

    def _normalize_eos(self) -> None:
        """Accept HF's list form (`eos_token_id: [a, b]`, e.g. from overrides); keep one canonical form:
        the primary id in `eos_token_id`, the others, without repeats, in a tuple (hashable, so configs
        stay usable as static arguments)."""
        eos, extra = self.eos_token_id, list(self.extra_eos_token_ids or ())
        if isinstance(eos, (list, tuple)):
            eos, extra = (eos[0] if eos else None), [*eos[1:], *extra]
        if eos is None and extra:
            raise ValueError(f"extra_eos_token_ids={extra} needs an eos_token_id")
        eos = None if eos is None else int(eos)
        extra = tuple(i for i in dict.fromkeys(int(i) for i in extra) if i != eos)
        object.__setattr__(self, "eos_token_id", eos)
        object.__setattr__(self, "extra_eos_token_ids", extra)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence, the primary first; empty when the model has no EOS."""
        return () if self.eos_token_id is None else (self.eos_token_id, *self.extra_eos_token_ids)

    def attends_blockwise(self, length: int, context: int = 1) -> bool:
        """Whether a forward without a KV cache over rows of `length` tokens, split over `context` devices,
        attends blockwise (`models.blockwise`): the runtime's rule, and the memory model's."""
        start = self.blockwise_attention_from
        return context == 1 and start is not None and length >= start and length > self.attention_block

    @property
    def unrolls_layers(self) -> bool:
        """Whether the forward runs its layer loop unrolled: `unroll_layers`, else by depth for a CPU."""
        return self.on_platform("cpu").unroll_layers

    def on_platform(self, platform: str) -> ModelConfig:
        """This config with the layer loop decided for `platform` ("cpu", "gpu", "tpu") where
        `unroll_layers` leaves it open: what the run and its plan both read (`unrolls_layers`)."""
        if self.unroll_layers is not None:
            return self
        limit = UNROLL_MAX_LAYERS.get(platform, UNROLL_MAX_LAYERS["cpu"])
        return self.replace(unroll_layers=self.num_layers <= limit)

    @property
    def expert_intermediate_size(self) -> int:
        """The width of each expert's MLP (`moe_intermediate_size`, else `intermediate_size`)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it attends through the sliding window (see `sliding_window_pattern`)."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        p = self.sliding_window_pattern
        return tuple(p is None or (i + 1) % p != 0 for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by: query_pre_attn_scalar ** -0.5, else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.dim_per_head) ** -0.5

    @property
    def jnp_param_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.param_dtype)

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_params(self, with_lm_head: bool = True) -> int:
        """Parameter count of the causal LM (trunk + output embedding unless tied)."""
        d, f, h, kv, hd = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.dim_per_head,
        )
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if self.attention_bias:
            attn += h * hd + 2 * kv * hd
        if self.qk_norm:
            attn += 2 * hd
        mlp = 3 * d * f
        if self.num_experts:  # the router and every expert (all held, whichever a token uses)
            mlp = d * self.num_experts + self.num_experts * 3 * d * self.expert_intermediate_size
            if self.shared_expert_intermediate_size:  # the shared expert and its gate
                mlp += 3 * d * self.shared_expert_intermediate_size + d
        layer = attn + mlp + (4 if self.post_norms else 2) * d
        total = self.vocab_size * d + self.num_layers * layer + d
        if with_lm_head and not self.tie_word_embeddings:
            total += d * self.vocab_size
        return total


# Named presets hold only dimensions; they are usable without weights (planner, abstract plans).
PRESETS: Registry[ModelConfig] = Registry("model preset", KeyError, {
    # Test sizes: fast to compile on CPU with 8 simulated devices.
    "tiny": ModelConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=512,
    ),
    "tiny-qwen2": ModelConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=512, rope_theta=1e6,
        rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=True, architecture="qwen2",
    ),
    "tiny-mistral": ModelConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=512, sliding_window=16,
        architecture="mistral",
    ),
    "tiny-qwen3": ModelConfig(  # head_dim 32 != hidden / heads, as real Qwen3 sizes have
        vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=1e6,
        rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=True, architecture="qwen3",
    ),
    # Test sizes of the Gemmas: query_pre_attn_scalar != head_dim as in the larger Gemmas, and caps that a
    # tiny random model's attention scores (~0.03) and logits (~0.5) reach, so that tests exercise every switch.
    "tiny-gemma2": ModelConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        sliding_window=16, sliding_window_pattern=2, norm_offset=1.0, scale_embeddings=True, post_norms=True,
        mlp_activation="gelu_tanh", query_pre_attn_scalar=24, attn_logit_softcap=0.05, final_logit_softcap=0.5,
        tie_word_embeddings=True, architecture="gemma2", bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
    "tiny-gemma3": ModelConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=6,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_theta=1e6, local_rope_theta=10000.0, sliding_window=16, sliding_window_pattern=6, qk_norm=True,
        norm_offset=1.0, scale_embeddings=True, post_norms=True, mlp_activation="gelu_tanh",
        query_pre_attn_scalar=24, tie_word_embeddings=True, architecture="gemma3", bos_token_id=2,
        eos_token_id=1, pad_token_id=0,
    ),
    # Test sizes of the mixtures of experts: Qwen3-MoE's router without renormalisation (transformers'
    # default; the published sizes renormalise) and Mixtral's softmax over the top-k logits, so that the parity
    # tests reach both routings. An expert narrower than the dense MLP, as in Qwen3-MoE.
    "tiny-qwen3-moe": ModelConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=1e6,
        rms_norm_eps=1e-6, qk_norm=True, architecture="qwen3_moe", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "tiny-qwen2-moe": ModelConfig(  # Qwen2's q/k/v biases, a shared expert with its sigmoid gate
        vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6,
        attention_bias=True, architecture="qwen2_moe", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64,
    ),
    "tiny-mixtral": ModelConfig(
        vocab_size=384, hidden_size=64, intermediate_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, max_position_embeddings=512, rope_theta=1e6, architecture="mixtral",
        num_experts=4, num_experts_per_tok=2, router_order="topk_then_softmax", router_aux_loss_coef=0.02,
    ),
    "small": ModelConfig(  # quickstart-scale actor (~3M parameters)
        vocab_size=384, hidden_size=256, intermediate_size=688, num_layers=4,
        num_heads=8, num_kv_heads=4, max_position_embeddings=1024,
    ),
    "llama-100m": ModelConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
        num_heads=12, num_kv_heads=4, max_position_embeddings=2048, tie_word_embeddings=True,
    ),
    "llama2-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
        num_heads=32, num_kv_heads=32, max_position_embeddings=4096, param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    "llama2-13b": ModelConfig(
        vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_layers=40,
        num_heads=40, num_kv_heads=40, max_position_embeddings=4096, param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    "llama2-34b": ModelConfig(
        vocab_size=32000, hidden_size=8192, intermediate_size=22016, num_layers=48,
        num_heads=64, num_kv_heads=8, max_position_embeddings=4096, param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    "llama2-70b": ModelConfig(
        vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, max_position_embeddings=4096, param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=True, param_dtype="bfloat16", dtype="bfloat16", bos_token_id=128000,
        eos_token_id=128001, pad_token_id=None,
    ),
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
        pad_token_id=None,
    ),
    "qwen2-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
        num_heads=14, num_kv_heads=2, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=True, architecture="qwen2",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=None, eos_token_id=151643,
        pad_token_id=None,
    ),
    "qwen2-1.5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=True, architecture="qwen2",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=None, eos_token_id=151643,
        pad_token_id=None,
    ),
    "qwen2-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=False, architecture="qwen2",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=None, eos_token_id=151643,
        pad_token_id=None,
    ),
    # The published shapes of models in peers' published RL runs (docs/results/published_cases.yaml): Qwen2.5-Math-7B
    # is Qwen2-7B's shape (rope base 10k; verl's recipes stretch its 4096 positions to 32768 for 28k responses);
    # the DeepSeek-R1 distills are Qwen2.5 models (config.json: Qwen2ForCausalLM, untied head).
    "qwen2.5-math-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, max_position_embeddings=32768, rope_theta=10000.0,
        rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=False, architecture="qwen2",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=None, eos_token_id=151643,
        pad_token_id=None,
    ),
    "deepseek-r1-distill-qwen-1.5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, max_position_embeddings=131072, rope_theta=10000.0,
        rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=False, architecture="qwen2",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=151646, eos_token_id=151643,
        pad_token_id=None,
    ),
    "deepseek-r1-distill-qwen-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, max_position_embeddings=131072, rope_theta=10000.0,
        rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=False, architecture="qwen2",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=151646, eos_token_id=151643,
        pad_token_id=None,
    ),
    "deepseek-r1-distill-qwen-14b": ModelConfig(
        vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_layers=48,
        num_heads=40, num_kv_heads=8, max_position_embeddings=131072, rope_theta=1e6,
        rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False, architecture="qwen2",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=151646, eos_token_id=151643,
        pad_token_id=None,
    ),
    "deepseek-r1-distill-qwen-32b": ModelConfig(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
        num_heads=40, num_kv_heads=8, max_position_embeddings=131072, rope_theta=1e6,
        rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False, architecture="qwen2",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=151646, eos_token_id=151643,
        pad_token_id=None,
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=True, architecture="qwen3",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=None, eos_token_id=151645,
        extra_eos_token_ids=(151643,), pad_token_id=None,
    ),
    "qwen3-1.7b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=True, architecture="qwen3",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=None, eos_token_id=151645,
        extra_eos_token_ids=(151643,), pad_token_id=None,
    ),
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=False, architecture="qwen3",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=None, eos_token_id=151645,
        extra_eos_token_ids=(151643,), pad_token_id=None,
    ),
    "qwen3-32b": ModelConfig(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64,
        num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=False, architecture="qwen3",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=None, eos_token_id=151645,
        extra_eos_token_ids=(151643,), pad_token_id=None,
    ),
    # 30.5B parameters, 3.3B active: 48 layers of 128 experts (width 768), 8 per token, renormalised; no
    # shared expert, every layer sparse (intermediate_size is that of the dense layers it has none of).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=False, architecture="qwen3_moe",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=151643, eos_token_id=151645, pad_token_id=None,
    ),
    # Qwen2-MoE's published size, 14.3B parameters, 2.7B active: 60 routed experts (width 1408), 4 per token,
    # not renormalised, and a shared expert of width 5632 (four experts' worth) with a sigmoid gate.
    "qwen1.5-moe-a2.7b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_layers=24,
        num_heads=16, num_kv_heads=16, max_position_embeddings=8192, rope_theta=1e6, rms_norm_eps=1e-6,
        attention_bias=True, tie_word_embeddings=False, architecture="qwen2_moe", num_experts=60,
        num_experts_per_tok=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=151643, eos_token_id=151643, pad_token_id=None,
    ),
    # DeepSeek-V2-Lite's published sizes (a DeepSeekMoE: many small routed experts, shared experts), 15.7B
    # parameters, 2.4B active: 64 routed experts of width 1408, 6 per token (softmax, not renormalised) and 2
    # shared experts, here one shared expert of their summed width 2816. What the model does not build, priced
    # as the nearest thing it does (docs/models.md#deepseek-style-mixtures): MLA attention as standard
    # attention with the published head dims (16 heads of 128, one key/value head each: the keys and values MLA
    # decompresses its 576-wide latent into), the first layer's dense MLP (first_k_dense_replace=1) as a MoE
    # layer like the others, the shared experts with Qwen2-MoE's sigmoid gate (2048 parameters a layer); YaRN
    # rope scaling left out. 16.3B parameters as built (+4 %).
    "deepseek-v2-lite": ModelConfig(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27,
        num_heads=16, num_kv_heads=16, head_dim=128, max_position_embeddings=163840, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, architecture="qwen2_moe", num_experts=64,
        num_experts_per_tok=6, moe_intermediate_size=1408, shared_expert_intermediate_size=2816,
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=100000, eos_token_id=100001, pad_token_id=None,
    ),
    "mixtral-8x7b": ModelConfig(  # 46.7B parameters, 12.9B active: 8 experts of width 14336, 2 per token
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, max_position_embeddings=32768, rope_theta=1e6, architecture="mixtral",
        num_experts=8, num_experts_per_tok=2, router_order="topk_then_softmax", router_aux_loss_coef=0.02,
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=None,
    ),
    "gemma2-2b": ModelConfig(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_layers=26,
        num_heads=8, num_kv_heads=4, head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6,
        sliding_window=4096, sliding_window_pattern=2, norm_offset=1.0, scale_embeddings=True, post_norms=True,
        mlp_activation="gelu_tanh", query_pre_attn_scalar=256, attn_logit_softcap=50.0, final_logit_softcap=30.0,
        tie_word_embeddings=True, architecture="gemma2", param_dtype="bfloat16", dtype="bfloat16",
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    ),
    "gemma3-1b": ModelConfig(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
        num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1e6, local_rope_theta=10000.0, sliding_window=512, sliding_window_pattern=6, qk_norm=True,
        norm_offset=1.0, scale_embeddings=True, post_norms=True, mlp_activation="gelu_tanh",
        query_pre_attn_scalar=256, tie_word_embeddings=True, architecture="gemma3", param_dtype="bfloat16",
        dtype="bfloat16", bos_token_id=2, eos_token_id=1, extra_eos_token_ids=(106,), pad_token_id=0,
    ),
    # Gemma 3 4B and larger: the text model of the multimodal checkpoint, global layers' rope scaled by 8.
    "gemma3-4b": ModelConfig(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34,
        num_heads=8, num_kv_heads=4, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_linear_factor=8.0, local_rope_theta=10000.0, sliding_window=1024,
        sliding_window_pattern=6, qk_norm=True, norm_offset=1.0, scale_embeddings=True, post_norms=True,
        mlp_activation="gelu_tanh", query_pre_attn_scalar=256, tie_word_embeddings=True, architecture="gemma3",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=2, eos_token_id=1, extra_eos_token_ids=(106,),
        pad_token_id=0,
    ),
    "gemma3-27b": ModelConfig(
        vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_layers=62,
        num_heads=32, num_kv_heads=16, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_linear_factor=8.0, local_rope_theta=10000.0, sliding_window=1024,
        sliding_window_pattern=6, qk_norm=True, norm_offset=1.0, scale_embeddings=True, post_norms=True,
        mlp_activation="gelu_tanh", query_pre_attn_scalar=168, tie_word_embeddings=True, architecture="gemma3",
        param_dtype="bfloat16", dtype="bfloat16", bos_token_id=2, eos_token_id=1, extra_eos_token_ids=(106,),
        pad_token_id=0,
    ),
})


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Look up a named size preset (KeyError naming the close and the known ones), optionally replacing fields."""
    config = PRESETS.get(name)
    return config.replace(**overrides) if overrides else config
