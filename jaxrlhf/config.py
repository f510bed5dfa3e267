"""Typed run configuration: nested frozen dataclasses, YAML files and dotted
`key=value` command-line overrides.

    cfg = load_config("configs/quickstart.yaml", ["run.steps=20", "algorithm.kl_coef=0.05"])
    print(format_config(cfg))          # what --print-config shows

The dataclasses below are the schema: field types (including `Literal`
choices) drive type checking, `_check` metadata holds per-key value rules and
`validate()` the rules that span keys. Every user mistake is a `ConfigError`
whose message names the dotted key, so the CLI prints it without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
import types
import typing
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence, Union

import yaml


class ConfigError(ValueError):
    """A configuration mistake; the message names the key and what to do."""


# ---------------------------------------------------------------------------------------------
# Per-key value checks (attached to fields as metadata)

Check = Callable[[Any], str | None]  # returns a complaint ("must be > 0") or None


def positive(value: Any) -> str | None:
    return None if value is None or value > 0 else "must be > 0"


def non_negative(value: Any) -> str | None:
    return None if value is None or value >= 0 else "must be >= 0"


def unit_interval(value: Any) -> str | None:
    """(0, 1]: probabilities such as top_p, discount factors."""
    return None if value is None or 0 < value <= 1 else "must be in (0, 1]"


def closed_unit_interval(value: Any) -> str | None:
    return None if value is None or 0 <= value <= 1 else "must be in [0, 1]"


def not_empty(value: Any) -> str | None:
    return None if value is None or len(value) > 0 else "must not be empty"


def _field(default: Any = dataclasses.MISSING, *, check: Check | None = None, factory: Any = None) -> Any:
    """A dataclass field with an optional value check."""
    metadata = {"check": check} if check else {}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


Dtype = Literal["float32", "bfloat16", "float16"]


# ---------------------------------------------------------------------------------------------
# Schema


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where outputs go, how long to run and on which devices."""

    output_dir: str = "runs/default"
    steps: int = _field(100, check=positive)
    seed: int = 0
    resume: bool = False  # continue from the latest checkpoint in output_dir
    checkpoint_every: int = _field(50, check=non_negative)  # steps; 0 = only at the end
    keep_checkpoints: int = _field(3, check=positive)
    log_every: int = _field(1, check=positive)
    eval_every: int = _field(0, check=non_negative)  # steps; 0 = no evaluation on data.eval_split
    platform: Literal["cpu", "gpu", "tpu", "auto"] = "auto"
    devices: int | None = _field(None, check=positive)  # simulated CPU devices; null = what JAX has
    distributed: bool = False  # call jax.distributed.initialize() (multi-host)
    compile_cache: str | None = "~/.cache/jaxrlhf/xla"  # persistent compilation cache; null = off
    tensorboard: bool = True
    export_hf: bool = True  # write the final actor as an HF checkpoint


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """How model calls are placed on devices (see jaxrlhf.mesh)."""

    strategy: Literal["colocated", "interleaved", "disaggregated", "reallocated", "auto"] = "colocated"
    file: str | None = None  # a plan YAML; overrides strategy
    offpolicy: bool = False  # generate step i+1 while training step i (disaggregated)
    hardware: str | None = None  # planner hardware profile; null = detect from the platform
    axis_rules: dict[str, Any] | None = None  # logical axis -> mesh axis (or list, or null)
    # frozen roles kept in host memory between their calls; null = what the memory model needs to fit
    offload: tuple[Literal["actor", "critic", "ref", "reward"], ...] | None = None


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """The algorithm or training stage (`jaxrlhf.algorithms`) and its hyperparameters.

    RL algorithms: ppo, grpo, rloo, reinforce_pp, remax (defaults follow
    ReaLHF's PPO). Stages: sft, rm (reward model), dpo. Keys an algorithm does
    not use are ignored by it; null means "the algorithm's own default".
    """

    name: str = _field("ppo", check=not_empty)  # a name in jaxrlhf.algorithms.ALGORITHMS
    kl_coef: float = _field(0.1, check=non_negative)  # 0 (and no kl_target) = no reference model
    kl_target: float | None = _field(None, check=positive)  # null = fixed coefficient
    kl_horizon: int = _field(10000, check=positive)  # adaptive controller horizon (samples)
    kl_estimator: Literal["k1", "k2", "k3"] | None = None  # null: k1 in the reward (ppo...), k3 in the loss (grpo)
    gamma: float = _field(1.0, check=closed_unit_interval)
    lam: float = _field(1.0, check=closed_unit_interval)
    clip_eps: float = _field(0.2, check=positive)
    value_clip_eps: float | None = _field(0.2, check=positive)  # null = unclipped value loss
    minibatches: int = _field(4, check=positive)
    epochs: int = _field(1, check=positive)
    micro_batch_size: int | None = _field(None, check=positive)  # rows per micro-batch; null = no micro-batching
    ratio_early_stop: float | None = _field(5.0, check=positive)  # null = never stop early
    whiten_advantages: bool | None = None  # GAE only (null = on); other estimators fix their own normalisation
    normalize_values: bool = False
    group_size: int = _field(1, check=positive)  # samples per prompt (grpo, rloo: >= 2)
    norm_adv_by_std: bool = True  # grpo: divide by the group's std (false = Dr. GRPO)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None
    entropy_coef: float = _field(0.0, check=non_negative)
    dpo_beta: float = _field(0.1, check=positive)  # dpo: strength of the implicit KL to the reference
    dpo_label_smoothing: float = _field(0.0, check=lambda v: None if 0 <= v < 0.5 else "must be in [0, 0.5)")
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"


@dataclasses.dataclass(frozen=True)
class RoleModelConfig:
    """Where one role's weights come from: a size preset, an HF checkpoint, or another role."""

    preset: str | None = None  # a name from jaxrlhf.models.config.PRESETS (random init)
    path: str | None = None  # HF checkpoint folder (config.json + *.safetensors)
    init_from: Literal["actor", "critic", "ref", "reward"] | None = None  # copy that role's trunk
    overrides: dict[str, Any] = _field(factory=dict)  # ModelConfig fields to replace
    dtype: Dtype | None = None  # compute dtype; null = the model's own
    param_dtype: Dtype | None = None
    # rematerialise the scanned layer in training: none, full (keep layer inputs), dots (keep matmul outputs)
    remat: Literal["none", "full", "dots"] = "none"

    @property
    def source(self) -> str | None:
        """A short description of where the weights come from, or None if unset."""
        if self.init_from:
            return f"init_from {self.init_from}"
        return self.path or (f"preset {self.preset}" if self.preset else None)


ROLES = ("actor", "critic", "ref", "reward")


@dataclasses.dataclass(frozen=True)
class ModelsConfig:
    """The four roles and the tokenizer they share."""

    actor: RoleModelConfig = _field(factory=lambda: RoleModelConfig(preset="tiny"))
    critic: RoleModelConfig = _field(factory=lambda: RoleModelConfig(init_from="actor"))
    ref: RoleModelConfig = _field(factory=lambda: RoleModelConfig(init_from="actor"))
    reward: RoleModelConfig = _field(factory=RoleModelConfig)  # used when rewards.model is true
    tokenizer: str = "byte"  # "byte" or a path to tokenizer.json (or its folder)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup and a decay schedule, for one trained role."""

    lr: float = _field(1e-5, check=positive)
    weight_decay: float = _field(0.0, check=non_negative)
    b1: float = _field(0.9, check=closed_unit_interval)
    b2: float = _field(0.95, check=closed_unit_interval)
    eps: float = _field(1e-8, check=positive)
    warmup_steps: int = _field(0, check=non_negative)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    max_grad_norm: float | None = _field(1.0, check=positive)  # null = no clipping
    master_weights: bool = True  # bf16/fp16 params: AdamW on an fp32 master copy (no effect on fp32 params)


@dataclasses.dataclass(frozen=True)
class OptimizersConfig:
    """One optimizer per trained role (the reward model is trained by the `rm` stage)."""

    actor: OptimConfig = _field(factory=OptimConfig)
    critic: OptimConfig = _field(factory=lambda: OptimConfig(lr=5e-5))
    reward: OptimConfig = _field(factory=lambda: OptimConfig(lr=1e-5))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Prompt data for rollouts (see jaxrlhf.data.sources for what `source` accepts)."""

    source: str = _field("arithmetic", check=not_empty)  # bundled task, file, folder or TFDS name
    split: str = "train"
    eval_split: str | None = "test"  # held-out split for run.eval_every; null = no evaluation
    prompt_key: str = _field("prompt", check=not_empty)
    answer_key: str | None = "answer"  # null = no reference answers (reward model only)
    answer_extract: str = "none"  # a name in jaxrlhf.data.answers.ANSWER_EXTRACTORS
    prompt_template: str = "{prompt}"
    add_bos: bool = True
    batch_size: int = _field(32, check=positive)  # prompts per step (global)
    max_prompt_len: int = _field(64, check=positive)  # tokens; longer prompts are skipped
    pad_multiple: int = _field(16, check=positive)  # prompt lengths pad to multiples of this
    shuffle: bool = True
    seed: int | None = None  # null = run.seed
    data_dir: str | None = None  # TFDS data dir; null = $JAXRLHF_DATA_DIR or ~/.cache/jaxrlhf/tfds
    chosen_key: str = _field("chosen", check=not_empty)  # preference pairs (rm, dpo)
    rejected_key: str = _field("rejected", check=not_empty)
    max_seq_len: int | None = _field(None, check=positive)  # sft/rm/dpo; null = max_prompt_len + max_new_tokens
    packing: bool = False  # sft: several demonstrations per row


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Optional supervised warm-up of the actor before RL: the `sft` stage run first, on the
    actor's training placement (the reference then copies the warmed-up actor)."""

    steps: int = _field(0, check=non_negative)  # 0 = no warm-up
    source: str | None = None  # null = data.source
    split: str = "sft"
    completion_key: str | None = None  # null = data.answer_key
    batch_size: int = _field(32, check=positive)
    lr: float = _field(1e-3, check=positive)
    packing: bool = False


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Sampling for rollouts; the loss recomputes log-probs with the same processing."""

    max_new_tokens: int = _field(32, check=positive)
    temperature: float = _field(1.0, check=positive)
    top_k: int = _field(0, check=non_negative)  # 0 = off
    top_p: float = _field(1.0, check=unit_interval)  # 1 = off
    greedy: bool = False


@dataclasses.dataclass(frozen=True)
class RewardRule:
    """One rule reward by registry name, its weight and keyword arguments."""

    name: str = _field(check=not_empty)
    weight: float = 1.0
    args: dict[str, Any] = _field(factory=dict)


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    """Reward = (sum of weighted rules [+ reward model] - bias) * scale, clipped."""

    model: bool = False  # score with the reward model (model.reward)
    rules: tuple[RewardRule, ...] = (RewardRule("exact_match"),)
    scale: float = 1.0
    bias: float = 0.0
    clip: float | None = _field(20.0, check=positive)  # |reward| bound; null = no clipping
    eos_only: bool = True  # sequences that did not end with EOS get no score


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run."""

    run: RunConfig = _field(factory=RunConfig)
    plan: PlanConfig = _field(factory=PlanConfig)
    algorithm: AlgorithmConfig = _field(factory=AlgorithmConfig)
    model: ModelsConfig = _field(factory=ModelsConfig)
    optimizer: OptimizersConfig = _field(factory=OptimizersConfig)
    data: DataConfig = _field(factory=DataConfig)
    sft: SFTConfig = _field(factory=SFTConfig)
    generation: GenerationConfig = _field(factory=GenerationConfig)
    rewards: RewardsConfig = _field(factory=RewardsConfig)


# ---------------------------------------------------------------------------------------------
# Types: checking and coercion driven by the annotations


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {_type_name(args[0])}"
    if origin is dict or tp is dict:
        return "a mapping"
    if _is_dataclass_type(tp):
        return "a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` as type `tp`, or ConfigError naming the key, the expected type and the value."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(e)
        if len(options) == 1 and (typing.get_origin(options[0]) is Literal or _is_dataclass_type(options[0])):
            raise errors[0]  # its own message is more specific (choices, nested keys)
        raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        if value in args and isinstance(value, str) == isinstance(args[0], str):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"config key '{key}' must be one of {', '.join(str(a) for a in args)}; got {value!r}{hint}"
        )
    if _is_dataclass_type(tp):
        if isinstance(value, str) and tp is RewardRule:  # shorthand: a rule by name
            value = {"name": value}
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {_describe(value)}")
        unknown = _unknown_keys(tp, value, key)
        if unknown:
            valid = config_keys(tp, key)
            raise ConfigError("\n".join(_unknown_key_message(k, valid) for k in unknown))
        return _build(tp, value, key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {_describe(value)}")
        items = [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"config key '{key}' expects a mapping with string keys, got {_describe(value)}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"config key '{key}' expects float, got {_describe(value)}") from None
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {_describe(value)}")


def _build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """An instance of dataclass `cls` from a mapping already checked for unknown keys."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"config key '{key}' is required")
            continue
        value = _coerce(data[f.name], hints[f.name], key)
        check = f.metadata.get("check")
        complaint = check(value) if check else None
        if complaint:
            raise ConfigError(f"config key '{key}' {complaint}, got {value!r}")
        kwargs[f.name] = value
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------
# Keys: the dotted key list, unknown-key detection with suggestions


def config_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every settable dotted key (sections expanded; lists and mappings are leaves)."""
    keys = []
    for name, tp in _hints(cls).items():
        key = f"{prefix}.{name}" if prefix else name
        keys += config_keys(tp, key) if _is_dataclass_type(tp) else [key]
    return keys


def _suggest(key: str, valid: Sequence[str]) -> list[str]:
    """Closest valid keys by the last part (so a right name in the wrong section,
    like `ppo.kl_coef`, is found), ranked by how close the section is too."""
    prefix, _, leaf = key.rpartition(".")
    scored = []
    for candidate in valid:
        cand_prefix, _, cand_leaf = candidate.rpartition(".")
        part = difflib.SequenceMatcher(None, leaf, cand_leaf).ratio()
        if part >= 0.75:
            section = difflib.SequenceMatcher(None, prefix, cand_prefix).ratio()
            scored.append((part + 0.5 * section, candidate))
    return [candidate for _, candidate in sorted(scored, key=lambda s: -s[0])[:3]]


# Keys that were removed, and what replaces them.
REMOVED_KEYS = {
    "algorithm.advantage": "the advantage estimator is part of algorithm.name now "
    "(ppo = GAE with a critic, grpo, rloo, reinforce_pp, remax)",
}


def _unknown_key_message(key: str, valid: Sequence[str]) -> str:
    if key in REMOVED_KEYS:
        return f"config key '{key}' was removed: {REMOVED_KEYS[key]}"
    close = _suggest(key, valid)
    if not close:
        sections = sorted({k.split(".")[0] for k in valid})
        return f"unknown config key '{key}'; sections are {', '.join(sections)}"
    quoted = [f"'{c}'" for c in close]
    options = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"unknown config key '{key}'; did you mean {options}?"


def _unknown_keys(cls: type, data: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths in `data` that the schema does not have (walking into unknown sections)."""
    hints = _hints(cls)
    unknown = []
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in hints:
            if isinstance(value, Mapping) and value:
                unknown += [f"{key}.{k}" for k in _leaf_paths(value)]
            else:
                unknown.append(key)
        elif _is_dataclass_type(hints[name]) and isinstance(value, Mapping):
            unknown += _unknown_keys(hints[name], value, key)
    return unknown


def _leaf_paths(data: Mapping[str, Any]) -> list[str]:
    paths = []
    for name, value in data.items():
        if isinstance(value, Mapping) and value:
            paths += [f"{name}.{p}" for p in _leaf_paths(value)]
        else:
            paths.append(str(name))
    return paths


# ---------------------------------------------------------------------------------------------
# Loading, overrides, printing


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b.c=value` -> ("a.b.c", value parsed as YAML).

    For a key whose type is a string, text that YAML reads as something else
    (or cannot read: `prompt_template=Q: {prompt} A:`) is kept as typed.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. run.steps=10)")
    wants_str = _accepts_str(_schema_type(key))
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        if wants_str:
            return key, raw
        raise ConfigError(f"override {key}: cannot parse value {raw!r} ({e.problem})") from None
    if wants_str and value is not None and not isinstance(value, str):
        return key, raw
    return key, value


def _schema_type(key: str) -> Any:
    """The annotated type of a dotted key, or None if the schema has no such key."""
    tp: Any = Config
    for part in key.split("."):
        if not _is_dataclass_type(tp) or part not in _hints(tp):
            return None
        tp = _hints(tp)[part]
    return tp


def _accepts_str(tp: Any) -> bool:
    args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    return str in args


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of the nested mapping `data` with each `key=value` override set.

    Values are parsed as YAML (see `parse_override`). Setting one of a group of
    exclusive keys (a role's preset / path / init_from) drops the others the file
    set, so `model.actor.path=DIR` simply replaces the file's `preset`.
    """
    out = _deep_copy(data)
    for text in overrides:
        key, value = parse_override(text)
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
            node = child
        node[parts[-1]] = value
        section = _schema_type(".".join(parts[:-1])) if len(parts) > 1 else None
        exclusive = _EXCLUSIVE_KEYS.get(section, ())
        if parts[-1] in exclusive and value is not None:
            for other in exclusive:
                if other != parts[-1]:
                    node.pop(other, None)
    return out


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def from_dict(data: Mapping[str, Any] | None) -> Config:
    """Build and validate a Config from a nested mapping (e.g. parsed YAML)."""
    data = data or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {_describe(data)}")
    valid = config_keys()
    unknown = _unknown_keys(Config, data)
    if unknown:
        raise ConfigError("\n".join(_unknown_key_message(key, valid) for key in unknown))
    config = _build(Config, _merge(Config, to_dict(Config()), data))
    validate(config)
    return config


# Keys of which a user sets one: setting any of them drops the defaults of the others,
# so `model.critic.preset: small` replaces the default `init_from: actor`.
_EXCLUSIVE_KEYS: dict[type, tuple[str, ...]] = {RoleModelConfig: ("preset", "path", "init_from")}


def _merge(cls: type, base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """`update` over `base`, section by section, so a partial section keeps the
    defaults of the enclosing one (model.actor.dtype alone keeps preset: tiny)."""
    out = dict(base)
    exclusive = _EXCLUSIVE_KEYS.get(cls, ())
    if any(name in update for name in exclusive):
        out.update({name: None for name in exclusive})
    hints = _hints(cls)
    for name, value in update.items():
        tp = hints.get(name)
        if _is_dataclass_type(tp) and isinstance(value, Mapping) and isinstance(base.get(name), Mapping):
            out[name] = _merge(tp, base[name], value)
        else:
            out[name] = value
    return out


def read_yaml(path: str | pathlib.Path) -> dict[str, Any]:
    """A config file's contents (an empty file is an empty config)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | pathlib.Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Defaults, then the YAML file (if any), then `key=value` overrides; validated."""
    data = read_yaml(path) if path is not None else {}
    return from_dict(apply_overrides(data, overrides))


def with_overrides(config: Config, overrides: Iterable[str]) -> Config:
    """A new validated Config with `key=value` overrides applied to `config`."""
    return from_dict(apply_overrides(to_dict(config), overrides))


def to_dict(config: Any) -> Any:
    """Plain nested dicts/lists (YAML- and JSON-safe) of a config or any part of it."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def format_config(config: Config) -> str:
    """The resolved config as YAML (what `--print-config` shows); loads back to the same Config."""
    return yaml.safe_dump(to_dict(config), sort_keys=False, default_flow_style=False)


@dataclasses.dataclass(frozen=True)
class CliArgs:
    config: Config
    print_config: bool


def parse_cli(argv: Sequence[str] | None = None, prog: str = "python -m jaxrlhf.train") -> CliArgs:
    """`--config FILE [--print-config] [key=value ...]` -> the resolved config.

    Raises ConfigError for config mistakes; argparse exits on malformed flags.
    """
    parser = argparse.ArgumentParser(prog=prog, description="RLHF training with planned placement.")
    parser.add_argument("--config", help="YAML config file (defaults apply to anything it leaves out)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. run.steps=10")
    args = parser.parse_args(argv)
    return CliArgs(load_config(args.config, args.overrides), args.print_config)


# ---------------------------------------------------------------------------------------------
# Cross-field validation


def _model_presets() -> Mapping[str, Any]:
    from jaxrlhf.models.config import PRESETS

    return PRESETS


def _check_role(config: Config, role: str, needed_for: str) -> None:
    """A role that is used must say where its weights come from, in exactly one way."""
    spec: RoleModelConfig = getattr(config.model, role)
    ways = [name for name in ("preset", "path", "init_from") if getattr(spec, name)]
    if not ways:
        raise ConfigError(
            f"model.{role} is needed ({needed_for}) but has no weights: set model.{role}.preset, "
            f"model.{role}.path or model.{role}.init_from"
        )
    if len(ways) > 1:
        raise ConfigError(f"model.{role}: set only one of {', '.join(f'model.{role}.{w}' for w in ways)}")
    if spec.preset is not None and spec.preset not in _model_presets():
        close = difflib.get_close_matches(spec.preset, list(_model_presets()), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"model.{role}.preset {spec.preset!r} is not a known preset{hint}")
    if spec.path is not None and not pathlib.Path(spec.path).expanduser().is_dir():
        raise ConfigError(f"model.{role}.path: checkpoint folder not found: {spec.path}")
    if spec.overrides:
        from jaxrlhf.models.config import ModelConfig

        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        for name in spec.overrides:
            if name not in fields:
                close = difflib.get_close_matches(name, sorted(fields), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(f"model.{role}.overrides: {name!r} is not a model field{hint}")
    seen = {role}
    while spec.init_from is not None:  # follow the chain to a role with real weights
        source = spec.init_from
        if source in seen:
            raise ConfigError(f"model.{role}.init_from forms a cycle through {', '.join(sorted(seen))}")
        seen.add(source)
        spec = getattr(config.model, source)
        if not (spec.preset or spec.path or spec.init_from):
            raise ConfigError(f"model.{role} is initialised from model.{source}, which has no weights")


def _resolved_preset(config: Config, role: str) -> Any | None:
    spec: RoleModelConfig = getattr(config.model, role)
    seen = set()
    while spec.init_from is not None and spec.init_from not in seen:
        seen.add(spec.init_from)
        spec = getattr(config.model, spec.init_from)
    if spec.preset is None:
        return None
    preset = _model_presets()[spec.preset]
    return preset.replace(**spec.overrides) if spec.overrides else preset


def validate(config: Config, *, hardware_profiles: Iterable[str] | None = None) -> None:
    """Rules that span keys. The algorithm (`algorithm.name`) says which roles it needs and
    checks its own keys; the hardware registry is checked when passed (the planner's)."""
    alg, data, gen = config.algorithm, config.data, config.generation

    from jaxrlhf.algorithms import ALGORITHMS, AlgorithmConfigError

    if alg.name not in ALGORITHMS:
        close = difflib.get_close_matches(alg.name, list(ALGORITHMS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(
            f"algorithm.name {alg.name!r} is not a known algorithm{hint} (choices: {', '.join(sorted(ALGORITHMS))})"
        )
    algorithm = ALGORITHMS.get(alg.name)(config)
    try:
        algorithm.validate()
    except AlgorithmConfigError as e:
        raise ConfigError(str(e)) from None
    micro = alg.micro_batch_size
    if micro is not None:
        sizes = {"a minibatch": algorithm.batch_rows // algorithm.minibatches, "a step's batch": algorithm.batch_rows}
        if config.sft.steps:
            sizes["a warm-up batch (sft.batch_size)"] = config.sft.batch_size
        for what, rows in sizes.items():
            if micro < rows and rows % micro:
                raise ConfigError(
                    f"algorithm.micro_batch_size={micro} must divide {what} ({rows} rows); "
                    f"divisors: {[d for d in range(1, rows + 1) if rows % d == 0]}"
                )
    roles = algorithm.roles()
    for role, spec in roles.items():
        _check_role(config, role, spec.why)
    if config.sft.steps and (alg.name == "sft" or not ("actor" in roles and roles["actor"].trained)):
        raise ConfigError(
            f"sft.steps={config.sft.steps} warms up a trained actor before another algorithm; "
            f"algorithm.name={alg.name} has none to warm up (set sft.steps=0)"
        )

    actor = _resolved_preset(config, "actor")
    if actor is not None:
        total = data.max_prompt_len + gen.max_new_tokens
        if total > actor.max_position_embeddings:
            raise ConfigError(
                f"data.max_prompt_len + generation.max_new_tokens = {total} exceeds the actor's "
                f"max_position_embeddings {actor.max_position_embeddings}"
            )
        if config.model.tokenizer == "byte" and actor.vocab_size < 259:
            raise ConfigError(f"model.tokenizer=byte needs vocab_size >= 259; the actor has {actor.vocab_size}")

    from jaxrlhf.data.answers import ANSWER_EXTRACTORS

    if data.answer_extract not in ANSWER_EXTRACTORS:
        raise ConfigError(
            f"data.answer_extract must be one of {', '.join(ANSWER_EXTRACTORS)}; got {data.answer_extract!r}"
        )
    if "{prompt}" not in data.prompt_template:
        raise ConfigError(f"data.prompt_template must contain '{{prompt}}'; got {data.prompt_template!r}")
    for key, spec in (("data.source", data.source), ("sft.source", config.sft.source)):
        if spec is not None and _looks_like_missing_file(spec):
            raise ConfigError(f"{key}: file or folder not found: {spec}")

    run, plan = config.run, config.plan
    if run.devices is not None and run.platform in ("gpu", "tpu"):
        raise ConfigError(f"run.devices simulates CPU devices; it cannot be used with run.platform={run.platform}")
    if plan.file is not None and not pathlib.Path(plan.file).expanduser().is_file():
        raise ConfigError(f"plan.file: plan file not found: {plan.file}")
    if plan.offpolicy and plan.file is None and plan.strategy not in ("disaggregated", "auto"):
        raise ConfigError(
            "plan.offpolicy=true overlaps generation with training, which needs separate generation devices: "
            f"use plan.strategy=disaggregated (or auto), not {plan.strategy}"
        )
    if hardware_profiles is not None and plan.hardware is not None:
        known = list(hardware_profiles)
        if plan.hardware not in known:
            close = difflib.get_close_matches(plan.hardware, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"plan.hardware {plan.hardware!r} is not a known hardware profile{hint}")


def _looks_like_missing_file(spec: str) -> bool:
    from jaxrlhf.data.sources import file_path

    path = file_path(spec)
    return path is not None and not path.exists()
