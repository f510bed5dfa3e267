"""The peer benchmarks' GPU paths, checked without a GPU: what `--device cuda` passes to each side (dtype,
jaxrlhf's overrides, TRL's trainer arguments, the tokenizer's EOS), and how gpu_checks.sh installs the
wheels of scripts/gpu_wheels.txt. No timings here: benchmarks live in scripts/."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ppo():
    return _load("bench_ppo")


@pytest.fixture(scope="module")
def grpo():
    return _load("bench_grpo_trl")


def test_bf16_on_the_gpu_fp32_on_the_cpu(ppo):
    assert ppo.torch_dtype_name("cuda") == "bfloat16" and ppo.torch_dtype_name("cpu") == "float32"
    assert ppo.trl_thread_counts(None, "cuda") == [0]  # torch's default: the GPU does the work
    assert ppo.trl_thread_counts(None, "cpu") == [1, os.cpu_count() or 1] if os.cpu_count() != 1 else [1]
    assert ppo.trl_thread_counts("2,2,4", "cuda") == [2, 4]


@pytest.mark.parametrize("config, roles", [("quickstart.yaml", {"actor", "ref", "critic"}),
                                           ("quickstart-grpo.yaml", {"actor", "ref"})])
def test_jaxrlhf_runs_every_role_in_bf16_on_one_gpu(ppo, config, roles):
    """On cuda the overrides put the run on the GPU (no simulated devices) with each role the algorithm runs
    in bf16, after the user's; on cpu the user's alone, so the CPU run stays the config's."""
    from jaxrlhf.config import load_config
    from jaxrlhf.run.planning import role_configs

    path = str(REPO / "configs" / config)
    user = ["model.actor.preset=small"]
    assert ppo.on_device(path, user, "cpu") == user
    overrides = ppo.on_device(path, user, "cuda")
    assert overrides[:1] == user and overrides[1:3] == ["run.platform=gpu", "run.devices=null"]
    assert {o.split(".")[1] for o in overrides[3:]} == roles
    cfg = load_config(path, overrides)
    assert cfg.run.platform == "gpu" and cfg.run.devices is None
    for role, mc in role_configs(cfg, sorted(roles)).items():
        assert (mc.dtype, mc.param_dtype) == ("bfloat16", "bfloat16"), role
    assert cfg.optimizer.actor.master_weights  # AdamW still updates an fp32 copy


def _ppo_spec(device):
    alg = {"minibatches": 2, "epochs": 2, "kl_coef": 0.02, "kl_estimator": "k3", "clip_eps": 0.2,
           "value_clip_eps": None, "gamma": 1.0, "lam": 0.95}
    return {"output_dir": "/tmp/x", "batch_size": 64, "warmup": 1, "steps": 2, "max_new_tokens": 256,
            "ignore_eos": True, "temperature": 1.0, "lr": 5e-4, "seed": 0, "algorithm": alg, "device": device}


def test_trl_ppo_trains_in_bf16_on_the_gpu_and_the_same_batches_as_on_the_cpu(ppo):
    cuda, cpu = ppo.ppo_config_kwargs(_ppo_spec("cuda")), ppo.ppo_config_kwargs(_ppo_spec("cpu"))
    assert cuda["bf16"] is True and "use_cpu" not in cuda and not cuda["fp16"]
    assert cpu["bf16"] is False and cpu["use_cpu"] is True
    differ = {k for k in cuda.keys() | cpu.keys() if cuda.get(k) != cpu.get(k)}
    assert differ == {"bf16", "use_cpu"}
    assert cuda["total_episodes"] == 64 * 3 and cuda["stop_token"] is None and not cuda["gradient_checkpointing"]


def test_the_tokenizer_keeps_its_eos_when_the_models_lies_past_its_vocabulary(ppo):
    """llama3.2-1b over the byte vocabulary: EOS 128001 has no token, and setting it would leave the tokenizer
    with no EOS at all; it keeps its own (2). An EOS the vocabulary has is set as before."""
    assert ppo.hf_special_ids(259, 0, 128001) == {"pad_token_id": 0}
    assert ppo.hf_special_ids(259, 0, 2) == {"pad_token_id": 0, "eos_token_id": 2}
    pytest.importorskip("transformers")
    tok = ppo.byte_tokenizer_hf()
    for key, value in ppo.hf_special_ids(len(tok), 0, 128001).items():
        setattr(tok, key, value)
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 2)
    naive = ppo.byte_tokenizer_hf()
    naive.eos_token_id = 128001
    assert naive.eos_token_id is None  # what the script did before: no EOS left
    # TRL's GRPO tokenizes the prompt text itself: BOS first, as jaxrlhf's prompt ids
    from jaxrlhf.models.tokenizer import ByteTokenizer

    assert ppo.byte_tokenizer_hf(add_bos=True)("12+7=")["input_ids"] == [1] + ByteTokenizer().encode("12+7=")


@pytest.mark.slow
def test_reward_scores_follow_the_input_to_its_device(ppo):
    """The rule reward's hidden states are built on input_ids' device (a GPU's there), not the CPU's (slow:
    transformers' Trainer import, ~15 s)."""
    torch = pytest.importorskip("torch")
    _, RuleRewardModule = ppo._trl_classes()
    spec = {"rules": [("exact_match", 1.0, {})], "reward_shaping": {"bias": 0.0, "scale": 1.0, "clip": None,
            "eos_only": False}, "tokenizer": "byte", "prompt_width": 2, "pad_id": 0, "eos_id": 2, "ignore_eos": True}
    module = RuleRewardModule(spec, {(1, 52): {"prompt": "1", "answer": "1"}})
    ids = torch.tensor([[1, 52, 52, 52], [1, 52, 53, 2]])
    h = module(input_ids=ids).hidden_states[0]
    assert h.device == ids.device and h.shape == (2, 4, 1)
    assert h[:, 0, 0].tolist() == [0.0, 0.0]  # "11" and "2" against the answer "1"


def test_comparison_has_the_ratio_per_call_seconds_and_generate_shares(ppo):
    jax_sm = {"step_s": 2.0, "tokens_per_s": 1000.0, "calls_s": {"actor.generate": 0.5, "actor.train": 1.0}}
    trl_sm = {"step_s": 10.0, "tokens_per_s": 200.0, "calls_s": {"generate_s": 6.0}}
    out = ppo.comparison(jax_sm, trl_sm)
    assert out["ratio"] == 5.0 and out["step_s"] == {"jaxrlhf": 2.0, "trl": 10.0}
    assert out["generate_share"] == {"jaxrlhf": 0.25, "trl": 0.6}
    assert out["per_call_s"]["jaxrlhf"] == jax_sm["calls_s"]
    assert ppo.comparison(jax_sm, None)["ratio"] is None


def _grpo_spec(device, micro=None):
    alg = {"group_size": 8, "minibatches": 2, "epochs": 2, "micro_batch_size": micro, "kl_coef": 0.02,
           "clip_eps": 0.2, "clip_eps_high": 0.28, "loss_agg": "seq-mean-token-mean", "norm_adv_by_std": True}
    return {"output_dir": "/tmp/x", "batch_size": 16, "warmup": 1, "steps": 2, "max_new_tokens": 256,
            "ignore_eos": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "lr": 5e-4, "seed": 0,
            "algorithm": alg, "device": device}


def test_trl_grpo_does_jaxrlhfs_updates_per_batch(grpo):
    """16 prompts x 8 = 128 rows, 2 minibatches x 2 epochs: one generation of all 128 rows, then 4 optimizer
    steps of 64 rows; with 32-row micro-batches, 2 accumulated per step. bf16 only on the GPU."""
    cuda, cpu = grpo.grpo_config_kwargs(_grpo_spec("cuda")), grpo.grpo_config_kwargs(_grpo_spec("cpu"))
    assert (cuda["per_device_train_batch_size"], cuda["gradient_accumulation_steps"], cuda["steps_per_generation"],
            cuda["num_iterations"], cuda["max_steps"]) == (64, 1, 2, 2, 3 * 4)
    micro = grpo.grpo_config_kwargs(_grpo_spec("cuda", micro=32))
    assert (micro["per_device_train_batch_size"], micro["gradient_accumulation_steps"],
            micro["steps_per_generation"]) == (32, 2, 4)
    assert cuda["bf16"] is True and "use_cpu" not in cuda and cuda["model_init_kwargs"] == {"dtype": "bfloat16"}
    assert cpu["bf16"] is False and cpu["use_cpu"] is True and cpu["model_init_kwargs"] == {"dtype": "float32"}
    assert {k for k in cuda.keys() | cpu.keys() if cuda.get(k) != cpu.get(k)} == {"bf16", "use_cpu",
                                                                                   "model_init_kwargs"}
    assert cuda["generation_kwargs"] == {"min_new_tokens": 256}  # no EOS ends a completion early
    assert (cuda["loss_type"], cuda["scale_rewards"], cuda["beta"], cuda["epsilon_high"]) == ("grpo", "group", 0.02,
                                                                                          0.28)
    assert not cuda["gradient_checkpointing"] and not cuda["shuffle_dataset"]


def test_trl_accepts_the_grpo_arguments(grpo):
    """Every argument is one the installed TRL's GRPOConfig has, and the CPU's build one (the GPU's bf16 needs
    a GPU to build)."""
    trl = pytest.importorskip("trl")
    import dataclasses

    kwargs = grpo.grpo_config_kwargs(_grpo_spec("cuda"))
    assert set(kwargs) <= {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    args = trl.GRPOConfig(**grpo.grpo_config_kwargs(_grpo_spec("cpu")))
    assert args.generation_batch_size == 128 and args.steps_per_generation == 2


def test_rl_steps_group_the_optimizer_steps_of_one_batch(grpo):
    ends = [0.0, 1.0, 1.5, 2.0, 2.5, 4.0, 4.5, 5.0, 5.5]  # start, then 8 optimizer steps, 4 per RL step
    assert grpo.rl_step_times(ends, 4) == [2.5, 3.0]
    assert grpo.rl_step_times(ends[:4], 4) == []


def test_grpo_bench_refuses_what_it_cannot_compare(grpo, capsys):
    assert grpo.main(["--skip-trl", "--config", str(REPO / "configs" / "quickstart.yaml")]) == 2
    assert "compares GRPO" in capsys.readouterr().err


@pytest.mark.slow
def test_grpo_bench_runs_both_sides_on_the_cpu(tmp_path):
    """A tiny end-to-end run (TRL when installed): both sides count the same tokens per step. The script
    runs as a user runs it, in its own process: it sets the device count before JAX starts, which a test
    worker that already ran JAX could not."""
    pytest.importorskip("trl")
    import json

    out = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_grpo_trl.py"), "--steps", "1", "--warmup", "1",
         "--trl-threads", "1", "--workdir", str(tmp_path / "w"), "--out", str(out), "data.batch_size=2",
         "algorithm.group_size=2", "generation.max_new_tokens=4", "run.devices=1"],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ratio"] > 0 and set(r["generate_share"]) == {"jaxrlhf", "trl"} and r["trl_reference"] == "1 thr"
    trl = r["trl"]["1 thr"]
    assert trl["summary"]["tokens_per_step"] == r["jaxrlhf"]["summary"]["tokens_per_step"]
    assert (trl["dtype"], trl["torch_threads"]) == ("float32", 1)


# --------------------------------------------------------------------------- gpu_wheels.txt and its install


def wheel_groups() -> dict[str, list[str]]:
    groups, group = {}, None
    for line in (REPO / "scripts" / "gpu_wheels.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        if line.startswith("["):
            group = line.strip("[]")
            continue
        assert group and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][A-Za-z0-9.]*", line), line
        groups.setdefault(group, []).append(line)
    return groups


def test_gpu_wheels_pin_one_version_per_folder_and_cover_jaxrlhfs_missing_dependencies():
    """Each group installs into its own folder, so a name appears once per group; the [jaxrlhf] group holds
    every dependency of jaxrlhf the GPU image lacks, and each TRL is the one its benchmark wants."""
    groups = wheel_groups()
    assert set(groups) == {"jaxrlhf", "trl-ppo", "trl-grpo", "tunix"}
    for name, lines in groups.items():
        names = [line.split("==")[0].lower().replace("_", "-") for line in lines]
        assert len(names) == len(set(names)), name
    base = {line.split("==")[0].lower().replace("_", "-") for line in groups["jaxrlhf"]}
    assert {"pydantic", "pydantic-core", "tensorflow-datasets", "array-record", "tensorboardx",
            "importlib-resources", "promise", "datasets"} <= base
    assert groups["trl-ppo"] == [f"trl=={_load('bench_ppo').TRL_VERSION}"]
    assert [line.split("==")[0] for line in groups["trl-grpo"]] == ["trl"]
    tunix = _load("bench_grpo_tunix")
    assert f"google-tunix=={tunix.TUNIX_VERSION}" in groups["tunix"]


def test_gpu_checks_installs_each_wheel_group_into_its_own_folder(tmp_path):
    """WHEELS=DIR: every listed wheel found in DIR (names matched as wheel files spell them: _ for - and .,
    any case) goes to $SITE/<group> with pip's offline, no-dependency install; a missing one is named."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    groups = wheel_groups()
    present = [line for lines in groups.values() for line in lines if not line.startswith("perfetto")]
    for line in present:
        name, version = line.split("==")
        (wheels / f"{re.sub(r'[-.]', '_', name).lower()}-{version}-py3-none-any.whl").touch()
    log = tmp_path / "pip.log"
    fake = tmp_path / "python"  # records the pip calls, answers the rest
    fake.write_text(f'#!/bin/bash\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = dict(os.environ, SMOKE="1", OUT=str(tmp_path / "out"), STEPS="none", WHEELS=str(wheels), PY=str(fake),
               SITE=str(tmp_path / "site"))
    run = subprocess.run(["bash", "scripts/gpu_checks.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert "no wheel of perfetto==" in run.stderr
    installs = [line.split() for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    by_target = {words[words.index("--target") + 1]: [w for w in words if w.endswith(".whl")] for words in installs}
    assert set(by_target) == {str(tmp_path / "site" / g) for g in groups}
    for words in installs:
        assert {"--no-index", "--no-deps"} <= set(words)
    for group, lines in groups.items():
        got = sorted(pathlib.Path(w).name.split("-")[0] for w in by_target[str(tmp_path / "site" / group)])
        want = sorted(re.sub(r"[-.]", "_", line.split("==")[0]).lower() for line in lines if line in present)
        assert got == want, group
