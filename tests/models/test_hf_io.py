"""HF checkpoint import/export: round trips, sharding, dtypes, heads, and one clear error per bad input."""

import json
import shutil
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from jaxrlhf.models.config import PRESETS, RopeScaling
from jaxrlhf.models.hf_families import config_from_hf, config_to_hf
from jaxrlhf.models.hf_io import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from jaxrlhf.models.transformer import positions_from_mask
from jaxrlhf.testing.models import (
    hf_config,
    jax_logits,
    left_padded_batch,
    load_transformers_model,
    max_relative_error,
    random_model,
    save_tiny_hf_checkpoint,
    tiny_config,
    torch_logits,
)

TOL = 1e-4
ARCHS = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {arch: save_tiny_hf_checkpoint(root, arch, seed=3) for arch in ARCHS}


def params(model: nnx.Module) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k


# ---------------------------------------------------------------- config.json


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-mistral", "llama3-8b", "qwen2-7b", "llama2-70b"])
def test_config_round_trip(name):
    config = PRESETS[name]
    if name == "llama3-8b":
        config = config.replace(rope_scaling=RopeScaling())
    assert config_from_hf(config_to_hf(config)) == config


def test_config_from_legacy_keys():
    """transformers 4.x configs: top-level rope_theta / rope_scaling ("type"), torch_dtype, eos list."""
    hf = config_to_hf(PRESETS["llama3-8b"])
    del hf["rope_parameters"], hf["dtype"]
    hf.update(
        rope_theta=500000.0, torch_dtype="bfloat16", eos_token_id=[128001, 128009], head_dim=None,
        rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )
    config = config_from_hf(hf)
    assert config.rope_scaling == RopeScaling() and config.rope_theta == 500000.0
    assert config.param_dtype == "bfloat16" and config.eos_token_id == 128001 and config.head_dim is None
    assert config.eos_token_ids == (128001, 128009)  # every EOS id kept, the first is the primary


def test_eos_list_config_round_trip():
    """Llama 3.1 lists three EOS ids in config.json: config_to_hf writes the list back, one id stays an int."""
    config = PRESETS["llama3-8b"].replace(eos_token_id=128001, extra_eos_token_ids=(128008, 128009))
    hf = config_to_hf(config)
    assert hf["eos_token_id"] == [128001, 128008, 128009]
    assert config_from_hf(hf) == config
    assert config_to_hf(PRESETS["llama3-8b"])["eos_token_id"] == 128001
    assert config_to_hf(PRESETS["tiny"].replace(eos_token_id=None))["eos_token_id"] is None


def test_model_config_eos_normal_form():
    """The HF list form is accepted (model.<role>.overrides may give one); repeats and the primary drop out."""
    config = tiny_config("llama", eos_token_id=[5, 6, 5], extra_eos_token_ids=[7, 6])
    assert (config.eos_token_id, config.extra_eos_token_ids, config.eos_token_ids) == (5, (6, 7), (5, 6, 7))
    assert config == tiny_config("llama", eos_token_id=5, extra_eos_token_ids=(6, 7))
    hash(config)  # a static argument of jitted functions
    assert tiny_config("llama", eos_token_id=None).eos_token_ids == ()
    with pytest.raises(ValueError, match="needs an eos_token_id"):
        tiny_config("llama", eos_token_id=None, extra_eos_token_ids=(3,))


def test_qwen2_sliding_window_config():
    hf = config_to_hf(PRESETS["tiny-qwen2"])
    assert hf["use_sliding_window"] is False and config_from_hf(hf).sliding_window is None
    hf.update(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    del hf["layer_types"]
    assert config_from_hf(hf).sliding_window == 8
    hf["max_window_layers"] = 1  # layer 0 full, layer 1 sliding: one mask for all layers cannot express it
    with pytest.raises(CheckpointError, match="some layers"):
        config_from_hf(hf)


# ---------------------------------------------------------------- export / import


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_export_then_transformers_load_gives_same_logits(tmp_path, arch):
    config = tiny_config(arch)
    model = random_model(config, seed=4)
    save_hf_checkpoint(model, config, tmp_path)
    hf = load_transformers_model(tmp_path)
    tokens, mask = left_padded_batch(config.vocab_size, 40, pads=(0, 5, 17))
    assert max_relative_error(jax_logits(model, tokens, mask), torch_logits(hf, tokens, mask), mask) <= TOL
    assert hf.generation_config.eos_token_id == config.eos_token_id
    if arch == "qwen2":  # tied: no lm_head tensor written
        with safe_open(tmp_path / "model.safetensors", "np") as f:
            assert "lm_head.weight" not in f.keys()


@pytest.mark.parametrize("arch", ARCHS)
def test_import_export_import_is_bitwise_identity(checkpoints, tmp_path, arch):
    first, config = load_hf_checkpoint(checkpoints[arch])
    save_hf_checkpoint(first, config, tmp_path)
    second, config2 = load_hf_checkpoint(tmp_path)
    assert config2 == config
    assert_bitwise_equal(params(first), params(second))
    # and the written tensors equal transformers' own file, key for key (except a tied lm_head copy)
    ours, theirs = load_file(tmp_path / "model.safetensors"), load_file(checkpoints[arch] / "model.safetensors")
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert_bitwise_equal(ours, theirs)


def test_eos_list_export_import_round_trip(tmp_path):
    config = tiny_config("llama", eos_token_id=2, extra_eos_token_ids=(7, 9))
    path = save_hf_checkpoint(random_model(config), config, tmp_path / "out")
    for name in ("config.json", "generation_config.json"):
        assert json.loads((path / name).read_text())["eos_token_id"] == [2, 7, 9]
    _, loaded = load_hf_checkpoint(path)
    assert loaded == config
    import transformers

    assert transformers.AutoConfig.from_pretrained(path).eos_token_id == [2, 7, 9]


def test_generation_config_eos_ids_are_read(checkpoints, tmp_path):
    """transformers' generate stops on generation_config.json's ids; instruct models list more there."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["qwen2"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2]}))
    _, loaded = load_hf_checkpoint(path)
    assert loaded.eos_token_ids == (2, 5)  # config.json's id stays the primary
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match="generation_config.json: cannot read eos_token_id"):
        load_hf_checkpoint(path)


def test_sharded_round_trip(checkpoints, tmp_path):
    model, config = load_hf_checkpoint(checkpoints["llama"])
    save_hf_checkpoint(model, config, tmp_path, max_shard_bytes=40_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    again, _ = load_hf_checkpoint(tmp_path)
    assert_bitwise_equal(params(model), params(again))
    tokens, mask = left_padded_batch(config.vocab_size, 40, pads=(0, 5, 17))
    ref = torch_logits(load_transformers_model(tmp_path), tokens, mask)
    assert max_relative_error(jax_logits(model, tokens, mask), ref, mask) <= TOL
    # saving again unsharded removes the old shards and index
    save_hf_checkpoint(model, config, tmp_path)
    assert not list(tmp_path.glob("model-*")) and not (tmp_path / "model.safetensors.index.json").exists()


def test_bfloat16_saved_as_bf16(tmp_path):
    config = tiny_config("llama", param_dtype="bfloat16", dtype="bfloat16")
    model = random_model(config, seed=5)
    save_hf_checkpoint(model, config, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    hf = load_transformers_model(tmp_path, dtype="bfloat16")
    assert next(hf.parameters()).dtype.__repr__() == "torch.bfloat16"
    again, config2 = load_hf_checkpoint(tmp_path)
    assert config2.param_dtype == "bfloat16"
    assert_bitwise_equal(params(model), params(again))
    upcast, config3 = load_hf_checkpoint(tmp_path, param_dtype="float32")
    assert config3.param_dtype == config3.dtype == "float32"
    assert params(upcast)[("model", "embed")].dtype == np.float32


# ---------------------------------------------------------------- critic and reward heads


@pytest.mark.slow
def test_value_and_reward_heads_from_actor_checkpoint(checkpoints):
    actor, _ = load_hf_checkpoint(checkpoints["llama"])
    trunk = {p: v for p, v in params(actor).items() if p[0] == "model"}
    critic, _ = load_hf_checkpoint(checkpoints["llama"], head="value")
    reward, config = load_hf_checkpoint(checkpoints["llama"], head="reward", seed=7)
    for model in (critic, reward):
        assert not hasattr(model, "lm_head")
        assert_bitwise_equal(trunk, {p: v for p, v in params(model).items() if p[0] == "model"})
    assert not np.asarray(critic.value_head[...]).any() and float(critic.value_bias[...]) == 0.0
    score = np.asarray(reward.score_head[...])
    assert score.any() and np.abs(score).max() < 0.2
    tokens, mask = left_padded_batch(config.vocab_size, 40, pads=(0, 5, 17))
    m = jnp.asarray(mask)
    values = critic(jnp.asarray(tokens), positions_from_mask(m), m)
    assert values.shape == tokens.shape and not np.asarray(values).any()
    assert reward(jnp.asarray(tokens), positions_from_mask(m), m).shape == (3,)


@pytest.mark.parametrize("head", ["value", "reward"])
def test_trained_head_round_trips(tmp_path, head):
    config = tiny_config("llama")
    model = random_model(config, head, seed=6)
    save_hf_checkpoint(model, config, tmp_path)
    again, _ = load_hf_checkpoint(tmp_path)  # head recorded in config.json
    assert type(again) is type(model)
    assert_bitwise_equal(params(model), params(again))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'lm_head\.weight' is missing"):
        load_hf_checkpoint(tmp_path, head="lm")


# ---------------------------------------------------------------- reward models: HF sequence classification


def reward_model(config, seed):
    """A random reward model of ours (no bias, like HF's score head)."""
    return random_model(config, "reward", seed=seed)


def jax_scores(model, tokens, mask) -> np.ndarray:
    m = jnp.asarray(mask)
    return np.asarray(model(jnp.asarray(tokens), positions_from_mask(m), m), np.float32)


def torch_scores(hf, tokens, mask) -> np.ndarray:
    return torch_logits(hf, tokens, mask)[:, 0]  # [batch, num_labels=1]


def assert_scores_close(ours, ref):
    np.testing.assert_allclose(ours, ref, rtol=TOL, atol=TOL * np.abs(ref).max())


def hf_reward_checkpoint(path, arch, seed):
    """A random num_labels=1 `<Arch>ForSequenceClassification` written by transformers itself."""
    import torch
    import transformers

    hfc = hf_config(tiny_config(arch))
    hfc.num_labels = 1
    cls = getattr(transformers, hfc.architectures[0].replace("ForCausalLM", "ForSequenceClassification"))
    torch.manual_seed(seed)
    model = cls._from_config(hfc, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():  # norms at 1 and biases at 0 would hide layout mistakes
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_reward_export_scores_match_transformers(tmp_path, arch):
    import torch
    import transformers

    config = tiny_config(arch)
    assert config.pad_token_id != config.eos_token_id
    model = reward_model(config, seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pad != eos: no pooling warning
        save_hf_checkpoint(model, config, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "np") as f:
        assert f.get_slice("score.weight").get_shape() == [1, config.hidden_size]
        assert not [k for k in f.keys() if not k.startswith("model.") and k != "score.weight"]
    hf_json = json.loads((tmp_path / "config.json").read_text())
    assert hf_json["architectures"] == [f"{type(hf_config(config)).__name__[:-6]}ForSequenceClassification"]
    assert hf_json["jaxrlhf_head"] == "reward" and hf_json["num_labels"] == 1
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(hf).__name__ == hf_json["architectures"][0] and hf.config.num_labels == 1
    tokens, mask = left_padded_batch(config.vocab_size, 40, pads=(0, 5, 17), pad_id=config.pad_token_id)
    tokens[:, -1] = config.eos_token_id  # a final EOS, as reward inputs usually end
    ours = jax_scores(model, tokens, mask)
    assert_scores_close(ours, torch_scores(hf, tokens, mask))
    assert np.abs(ours).min() > 0 and len(set(ours.tolist())) == 3  # a real, row-dependent score


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reward_model_loads_with_same_scores(tmp_path, arch):
    theirs = tmp_path / "theirs"
    hf = hf_reward_checkpoint(theirs, arch, seed=9)
    assert "jaxrlhf_head" not in json.loads((theirs / "config.json").read_text())
    model, config = load_hf_checkpoint(theirs)  # ...ForSequenceClassification: reward head by default
    assert type(model).__name__ == "RewardModel"
    tokens, mask = left_padded_batch(config.vocab_size, 40, pads=(0, 5, 17), pad_id=config.pad_token_id)
    assert_scores_close(jax_scores(model, tokens, mask), torch_scores(hf, tokens, mask))
    # and exporting it writes transformers' own file back, tensor for tensor
    save_hf_checkpoint(model, config, tmp_path / "ours")
    assert_bitwise_equal(load_file(tmp_path / "ours" / "model.safetensors"), load_file(theirs / "model.safetensors"))


@pytest.mark.parametrize("arch", ARCHS)
def test_reward_export_import_is_bitwise_identity(tmp_path, arch):
    config = tiny_config(arch)
    model = reward_model(config, seed=10)
    save_hf_checkpoint(model, config, tmp_path)
    again, config2 = load_hf_checkpoint(tmp_path)
    assert type(again) is type(model) and config2 == config
    assert_bitwise_equal(params(model), params(again))


def test_pad_equal_to_eos_warns(tmp_path):
    config = tiny_config("llama", pad_token_id=2, eos_token_id=2)
    with pytest.warns(UserWarning, match=r"pad_token_id == eos_token_id \(2\).*before the final EOS"):
        save_hf_checkpoint(reward_model(config, seed=12), config, tmp_path)


def test_legacy_score_head_layout_still_loads(tmp_path):
    """Reward checkpoints written before the HF layout: `score_head.weight` [hidden] + a zero `score_head.bias`."""
    config = tiny_config("llama")
    model = reward_model(config, seed=13)
    save_hf_checkpoint(model, config, tmp_path)
    rewrite(tmp_path, lambda t: t.update(
        {"score_head.weight": t.pop("score.weight")[0], "score_head.bias": np.zeros((1,), np.float32)}))
    again, _ = load_hf_checkpoint(tmp_path)
    assert_bitwise_equal(params(model), params(again))
    # A non-zero bias has nowhere to go: a clear error instead of silently shifted scores.
    rewrite(tmp_path, lambda t: t.update({"score_head.bias": np.ones((1,), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: score_head\.bias is non-zero.*rewards\.bias"):
        load_hf_checkpoint(tmp_path)


def test_reward_head_wrong_shape(tmp_path):
    config = tiny_config("llama")
    save_hf_checkpoint(reward_model(config, seed=14), config, tmp_path)
    rewrite(tmp_path, lambda t: t.update({"score.weight": np.ones((2, config.hidden_size), np.float32)}))
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(tmp_path)
    assert str(e.value) == f"{tmp_path}/model.safetensors: tensor 'score.weight' has shape [2, 64], expected [1, 64]"


# ---------------------------------------------------------------- bad input: one error naming file and key


@pytest.fixture
def broken(checkpoints, tmp_path):
    """A writable copy of the tiny Llama checkpoint."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"], path)
    return path


def rewrite(path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_config_json(broken):
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"{broken}/config\.json: not found"):
        load_hf_checkpoint(broken)


def test_missing_safetensors(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        load_hf_checkpoint(broken)


def test_missing_shard_file(checkpoints, tmp_path):
    model, config = load_hf_checkpoint(checkpoints["llama"])
    save_hf_checkpoint(model, config, tmp_path, max_shard_bytes=40_000)
    key = "model.layers.1.mlp.down_proj.weight"
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"][key]
    (tmp_path / shard).unlink()
    message = rf"{shard}: shard file listed in .*index\.json for tensor '{key}' is missing"
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE", "sub/model-1.safetensors"])
def test_index_may_name_only_files_in_the_model_folder(checkpoints, tmp_path, where):
    """An index from elsewhere must not make the loader read files the user never pointed at: the shard
    it names is a real safetensors file outside the folder, and still refused before anything is read."""
    model, config = load_hf_checkpoint(checkpoints["llama"])
    folder = tmp_path / "model"
    save_hf_checkpoint(model, config, folder, max_shard_bytes=40_000)
    outside = tmp_path / "outside.safetensors"
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    key = "model.layers.1.mlp.down_proj.weight"
    (folder / index["weight_map"][key]).rename(outside)
    index["weight_map"][key] = str(outside) if where == "ABSOLUTE" else where
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' is mapped to .*plain file names inside"):
        load_hf_checkpoint(folder)


def test_unsupported_architecture(broken):
    hf = json.loads((broken / "config.json").read_text())
    hf["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(broken)
    msg = str(e.value)
    assert str(broken / "config.json") in msg and "GPT2LMHeadModel" in msg
    assert "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM" in msg


def test_wrong_shape(broken):
    key = "model.layers.1.mlp.up_proj.weight"
    rewrite(broken, lambda t: t.__setitem__(key, t[key][:-1]))
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(broken)
    assert str(e.value) == (
        f"{broken}/model.safetensors: tensor '{key}' has shape [127, 64], expected [128, 64]"
    )


def test_missing_tensor(broken):
    key = "model.layers.0.self_attn.k_proj.weight"
    rewrite(broken, lambda t: t.pop(key))
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(broken)
    assert str(e.value) == f"{broken}/model.safetensors: tensor '{key}' is missing (expected shape [32, 64])"


def test_extra_tensors(broken):
    rewrite(broken, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    load_hf_checkpoint(broken)  # buffers are ignored
    key = "model.layers.2.mlp.up_proj.weight"
    rewrite(broken, lambda t: t.update({key: np.ones((128, 64), np.float32)}))
    message = rf"model\.safetensors: tensor '{key}' belongs to layer 2.*num_hidden_layers=2"
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(broken)


def test_unsupported_export():
    with pytest.raises(ValueError, match="sliding window"):
        config_to_hf(tiny_config("llama", sliding_window=8))
    with pytest.raises(ValueError, match="attention_bias"):
        config_to_hf(tiny_config("qwen2", attention_bias=False))


def test_corrupt_safetensors(broken):
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=rf"{broken}/model\.safetensors: not a readable safetensors file"):
        load_hf_checkpoint(broken)
