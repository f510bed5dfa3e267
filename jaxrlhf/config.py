"""Typed run configuration: YAML files and dotted `key=value` command-line overrides,
validated against the dataclass schema in `jaxrlhf.config_schema`.

    cfg = load_config("configs/quickstart.yaml", ["run.steps=20", "algorithm.kl_coef=0.05"])
    print(format_config(cfg))          # what --print-config shows

pydantic checks the types (including `Literal` choices) and refuses unknown keys; this module
turns its errors into one line per mistake naming the dotted key, then runs the per-key value
rules (`_field(check=...)`) and `validate()`: the rules that span keys (each section's `problems`,
beside its keys in the schema), names looked up in registries, files named. The `algorithm` section is
checked against the class of keys `algorithm.name` picks (`ALGORITHM_CONFIGS`), and `validate()`
asks the algorithm's declaration (jaxrlhf.algorithms, no JAX) for its roles and rules, so loading
a config never imports JAX. Every user mistake is a `ConfigError`, so the CLI prints it without a
traceback.

One file over 600 lines, and on purpose: loading, overrides and validation walk the same schema with the
same helpers (`_field_type`, `_locate`, `_suggest`), so that every message names a dotted key one way.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import pathlib
import sys
import types
import typing
from typing import Any, Iterable, Literal, Mapping, Sequence, Union

import pydantic
import yaml

from jaxrlhf.config_schema import (
    ALGORITHM_CONFIGS,
    ROLES,
    AlgorithmConfig,
    Check,
    Config,
    DataConfig,
    DistributedConfig,
    Dtype,
    GenerationConfig,
    ModelsConfig,
    OptimConfig,
    OptimizersConfig,
    PlanConfig,
    RewardRule,
    RewardsConfig,
    RoleModelConfig,
    RunConfig,
    SFTConfig,
    closed_unit_interval,
    non_negative,
    not_empty,
    positive,
    unit_interval,
)
from jaxrlhf.yaml_input import MAX_ALIAS_NODES
from jaxrlhf.yaml_input import load as _load_yaml
from jaxrlhf.yaml_input import read as _read_yaml

__all__ = [
    # the schema (jaxrlhf.config_schema)
    "ALGORITHM_CONFIGS", "ROLES", "AlgorithmConfig", "Check", "Config", "DataConfig", "DistributedConfig", "Dtype", "GenerationConfig", "ModelsConfig",
    "OptimConfig", "OptimizersConfig", "PlanConfig", "RewardRule", "RewardsConfig", "RoleModelConfig", "RunConfig",
    "SFTConfig", "closed_unit_interval", "non_negative", "not_empty", "positive", "unit_interval",
    # loading
    "MAX_ALIAS_NODES", "REMOVED_KEYS", "CliArgs", "ConfigError", "algorithm_config", "apply_overrides", "config_keys",
    "format_config",
    "from_dict", "load_config", "parse_cli", "parse_override", "read_yaml", "to_dict", "validate", "with_overrides",
]


class ConfigError(ValueError):
    """A configuration mistake; the message names the key and what to do."""


# ---------------------------------------------------------------------------------------------
# Types: pydantic validates; its errors become messages that name the dotted key


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Field types with the pydantic annotations stripped (Int -> int)."""
    return typing.get_type_hints(cls)


def _field_type(cls: type, name: str, value: Any = None) -> Any:
    """The schema type of field `name` of section `cls`, or None. The `algorithm` section's class is the
    one its `algorithm.name` picks (`ALGORITHM_CONFIGS`), read from `value` (that section's mapping)."""
    if cls is Config and name == "algorithm":
        return algorithm_config(value.get("name") if isinstance(value, Mapping) else getattr(value, "name", None))
    return _hints(cls).get(name)


def algorithm_config(name: Any) -> type[AlgorithmConfig]:
    """The class of the keys algorithm `name` reads (PPO's for no name; the base class for an unknown one,
    which `_build` refuses by name)."""
    if name is None:
        return ALGORITHM_CONFIGS["ppo"]
    return ALGORITHM_CONFIGS[name] if isinstance(name, str) and name in ALGORITHM_CONFIGS else AlgorithmConfig


def _without_none(tp: Any) -> Any:
    """`X` for `X | None`, else `tp`."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1:
            return options[0]
    return tp


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
        return "a mapping with string keys"
    if _is_dataclass_type(tp):
        return "a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


@functools.cache
def _validator() -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(Config)


@functools.cache
def _section_validator(cls: type) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(cls)


def _build(data: Mapping[str, Any]) -> Config:
    """A Config from a complete nested mapping: types by pydantic, then each field's value check.

    The algorithm section is validated first, against the class its `algorithm.name` picks; pydantic
    then takes that instance as the section as it is."""
    alg = data.get("algorithm")
    if isinstance(alg, Mapping):
        _check_algorithm_keys(alg)
        try:
            section = _section_validator(algorithm_config(alg.get("name"))).validate_python(alg)
        except pydantic.ValidationError as e:
            errors = [{**err, "loc": ("algorithm", *err["loc"])} for err in e.errors(include_url=False)]
            raise ConfigError(_explain(errors, data)) from None
        data = {**data, "algorithm": section}
    try:
        config = _validator().validate_python(data)
    except pydantic.ValidationError as e:
        raise ConfigError(_explain(e.errors(include_url=False), data)) from None
    _check_values(config)
    return config


def _check_algorithm_keys(alg: Mapping[str, Any]) -> None:
    """The algorithm section holds a known name and only the keys that algorithm reads."""
    name = alg.get("name")
    if not isinstance(name, str):  # before the keys: which keys are valid depends on it
        raise ConfigError(f"config key 'algorithm.name' expects str, got {_describe(name)}")
    if not name:
        return  # the field's own check says so
    if name not in ALGORITHM_CONFIGS:
        raise ConfigError(f"algorithm.name: {ALGORITHM_CONFIGS.unknown(name)}")
    reads = [f.name for f in dataclasses.fields(ALGORITHM_CONFIGS[name])]
    valid = config_keys(algorithm=name)
    lines = []
    for key in (k for k in alg if k not in reads):
        dotted = f"algorithm.{key}"
        others = sorted(n for n, cls in ALGORITHM_CONFIGS.items() if key in _hints(cls))
        if others:  # another algorithm's key
            lines.append(f"config key '{dotted}' is not read by algorithm.name={name} (it is for "
                         f"{', '.join(others)}); {name} reads {', '.join(reads)}")
        elif dotted in REMOVED_KEYS or _suggest(dotted, valid):  # a removed key or a typo
            lines.append(_unknown_key_message(dotted, valid))
        else:
            lines.append(f"unknown config key '{dotted}'; algorithm.name={name} reads {', '.join(reads)}")
    if lines:
        raise ConfigError("\n".join(lines))


# pydantic's error types for a key that the schema does not have
_UNKNOWN_KEY_ERRORS = ("unexpected_keyword_argument", "extra_forbidden", "invalid_key")


def _explain(errors: list[Any], data: Mapping[str, Any]) -> str:
    """Every unknown key (with suggestions), else the first type error, one line each."""
    unknown = [e for e in errors if e["type"] in _UNKNOWN_KEY_ERRORS]
    if unknown:
        lines = []
        for error in unknown:
            loc = error["loc"]
            section, section_type, _ = _locate(loc[:-1], data)
            key = f"{section}.{loc[-1]}" if section else str(loc[-1])
            value = error["input"] if error["type"] != "invalid_key" else None
            keys = [f"{key}.{p}" for p in _leaf_paths(value)] if isinstance(value, Mapping) and value else [key]
            # inside a list item (rewards.rules[0]) only that item's keys are candidates
            in_item = any(isinstance(part, int) for part in loc[:-1])
            valid = config_keys(section_type, section) if in_item else config_keys(algorithm=_algorithm_name(data))
            lines += [_unknown_key_message(k, valid) for k in keys]
        return "\n".join(lines)
    error = errors[0]
    key, tp, value = _locate(error["loc"], data)
    if error["type"] == "missing":
        return f"config key '{key}' is required"
    choices = _without_none(tp)
    if typing.get_origin(choices) is Literal:
        args = [str(a) for a in typing.get_args(choices)]
        close = difflib.get_close_matches(str(value), args, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"config key '{key}' must be one of {', '.join(args)}; got {value!r}{hint}"
    return f"config key '{key}' expects {_type_name(tp)}, got {_describe(value)}"


def _locate(loc: Sequence[Any], data: Any) -> tuple[str, Any, Any]:
    """The dotted key, schema type and given value at a pydantic error location.

    Parts below the schema's leaves (a mapping's key, a validator's name) are dropped, so the
    message is about the key the user wrote.
    """
    key, tp, value = "", Config, data
    for part in loc:
        inner = _without_none(tp)
        part_type = _field_type(inner, part, _item(value, part)) if _is_dataclass_type(inner) else None
        if part_type is not None:
            key, tp = (f"{key}.{part}" if key else part), part_type
        elif typing.get_origin(inner) is tuple and isinstance(part, int):
            key, tp = f"{key}[{part}]", typing.get_args(inner)[0]
        else:
            break
        value = _item(value, part)
    return key, tp, value


def _item(value: Any, part: Any) -> Any:
    """`value[part]`, or None for a missing key."""
    try:
        return value[part]
    except (KeyError, IndexError, TypeError):
        return None


def _algorithm_name(data: Any) -> Any:
    alg = _item(data, "algorithm")
    return _item(alg, "name") if isinstance(alg, Mapping) else getattr(alg, "name", None)


def _check_values(obj: Any, prefix: str = "") -> None:
    """Run each field's `check` (from `_field(check=...)`), sections and list items included."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        check = f.metadata.get("check")
        complaint = check(value) if check else None
        if complaint:
            raise ConfigError(f"config key '{key}' {complaint}, got {value!r}")
        if dataclasses.is_dataclass(value):
            _check_values(value, key)
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    _check_values(item, f"{key}[{i}]")


# ---------------------------------------------------------------------------------------------
# Keys: the dotted key list, unknown-key messages with suggestions


def config_keys(cls: type = Config, prefix: str = "", *, algorithm: str | None = None) -> list[str]:
    """Every settable dotted key (sections expanded; lists and mappings are leaves); the algorithm
    section holds the keys of `algorithm` (default: ppo)."""
    keys = []
    for name in _hints(cls):
        tp = _field_type(cls, name, {"name": algorithm})
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
        value = _load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        if wants_str:
            return key, raw
        raise ConfigError(f"override {key}: cannot parse value {raw!r} ({getattr(e, 'problem', e)})") from None
    if wants_str and value is not None and not isinstance(value, str):
        return key, raw
    return key, value


def _schema_type(key: str) -> Any:
    """The annotated type of a dotted key, or None if the schema has no such key (an algorithm key
    is looked up in the classes of every algorithm that has it)."""
    found, tp, _ = _locate(key.split("."), {})
    if found != key and key.startswith("algorithm.") and key.count(".") == 1:
        leaf = key.partition(".")[2]
        return next((_hints(cls)[leaf] for cls in ALGORITHM_CONFIGS.values() if leaf in _hints(cls)), None)
    return tp if found == key else None


def _accepts_str(tp: Any) -> bool:
    args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    return str in args


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of the nested mapping `data` with each `key=value` override set.

    Values are parsed as YAML (see `parse_override`). Setting one of a group of
    exclusive keys (a role's preset / path / init_from) drops the others the file
    set, so `model.actor.path=DIR` simply replaces the file's `preset`. Switching
    `algorithm.name` starts from the new algorithm's defaults (`_switch_algorithm`).
    """
    out = _deep_copy(data)
    for text in overrides:
        key, value = parse_override(text)
        if key == "algorithm.name" and isinstance(out.get("algorithm"), dict):
            _switch_algorithm(out["algorithm"], value)
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


def _switch_algorithm(section: dict[str, Any], name: Any) -> None:
    """Before `algorithm.name` switches to `name`: drop the keys of `section` that hold the old algorithm's
    defaults, so the new algorithm's own fill them in (`algorithm.name=grpo` over configs/quickstart.yaml,
    whose `whiten_advantages: true` is PPO's default, gets GRPO's keys, not a refusal of PPO's). A key set
    to another value stays: it was chosen, and the new algorithm refuses it by name if it does not read it."""
    old = section.get("name", "ppo")
    if name == old or not isinstance(old, str) or old not in ALGORITHM_CONFIGS:
        return
    defaults = _declared_defaults(ALGORITHM_CONFIGS[old])
    for key in [k for k, v in section.items() if k != "name" and k in defaults and v == defaults[k]]:
        del section[key]


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def from_dict(data: Mapping[str, Any] | None) -> Config:
    """Build and validate a Config from a nested mapping (e.g. parsed YAML)."""
    data = data or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {_describe(data)}")
    config = _build(_packing_for_a_token_budget(with_defaults(data)))
    validate(config)
    return config


def _packing_for_a_token_budget(data: dict[str, Any]) -> dict[str, Any]:
    """A token budget (`algorithm.max_tokens_per_micro_batch`) means micro-batches sized in tokens, which
    packed rows are: a budget with `algorithm.pack_sequences` off turns packing on and says so on one line
    (on stderr, so that `--print-config` stays YAML), with the way back to row micro-batches."""
    alg = data.get("algorithm")
    budget = alg.get("max_tokens_per_micro_batch") if isinstance(alg, Mapping) else None
    unpacked = alg.get("pack_sequences") is False if isinstance(alg, Mapping) else False
    if not unpacked or isinstance(budget, bool) or not isinstance(budget, int):  # a bad value: its key's own error
        return data
    print(f"note: algorithm.max_tokens_per_micro_batch={budget} sizes micro-batches in tokens, so "
          "algorithm.pack_sequences is turned on (packed rows, the same math); for row micro-batches set "
          "algorithm.max_tokens_per_micro_batch=null", file=sys.stderr, flush=True)
    return {**data, "algorithm": {**alg, "pack_sequences": True}}


def with_defaults(data: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults with `data` over them, as `from_dict` reads it, but not validated: for tools that
    look at a config before they finish it (`plan --model-preset` finds the roles with own weights).
    The algorithm section's defaults are those of the algorithm `data` names, as its class declares them
    (a default that follows another key, such as `clip_eps_high: null` = clip_eps, follows `data`'s)."""
    defaults = to_dict(Config())
    name = _algorithm_name(data)
    defaults["algorithm"] = {**_declared_defaults(algorithm_config(name)), "name": name or "ppo"}
    return _merge(Config, defaults, data)


def _declared_defaults(cls: type) -> dict[str, Any]:
    """A section's field defaults as written in its class, before `__post_init__` resolves any."""
    return {f.name: to_dict(f.default_factory() if f.default is dataclasses.MISSING else f.default)  # type: ignore[misc]
            for f in dataclasses.fields(cls)}


def _holds_default(section: Any, key: str) -> bool:
    """Whether `section.key` is what its class fills in when the key is left out (resolved against the
    section's other keys: an upper clip equal to the lower one holds the default `null`)."""
    declared = _declared_defaults(type(section))[key]
    return getattr(dataclasses.replace(section, **{key: declared}), key) == getattr(section, key)


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
    for name, value in update.items():
        tp = _field_type(cls, name, value)
        if _is_dataclass_type(tp) and isinstance(value, Mapping) and isinstance(base.get(name), Mapping):
            out[name] = _merge(tp, base[name], value)
        else:
            out[name] = value
    return out


def read_yaml(path: str | pathlib.Path) -> dict[str, Any]:
    """A config file's contents (an empty file is an empty config); every refusal names the file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(f"config file {path} is not UTF-8 text (line {line}); save it as UTF-8") from None
    try:
        data = _read_yaml(text, f"config file {path}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
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
    """A new validated Config with `key=value` overrides applied to `config`. The algorithm keys that
    hold their algorithm's defaults are filled in again after the overrides, so an override of
    `algorithm.name` starts from the new algorithm's defaults (keeping the keys whose values differ
    from the old one's), and a default that follows another key follows its override."""
    data = to_dict(config)
    data["algorithm"] = {k: v for k, v in data["algorithm"].items()
                         if k == "name" or not _holds_default(config.algorithm, k)}
    return from_dict(apply_overrides(data, overrides))


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


def _model_presets() -> Any:
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
        raise ConfigError(f"model.{role}.preset: {_model_presets().unknown(spec.preset)}")
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
    chain = config.model.init_chain(role)
    end: RoleModelConfig = getattr(config.model, chain[-1])
    if end.init_from is not None:
        raise ConfigError(f"model.{role}.init_from forms a cycle through {', '.join(sorted(chain))}")
    if not (end.preset or end.path):
        raise ConfigError(f"model.{role} is initialised from model.{chain[-1]}, which has no weights")


def _resolved_preset(config: Config, role: str) -> Any | None:
    spec: RoleModelConfig = getattr(config.model, config.model.init_chain(role)[-1])
    if spec.preset is None:
        return None
    preset = _model_presets()[spec.preset]
    return preset.replace(**spec.overrides) if spec.overrides else preset


def validate(config: Config, *, hardware_profiles: Iterable[str] | None = None) -> None:
    """Rules that span keys. The algorithm's declaration (`algorithm.name`) says which roles it needs
    and checks its own keys; each section's `problems` (jaxrlhf.config_schema) checks its keys against
    the others; then the names looked up in registries (presets, answer extractors; the hardware
    registry when passed, the planner's) and the files named."""
    data = config.data

    # the algorithm's declaration (jaxrlhf.algorithms imports no JAX): its roles and its own rules
    from jaxrlhf.algorithms import AlgorithmConfigError, declare

    algorithm = declare(config)
    try:
        algorithm.validate()
    except AlgorithmConfigError as e:
        raise ConfigError(str(e)) from None
    for f in dataclasses.fields(config):  # each section's rules that span keys (beside its keys in the schema)
        rules = getattr(getattr(config, f.name), "problems", None)
        for problem in rules(config, algorithm) if rules else ():
            raise ConfigError(problem)

    # the rules that read a model preset (jaxrlhf.models, a layer above the schema)
    for role, spec in algorithm.roles().items():
        _check_role(config, role, spec.why)
    _check_positions(config, algorithm)
    actor = _resolved_preset(config, "actor")
    if actor is not None:
        if config.model.tokenizer == "byte" and actor.vocab_size < 259:
            raise ConfigError(f"model.tokenizer=byte needs vocab_size >= 259; the actor has {actor.vocab_size}")

    from jaxrlhf.data.answers import ANSWER_EXTRACTORS

    if data.answer_extract not in ANSWER_EXTRACTORS:
        raise ConfigError(f"data.answer_extract: {ANSWER_EXTRACTORS.unknown(data.answer_extract)}")
    if "{prompt}" not in data.prompt_template:
        raise ConfigError(f"data.prompt_template must contain '{{prompt}}'; got {data.prompt_template!r}")
    for key, spec in (("data.source", data.source), ("sft.source", config.sft.source)):
        if spec is not None and _looks_like_missing_file(spec):
            raise ConfigError(f"{key}: file or folder not found: {spec}")

    plan = config.plan
    if plan.file is not None and not pathlib.Path(plan.file).expanduser().is_file():
        raise ConfigError(f"plan.file: plan file not found: {plan.file}")
    if plan.profile is not None and not pathlib.Path(plan.profile).expanduser().is_file():
        raise ConfigError(f"plan.profile: profile file not found: {plan.profile}; write one with "
                          "python -m jaxrlhf.profile --config <this config> --out <file>")
    if hardware_profiles is not None and plan.hardware is not None:
        known = list(hardware_profiles)
        if plan.hardware not in known:
            close = difflib.get_close_matches(plan.hardware, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"plan.hardware {plan.hardware!r} is not a known hardware profile{hint}")


def _check_positions(config: Config, algorithm: Any) -> None:
    """The longest sequence must fit the models' positions: prompt plus response for an algorithm that
    generates (the actor's), `data.max_seq_len` for one that never does (sft, rm, dpo: each of its models,
    whose sequences the data stack cuts to that length)."""
    data, gen = config.data, config.generation
    if any(call.kind == "generate" for call in algorithm.graph().calls):
        checks = [("actor", data.max_prompt_len + gen.max_new_tokens, "data.max_prompt_len + generation.max_new_tokens")]
    else:
        length = data.max_seq_len or data.max_prompt_len + gen.max_new_tokens
        what = ("data.max_seq_len" if data.max_seq_len else
                "data.max_seq_len (null: data.max_prompt_len + generation.max_new_tokens)")
        checks = [(role, length, what) for role in algorithm.roles()]
    for role, length, what in checks:
        model = _resolved_preset(config, role)
        if model is not None and length > model.max_position_embeddings:
            raise ConfigError(f"{what} = {length} exceeds the {role}'s max_position_embeddings "
                              f"{model.max_position_embeddings}")


def _looks_like_missing_file(spec: str) -> bool:
    from jaxrlhf.data.sources import file_path

    path = file_path(spec)
    return path is not None and not path.exists()
