"""Hugging Face checkpoints in and out: `config.json` + `*.safetensors`.

Users start from pretrained Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 / Qwen3-MoE / Mixtral checkpoints
(docs/models.md) and hand trained actors back to `transformers`, so both directions must be exact
(float32 logits within 1e-4 relative, import -> export -> import bitwise).

HF stores `nn.Linear` weights as [out, in] with heads flattened; our layout
keeps separate head axes ([embed, heads, head_dim]) for tensor parallelism.
`_tensor_specs` is the single table that maps one onto the other.

Reward models use transformers' own sequence-classification layout
(`<Arch>ForSequenceClassification`, num_labels=1: the trunk plus
`score.weight` [1, hidden], no bias), so an exported reward model scores the
same in `transformers` and standard HF reward models load here; our older
`score_head.weight`/`.bias` layout still loads. Critics have no HF
counterpart: they keep the trunk layout plus `value_head.weight`/`.bias`,
which `transformers` ignores. Loading an actor checkpoint with
`head="value"` or `"reward"` creates a fresh head instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrlhf.models import lora
from jaxrlhf.models.config import MLP_ACTIVATIONS, ModelConfig, RopeScaling
from jaxrlhf.models.transformer import build_model

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# HF `architectures` entry <-> our `ModelConfig.architecture`.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",  # Gemma 3 1B and 270M; the larger ones through MULTIMODAL_TEXT
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
_HF_CLASS = {arch: cls for cls, arch in HF_ARCHITECTURES.items()}
# Multimodal checkpoints whose text model we load (its config in `text_config`, its tensors under a prefix;
# the vision tower and projector are left out): class -> (our architecture, tensor name prefix). Export
# writes the text model alone, as the architecture's ...ForCausalLM.
MULTIMODAL_TEXT: dict[str, tuple[str, str]] = {"Gemma3ForConditionalGeneration": ("gemma3", "language_model.")}
# The published multimodal configs leave out every text_config key at transformers' default (Gemma 3 27B's
# has no vocab_size, heads or activation): those defaults, per text architecture.
_TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {"gemma3": dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
    pad_token_id=0,
)}
_MODEL_TYPE = {"gemma3": "gemma3_text"}  # config.json `model_type`, where it is not the architecture's name
# Reward models: transformers' sequence-classification classes (num_labels=1).
HF_REWARD_ARCHITECTURES: dict[str, str] = {
    cls.removesuffix("ForCausalLM") + "ForSequenceClassification": arch
    for cls, arch in HF_ARCHITECTURES.items() if arch != "gemma3"
} | {"Gemma3TextForSequenceClassification": "gemma3"}
# What each family fixes in the model beyond what its config.json keys say (ModelConfig's switches).
FAMILY_SWITCHES: dict[str, dict[str, Any]] = {
    "qwen2": dict(attention_bias=True),
    "qwen3": dict(qk_norm=True),
    "qwen2_moe": dict(attention_bias=True),
    "qwen3_moe": dict(qk_norm=True),
    "gemma2": dict(norm_offset=1.0, scale_embeddings=True, post_norms=True),
    "gemma3": dict(qk_norm=True, norm_offset=1.0, scale_embeddings=True, post_norms=True),
}
_GEMMA = ("gemma2", "gemma3")
# Mixtures of experts: the config.json key of the expert count, and the tensor names of one layer's sparse
# MLP (under model.layers.{i}.): its router, and expert j's gate / up / down projections.
_MOE = ("qwen2_moe", "qwen3_moe", "mixtral")
_EXPERTS_KEY = {"qwen2_moe": "num_experts", "qwen3_moe": "num_experts", "mixtral": "num_local_experts"}
_QWEN_MOE_TENSORS = ("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                     "mlp.experts.{j}.down_proj.weight")
_MOE_TENSORS = {
    "qwen2_moe": _QWEN_MOE_TENSORS,
    "qwen3_moe": _QWEN_MOE_TENSORS,
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight"),
}
# Gemma's layer kinds when config.json has no `layer_types`: every P-th layer global.
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6}
_HF_REWARD_CLASS = {arch: cls for cls, arch in HF_REWARD_ARCHITECTURES.items()}
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# config.json key that records which head (value / reward) a checkpoint of ours carries.
HEAD_KEY = "jaxrlhf_head"


class CheckpointError(ValueError):
    """A checkpoint directory cannot be read: names the file and the tensor or key at fault."""


# ---------------------------------------------------------------- config.json


def _supported() -> str:
    return (", ".join(sorted(HF_ARCHITECTURES)) + " (and their ...ForSequenceClassification reward models; "
            + ", ".join(f"the text model of {cls}" for cls in MULTIMODAL_TEXT) + ")")


_LAYER_KINDS = ("full_attention", "sliding_attention")  # transformers' `layer_types` entries


def _rope_from_hf(hf: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """The rope fields of ModelConfig (rope_theta, rope_scaling, rope_linear_factor, local_rope_theta) from
    either the transformers 5 `rope_parameters` (Gemma 3: one entry per layer kind) or the legacy keys."""
    params = hf.get("rope_parameters") or {}
    _check_full_rotation(hf, "", where)
    per_kind = any(isinstance(v, dict) for v in params.values())
    if arch != "gemma3" and ("rope_layer" in params or per_kind):
        raise CheckpointError(f"{where}: per-layer rope_parameters are not supported for {arch}")
    if arch != "gemma3":
        rope = _one_rope(params, hf.get("rope_scaling"), hf.get("rope_theta", 10000.0), "rope_parameters", where)
    else:
        if per_kind and set(params) - set(_LAYER_KINDS):
            raise CheckpointError(f"{where}: rope_parameters keys {sorted(params)}: expected {list(_LAYER_KINDS)}")
        full = params.get("full_attention") or {} if per_kind else params
        local = params.get("sliding_attention") or {} if per_kind else {}
        rope = _one_rope(full, hf.get("rope_scaling"), hf.get("rope_theta", 1e6),
                         "rope_parameters.full_attention", where)
        key = "rope_parameters.sliding_attention"
        local_rope = _one_rope(local, None, hf.get("rope_local_base_freq", 10000.0), key, where)
        if local_rope["rope_scaling"] or local_rope["rope_linear_factor"]:
            raise CheckpointError(f"{where}: {key}: a scaled rope on the local layers is not supported")
        rope["local_rope_theta"] = local_rope["rope_theta"]
    if arch in _GEMMA and rope["rope_scaling"] is not None:
        raise CheckpointError(f"{where}: rope_parameters: 'llama3' rope scaling is not supported for {arch}")
    return rope


def _check_full_rotation(params: dict[str, Any], prefix: str, where: str) -> None:
    """Our rope rotates every dimension of a head: a partial rotation is refused."""
    value = params.get("partial_rotary_factor", 1.0)
    if value is not None and float(value) != 1.0:
        raise CheckpointError(f"{where}: {prefix}partial_rotary_factor={value!r} is not supported (only 1.0)")


def _one_rope(params: dict[str, Any], legacy: dict[str, Any] | None, legacy_theta: Any, key: str,
              where: str) -> dict[str, Any]:
    """One rope (`params` in transformers 5's form, else the legacy `rope_scaling` / `rope_theta`)."""
    rope: dict[str, Any] = dict(rope_theta=float(params.get("rope_theta", legacy_theta)), rope_scaling=None,
                                rope_linear_factor=None)
    scaling = legacy or params
    key = "rope_scaling" if legacy else key
    _check_full_rotation(scaling or {}, f"{key}.", where)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return rope
    if kind == "linear":
        if "factor" not in scaling:
            raise CheckpointError(f"{where}: {key}: a 'linear' rope needs its factor")
        return rope | dict(rope_linear_factor=float(scaling["factor"]))
    if kind != "llama3":
        raise CheckpointError(
            f"{where}: {key}.rope_type={kind!r} is not supported; only the default rope, 'linear' and 'llama3' "
            "scaling are"
        )
    defaults = RopeScaling()
    return rope | dict(rope_scaling=RopeScaling(
        factor=float(scaling.get("factor", defaults.factor)),
        low_freq_factor=float(scaling.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(scaling.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            scaling.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    ))


def _gemma_layers_from_hf(hf: dict[str, Any], arch: str, num_layers: int, where: str
                          ) -> tuple[int | None, int | None]:
    """Gemma's (sliding_window, sliding_window_pattern) from `sliding_window` and `layer_types` (else the
    family's pattern): local layers with every P-th layer global, every layer local (P None), or none."""
    window = hf.get("sliding_window")
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or _DEFAULT_PATTERN[arch])
    kinds = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    if len(kinds) != num_layers or set(kinds) - set(_LAYER_KINDS):
        raise CheckpointError(f"{where}: layer_types={kinds} must list {num_layers} of {list(_LAYER_KINDS)}")
    if window is None or "sliding_attention" not in kinds:
        return None, None
    if "full_attention" not in kinds:
        return int(window), None
    pattern = kinds.index("full_attention") + 1
    if [k == "sliding_attention" for k in kinds] != [bool((i + 1) % pattern) for i in range(num_layers)]:
        raise CheckpointError(
            f"{where}: layer_types={kinds} is not supported: global layers must recur every N layers "
            "(layer i global when (i + 1) % N == 0)"
        )
    return int(window), pattern


def _sliding_window_from_hf(hf: dict[str, Any], arch: str, num_layers: int, where: str) -> int | None:
    """Mistral: `sliding_window` as is. Qwen2/3: only if every layer slides (or none does)."""
    if arch in ("mistral", "mixtral"):
        return hf.get("sliding_window")
    if arch == "llama" or not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
        return None
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(num_layers)
    ]
    if all(t == "sliding_attention" for t in layer_types):
        return int(hf["sliding_window"])
    if all(t == "full_attention" for t in layer_types):
        return None
    raise CheckpointError(
        f"{where}: {arch} with sliding window on only some layers (layer_types={layer_types}) is not supported"
    )


# transformers' defaults for the mixture-of-experts keys a config.json leaves out.
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_moe": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408, norm_topk_prob=False,
                      router_aux_loss_coef=0.001, shared_expert_intermediate_size=5632),
    "qwen3_moe": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                      router_aux_loss_coef=0.001),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001),
}


def _experts_from_hf(hf: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig ({} for a dense family). Refused: what our sparse MLP
    does not compute (dense MLP layers among the sparse ones, shared experts outside Qwen2-MoE, router
    jitter, Qwen2-MoE without q/k/v biases)."""
    if arch not in _MOE:
        return {}
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if hf.get(key) and not (arch == "qwen2_moe" and key == "shared_expert_intermediate_size"):
            raise CheckpointError(f"{where}: {key}={hf[key]!r} is not supported (no shared experts)")
    defaults = _MOE_DEFAULTS[arch]
    key = _EXPERTS_KEY[arch]
    other = "num_local_experts" if key == "num_experts" else "num_experts"  # transformers reads either
    experts = hf.get(key, hf.get(other, defaults[key]))
    k = hf.get("num_experts_per_tok", defaults["num_experts_per_tok"])
    for name, value in ((key, experts), ("num_experts_per_tok", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{where}: {name}={value!r} must be a positive integer")
    if k > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok={k} must be at most {key}={experts}")
    fields: dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=k, router_aux_loss_coef=float(
        hf.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])))
    if arch == "mixtral":
        jitter = hf.get("router_jitter_noise") or 0.0
        if float(jitter) != 0.0:
            raise CheckpointError(f"{where}: router_jitter_noise={jitter!r} is not supported (only 0.0)")
        return fields | dict(router_order="topk_then_softmax")
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise CheckpointError(f"{where}: decoder_sparse_step={step!r} is not supported: every layer must be sparse (1)")
    if hf.get("mlp_only_layers"):
        raise CheckpointError(f"{where}: mlp_only_layers={hf['mlp_only_layers']!r} is not supported (dense MLP "
                              "layers among the sparse ones); every layer must be sparse ([])")
    fields |= dict(moe_intermediate_size=int(hf.get("moe_intermediate_size", defaults["moe_intermediate_size"])),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", defaults["norm_topk_prob"])),
                   router_order="softmax_then_topk")
    if arch == "qwen2_moe":
        if not hf.get("qkv_bias", True):
            raise CheckpointError(f"{where}: qkv_bias=false is not supported for qwen2_moe (only true)")
        shared = hf.get("shared_expert_intermediate_size", defaults["shared_expert_intermediate_size"])
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
            raise CheckpointError(f"{where}: shared_expert_intermediate_size={shared!r} must be a positive integer")
        fields["shared_expert_intermediate_size"] = shared
    return fields


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _int_if_whole(value: float) -> int | float:
    """transformers types some scalars (Gemma's query_pre_attn_scalar) as int: 256.0 is written 256."""
    return int(value) if float(value).is_integer() else value


def _first_id(value: Any) -> int | None:
    """Token ids may be lists in HF configs; BOS and pad use the first."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _id_list(value: Any) -> list[int]:
    """An HF `eos_token_id` (int, null or list: Llama 3.1 has three) as a list of every id."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if v is not None]


def _hf_ids(ids: tuple[int, ...]) -> int | list[int] | None:
    """The HF form of a set of EOS ids: one id as an int (what most configs hold), several as a list."""
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def _text_part(hf: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """The config of the text model and the prefix of its tensor names: a multimodal checkpoint's
    `text_config` over transformers' defaults for the keys it leaves out, the top level's token ids and
    dtype over both (generation_config.json's EOS ids land there); else `hf` itself and no prefix."""
    found = [a for a in hf.get("architectures") or [] if a in MULTIMODAL_TEXT]
    if not found:
        return hf, ""
    arch, prefix = MULTIMODAL_TEXT[found[0]]
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{where}: {found[0]} needs a text_config")
    top = {k: hf[k] for k in ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
                              "tie_word_embeddings") if hf.get(k) is not None}
    return {**_TEXT_CONFIG_DEFAULTS[arch], **text, **top, "architectures": [_HF_CLASS[arch]]}, prefix


def config_from_hf(hf: dict[str, Any], *, source: str | os.PathLike = CONFIG_FILE) -> ModelConfig:
    """Translate a HF `config.json` dict into a `ModelConfig` (of the text model, for a multimodal
    checkpoint in `MULTIMODAL_TEXT`).

    `source` only names the file in error messages.
    """
    where = str(source)
    hf, _ = _text_part(hf, where)
    archs = hf.get("architectures") or []
    known = {**HF_ARCHITECTURES, **HF_REWARD_ARCHITECTURES}
    found = [a for a in archs if a in known]
    if not found:
        raise CheckpointError(
            f"{where}: architectures={archs!r} is not supported; supported architectures: {_supported()}"
        )
    arch = known[found[0]]
    gemma = arch in _GEMMA
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = hf.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
    activations = {theirs: ours for ours, theirs in MLP_ACTIVATIONS.items()}
    if act not in activations or (act != "silu") != gemma:
        expected = "gelu_pytorch_tanh" if gemma else "silu"
        raise CheckpointError(f"{where}: {act_key}={act!r} is not supported for {arch} (only {expected!r})")
    if hf.get("mlp_bias", False):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")
    if arch != "qwen2" and hf.get("attention_bias", False):
        raise CheckpointError(f"{where}: {arch} attention_bias=true (bias on o_proj too) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(f"{where}: use_bidirectional_attention=true is not supported (causal models only)")
    try:
        hidden, heads, layers = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
        rope = _rope_from_hf(hf, arch, where)
        local_theta = rope.pop("local_rope_theta", None)
        head_dim = hf.get("head_dim")
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
        if dtype not in _DTYPES:
            raise CheckpointError(f"{where}: dtype={dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        if gemma:
            window, pattern = _gemma_layers_from_hf(hf, arch, layers, where)
            family = dict(
                sliding_window=window, sliding_window_pattern=pattern,
                local_rope_theta=local_theta if window is not None and local_theta != rope["rope_theta"] else None,
                mlp_activation="gelu_tanh", query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                attn_logit_softcap=_optional_float(hf.get("attn_logit_softcapping")),
                final_logit_softcap=_optional_float(hf.get("final_logit_softcapping")),
            )
        else:
            family = dict(sliding_window=_sliding_window_from_hf(hf, arch, layers, where))
        family.update(_experts_from_hf(hf, arch, where))
        return ModelConfig(
            **FAMILY_SWITCHES.get(arch, {}),
            **family,
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim) if head_dim and int(head_dim) != hidden // heads else None,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            **rope,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),  # Gemma's default: tied
            param_dtype=dtype,
            dtype=dtype,
            bos_token_id=_first_id(hf.get("bos_token_id")),
            eos_token_id=_first_id(hf.get("eos_token_id")),
            extra_eos_token_ids=tuple(_id_list(hf.get("eos_token_id"))[1:]),
            pad_token_id=_first_id(hf.get("pad_token_id")),
        )
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{where}: required key {e.args[0]!r} is missing") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:  # a string where a number belongs, zero heads
        raise CheckpointError(f"{where}: {_hf_value_problem(hf, e)}") from None


# ModelConfig field -> the config.json key it is read from, to name the key a user must fix.
_HF_KEYS = {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
            "num_layers": "num_hidden_layers"}


def _hf_value_problem(hf: dict[str, Any], e: Exception) -> str:
    """Name the config.json key behind a conversion error (int("abc") does not say which key it was)."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "head_dim", "rms_norm_eps"):
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{key}={value!r} must be a number"
        if value is not None and key != "rms_norm_eps" and value < 1:
            return f"{key}={value!r} must be at least 1"
    text = str(e)
    for ours, theirs in _HF_KEYS.items():
        text = text.replace(f"{ours}=", f"{theirs}=")
    return text


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A `config.json` dict that transformers 5 (and 4.x, via the legacy rope keys) loads."""
    arch = config.architecture
    if arch in ("qwen2", "qwen2_moe") and not config.attention_bias:
        raise ValueError(f"{arch} checkpoints always have q/k/v biases; set attention_bias=True")
    if arch not in ("qwen2", "qwen2_moe") and config.attention_bias:
        raise ValueError(f"{arch} checkpoints cannot hold q/k/v biases without an o_proj bias; use qwen2")
    if arch == "llama" and config.sliding_window is not None:
        raise ValueError("LlamaForCausalLM has no sliding window; use architecture='mistral'")
    _check_family(config)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    hf: dict[str, Any] = {
        "architectures": [_HF_CLASS[arch]],
        "model_type": _MODEL_TYPE.get(arch, arch),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _hf_ids(config.eos_token_ids),
        "pad_token_id": config.pad_token_id,
        "dtype": config.param_dtype,
        "torch_dtype": config.param_dtype,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if config.rope_scaling is not None:
        s = dataclasses.asdict(config.rope_scaling)
        hf["rope_scaling"] = {"rope_type": "llama3", **s}
        rope_parameters = {"rope_type": "llama3", "rope_theta": config.rope_theta, **s}
    if config.rope_linear_factor is not None:
        hf["rope_scaling"] = {"rope_type": "linear", "factor": config.rope_linear_factor}
        rope_parameters = {"rope_type": "linear", "rope_theta": config.rope_theta, "factor": config.rope_linear_factor}
    hf["rope_parameters"] = rope_parameters
    if arch == "llama":
        hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch in ("mistral", "mixtral"):
        hf["sliding_window"] = config.sliding_window
    elif arch in _GEMMA:
        del hf["hidden_act"]
        local = config.local_layers
        hf.update(
            hidden_activation=MLP_ACTIVATIONS[config.mlp_activation], attention_bias=False,
            query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar or config.dim_per_head),
            attn_logit_softcapping=config.attn_logit_softcap, final_logit_softcapping=config.final_logit_softcap,
            sliding_window=config.sliding_window, use_bidirectional_attention=False,
            layer_types=[_LAYER_KINDS[is_local] for is_local in local],
        )
        if arch == "gemma3":  # one rope per layer kind, and transformers 4.x's keys for the local one
            local_theta = config.local_rope_theta or config.rope_theta
            hf["rope_parameters"] = {"full_attention": rope_parameters,
                                     "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
            hf.update(rope_local_base_freq=local_theta)
            if config.sliding_window_pattern is not None:
                hf["sliding_window_pattern"] = config.sliding_window_pattern
    else:
        sliding = config.sliding_window is not None
        hf.update(use_sliding_window=sliding, sliding_window=config.sliding_window, max_window_layers=0)
        hf["layer_types"] = ["sliding_attention" if sliding else "full_attention"] * config.num_layers
    if arch in _MOE:
        hf.update({_EXPERTS_KEY[arch]: config.num_experts}, num_experts_per_tok=config.num_experts_per_tok,
                  router_aux_loss_coef=config.router_aux_loss_coef, output_router_logits=False)
        if arch in ("qwen2_moe", "qwen3_moe"):
            hf.update(moe_intermediate_size=config.expert_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                      decoder_sparse_step=1, mlp_only_layers=[])
        if arch == "qwen3_moe":
            hf.update(attention_bias=False)
        elif arch == "qwen2_moe":
            hf.update(qkv_bias=True, shared_expert_intermediate_size=config.shared_expert_intermediate_size)
        else:
            hf.update(router_jitter_noise=0.0)
    return hf


# ModelConfig's per-family switches and their Llama values; a family's own values in FAMILY_SWITCHES.
_SWITCH_DEFAULTS: dict[str, Any] = dict(qk_norm=False, norm_offset=0.0, scale_embeddings=False, post_norms=False)


def _check_family(config: ModelConfig) -> None:
    """A config that `architecture`'s HF class can hold: its switches are the family's (a Llama with q/k
    norms has no HF class), else a ValueError naming the field."""
    arch = config.architecture
    family = {k: v for k, v in FAMILY_SWITCHES.get(arch, {}).items() if k != "attention_bias"}
    for name, value in (_SWITCH_DEFAULTS | family).items():
        if getattr(config, name) != value:
            raise ValueError(f"{arch} checkpoints have {name}={value!r}; this model has {getattr(config, name)!r}")
    gemma_only = dict(sliding_window_pattern=None, query_pre_attn_scalar=None, attn_logit_softcap=None,
                      final_logit_softcap=None)
    if arch not in _GEMMA:
        gemma_only.update(mlp_activation="silu", local_rope_theta=None)
    elif config.mlp_activation != "gelu_tanh":
        raise ValueError(f"{arch} checkpoints have mlp_activation='gelu_tanh'; this model has {config.mlp_activation!r}")
    elif arch == "gemma2":
        gemma_only = dict(local_rope_theta=None)
    else:
        gemma_only = {}
    for name, value in gemma_only.items():
        if getattr(config, name) != value:
            raise ValueError(f"{arch} checkpoints have no {name} (this model has {getattr(config, name)!r})")
    if arch in _GEMMA and config.rope_scaling is not None:
        raise ValueError(f"{arch}: rope_scaling is not supported")
    if arch not in _MOE:
        if config.num_experts:
            raise ValueError(f"{arch} checkpoints have no experts (this model has num_experts={config.num_experts}); "
                             f"use one of {list(_MOE)}")
        return
    if not config.num_experts:
        raise ValueError(f"{arch} checkpoints have experts; this model has num_experts=0")
    order = "topk_then_softmax" if arch == "mixtral" else "softmax_then_topk"
    if config.router_order != order:
        raise ValueError(f"{arch} checkpoints route with router_order={order!r}; "
                         f"this model has {config.router_order!r}")
    if (arch == "qwen2_moe") != (config.shared_expert_intermediate_size is not None):
        has = "have a shared expert" if arch == "qwen2_moe" else "have no shared expert"
        raise ValueError(f"{arch} checkpoints {has}; this model has shared_expert_intermediate_size="
                         f"{config.shared_expert_intermediate_size!r}")
    if arch == "mixtral" and config.moe_intermediate_size not in (None, config.intermediate_size):
        raise ValueError(f"mixtral checkpoints have one MLP width (intermediate_size={config.intermediate_size}); "
                         f"this model has moe_intermediate_size={config.moe_intermediate_size}")


# ---------------------------------------------------------------- tensor layout


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
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


def _linear(path, key, ours: tuple[int, ...], n_in: int) -> _TensorSpec:
    """`ours` = [in..., out...] with the first `n_in` axes the input; HF = [prod(out), prod(in)]."""
    d_in, d_out = int(np.prod(ours[:n_in])), int(np.prod(ours[n_in:]))
    return _TensorSpec(
        path, key, (d_out, d_in),
        to_hf=lambda x: x.reshape(d_in, d_out).T,
        from_hf=lambda w: w.T.reshape(ours),
    )


def _flat(path, key, ours: tuple[int, ...]) -> _TensorSpec:
    n = int(np.prod(ours))
    return _TensorSpec(path, key, (n,), to_hf=lambda x: x.reshape(n), from_hf=lambda w: w.reshape(ours))


def _norm(path, key, size: int) -> _TensorSpec:
    return _TensorSpec(path, key, (size,), _same, _same)


def _trunk_specs(config: ModelConfig) -> list[_TensorSpec]:
    d, v = config.hidden_size, config.vocab_size
    h, kv, hd = config.num_heads, config.num_kv_heads, config.dim_per_head
    specs = [
        _TensorSpec(("model", "embed"), "model.embed_tokens.weight", (v, d), _same, _same),
        _TensorSpec(("model", "final_norm", "weight"), "model.norm.weight", (d,), _same, _same),
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
            _TensorSpec(p + ("input_norm", "weight"), k + "input_layernorm.weight", (d,), _same, _same),
            _TensorSpec(p + ("post_attn_norm", "weight"), k + "post_attention_layernorm.weight", (d,), _same, _same),
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


def _mlp_specs(config: ModelConfig, p: tuple[str, ...], k: str) -> list[_TensorSpec]:
    """One layer's MLP tensors: the dense gate / up / down projections, or a mixture of experts' router and
    every expert's three (`_MOE_TENSORS`), each a slice of the stacked [expert, ...] weight."""
    d = config.hidden_size
    if not config.num_experts:
        f = config.intermediate_size
        return [
            _linear(p + ("mlp", "gate"), k + "mlp.gate_proj.weight", (d, f), 1),
            _linear(p + ("mlp", "up"), k + "mlp.up_proj.weight", (d, f), 1),
            _linear(p + ("mlp", "down"), k + "mlp.down_proj.weight", (f, d), 1),
        ]
    f = config.expert_intermediate_size
    router, gate, up, down = _MOE_TENSORS[config.architecture]
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


def _head_layouts(config: ModelConfig, head: str) -> list[list[_TensorSpec]]:
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
            _TensorSpec(("value_head",), "value_head.weight", (d,), _same, _same),
            _flat(("value_bias",), "value_head.bias", ()),
        ]]
    return [
        [_TensorSpec(("score_head",), "score.weight", (1, d), lambda x: x.reshape(1, d), lambda w: w.reshape(d))],
        [_TensorSpec(("score_head",), "score_head.weight", (d,), _same, _same)],
    ]


# Tensors of old layouts that have no parameter any more and must be zero to be dropped.
_MUST_BE_ZERO = ("score_head.bias",)


HEADS = ("lm", "value", "reward")


def _check_head(head: str) -> None:
    if head not in HEADS:
        raise ValueError(f"unknown model head {head!r}; choose one of {HEADS}")


# ---------------------------------------------------------------- reading


def _open_safetensors(file: Path):
    try:
        return safe_open(file, framework="np")
    except Exception as e:  # SafetensorError for truncated or foreign files
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _shard_file(folder: Path, index: Path, key: str, name: Any) -> Path:
    """A shard named by the index, which must be a plain file name inside the model folder: an index may
    come from anywhere, and `../x` or an absolute path would read files the user never pointed at."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or os.path.normpath(name) != os.path.basename(name):
        raise CheckpointError(
            f"{index}: tensor {key!r} is mapped to {name!r}; shard files must be plain file names inside {folder}"
        )
    return folder / name


class _Weights:
    """Lazy access to the tensors of one checkpoint directory (single file or sharded index)."""

    def __init__(self, path: Path):
        self.path = path
        index = path / INDEX_FILE
        single = path / WEIGHTS_FILE
        if index.is_file():
            self.source = index
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
            self.files = {key: _shard_file(path, index, key, name) for key, name in weight_map.items()}
        elif single.is_file():
            self.source = single
            with _open_safetensors(single) as f:
                self.files = {key: single for key in f.keys()}
        else:
            raise CheckpointError(f"{path}: no {WEIGHTS_FILE} or {INDEX_FILE} found")
        self._open: dict[Path, Any] = {}

    def file_of(self, key: str) -> Path:
        return self.files[key]

    def _handle(self, key: str):
        file = self.files[key]
        if file not in self._open:
            if not file.is_file():
                raise CheckpointError(f"{file}: shard file listed in {self.source} for tensor {key!r} is missing")
            self._open[file] = _open_safetensors(file)
        return self._open[file]

    def shape(self, key: str) -> tuple[int, ...]:
        try:
            return tuple(self._handle(key).get_slice(key).get_shape())
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for a key absent from a shard
            raise CheckpointError(f"{self.files[key]}: cannot read tensor {key!r} ({e})") from None

    def get(self, key: str) -> np.ndarray:
        return self._handle(key).get_tensor(key)


def _check_tensors(weights: _Weights, specs: Iterable[_TensorSpec], num_layers: int, prefix: str = "") -> None:
    """Every expected tensor present with its shape, no layers beyond num_layers: else one error listing all.
    `prefix`: what the trunk's tensor names start with before `model.` (a multimodal checkpoint's text model)."""
    layer_key = re.compile(rf"^{re.escape(prefix)}model\.layers\.(\d+)\.")
    problems = []
    for s in specs:
        if s.key not in weights.files:
            problems.append(f"{weights.source}: tensor {s.key!r} is missing (expected shape {list(s.shape)})")
            continue
        found = weights.shape(s.key)
        if found != s.shape:
            problems.append(
                f"{weights.file_of(s.key)}: tensor {s.key!r} has shape {list(found)}, expected {list(s.shape)}"
            )
    extra = sorted(
        {int(m.group(1)) for k in weights.files if (m := layer_key.match(k)) and int(m.group(1)) >= num_layers}
    )
    if extra:
        key = next(k for k in weights.files if k.startswith(f"{prefix}model.layers.{extra[0]}."))
        problems.append(
            f"{weights.file_of(key)}: tensor {key!r} belongs to layer {extra[0]}, but config.json has "
            f"num_hidden_layers={num_layers} (layers {extra} found)"
        )
    if problems:
        more = ""
        if len(problems) > 1:
            more = f"\n(and {len(problems) - 1} more problem(s):\n  " + "\n  ".join(problems[1:6]) + ")"
        raise CheckpointError(problems[0] + more)


_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(\.weight)?$")


def _check_per_expert(weights: _Weights) -> None:
    """A mixture of experts is read one tensor per expert (as the published checkpoints and transformers'
    `save_pretrained` store it): a checkpoint of fused [expert, ...] tensors (transformers' in-memory layout)
    is one error naming the tensor, not a list of every per-expert tensor it lacks."""
    fused = sorted(k for k in weights.files if _FUSED_EXPERTS.search(k))
    if fused:
        raise CheckpointError(
            f"{weights.file_of(fused[0])}: tensor {fused[0]!r} holds every expert fused (transformers' in-memory "
            "layout); this loader reads one tensor per expert (e.g. 'mlp.experts.0.gate_proj.weight'), as "
            "save_pretrained writes them"
        )


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` dict of a checkpoint directory, its `eos_token_id` widened by the EOS ids of
    `generation_config.json` (where transformers' `generate` takes its stop ids from; Llama 3 and Qwen2
    instruct models list more there), so the planner and the loader see the same ids."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{file}: not found (is {path} a Hugging Face checkpoint directory?)")
    try:
        hf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: holds a JSON {type(hf).__name__}, but a model config is a JSON object")
    generation = Path(path) / GENERATION_CONFIG_FILE
    if isinstance(hf, dict) and generation.is_file():
        try:
            more = _id_list(json.loads(generation.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(f"{generation}: cannot read eos_token_id ({e!r})") from None
        ids = list(dict.fromkeys(_id_list(hf.get("eos_token_id")) + more))
        if ids:
            hf["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return hf


def _fresh_head(path: tuple, shape: tuple[int, ...], dtype, seed: int) -> jax.Array:
    """New critic heads start at zero (values start unbiased); reward heads small random, as in build_model."""
    if path == ("score_head",):
        return (0.02 * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)
    return jnp.zeros(shape, dtype)


def load_hf_checkpoint(
    path: str | os.PathLike,
    head: str | None = None,
    *,
    param_dtype: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    remat: str | bool = "none",
    config_overrides: dict[str, Any] | None = None,
    shardings: Callable[[nnx.State], Any] | None = None,
) -> tuple[nnx.Module, ModelConfig]:
    """Load a HF checkpoint of a supported family (`HF_ARCHITECTURES`) (or one of ours) as an NNX model.

    head: "lm", "value" or "reward"; default: the head recorded in config.json by
    `save_hf_checkpoint`, else "reward" for a `...ForSequenceClassification`
    checkpoint, else "lm". A value/reward head missing from the checkpoint (an
    actor checkpoint) is created fresh and `lm_head` ignored.
    param_dtype / dtype override the checkpoint's dtype (params) and compute dtype.
    shardings(abstract state) -> shardings tree: place each parameter as it is read, each process
    building only its own devices' shards, so host memory holds one tensor at a time and no device
    the whole model (multi-host runs); without it parameters land on the default device.
    Raises `CheckpointError` naming the file and key for any missing or misshapen input.
    """
    path = Path(path)
    hf = read_hf_config(path)
    head = head or hf.get(HEAD_KEY) or _default_head(hf)
    _check_head(head)
    overrides = dict(config_overrides or {})
    if param_dtype is not None:
        overrides["param_dtype"] = param_dtype
        overrides.setdefault("dtype", param_dtype)
    if dtype is not None:
        overrides["dtype"] = dtype
    config = config_from_hf(hf, source=path / CONFIG_FILE).replace(**overrides)

    weights = _Weights(path)
    _, prefix = _text_part(hf, str(path / CONFIG_FILE))

    def prefixed(specs: list[_TensorSpec]) -> list[_TensorSpec]:
        return [dataclasses.replace(s, key=prefix + s.key) for s in specs] if prefix else specs

    trunk = prefixed(_trunk_specs(config))
    if config.num_experts:
        _check_per_expert(weights)
    layouts = [prefixed(layout) for layout in _head_layouts(config, head)]
    present = [layout for layout in layouts if any(s.key in weights.files for s in layout)]
    head_specs = present[0] if present else layouts[0]
    fresh_head = head != "lm" and not present
    _check_tensors(weights, trunk + ([] if fresh_head else head_specs), config.num_layers, prefix)

    for key in _MUST_BE_ZERO:
        if key in weights.files and np.any(weights.get(key) != 0):
            raise CheckpointError(
                f"{weights.file_of(key)}: {key} is non-zero, but reward heads have no bias (a pairwise loss "
                "cannot train one); shift scores with rewards.bias instead, or set the tensor to 0"
            )
    abstract = nnx.eval_shape(lambda: build_model(config, head, seed=seed, remat=remat))
    graphdef, state = nnx.split(abstract)
    by_path: dict[tuple, list[_TensorSpec]] = {}
    for spec in trunk + head_specs:
        by_path.setdefault(spec.path, []).append(spec)
    target = np.dtype(config.jnp_param_dtype)
    placement = {}
    if shardings is not None:
        from jaxrlhf.transfer.realloc import put_host

        placement = {tuple(p): sh.get_value() if isinstance(sh, nnx.Variable) else sh
                     for p, sh in nnx.to_flat_state(shardings(state))}
        place = lambda p, value: put_host(np.asarray(value), placement[tuple(p)])  # noqa: E731
    else:
        place = lambda p, value: jnp.asarray(value)  # noqa: E731

    def read(spec: _TensorSpec) -> np.ndarray:
        return np.asarray(spec.from_hf(weights.get(spec.key)), dtype=target)

    leaves = []
    for p, var in nnx.to_flat_state(state):
        struct = var.get_value()
        specs = by_path.get(tuple(p))
        if fresh_head and p[0] != "model":
            value = _fresh_head(tuple(p), struct.shape, struct.dtype, seed)
            value = place(p, jax.device_get(value)) if placement else value
        elif specs is None and lora.is_adapter(p):  # adapters (config lora) start fresh: B = 0, the base model
            value = lora.fresh_value(tuple(p), struct.shape, struct.dtype, seed)
            value = place(p, jax.device_get(value)) if placement else value
        elif specs is None:
            raise AssertionError(f"hf_io has no mapping for parameter {p}")  # model layout changed
        elif specs[0].layer is None:
            value = place(p, np.asarray(read(specs[0]), order="C"))
        else:  # one HF tensor per layer (and expert), stacked along the leading layers (and expert) axes
            stacked = np.empty(struct.shape, target)
            for spec in specs:
                stacked[spec.index] = read(spec)
            value = place(p, stacked)
        leaves.append((p, var.replace(value=value)))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves)), config


def _default_head(hf: dict[str, Any]) -> str:
    """HF reward models (`...ForSequenceClassification`) carry no HEAD_KEY but are reward models."""
    archs = hf.get("architectures") or []
    return "reward" if any(a in HF_REWARD_ARCHITECTURES for a in archs) else "lm"


# ---------------------------------------------------------------- writing


def _head_of(model: nnx.Module) -> str:
    for head, attr in (("value", "value_head"), ("reward", "score_head")):
        if hasattr(model, attr):
            return head
    return "lm"


def _reward_config(hf: dict[str, Any], config: ModelConfig, path: Path) -> None:
    """Make `hf` a transformers num_labels=1 sequence-classification config; warn where pooling differs."""
    pad, eos = config.pad_token_id, config.eos_token_ids
    if pad is None or pad in eos:
        why = "is None: transformers refuses batches of more than one sequence" if pad is None else (
            f"== eos_token_id ({pad}): transformers pools at the last token that is not pad_token_id, so it "
            "would score the token before the final EOS, not the position we read"
        )
        warnings.warn(f"{path}: reward model exported with pad_token_id {why}", stacklevel=3)
    hf.update(
        architectures=[_HF_REWARD_CLASS[config.architecture]],
        num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
    )


def _generation_config(config: ModelConfig) -> dict[str, Any]:
    """transformers' `generate` stops on this file's `eos_token_id`: every EOS id."""
    return {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _hf_ids(config.eos_token_ids),
        "pad_token_id": config.pad_token_id,
    }


def save_hf_checkpoint(
    model: nnx.Module,
    config: ModelConfig,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write `model` as a HF checkpoint that `transformers` loads.

    Actors load as `AutoModelForCausalLM`, reward models as
    `AutoModelForSequenceClassification` (num_labels=1). Parameters keep
    their dtype (bfloat16 stays bf16). Files larger than `max_shard_bytes` are
    split into `model-0000i-of-0000n.safetensors` with an index. Value/reward
    models record the head in config.json so `load_hf_checkpoint` restores the
    same model.

    A model with LoRA adapters is written merged (`lora.merge_adapters`); `lora.save_peft_adapter`
    writes the adapters alone. Multi-process: call it on every process; each parameter is gathered to host one at a time on all
    of them (its shards may live on any host), and only process 0 writes.
    """
    from jaxrlhf.transfer.host import host_get
    from jaxrlhf.transfer.processes import is_main

    path = Path(path)
    head = _head_of(model)
    hf = config_to_hf(config)
    state = nnx.state(model, nnx.Param)
    if config.lora:  # LoRA: the checkpoint is the merged model (W + scale * A @ B), a plain HF model
        state = lora.merge_adapters(state, config.lora)
    params = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state)}
    if head == "reward":
        _reward_config(hf, config, path)
    if head != "lm":
        hf[HEAD_KEY] = head
    tensors: dict[str, np.ndarray] = {}
    host: dict[tuple, np.ndarray] = {}  # each (stacked) parameter fetched once
    for spec in _trunk_specs(config) + _head_layouts(config, head)[0]:
        if spec.path not in host:
            host[spec.path] = np.asarray(host_get(params[spec.path]))
        value = host[spec.path][spec.index] if spec.index else host[spec.path]
        tensors[spec.key] = np.ascontiguousarray(spec.to_hf(value))
    if not is_main():
        return path
    path.mkdir(parents=True, exist_ok=True)

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, arr in tensors.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = arr
        size += arr.nbytes
    for stale in list(path.glob("model*.safetensors")) + [path / INDEX_FILE]:
        stale.unlink(missing_ok=True)  # a previous save with another shard count must not linger
    if len(shards) == 1:
        save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / name, metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    (path / GENERATION_CONFIG_FILE).write_text(json.dumps(_generation_config(config), indent=2) + "\n")
    return path
