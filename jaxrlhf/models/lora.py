"""LoRA adapters: a trainable low-rank update `scale * x @ A @ B` beside a frozen projection.

A projection `W` ([in..., out...], see `transformer.py`) gets `A` [in..., rank] and
`B` [rank, out...], with `scale = alpha / rank` as in PEFT. `A` starts as PEFT's
default (kaiming-uniform, bound 1/sqrt(fan_in)) and `B` at zero, so a fresh adapter
changes nothing: the model computes exactly the base model's logits.

Adapters are parameters like any other (they carry logical axes, so every placement
shards them like the dimensions they share with `W`; the rank axis is replicated),
held in their own dtype (`LoraConfig.dtype`, float32 by default) while the base keeps
its own. They live under a `<projection>_lora` sub-module (e.g. `attn/q_lora/a`), so
`is_adapter` picks them out by path: what the optimizer trains (`trainable`), what the
reference model drops (`strip_adapters`), what export merges (`merge_adapters`).
Dropout on the adapter input is not implemented: RL losses compare the policy's
log-probabilities with the rollout's, and a stochastic forward would make them differ.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from jaxrlhf.models import axes as ax
from jaxrlhf.models.config import TARGETS, LoraConfig

SUFFIX = "_lora"
# Parameters outside the trunk that a LoRA-trained role still trains in full (PEFT's `modules_to_save`):
# a critic's or reward model's fresh scalar head. The LM head stays frozen.
TRAINED_HEADS = ("value_head", "value_bias", "score_head")


class Adapter(nnx.Module):
    """`A` [in..., rank] and `B` [rank, out...] of one projection."""

    def __init__(self, cfg: LoraConfig, in_shape: Sequence[int], in_axes: ax.LogicalAxes,
                 out_shape: Sequence[int], out_axes: ax.LogicalAxes, *, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        fan_in = math.prod(in_shape)
        key = rngs.lora() if "lora" in rngs else rngs.params()
        self.a = nnx.Param(init_a(key, (*in_shape, cfg.rank), fan_in, dt),
                           logical_axes=(*in_axes, None))
        self.b = nnx.Param(jnp.zeros((cfg.rank, *out_shape), dt), logical_axes=(None, *out_axes))
        self.scale = cfg.scale

    def __call__(self, x: Float[Array, "batch length in"], dtype) -> jax.Array:
        """`scale * x @ A @ B`, with `x`'s input axes flattened (as `transformer.dense` takes them)."""
        a, b = self.a.value.astype(dtype), self.b.value.astype(dtype)
        bsz, t, d = x.shape
        low = jnp.matmul(x.reshape(bsz * t, d), a.reshape(d, -1))
        y = jnp.matmul(low, b.reshape(b.shape[0], -1)) * jnp.asarray(self.scale, dtype)
        return y.reshape(bsz, t, *b.shape[1:])


def init_a(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    """PEFT's default `A`: torch's kaiming_uniform_(a=sqrt(5)), i.e. uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def fresh_value(path: tuple, shape: tuple[int, ...], dtype, seed: int) -> jax.Array:
    """A new adapter parameter of a stacked layer parameter ([layers, ...]): `B` zero, `A` as `init_a`."""
    if path[-1] == "b":
        return jnp.zeros(shape, dtype)
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32("/".join(map(str, path)).encode()))
    return init_a(key, shape, math.prod(shape[1:-1]), dtype)


def adapters(cfg: LoraConfig | None, module: str, shapes: dict[str, tuple[tuple[int, ...], ax.LogicalAxes, int]],
             rngs: nnx.Rngs) -> dict[str, Adapter]:
    """The adapters of `module`'s targeted projections; `shapes[name]` = (W's shape, W's axes, input axes)."""
    if cfg is None:
        return {}
    out = {}
    for name in cfg.targets_of(module):
        shape, names, n_in = shapes[name]
        out[name + SUFFIX] = Adapter(cfg, shape[:n_in], names[:n_in], shape[n_in:], names[n_in:], rngs=rngs)
    return out


# --------------------------------------------------------------------------- state helpers


def is_adapter(path: Sequence[Any]) -> bool:
    """Whether a parameter path (as in `nnx.to_flat_state`) belongs to an adapter."""
    return any(isinstance(p, str) and p.endswith(SUFFIX) for p in path)


def trainable(path: Sequence[Any]) -> bool:
    """What a LoRA role trains: its adapters and a scalar head (critic, reward model)."""
    return is_adapter(path) or (len(path) > 0 and path[0] in TRAINED_HEADS)


def _value(v: Any) -> Any:
    return v.get_value() if isinstance(v, nnx.Variable) else v


def strip_adapters(state: nnx.State) -> nnx.State:
    """The base model's parameters: `state` without its adapters, sharing their buffers (no copy)."""
    return nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(state) if not is_adapter(p)])


def adapter_state(state: nnx.State) -> nnx.State:
    """Only the adapters of `state`."""
    return nnx.from_flat_state([(p, v) for p, v in nnx.to_flat_state(state) if is_adapter(p)])


def with_base(target: nnx.State, source: nnx.State) -> nnx.State:
    """`target` with every non-adapter parameter that `source` also has taken from `source`: a copy of a
    model under a role with other adapters (its own stay), or another head (the target's stays)."""
    base = {tuple(p): v for p, v in nnx.to_flat_state(source) if not is_adapter(p)}
    return nnx.from_flat_state([(p, v if is_adapter(p) else base.get(tuple(p), v))
                                for p, v in nnx.to_flat_state(target)])


def delta(a: np.ndarray, b: np.ndarray, scale: float, weight_shape: tuple[int, ...]) -> np.ndarray:
    """`scale * A @ B` in `W`'s layout ([layers, in..., out...]): what merging adds to `W`."""
    layers, r = a.shape[0], a.shape[-1]
    d = np.einsum("lir,lro->lio", a.reshape(layers, -1, r).astype(np.float32),
                  b.reshape(layers, r, -1).astype(np.float32))
    return (scale * d).reshape(weight_shape)


def merge_adapters(state: nnx.State, cfg: LoraConfig) -> nnx.State:
    """The base parameters with every adapter folded into its projection (`W + scale * A @ B`, on host in
    float32, cast back to `W`'s dtype): a plain model that computes what the adapted one does."""
    from jaxrlhf.transfer.host import host_get

    flat = dict((tuple(p), v) for p, v in nnx.to_flat_state(state))
    out = []
    for p, v in flat.items():
        if is_adapter(p):
            continue
        adapter = p[:-1] + (p[-1] + SUFFIX,)
        if adapter + ("a",) in flat:
            w = np.asarray(host_get(_value(v)))
            a = np.asarray(host_get(_value(flat[adapter + ("a",)])))
            b = np.asarray(host_get(_value(flat[adapter + ("b",)])))
            merged = (w.astype(np.float32) + delta(a, b, cfg.scale, w.shape)).astype(w.dtype)
            v = v.replace(value=jnp.asarray(merged)) if isinstance(v, nnx.Variable) else jnp.asarray(merged)
        out.append((p, v))
    return nnx.from_flat_state(out)


# --------------------------------------------------------------------------- PEFT export

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_HF_MODULE = {"attn": "self_attn", "mlp": "mlp"}


def peft_tensors(state: nnx.State, cfg: LoraConfig) -> dict[str, np.ndarray]:
    """The adapters under PEFT's key names, in torch's [out, in] layout: `lora_A.weight` [rank, in],
    `lora_B.weight` [out, rank], one pair per layer and targeted projection."""
    from jaxrlhf.transfer.host import host_get

    ours = {ours_name: hf for hf, (_, ours_name, _) in TARGETS.items()}
    out: dict[str, np.ndarray] = {}
    for p, v in nnx.to_flat_state(adapter_state(state)):
        module, adapter, which = p[-3], p[-2], p[-1]
        hf = ours[adapter[: -len(SUFFIX)]]
        x = np.asarray(host_get(_value(v)))
        for layer in range(x.shape[0]):
            w = x[layer]
            if which == "a":  # [in..., r] -> [r, in]
                t = w.reshape(-1, w.shape[-1]).T
            else:  # [r, out...] -> [out, r]
                t = w.reshape(w.shape[0], -1).T
            key = f"base_model.model.model.layers.{layer}.{_HF_MODULE[module]}.{hf}.lora_{which.upper()}.weight"
            out[key] = np.ascontiguousarray(t)
    return out


def save_peft_adapter(state: nnx.State, cfg: LoraConfig, path: str, base_model: str | None = None) -> None:
    """Write the adapters alone as PEFT does (`adapter_config.json` + `adapter_model.safetensors`), so
    `peft.PeftModel.from_pretrained(base, path)` puts them on the transformers model. Call it on every
    process (each tensor is gathered on all); only process 0 writes."""
    import json
    import os

    from safetensors.numpy import save_file

    from jaxrlhf.transfer.processes import is_main

    tensors = peft_tensors(state, cfg)
    if not is_main():
        return
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, PEFT_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
        "target_modules": sorted(cfg.targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
        "inference_mode": True, "base_model_name_or_path": base_model,
    }
    with open(os.path.join(path, PEFT_CONFIG), "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")
