"""The Hugging Face model families and their `config.json` <-> `ModelConfig` translation.

Each family is one `HfFamily` entry in `FAMILIES`: its transformers classes, `model_type`, the
`ModelConfig` switches it fixes beyond what its config.json says, how it describes sliding windows,
and for a mixture of experts its config keys, transformers' defaults and tensor names. The translation
below reads those entries, so a family that fits the one decoder (docs/architecture.md, "A new model
family") is an entry here plus, where its config.json has keys of its own, their reading and writing.

Both directions must be exact: an imported config builds the model transformers builds, and an
exported one loads in transformers as the same model. The tensors' names and layouts are in
`hf_tensors`, the files in `hf_io`.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Literal, Mapping

import ml_dtypes
import numpy as np

from jaxrlhf.models.config import MLP_ACTIVATIONS, ModelConfig, RopeScaling

CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint directory cannot be read: names the file and the tensor or key at fault."""


@dataclasses.dataclass(frozen=True)
class HfFamily:
    """What one HF family is to the decoder: the classes and keys its config.json uses, what it fixes."""

    architecture: str  # ModelConfig.architecture
    causal_lm: str  # config.json `architectures` entry of the language model
    sequence_classifier: str  # ... of transformers' num_labels=1 reward model
    model_type: str  # config.json `model_type`
    # ModelConfig switches the family fixes beyond what its config.json keys say
    switches: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # how config.json describes sliding windows: never (Llama); `sliding_window` on every layer (Mistral);
    # `use_sliding_window` on every layer or none (Qwen); local and global layers in `layer_types` (Gemma)
    windows: Literal["none", "every_layer", "use_sliding_window", "layer_types"] = "use_sliding_window"
    # Gemma's layer: GeGLU (`hidden_activation`), soft-caps, `query_pre_attn_scalar`, tied embeddings by default
    gemma: bool = False
    global_every: int | None = None  # Gemma: every P-th layer global when config.json has no `layer_types`
    rope_per_layer_kind: bool = False  # Gemma 3: one rope for global layers, another for local ones
    # config.json keys with one value in every checkpoint of the family (written on export)
    fixed_keys: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # mixtures of experts: the config.json keys of the expert count and of an expert's width (None: as wide as
    # the dense MLP, `intermediate_size`, with Mixtral's keys), transformers' defaults for the keys a config.json
    # leaves out, the router's order, whether a shared expert joins, and the tensor names of one layer's sparse
    # MLP (under model.layers.{i}.): its router and expert j's gate / up / down projections
    experts_key: str | None = None
    expert_width_key: str | None = None
    moe_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    router_order: str | None = None
    shared_expert: bool = False
    expert_tensors: tuple[str, str, str, str] | None = None
    # transformers' defaults for the text_config keys a multimodal checkpoint leaves out (`MULTIMODAL_TEXT`)
    text_config_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def moe(self) -> bool:
        return self.experts_key is not None


_GEMMA_SWITCHES = dict(norm_offset=1.0, scale_embeddings=True, post_norms=True)
_QWEN_MOE_TENSORS = ("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                     "mlp.experts.{j}.down_proj.weight")
_QWEN_MOE_KEYS = dict(decoder_sparse_step=1, mlp_only_layers=[])

FAMILIES: dict[str, HfFamily] = {f.architecture: f for f in (
    HfFamily("llama", "LlamaForCausalLM", "LlamaForSequenceClassification", "llama", windows="none",
             fixed_keys=dict(attention_bias=False, mlp_bias=False, pretraining_tp=1)),
    HfFamily("qwen2", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "qwen2",
             switches=dict(attention_bias=True)),
    HfFamily("mistral", "MistralForCausalLM", "MistralForSequenceClassification", "mistral", windows="every_layer"),
    HfFamily("qwen3", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "qwen3", switches=dict(qk_norm=True)),
    HfFamily("gemma2", "Gemma2ForCausalLM", "Gemma2ForSequenceClassification", "gemma2", switches=_GEMMA_SWITCHES,
             windows="layer_types", gemma=True, global_every=2),
    # Gemma 3 1B and 270M; the larger ones are multimodal and load through MULTIMODAL_TEXT
    HfFamily("gemma3", "Gemma3ForCausalLM", "Gemma3TextForSequenceClassification", "gemma3_text",
             switches=dict(qk_norm=True, **_GEMMA_SWITCHES), windows="layer_types", gemma=True, global_every=6,
             rope_per_layer_kind=True,
             # the published multimodal configs leave out every text_config key at transformers' default
             # (Gemma 3 27B's has no vocab_size, heads or activation)
             text_config_defaults=dict(
                 vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                 max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=10000.0,
                 query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6, tie_word_embeddings=True,
                 bos_token_id=2, eos_token_id=1, pad_token_id=0,
             )),
    HfFamily("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification", "qwen2_moe",
             switches=dict(attention_bias=True), fixed_keys=dict(_QWEN_MOE_KEYS, qkv_bias=True),
             experts_key="num_experts", expert_width_key="moe_intermediate_size", router_order="softmax_then_topk",
             shared_expert=True, expert_tensors=_QWEN_MOE_TENSORS,
             moe_defaults=dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                               norm_topk_prob=False, router_aux_loss_coef=0.001,
                               shared_expert_intermediate_size=5632)),
    HfFamily("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification", "qwen3_moe",
             switches=dict(qk_norm=True), fixed_keys=dict(_QWEN_MOE_KEYS, attention_bias=False),
             experts_key="num_experts", expert_width_key="moe_intermediate_size", router_order="softmax_then_topk",
             expert_tensors=_QWEN_MOE_TENSORS,
             moe_defaults=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                               norm_topk_prob=False, router_aux_loss_coef=0.001)),
    HfFamily("mixtral", "MixtralForCausalLM", "MixtralForSequenceClassification", "mixtral", windows="every_layer",
             fixed_keys=dict(router_jitter_noise=0.0), experts_key="num_local_experts",
             router_order="topk_then_softmax",
             expert_tensors=("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                             "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight"),
             moe_defaults=dict(num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001)),
)}

# HF `architectures` entry <-> our `ModelConfig.architecture`, for language models and for reward models.
HF_ARCHITECTURES: dict[str, str] = {f.causal_lm: arch for arch, f in FAMILIES.items()}
HF_REWARD_ARCHITECTURES: dict[str, str] = {f.sequence_classifier: arch for arch, f in FAMILIES.items()}
# Multimodal checkpoints whose text model we load (its config in `text_config`, its tensors under a prefix;
# the vision tower and projector are left out): class -> (our architecture, tensor name prefix). Export
# writes the text model alone, as the architecture's ...ForCausalLM.
MULTIMODAL_TEXT: dict[str, tuple[str, str]] = {"Gemma3ForConditionalGeneration": ("gemma3", "language_model.")}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_LAYER_KINDS = ("full_attention", "sliding_attention")  # transformers' `layer_types` entries


def _supported() -> str:
    return (", ".join(sorted(HF_ARCHITECTURES)) + " (and their ...ForSequenceClassification reward models; "
            + ", ".join(f"the text model of {cls}" for cls in MULTIMODAL_TEXT) + ")")


# ---------------------------------------------------------------- config.json -> ModelConfig


def _rope_from_hf(hf: dict[str, Any], family: HfFamily, where: str) -> dict[str, Any]:
    """The rope fields of ModelConfig (rope_theta, rope_scaling, rope_linear_factor, local_rope_theta) from
    either the transformers 5 `rope_parameters` (Gemma 3: one entry per layer kind) or the legacy keys."""
    arch = family.architecture
    params = hf.get("rope_parameters") or {}
    _check_full_rotation(hf, "", where)
    per_kind = any(isinstance(v, dict) for v in params.values())
    if not family.rope_per_layer_kind and ("rope_layer" in params or per_kind):
        raise CheckpointError(f"{where}: per-layer rope_parameters are not supported for {arch}")
    if not family.rope_per_layer_kind:
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
    if family.gemma and rope["rope_scaling"] is not None:
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


def _gemma_layers_from_hf(hf: dict[str, Any], family: HfFamily, num_layers: int, where: str
                          ) -> tuple[int | None, int | None]:
    """Gemma's (sliding_window, sliding_window_pattern) from `sliding_window` and `layer_types` (else the
    family's pattern): local layers with every P-th layer global, every layer local (P None), or none."""
    window = hf.get("sliding_window")
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or family.global_every)
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


def _sliding_window_from_hf(hf: dict[str, Any], family: HfFamily, num_layers: int, where: str) -> int | None:
    """Mistral: `sliding_window` as is. Qwen2/3: only if every layer slides (or none does)."""
    if family.windows == "every_layer":
        return hf.get("sliding_window")
    if family.windows == "none" or not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
        return None
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(num_layers)
    ]
    if all(t == "sliding_attention" for t in layer_types):
        return int(hf["sliding_window"])
    if all(t == "full_attention" for t in layer_types):
        return None
    raise CheckpointError(
        f"{where}: {family.architecture} with sliding window on only some layers (layer_types={layer_types}) "
        "is not supported"
    )


def _experts_from_hf(hf: dict[str, Any], family: HfFamily, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig ({} for a dense family). Refused: what our sparse MLP
    does not compute (dense MLP layers among the sparse ones, shared experts outside Qwen2-MoE, router
    jitter, Qwen2-MoE without q/k/v biases)."""
    if not family.moe:
        return {}
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if hf.get(key) and not (family.shared_expert and key == "shared_expert_intermediate_size"):
            raise CheckpointError(f"{where}: {key}={hf[key]!r} is not supported (no shared experts)")
    defaults = family.moe_defaults
    key = family.experts_key
    other = "num_local_experts" if key == "num_experts" else "num_experts"  # transformers reads either
    experts = hf.get(key, hf.get(other, defaults[key]))
    k = hf.get("num_experts_per_tok", defaults["num_experts_per_tok"])
    for name, value in ((key, experts), ("num_experts_per_tok", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{where}: {name}={value!r} must be a positive integer")
    if k > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok={k} must be at most {key}={experts}")
    fields: dict[str, Any] = dict(num_experts=experts, num_experts_per_tok=k, router_aux_loss_coef=float(
        hf.get("router_aux_loss_coef", defaults["router_aux_loss_coef"])), router_order=family.router_order)
    if family.expert_width_key is None:  # Mixtral: experts as wide as intermediate_size, a router jitter key
        jitter = hf.get("router_jitter_noise") or 0.0
        if float(jitter) != 0.0:
            raise CheckpointError(f"{where}: router_jitter_noise={jitter!r} is not supported (only 0.0)")
        return fields
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise CheckpointError(f"{where}: decoder_sparse_step={step!r} is not supported: every layer must be sparse (1)")
    if hf.get("mlp_only_layers"):
        raise CheckpointError(f"{where}: mlp_only_layers={hf['mlp_only_layers']!r} is not supported (dense MLP "
                              "layers among the sparse ones); every layer must be sparse ([])")
    width = family.expert_width_key
    fields |= dict(moe_intermediate_size=int(hf.get(width, defaults[width])),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", defaults["norm_topk_prob"])))
    if family.shared_expert:  # Qwen2-MoE
        if not hf.get("qkv_bias", True):
            raise CheckpointError(f"{where}: qkv_bias=false is not supported for {family.architecture} (only true)")
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


def id_list(value: Any) -> list[int]:
    """An HF `eos_token_id` (int, null or list: Llama 3.1 has three) as a list of every id."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if v is not None]


def hf_ids(ids: tuple[int, ...]) -> int | list[int] | None:
    """The HF form of a set of EOS ids: one id as an int (what most configs hold), several as a list."""
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def text_part(hf: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
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
    family = FAMILIES[arch]
    return {**family.text_config_defaults, **text, **top, "architectures": [family.causal_lm]}, prefix


def config_from_hf(hf: dict[str, Any], *, source: str | os.PathLike = CONFIG_FILE) -> ModelConfig:
    """Translate a HF `config.json` dict into a `ModelConfig` (of the text model, for a multimodal
    checkpoint in `MULTIMODAL_TEXT`).

    `source` only names the file in error messages.
    """
    where = str(source)
    hf, _ = text_part(hf, where)
    archs = hf.get("architectures") or []
    known = {**HF_ARCHITECTURES, **HF_REWARD_ARCHITECTURES}
    found = [a for a in archs if a in known]
    if not found:
        raise CheckpointError(
            f"{where}: architectures={archs!r} is not supported; supported architectures: {_supported()}"
        )
    arch = known[found[0]]
    family = FAMILIES[arch]
    gemma = family.gemma
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = hf.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
    activations = {theirs: ours for ours, theirs in MLP_ACTIVATIONS.items()}
    if act not in activations or (act != "silu") != gemma:
        expected = "gelu_pytorch_tanh" if gemma else "silu"
        raise CheckpointError(f"{where}: {act_key}={act!r} is not supported for {arch} (only {expected!r})")
    if hf.get("mlp_bias", False):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")
    # Qwen2 alone reads q/k/v biases from `attention_bias` (Qwen2-MoE from `qkv_bias`); elsewhere it means an
    # o_proj bias too
    if arch != "qwen2" and hf.get("attention_bias", False):
        raise CheckpointError(f"{where}: {arch} attention_bias=true (bias on o_proj too) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(f"{where}: use_bidirectional_attention=true is not supported (causal models only)")
    try:
        hidden, heads, layers = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
        rope = _rope_from_hf(hf, family, where)
        local_theta = rope.pop("local_rope_theta", None)
        head_dim = hf.get("head_dim")
        dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
        if dtype not in DTYPES:
            raise CheckpointError(f"{where}: dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if gemma:
            window, pattern = _gemma_layers_from_hf(hf, family, layers, where)
            fields = dict(
                sliding_window=window, sliding_window_pattern=pattern,
                local_rope_theta=local_theta if window is not None and local_theta != rope["rope_theta"] else None,
                mlp_activation="gelu_tanh", query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                attn_logit_softcap=_optional_float(hf.get("attn_logit_softcapping")),
                final_logit_softcap=_optional_float(hf.get("final_logit_softcapping")),
            )
        else:
            fields = dict(sliding_window=_sliding_window_from_hf(hf, family, layers, where))
        fields.update(_experts_from_hf(hf, family, where))
        return ModelConfig(
            **family.switches,
            **fields,
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
            extra_eos_token_ids=tuple(id_list(hf.get("eos_token_id"))[1:]),
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


# ---------------------------------------------------------------- ModelConfig -> config.json


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A `config.json` dict that transformers 5 (and 4.x, via the legacy rope keys) loads."""
    arch = config.architecture
    family = FAMILIES[arch]
    biased = family.switches.get("attention_bias", False)
    if biased and not config.attention_bias:
        raise ValueError(f"{arch} checkpoints always have q/k/v biases; set attention_bias=True")
    if not biased and config.attention_bias:
        raise ValueError(f"{arch} checkpoints cannot hold q/k/v biases without an o_proj bias; use qwen2")
    if family.windows == "none" and config.sliding_window is not None:
        raise ValueError(f"{family.causal_lm} has no sliding window; use architecture='mistral'")
    _check_family(config)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    hf: dict[str, Any] = {
        "architectures": [family.causal_lm],
        "model_type": family.model_type,
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
        "eos_token_id": hf_ids(config.eos_token_ids),
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
    if family.windows == "every_layer":
        hf["sliding_window"] = config.sliding_window
    elif family.windows == "layer_types":  # Gemma
        del hf["hidden_act"]
        local = config.local_layers
        hf.update(
            hidden_activation=MLP_ACTIVATIONS[config.mlp_activation], attention_bias=False,
            query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar or config.dim_per_head),
            attn_logit_softcapping=config.attn_logit_softcap, final_logit_softcapping=config.final_logit_softcap,
            sliding_window=config.sliding_window, use_bidirectional_attention=False,
            layer_types=[_LAYER_KINDS[is_local] for is_local in local],
        )
        if family.rope_per_layer_kind:  # one rope per layer kind, and transformers 4.x's keys for the local one
            local_theta = config.local_rope_theta or config.rope_theta
            hf["rope_parameters"] = {"full_attention": rope_parameters,
                                     "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
            hf.update(rope_local_base_freq=local_theta)
            if config.sliding_window_pattern is not None:
                hf["sliding_window_pattern"] = config.sliding_window_pattern
    elif family.windows == "use_sliding_window":
        sliding = config.sliding_window is not None
        hf.update(use_sliding_window=sliding, sliding_window=config.sliding_window, max_window_layers=0)
        hf["layer_types"] = ["sliding_attention" if sliding else "full_attention"] * config.num_layers
    if family.moe:
        hf.update({family.experts_key: config.num_experts}, num_experts_per_tok=config.num_experts_per_tok,
                  router_aux_loss_coef=config.router_aux_loss_coef, output_router_logits=False)
        if family.expert_width_key:
            hf.update({family.expert_width_key: config.expert_intermediate_size}, norm_topk_prob=config.norm_topk_prob)
        if family.shared_expert:
            hf.update(shared_expert_intermediate_size=config.shared_expert_intermediate_size)
    hf.update(copy.deepcopy(dict(family.fixed_keys)))  # a copy: the caller may edit its lists
    return hf


# ModelConfig's per-family switches and their Llama values; a family's own values in its `switches`.
_SWITCH_DEFAULTS: dict[str, Any] = dict(qk_norm=False, norm_offset=0.0, scale_embeddings=False, post_norms=False)


def _check_family(config: ModelConfig) -> None:
    """A config that `architecture`'s HF class can hold: its switches are the family's (a Llama with q/k
    norms has no HF class), else a ValueError naming the field."""
    arch = config.architecture
    family = FAMILIES[arch]
    switches = {k: v for k, v in family.switches.items() if k != "attention_bias"}
    for name, value in (_SWITCH_DEFAULTS | switches).items():
        if getattr(config, name) != value:
            raise ValueError(f"{arch} checkpoints have {name}={value!r}; this model has {getattr(config, name)!r}")
    gemma_only = dict(sliding_window_pattern=None, query_pre_attn_scalar=None, attn_logit_softcap=None,
                      final_logit_softcap=None)
    if not family.gemma:
        gemma_only.update(mlp_activation="silu", local_rope_theta=None)
    elif config.mlp_activation != "gelu_tanh":
        raise ValueError(f"{arch} checkpoints have mlp_activation='gelu_tanh'; this model has "
                         f"{config.mlp_activation!r}")
    elif not family.rope_per_layer_kind:
        gemma_only = dict(local_rope_theta=None)
    else:
        gemma_only = {}
    for name, value in gemma_only.items():
        if getattr(config, name) != value:
            raise ValueError(f"{arch} checkpoints have no {name} (this model has {getattr(config, name)!r})")
    if family.gemma and config.rope_scaling is not None:
        raise ValueError(f"{arch}: rope_scaling is not supported")
    if not family.moe:
        if config.num_experts:
            moe = [a for a, f in FAMILIES.items() if f.moe]
            raise ValueError(f"{arch} checkpoints have no experts (this model has num_experts={config.num_experts}); "
                             f"use one of {moe}")
        return
    if not config.num_experts:
        raise ValueError(f"{arch} checkpoints have experts; this model has num_experts=0")
    if config.router_order != family.router_order:
        raise ValueError(f"{arch} checkpoints route with router_order={family.router_order!r}; "
                         f"this model has {config.router_order!r}")
    if family.shared_expert != (config.shared_expert_intermediate_size is not None):
        has = "have a shared expert" if family.shared_expert else "have no shared expert"
        raise ValueError(f"{arch} checkpoints {has}; this model has shared_expert_intermediate_size="
                         f"{config.shared_expert_intermediate_size!r}")
    if family.expert_width_key is None and config.moe_intermediate_size not in (None, config.intermediate_size):
        raise ValueError(f"{arch} checkpoints have one MLP width (intermediate_size={config.intermediate_size}); "
                         f"this model has moe_intermediate_size={config.moe_intermediate_size}")
