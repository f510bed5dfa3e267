"""Which HF tensor is which parameter of ours, and how its layout converts.

HF stores `nn.Linear` weights as [out, in] with heads flattened; our layout keeps separate head axes
([embed, heads, head_dim]) for tensor parallelism. `trunk_specs` and `head_layouts` are the single table
that maps one onto the other, read in both directions by `hf_io` (import and export), so the two cannot
disagree. A mixture of experts' tensor names come from its family's entry (`hf_families.FAMILIES`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_families import FAMILIES


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One HF tensor: the NNX parameter it belongs to, its HF key and shape, the two layout conversions.

    Decoder-layer parameters are stacked along a leading layers axis, so one NNX
    parameter holds `num_layers` HF tensors; `layer` says which slice this is. A
    mixture of experts' weights are stacked once more, [layers, expert, ...]: `expert`
    says which expert's slice of the layer's (HF stores one tensor per expert).
    """

    path: tuple[str | int, ...]
    key: str
    shape: tuple[int, ...]
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray], np.ndarray]
    layer: int | None = None
    expert: int | None = None

    @property
    def index(self) -> tuple[int, ...]:
        """Where this tensor sits in its (stacked) parameter: () for an unstacked one."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _linear(path, key, ours: tuple[int, ...], n_in: int) -> TensorSpec:
    """`ours` = [in..., out...] with the first `n_in` axes the input; HF = [prod(out), prod(in)]."""
    d_in, d_out = int(np.prod(ours[:n_in])), int(np.prod(ours[n_in:]))
    return TensorSpec(
        path, key, (d_out, d_in),
        to_hf=lambda x: x.reshape(d_in, d_out).T,
        from_hf=lambda w: w.T.reshape(ours),
    )


def _flat(path, key, ours: tuple[int, ...]) -> TensorSpec:
    n = int(np.prod(ours))
    return TensorSpec(path, key, (n,), to_hf=lambda x: x.reshape(n), from_hf=lambda w: w.reshape(ours))


def _norm(path, key, size: int) -> TensorSpec:
    return TensorSpec(path, key, (size,), _same, _same)


def trunk_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the decoder (embeddings, layers, final norm): what any head's checkpoint holds."""
    d, v = config.hidden_size, config.vocab_size
    h, kv, hd = config.num_heads, config.num_kv_heads, config.dim_per_head
    specs = [
        TensorSpec(("model", "embed"), "model.embed_tokens.weight", (v, d), _same, _same),
        TensorSpec(("model", "final_norm", "weight"), "model.norm.weight", (d,), _same, _same),
    ]
    p = ("model", "layers")
    for i in range(config.num_layers):
        k = f"model.layers.{i}."
        layer = [
            _linear(p + ("attn", "q"), k + "self_attn.q_proj.weight", (d, h, hd), 1),
            _linear(p + ("attn", "k"), k + "self_attn.k_proj.weight", (d, kv, hd), 1),
            _linear(p + ("attn", "v"), k + "self_attn.v_proj.weight", (d, kv, hd), 1),
            _linear(p + ("attn", "o"), k + "self_attn.o_proj.weight", (h, hd, d), 2),
            *_mlp_specs(config, p, k),
            TensorSpec(p + ("input_norm", "weight"), k + "input_layernorm.weight", (d,), _same, _same),
            TensorSpec(p + ("post_attn_norm", "weight"), k + "post_attention_layernorm.weight", (d,), _same, _same),
        ]
        if config.post_norms:  # Gemma: HF's post_attention_layernorm is on the attention output
            layer[-1] = _norm(p + ("post_attn_norm", "weight"), k + "pre_feedforward_layernorm.weight", d)
            layer += [
                _norm(p + ("attn_out_norm", "weight"), k + "post_attention_layernorm.weight", d),
                _norm(p + ("mlp_out_norm", "weight"), k + "post_feedforward_layernorm.weight", d),
            ]
        if config.qk_norm:
            layer += [
                _norm(p + ("attn", "q_norm", "weight"), k + "self_attn.q_norm.weight", hd),
                _norm(p + ("attn", "k_norm", "weight"), k + "self_attn.k_norm.weight", hd),
            ]
        if config.attention_bias:
            layer += [
                _flat(p + ("attn", "q_bias"), k + "self_attn.q_proj.bias", (h, hd)),
                _flat(p + ("attn", "k_bias"), k + "self_attn.k_proj.bias", (kv, hd)),
                _flat(p + ("attn", "v_bias"), k + "self_attn.v_proj.bias", (kv, hd)),
            ]
        specs += [dataclasses.replace(spec, layer=i) for spec in layer]
    return specs


def _mlp_specs(config: ModelConfig, p: tuple[str, ...], k: str) -> list[TensorSpec]:
    """One layer's MLP tensors: the dense gate / up / down projections, or a mixture of experts' router and
    every expert's three (the family's `expert_tensors`), each a slice of the stacked [expert, ...] weight."""
    d = config.hidden_size
    if not config.num_experts:
        f = config.intermediate_size
        return [
            _linear(p + ("mlp", "gate"), k + "mlp.gate_proj.weight", (d, f), 1),
            _linear(p + ("mlp", "up"), k + "mlp.up_proj.weight", (d, f), 1),
            _linear(p + ("mlp", "down"), k + "mlp.down_proj.weight", (f, d), 1),
        ]
    f = config.expert_intermediate_size
    router, gate, up, down = FAMILIES[config.architecture].expert_tensors
    specs = [_linear(p + ("mlp", "router"), k + router, (d, config.num_experts), 1)]
    for j in range(config.num_experts):
        specs += [
            dataclasses.replace(_linear(p + ("mlp", "gate"), k + gate.format(j=j), (d, f), 1), expert=j),
            dataclasses.replace(_linear(p + ("mlp", "up"), k + up.format(j=j), (d, f), 1), expert=j),
            dataclasses.replace(_linear(p + ("mlp", "down"), k + down.format(j=j), (f, d), 1), expert=j),
        ]
    if config.shared_expert_intermediate_size is not None:  # Qwen2-MoE
        fs = config.shared_expert_intermediate_size
        specs += [
            _linear(p + ("mlp", "shared_gate"), k + "mlp.shared_expert.gate_proj.weight", (d, fs), 1),
            _linear(p + ("mlp", "shared_up"), k + "mlp.shared_expert.up_proj.weight", (d, fs), 1),
            _linear(p + ("mlp", "shared_down"), k + "mlp.shared_expert.down_proj.weight", (fs, d), 1),
            _linear(p + ("mlp", "shared_expert_gate"), k + "mlp.shared_expert_gate.weight", (d,), 1),
        ]
    return specs


def head_layouts(config: ModelConfig, head: str) -> list[list[TensorSpec]]:
    """The head's tensors, one list per accepted layout; the first is the one we write.

    reward: HF's `score.weight` [1, hidden] (no bias, like our reward head), else our
    pre-HF `score_head.weight`/`.bias`, so old checkpoints still load (their bias must be 0).
    """
    d = config.hidden_size
    if head == "lm":
        if config.tie_word_embeddings:
            return [[]]
        return [[_linear(("lm_head",), "lm_head.weight", (d, config.vocab_size), 1)]]
    if head == "value":
        return [[
            TensorSpec(("value_head",), "value_head.weight", (d,), _same, _same),
            _flat(("value_bias",), "value_head.bias", ()),
        ]]
    return [
        [TensorSpec(("score_head",), "score.weight", (1, d), lambda x: x.reshape(1, d), lambda w: w.reshape(d))],
        [TensorSpec(("score_head",), "score_head.weight", (d,), _same, _same)],
    ]


# Tensors of old layouts that have no parameter any more and must be zero to be dropped.
MUST_BE_ZERO = ("score_head.bias",)


HEADS = ("lm", "value", "reward")


def check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"unknown model head {head!r}; choose one of {HEADS}")
