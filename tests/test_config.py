"""Config: YAML + overrides, printing, and the specific message of each mistake."""

import json
import pathlib
import re
import subprocess
import sys
import time

import pytest
import yaml

from jaxrlhf.config import (
    ALGORITHM_CONFIGS,
    Config,
    ConfigError,
    RewardRule,
    config_keys,
    format_config,
    from_dict,
    load_config,
    parse_cli,
    validate,
    with_overrides,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


def _write(tmp_path, text: str) -> pathlib.Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_are_valid():
    config = load_config()
    assert config == Config()
    assert config.algorithm.name == "ppo"
    assert config.model.critic.init_from == "actor"


def test_yaml_then_overrides(tmp_path):
    path = _write(tmp_path, "run:\n  steps: 7\n  output_dir: /tmp/x\nalgorithm:\n  kl_coef: 0.3\n")
    config = load_config(path, ["run.steps=9", "optimizer.actor.lr=1e-4", "plan.strategy=interleaved"])
    assert config.run.steps == 9  # override wins over the file
    assert config.run.output_dir == "/tmp/x"
    assert config.algorithm.kl_coef == 0.3
    assert config.optimizer.actor.lr == pytest.approx(1e-4)  # YAML 1.1 reads 1e-4 as a string
    assert config.plan.strategy == "interleaved"


def test_partial_section_keeps_enclosing_defaults():
    config = load_config(None, ["model.actor.dtype=bfloat16"])
    assert config.model.actor.preset == "tiny"
    assert config.model.actor.dtype == "bfloat16"
    # Setting one weight source drops the default of the others.
    config = load_config(None, ["model.critic.preset=small"])
    assert config.model.critic.preset == "small" and config.model.critic.init_from is None


def test_structured_overrides():
    config = load_config(None, ["rewards.rules=[exact_match, {name: length_penalty, weight: -0.1, args: {max_chars: 8}}]",
                                "plan.axis_rules={embed: fsdp, mlp: [fsdp, tensor]}", "data.answer_key=null"])
    assert config.rewards.rules == (RewardRule("exact_match"), RewardRule("length_penalty", -0.1, {"max_chars": 8}))
    assert config.plan.axis_rules == {"embed": "fsdp", "mlp": ["fsdp", "tensor"]}
    assert config.data.answer_key is None


def test_string_keys_keep_override_text():
    config = load_config(None, ["data.prompt_template=Question: {prompt} Answer:", "data.split=1",
                                "run.output_dir=[x]"])
    assert config.data.prompt_template == "Question: {prompt} Answer:"  # not YAML: a mapping / parse error
    assert config.data.split == "1" and config.run.output_dir == "[x]"


def test_print_config_round_trips():
    config = load_config(REPO / "configs" / "quickstart.yaml", ["run.steps=3"])
    text = format_config(config)
    assert "steps: 3" in text
    assert from_dict(yaml.safe_load(text)) == config


def test_parse_cli():
    args = parse_cli(["--config", str(REPO / "configs" / "quickstart.yaml"), "--print-config", "run.seed=4"])
    assert args.print_config and args.config.run.seed == 4


def test_quickstart_loads():
    config = load_config(REPO / "configs" / "quickstart.yaml")
    assert config.run.platform == "cpu" and config.run.devices == 2
    assert config.model.actor.preset in ("tiny", "small")
    assert config.model.tokenizer == "byte"
    assert config.data.source == "arithmetic"


@pytest.mark.parametrize("devices, cores, noted", [(8, 2, True), (2, 2, False), (2, 16, False)])
def test_more_simulated_devices_than_cores_is_noted(devices, cores, noted, monkeypatch, capsys):
    """XLA's CPU client runs one compute thread per simulated device; on fewer cores every step slows,
    so the run says so and names the device count that avoids it."""
    from jaxrlhf.run import backend

    monkeypatch.setattr(backend, "available_cores", lambda: cores)
    backend._note_oversubscription(devices)
    out = capsys.readouterr().out
    if noted:
        assert f"run.devices={devices} simulates {devices} CPU devices on {cores} cores" in out
        assert f"run.devices={cores} avoids it" in out
    else:
        assert out == ""


def test_key_list_is_dotted_leaves():
    keys = config_keys()
    for key in ("run.output_dir", "run.resume", "plan.strategy", "plan.file", "algorithm.name",
                "optimizer.actor.lr", "model.critic.init_from", "rewards.rules"):
        assert key in keys
    assert "model.actor" not in keys


@pytest.mark.parametrize(
    "override, message",
    [
        ("ppo.kl_cof=0.1", "unknown config key 'ppo.kl_cof'; did you mean 'algorithm.kl_coef'?"),
        ("algorithm.gama=1", "unknown config key 'algorithm.gama'; did you mean 'algorithm.gamma'?"),
        ("optimiser.actor.lr=1", "did you mean 'optimizer.actor.lr'"),
        ("nonsense=1", "unknown config key 'nonsense'; sections are algorithm, data"),
        ("rewards.rules=[{name: a, wieght: 2}]", "unknown config key 'rewards.rules[0].wieght'; did you mean 'rewards.rules[0].weight'?"),
    ],
)
def test_unknown_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_unknown_key_in_yaml(tmp_path):
    path = _write(tmp_path, "ppo:\n  kl_cof: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'ppo.kl_cof'; did you mean 'algorithm.kl_coef'\?"):
        load_config(path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("run.steps=ten", "config key 'run.steps' expects int, got 'ten' (str)"),
        ("run.devices=2.5", "config key 'run.devices' expects int or null, got 2.5 (float)"),
        ("run.resume=3", "config key 'run.resume' expects bool, got 3 (int)"),
        ("algorithm.kl_coef=high", "config key 'algorithm.kl_coef' expects float, got 'high' (str)"),
        ("data.batch_size=[8]", "config key 'data.batch_size' expects int, got [8] (list)"),
        ("run=5", "config key 'run' expects a mapping with keys output_dir"),
    ],
)
def test_wrong_type(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["plan.strategy=colocatd"], "config key 'plan.strategy' must be one of colocated, interleaved, "
                                     "disaggregated, reallocated, heuristic, verl, auto; got 'colocatd'; did you mean 'colocated'?"),
        (["algorithm.name=trpo"], "algorithm.name: unknown algorithm 'trpo'. Did you mean 'grpo'? "
                                  "Known: ['dapo', 'dpo', 'dr_grpo', 'grpo', 'gspo', 'ppo', 'reinforce_pp', 'remax', "
                                  "'rloo', 'rm', 'sft']"),
        (["optimizer.actor.lr=-0.001"], "config key 'optimizer.actor.lr' must be > 0, got -0.001"),
        (["generation.top_p=1.5"], "config key 'generation.top_p' must be in (0, 1], got 1.5"),
        (["generation.engine=continous"], "config key 'generation.engine' must be one of static, continuous; "
                                          "got 'continous'; did you mean 'continuous'?"),
        (["generation.slots=0"], "config key 'generation.slots' must be > 0, got 0"),
        (["algorithm.minibatches=3"], "algorithm.minibatches=3 must divide the rollout batch "
                                      "data.batch_size x algorithm.group_size = 32 x 1 = 32"),
        (["algorithm.name=grpo", "algorithm.group_size=1"], "algorithm.name=grpo compares samples of the same "
                                                            "prompt: algorithm.group_size must be >= 2, got 1"),
        (["algorithm.advantage=grpo"], "config key 'algorithm.advantage' was removed: the advantage estimator is "
                                       "part of algorithm.name now"),
        # each algorithm has the keys it reads (config_schema.ALGORITHM_CONFIGS); another's key is refused
        (["algorithm.name=grpo", "algorithm.group_size=4", "algorithm.whiten_advantages=true"],
         "config key 'algorithm.whiten_advantages' is not read by algorithm.name=grpo (it is for ppo); grpo reads name, "
         "micro_batch_size, kl_coef,"),
        (["algorithm.dpo_beta=0.5"], "config key 'algorithm.dpo_beta' is not read by algorithm.name=ppo (it is for dpo); "
                                     "ppo reads name, micro_batch_size, kl_coef,"),
        (["algorithm.name=dpo", "algorithm.gamma=0.9"],
         "config key 'algorithm.gamma' is not read by algorithm.name=dpo (it is for ppo, reinforce_pp, remax); dpo reads "
         "name, micro_batch_size, dpo_beta, dpo_label_smoothing, dpo_loss"),
        (["algorithm.name=rloo", "algorithm.dynamic_sampling_factr=3"],
         "unknown config key 'algorithm.dynamic_sampling_factr'; did you mean 'algorithm.dynamic_sampling_factor'"),
        (["algorithm.name=sft", "algorithm.bogus=1"],
         "unknown config key 'algorithm.bogus'; algorithm.name=sft reads name, micro_batch_size"),
        (["algorithm.name=dpo", "sft.steps=0", "model.ref.init_from=null"],
         "model.ref is needed (DPO measures the policy against the reference) but has no weights"),
        (["algorithm.name=rm", "model.reward.init_from=actor", "sft.steps=5"], "algorithm.name=rm has none to warm up"),
        (["model.actor.preset=tiyn"], "model.actor.preset: unknown model preset 'tiyn'. Did you mean 'tiny'?"),
        # An explicit override wins over the other weight sources (here: then the folder is missing).
        (["model.actor.preset=tiny", "model.actor.path=/nonexistent"], "model.actor.path: checkpoint folder not found"),
        (["model.critic.init_from=critic"], "model.critic.init_from forms a cycle"),
        (["model.actor.overrides={num_layer: 3}"], "'num_layer' is not a model field; did you mean 'num_layers'?"),
        (["rewards.model=true"], "model.reward is needed (rewards.model=true) but has no weights"),
        (["rewards.rules=[]"], "no reward: set rewards.model=true"),
        (["data.max_prompt_len=600"], "exceeds the actor's max_position_embeddings 512"),
        (["data.source=/nonexistent/prompts.jsonl"], "data.source: file or folder not found"),
        (["data.answer_extract=gsm9k"], "data.answer_extract: unknown answer extractor 'gsm9k'. Did you mean 'gsm8k'? "
                                        "Known: ['gsm8k', 'last_number', 'none']"),
        (["data.prompt_template=Question"], "data.prompt_template must contain '{prompt}'"),
        (["plan.offpolicy=true"], "use plan.strategy=disaggregated"),
        (["plan.file=/nonexistent/plan.yaml"], "plan.file: plan file not found"),
        (["run.platform=gpu", "run.devices=8"], "run.devices simulates CPU devices"),
    ],
)
def test_bad_value(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


@pytest.mark.parametrize("algorithm", [["algorithm.name=sft"], ["algorithm.name=dpo"],
                                       ["algorithm.name=rm", "model.reward.preset=tiny"]], ids=lambda a: a[0][15:])
def test_stages_that_never_generate_check_max_seq_len_against_the_positions(algorithm):
    """sft, rm and dpo cut their sequences to data.max_seq_len and generate nothing: prompt length plus
    generation.max_new_tokens past the model's 512 positions is no reason to refuse them, a longer
    data.max_seq_len is (and with it null, its default, prompt plus new tokens). RL keeps its check."""
    base = [*algorithm, "sft.steps=0"]
    load_config(None, [*base, "data.max_prompt_len=500", "generation.max_new_tokens=32", "data.max_seq_len=512"])
    role = "reward" if "algorithm.name=rm" in algorithm else "actor"
    with pytest.raises(ConfigError, match=f"data.max_seq_len = 513 exceeds the {role}'s max_position_embeddings 512"):
        load_config(None, [*base, "data.max_seq_len=513"])
    with pytest.raises(ConfigError, match=r"data.max_seq_len \(null: data.max_prompt_len \+ generation.max_new_tokens\) "
                                          f"= 532 exceeds the {role}'s max_position_embeddings 512"):
        load_config(None, [*base, "data.max_prompt_len=500", "generation.max_new_tokens=32"])
    with pytest.raises(ConfigError, match=r"data.max_prompt_len \+ generation.max_new_tokens = 532 exceeds the actor's"):
        load_config(None, ["algorithm.name=ppo", "data.max_prompt_len=500", "generation.max_new_tokens=32",
                           "data.max_seq_len=512"])


def test_registries_checked_when_given():
    config = load_config(None, ["plan.hardware=h10"])
    validate(config)  # without the planner's registry hardware names are not checked
    with pytest.raises(ConfigError, match="plan.hardware 'h10' is not a known hardware profile; did you mean 'h100'"):
        validate(config, hardware_profiles=["h100", "tpu-v5e"])
    with pytest.raises(ConfigError, match=r"rewards.rules\[0\].name: unknown reward function 'exact_mach'\. "
                                          r"Did you mean 'exact_match'\?"):
        load_config(None, ["rewards.rules=[exact_mach]"])


def test_file_and_override_syntax_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(_write(tmp_path, "run: [unclosed\n"))
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="must look like key=value"):
        load_config(None, ["run.steps"])


def test_with_overrides_and_frozen():
    config = with_overrides(Config(), ["run.steps=2"])
    assert config.run.steps == 2
    with pytest.raises(AttributeError):
        config.run.steps = 3  # type: ignore[misc]


def test_a_file_setting_two_weight_sources_is_an_error(tmp_path):
    path = _write(tmp_path, "model:\n  actor:\n    preset: tiny\n    path: /somewhere\n")
    with pytest.raises(ConfigError, match="model.actor: set only one of model.actor.preset, model.actor.path"):
        load_config(path)


def test_type_error_names_the_full_dotted_key(tmp_path):
    path = _write(tmp_path, "model:\n  actor:\n    remat: true\n")
    message = r"^config key 'model.actor.remat' must be one of none, full, dots; got True$"
    with pytest.raises(ConfigError, match=message):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^config key 'rewards.rules\[0\].weight' expects float, got 'x' \(str\)$"):
        load_config(None, ["rewards.rules=[{name: exact_match, weight: x}]"])
    with pytest.raises(ConfigError, match=r"config key 'plan.offload\[1\]' must be one of actor, critic, ref, reward"):
        load_config(None, ["plan.offload=[ref, rewrd]"])


def test_duplicate_keys_are_refused(tmp_path):
    path = _write(tmp_path, "run:\n  steps: 3\n  seed: 1\n  steps: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"config file {path}, line 4: duplicate key 'steps' (first set on line 2)"
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_config(None, ["plan.axis_rules={a: fsdp, a: tensor}"])


def test_anchors_load_but_an_alias_bomb_fails_fast(tmp_path):
    path = _write(tmp_path, "optimizer:\n  actor: &opt {lr: 2.0e-5, b1: 0.8}\n  critic: *opt\n"
                            "  reward:\n    <<: *opt\n    lr: 3.0e-5\n")
    config = load_config(path)
    assert config.optimizer.critic.lr == 2e-5 and config.optimizer.reward.lr == 3e-5
    assert config.optimizer.reward.b1 == 0.8
    lines = ["a: &a [" + ", ".join(['"x"'] * 9) + "]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")  # 9**9 strings once expanded
    bomb = _write(tmp_path, "\n".join(lines) + "\n")
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"config file .*config.yaml, line \d+: YAML aliases expand to more than"):
        load_config(bomb)
    assert time.perf_counter() - start < 1.0


def test_a_file_must_be_a_utf8_mapping(tmp_path):
    for text in ("- a\n- b\n", "just text\n", "42\n"):
        with pytest.raises(ConfigError, match=r"^config file .*config.yaml must hold a mapping of sections, got \w+$"):
            load_config(_write(tmp_path, text))
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  output_dir: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^config file .*latin1.yaml is not UTF-8 text \(line 2\)"):
        load_config(path)


def test_the_config_path_imports_no_jax():
    """Loading, validating and printing a config (and every algorithm's declaration: roles, graph,
    rules) reads declarations only: no JAX, flax or optax, so `--print-config` answers at once;
    reporting a config mistake loads none either."""
    code = (
        "import contextlib, io, pathlib, sys\n"
        "from jaxrlhf import config, train\n"
        "from jaxrlhf.algorithms import declare\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:\n"
        "    assert train.main(['--config', 'configs/quickstart.yaml', '--print-config']) == 0\n"
        "    assert train.main(['--print-config', 'algorithm.dpo_beta=0.5']) == 2\n"
        "assert 'not read by algorithm.name=ppo' in err.getvalue(), err.getvalue()\n"
        "for path in sorted(pathlib.Path('configs').glob('*.yaml')):\n"
        "    cfg = config.load_config(path)\n"
        "    declare(cfg).graph(), declare(cfg).roles()\n"
        "for name, cls in config.ALGORITHM_CONFIGS.items():\n"
        "    extra = ['algorithm.group_size=2'] if 'group_size' in cls.__dataclass_fields__ else []\n"
        "    extra += ['model.reward.init_from=actor'] if name == 'rm' else []\n"
        "    declare(config.load_config(None, [f'algorithm.name={name}', *extra]), name).graph()\n"
        "print(sorted(m for m in ('jax', 'flax', 'optax', 'jaxlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_each_algorithm_has_its_own_section():
    """`algorithm.name` picks the section's class: its defaults, and only its keys."""
    from jaxrlhf.algorithms import ALGORITHMS

    assert set(ALGORITHM_CONFIGS) == set(ALGORITHMS)
    dpo = load_config(None, ["algorithm.name=dpo", "algorithm.dpo_beta=0.5"]).algorithm
    assert type(dpo) is ALGORITHM_CONFIGS["dpo"] and dpo.dpo_beta == 0.5 and not hasattr(dpo, "gamma")
    assert set(format_config(load_config(None, ["algorithm.name=sft"])).split("algorithm:")[1].split("model:")[0]
               .split()) == {"name:", "sft", "micro_batch_size:", "null"}
    # A file's algorithm section is merged over the defaults of the algorithm it names.
    assert load_config(REPO / "configs" / "dpo.yaml", ["algorithm.micro_batch_size=4"]).algorithm.micro_batch_size == 4
    # Switching the algorithm of a resolved config keeps only what was changed from the old defaults.
    config = with_overrides(load_config(None, ["algorithm.minibatches=2"]), ["algorithm.name=grpo",
                                                                            "algorithm.group_size=4"])
    assert config.algorithm.name == "grpo" and config.algorithm.minibatches == 2
    with pytest.raises(ConfigError, match="'algorithm.gamma' is not read by algorithm.name=dpo"):
        with_overrides(load_config(None, ["algorithm.gamma=0.9"]), ["algorithm.name=dpo"])
    # The name decides which keys are valid, so a name of the wrong type is the one error.
    with pytest.raises(ConfigError, match=r"^config key 'algorithm.name' expects str, got 5 \(int\)$"):
        from_dict({"algorithm": {"name": 5, "kl_coef": 1.0}})


def test_rl_sections_hold_what_their_estimator_takes():
    """The keys of each RL algorithm's section match the hyper-parameters its advantage estimator takes
    (jaxrlhf.algorithms.advantages; `scale_by_std` is `algorithm.norm_adv_by_std`), so no section holds
    an estimator key its algorithm ignores."""
    from jaxrlhf.algorithms import ALGORITHMS
    from jaxrlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS

    config_name = {"gamma": "gamma", "lam": "lam", "scale_by_std": "norm_adv_by_std"}
    for name, cls in ALGORITHMS.items():
        estimator = getattr(cls, "estimator", None)
        if estimator is None:
            continue
        keys = {f for f in ALGORITHM_CONFIGS[name].__dataclass_fields__} & set(config_name.values())
        takes = {config_name[p] for p in ADVANTAGE_ESTIMATORS.get(estimator).params if p in config_name}
        assert keys == takes, name
        assert ("whiten_advantages" in ALGORITHM_CONFIGS[name].__dataclass_fields__) == (
            ADVANTAGE_ESTIMATORS.get(estimator).whitening == "optional"), name


# The defaults of the keys that differ between algorithms: the published conventions (docs/algorithms.md).
PUBLISHED_DEFAULTS = {
    "ppo": {"kl_estimator": "k1", "clip_eps": 0.2, "clip_eps_high": 0.2, "loss_agg": "token-mean",
            "whiten_advantages": True},
    "grpo": {"kl_estimator": "k3", "clip_eps": 0.2, "clip_eps_high": 0.2, "loss_agg": "seq-mean-token-mean",
             "norm_adv_by_std": True, "dynamic_sampling": False},
    "dr_grpo": {"kl_estimator": "k3", "clip_eps": 0.2, "clip_eps_high": 0.2, "loss_agg": "seq-mean-token-sum-norm",
                "norm_adv_by_std": False, "dynamic_sampling": False},
    "dapo": {"kl_estimator": "k3", "clip_eps": 0.2, "clip_eps_high": 0.28, "loss_agg": "token-mean",
             "norm_adv_by_std": True, "dynamic_sampling": True},
    "gspo": {"kl_estimator": "k3", "clip_eps": 3e-4, "clip_eps_high": 4e-4, "loss_agg": "seq-mean-token-mean",
             "norm_adv_by_std": True, "dynamic_sampling": False},
    "rloo": {"kl_estimator": "k1", "clip_eps": 0.2, "clip_eps_high": 0.2, "loss_agg": "token-mean",
             "dynamic_sampling": False},
    "reinforce_pp": {"kl_estimator": "k1", "clip_eps": 0.2, "clip_eps_high": 0.2, "loss_agg": "token-mean"},
    "remax": {"kl_estimator": "k1", "clip_eps": 0.2, "clip_eps_high": 0.2, "loss_agg": "token-mean"},
    "sft": {},
    "rm": {},
    "dpo": {"dpo_beta": 0.1, "dpo_label_smoothing": 0.0, "dpo_loss": "sigmoid"},
}
# what a null still means where it is a setting of its own (not a value for the algorithm to fill in)
NULL_SETTINGS = {"micro_batch_size", "kl_target", "decoupled_cap", "max_tokens_per_micro_batch", "seq_mask_low"}


def _algorithm_config(name, *overrides):
    extra = ["algorithm.group_size=2"] if "group_size" in ALGORITHM_CONFIGS[name].__dataclass_fields__ else []
    extra += ["model.reward.init_from=actor"] if name == "rm" else []
    return load_config(None, [f"algorithm.name={name}", *extra, *overrides])


def test_print_config_shows_the_values_each_algorithm_runs_with(capsys):
    """Every algorithm's section is filled from its own class: `--print-config` shows no null for the
    algorithm to fill in later, the values are the published conventions, and the printout loads back."""
    from jaxrlhf import train
    from jaxrlhf.algorithms import ALGORITHMS

    assert set(PUBLISHED_DEFAULTS) == set(ALGORITHMS)
    for name in ALGORITHMS:
        config = _algorithm_config(name)
        printed = yaml.safe_load(format_config(config))
        nulls = {key for key, value in printed["algorithm"].items() if value is None}
        assert nulls <= NULL_SETTINGS, (name, nulls)
        expected = PUBLISHED_DEFAULTS[name]
        assert {key: printed["algorithm"][key] for key in expected} == expected, name
        assert from_dict(printed) == config, name
    assert train.main(["--print-config", "algorithm.name=dapo", "algorithm.group_size=2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["algorithm"]
    assert (printed["clip_eps"], printed["clip_eps_high"], printed["loss_agg"], printed["dynamic_sampling"]) == (
        0.2, 0.28, "token-mean", True)
    assert "null = the algorithm's own" not in (REPO / "docs" / "config_reference.md").read_text()


def test_an_explicit_value_wins_over_the_algorithms_default(tmp_path):
    dapo = _algorithm_config("dapo", "algorithm.clip_eps_high=0.3", "algorithm.dynamic_sampling=false",
                             "algorithm.loss_agg=seq-mean-token-mean", "algorithm.kl_estimator=k1").algorithm
    assert (dapo.clip_eps_high, dapo.dynamic_sampling, dapo.loss_agg, dapo.kl_estimator) == (
        0.3, False, "seq-mean-token-mean", "k1")
    assert _algorithm_config("dapo", "algorithm.clip_eps_high=0.28") == _algorithm_config("dapo")  # the default, written out
    path = _write(tmp_path, "algorithm:\n  name: dr_grpo\n  group_size: 2\n  norm_adv_by_std: true\n")
    dr = load_config(path).algorithm
    assert (dr.norm_adv_by_std, dr.loss_agg) == (True, "seq-mean-token-sum-norm")
    assert load_config(None, ["algorithm.whiten_advantages=false"]).algorithm.whiten_advantages is False
    # the symmetric upper clip is the lower one, also an explicit null (dapo's own is 0.28)
    assert _algorithm_config("ppo", "algorithm.clip_eps=0.1").algorithm.clip_eps_high == 0.1
    assert _algorithm_config("gspo", "algorithm.clip_eps_high=null").algorithm.clip_eps_high == 3e-4
    assert _algorithm_config("dapo", "algorithm.clip_eps_high=null").algorithm.clip_eps_high == 0.2
    # a resolved config's overrides: a default follows the key it derives from, a set value stays
    ppo = with_overrides(load_config(), ["algorithm.clip_eps=0.1"]).algorithm
    assert (ppo.clip_eps, ppo.clip_eps_high) == (0.1, 0.1)
    kept = with_overrides(load_config(None, ["algorithm.clip_eps_high=0.3"]), ["algorithm.clip_eps=0.1"]).algorithm
    assert (kept.clip_eps, kept.clip_eps_high) == (0.1, 0.3)
    switched = with_overrides(load_config(None, ["algorithm.group_size=2"]), ["algorithm.name=dapo"]).algorithm
    assert switched == _algorithm_config("dapo").algorithm
    # null is not a value of a key that has a default of its own
    with pytest.raises(ConfigError, match=r"^config key 'algorithm.loss_agg' must be one of token-mean, "):
        _algorithm_config("grpo", "algorithm.loss_agg=null")


GROUPED = ("grpo", "dr_grpo", "dapo", "gspo", "rloo")


def test_an_algorithm_chosen_by_name_gets_its_working_defaults(tmp_path, capsys):
    """issue 56: naming a grouped algorithm alone was refused (group_size 1, the base class's default);
    and over a config of another algorithm, the keys holding that one's defaults give way to the new one's."""
    from jaxrlhf import train

    for name in GROUPED:  # alone, in a file and as an override
        by_override = load_config(None, [f"algorithm.name={name}"])
        by_file = load_config(_write(tmp_path, f"algorithm:\n  name: {name}\n"))
        assert by_override == by_file and by_override.algorithm.group_size == 8, name
    ppo, grpo = load_config(REPO / "configs" / "quickstart.yaml"), ALGORITHM_CONFIGS["grpo"]()
    assert ppo.algorithm.whiten_advantages  # PPO's default, written in the file
    switched = load_config(REPO / "configs" / "quickstart.yaml", ["algorithm.name=grpo"]).algorithm
    assert switched.name == "grpo" and switched.group_size == grpo.group_size == 8
    assert (switched.kl_estimator, switched.loss_agg) == (grpo.kl_estimator, grpo.loss_agg)  # GRPO's own
    assert (switched.kl_coef, switched.minibatches, switched.epochs) == (0.02, 2, 2)  # the file's choices stay
    assert train.main(["--config", str(REPO / "configs" / "quickstart.yaml"), "algorithm.name=grpo",
                       "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["algorithm"]
    assert printed["name"] == "grpo" and printed["group_size"] == 8 and "whiten_advantages" not in printed
    # a key set to another value than the old algorithm's default is the user's, and still refused by name
    with pytest.raises(ConfigError, match="'algorithm.whiten_advantages' is not read by algorithm.name=grpo"):
        load_config(REPO / "configs" / "quickstart.yaml", ["algorithm.whiten_advantages=false", "algorithm.name=grpo"])
    # back and forth: the switch keeps what differs from the defaults, the rest is the new algorithm's
    assert load_config(None, ["algorithm.name=dapo", "algorithm.name=grpo"]) == load_config(None, ["algorithm.name=grpo"])


def test_the_plan_cli_plans_an_algorithm_named_alone(tmp_path, capsys):
    """The issue's command, which was refused with "algorithm.group_size must be >= 2, got 1"."""
    from jaxrlhf import plan

    argv = ["--model-preset", "qwen3-30b-a3b", "--devices", "64", "--hardware", "h100", "--algorithm", "grpo",
            "--evaluations", "200"]
    assert plan.main([*argv, "--out", str(tmp_path / "plan"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["algorithm"] == "grpo"
    assert set(out["searched"]["plan"]["calls"]) == {"actor.generate", "ref.inference", "actor.train"}


def test_the_checked_in_reference_is_current():
    """docs/config_reference.md is what the schema generates: every key, its default and its meaning."""
    from jaxrlhf.config_reference import reference

    text = reference()
    current = (REPO / "docs" / "config_reference.md").read_text()
    assert text == current, "regenerate: python -m jaxrlhf.config_reference > docs/config_reference.md"
    for key in config_keys():  # every key appears (the roles' keys as model.<role>.*)
        parts = key.split(".")
        if parts[0] in ("model", "optimizer") and len(parts) == 3:
            key = f"{parts[0]}.<role>.{parts[2]}"
        assert f"`{key}`" in text, key
    for cls in set(ALGORITHM_CONFIGS.values()):
        for name in cls.__dataclass_fields__:
            assert f"`algorithm.{name}`" in text, name


def test_name_tables_are_registries():
    """Every table config validation looks names up in is a `Registry`: one did-you-mean for all."""
    from jaxrlhf.data.answers import ANSWER_EXTRACTORS
    from jaxrlhf.models.config import PRESETS
    from jaxrlhf.registry import Registry
    from jaxrlhf.rewards.rules import REWARD_FUNCTIONS

    for table in (ALGORITHM_CONFIGS, PRESETS, ANSWER_EXTRACTORS, REWARD_FUNCTIONS):
        assert isinstance(table, Registry)
    with pytest.raises(KeyError, match=r"unknown model preset 'tinny'\. Did you mean 'tiny'\?"):
        PRESETS.get("tinny")
    table = Registry("colour", entries={"red": 1, "green": 2})
    assert dict(table) == {"red": 1, "green": 2} and table.get("red") == 1
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        table.register("red")(3)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.max_staleness=-1"], "algorithm.max_staleness"),
    (["algorithm.max_staleness=2", "plan.strategy=colocated"],
     "algorithm.max_staleness=2 overlaps generation with training, which needs separate generation devices: "
     "use plan.strategy=disaggregated (or auto), not colocated"),
    (["algorithm.max_staleness=1", "plan.strategy=auto", "plan.replan_every=5"],
     "plan.replan_every with algorithm.max_staleness=1 is not supported"),
    (["algorithm.name=dpo", "plan.strategy=disaggregated", "plan.offpolicy=true"],
     "algorithm.name=dpo has no rollout; set plan.offpolicy=false"),
])
def test_a_staleness_budget_the_plan_cannot_honour_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_the_staleness_budget_is_max_staleness_or_one_for_plan_offpolicy():
    assert load_config(None, []).staleness_budget == 0
    assert load_config(None, ["plan.strategy=disaggregated", "plan.offpolicy=true"]).staleness_budget == 1
    assert load_config(None, ["plan.strategy=auto", "algorithm.max_staleness=3"]).staleness_budget == 3
    assert load_config(None, ["algorithm.name=grpo", "algorithm.group_size=2", "plan.strategy=disaggregated",
                                     "algorithm.max_staleness=2", "plan.offpolicy=true"]).staleness_budget == 2


@pytest.mark.parametrize("overrides, message", [
    (["plan.response_length_median=0"], "config key 'plan.response_length_median' must be > 0, got 0"),
    (["generation.max_new_tokens=64", "plan.response_length_median=65"],
     "plan.response_length_median=65 is above the response length cap generation.max_new_tokens=64; "
     "set it to at most 64 (or null)"),
    (["plan.response_length_sigma=-0.5"], "config key 'plan.response_length_sigma' must be >= 0, got -0.5"),
])
def test_a_response_length_distribution_out_of_range_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_the_planner_and_the_runtime_read_one_staleness_and_the_lengths_from_the_config():
    """`Algorithm.workload()` fills eta with `Config.generator_lead`, the number `RunSetup.staleness`
    runs an off-policy plan with (the budget, at least 1), and the response lengths from `plan:`."""
    from jaxrlhf.algorithms import declare

    for overrides, eta in (([], 1), (["plan.strategy=auto", "algorithm.max_staleness=3"], 3)):
        cfg = load_config(None, overrides + ["generation.max_new_tokens=64", "plan.response_length_median=16",
                                             "plan.response_length_sigma=1.0"])
        wl = declare(cfg).workload()
        assert cfg.generator_lead == wl.staleness == eta
        assert (wl.gen_len, wl.gen_len_median, wl.gen_len_sigma) == (64, 16, 1.0)
    wl = declare(load_config(None, [])).workload()
    assert (wl.staleness, wl.gen_len_median, wl.gen_len_sigma) == (1, None, 0.0)
