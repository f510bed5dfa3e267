"""Hugging Face checkpoints in and out: `config.json` + `*.safetensors`, single-file or sharded.

Users start from pretrained Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 / Qwen3-MoE / Mixtral checkpoints
(docs/models.md) and hand trained actors back to `transformers`, so both directions must be exact
(float32 logits within 1e-4 relative, import -> export -> import bitwise). This module reads and writes
the files; what each family's config.json means is in `hf_families`, which tensor is which parameter
in `hf_tensors`. `CheckpointError` (raised by both this module and the config translation) is defined
in `hf_families` and is this module's error too.

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
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrlhf.models import lora
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.hf_families import (
    CONFIG_FILE,
    FAMILIES,
    HF_REWARD_ARCHITECTURES,
    CheckpointError,
    config_from_hf,
    config_to_hf,
    hf_ids,
    id_list,
    text_part,
)
from jaxrlhf.models.hf_tensors import MUST_BE_ZERO, TensorSpec, check_head, head_layouts, trunk_specs
from jaxrlhf.models.transformer import build_model

__all__ = ["CONFIG_FILE", "GENERATION_CONFIG_FILE", "HEAD_KEY", "INDEX_FILE", "WEIGHTS_FILE", "CheckpointError",
           "load_hf_checkpoint", "read_hf_config", "save_hf_checkpoint"]

GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# config.json key that records which head (value / reward) a checkpoint of ours carries.
HEAD_KEY = "jaxrlhf_head"


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


def _check_tensors(weights: _Weights, specs: Iterable[TensorSpec], num_layers: int, prefix: str = "") -> None:
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
            more = id_list(json.loads(generation.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            raise CheckpointError(f"{generation}: cannot read eos_token_id ({e!r})") from None
        ids = list(dict.fromkeys(id_list(hf.get("eos_token_id")) + more))
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
    check_head(head)
    overrides = dict(config_overrides or {})
    if param_dtype is not None:
        overrides["param_dtype"] = param_dtype
        overrides.setdefault("dtype", param_dtype)
    if dtype is not None:
        overrides["dtype"] = dtype
    config = config_from_hf(hf, source=path / CONFIG_FILE).replace(**overrides)

    weights = _Weights(path)
    _, prefix = text_part(hf, str(path / CONFIG_FILE))

    def prefixed(specs: list[TensorSpec]) -> list[TensorSpec]:
        return [dataclasses.replace(s, key=prefix + s.key) for s in specs] if prefix else specs

    trunk = prefixed(trunk_specs(config))
    if config.num_experts:
        _check_per_expert(weights)
    layouts = [prefixed(layout) for layout in head_layouts(config, head)]
    present = [layout for layout in layouts if any(s.key in weights.files for s in layout)]
    head_specs = present[0] if present else layouts[0]
    fresh_head = head != "lm" and not present
    _check_tensors(weights, trunk + ([] if fresh_head else head_specs), config.num_layers, prefix)

    for key in MUST_BE_ZERO:
        if key in weights.files and np.any(weights.get(key) != 0):
            raise CheckpointError(
                f"{weights.file_of(key)}: {key} is non-zero, but reward heads have no bias (a pairwise loss "
                "cannot train one); shift scores with rewards.bias instead, or set the tensor to 0"
            )
    abstract = nnx.eval_shape(lambda: build_model(config, head, seed=seed, remat=remat))
    graphdef, state = nnx.split(abstract)
    by_path: dict[tuple, list[TensorSpec]] = {}
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

    def read(spec: TensorSpec) -> np.ndarray:
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
        architectures=[FAMILIES[config.architecture].sequence_classifier],
        num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
    )


def _generation_config(config: ModelConfig) -> dict[str, Any]:
    """transformers' `generate` stops on this file's `eos_token_id`: every EOS id."""
    return {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": hf_ids(config.eos_token_ids),
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
    writes the adapters alone. Multi-process: call it on every process; each parameter is gathered to
    host one at a time on all of them (its shards may live on any host), and only process 0 writes.
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
    for spec in trunk_specs(config) + head_layouts(config, head)[0]:
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
