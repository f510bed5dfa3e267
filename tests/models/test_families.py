"""Qwen3, Gemma 2 and Gemma 3 (text): parity with transformers on random small checkpoints transformers itself
wrote (prefill logits, static and continuous greedy generation, reward scores), export round trips, the family
switches each exercised, gradients, chat templates in each family's style, and one clear error per unsupported
config key."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models import generation as gen
from jaxrlhf.models import pipeline
from jaxrlhf.models.config import PRESETS, ModelConfig
from jaxrlhf.models.continuous import continuous_fn
from jaxrlhf.models.hf_families import config_from_hf, config_to_hf
from jaxrlhf.models.hf_io import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from jaxrlhf.models.sampling import GREEDY
from jaxrlhf.testing.models import (
    hf_dims,
    jax_logits,
    left_padded_batch,
    load_transformers_model,
    max_relative_error,
    random_model,
    torch_logits,
)

TOL = 1e-4  # as tests/models/test_parity.py
LENGTH = 40  # longer than the tiny presets' sliding window (16): local layers differ from global ones
FAMILIES = ["qwen3", "gemma2", "gemma3"]
PROMPTS = [[2, 40, 41, 42, 43, 44, 45], [2, 50], [2, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76]]
N = 16  # with the 18-token prompt generation crosses the 16-token window


def hf_config(config: ModelConfig):
    """transformers' own config for one of our tiny family presets, built from its classes (not hf_families)."""
    import transformers

    common = hf_dims(config)
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_linear_factor is not None:
        rope = {"rope_type": "linear", "rope_theta": config.rope_theta, "factor": config.rope_linear_factor}
    if config.architecture == "qwen3":
        return transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"], rope_parameters=rope, **common)
    gemma = dict(query_pre_attn_scalar=config.query_pre_attn_scalar, sliding_window=config.sliding_window,
                 attn_logit_softcapping=config.attn_logit_softcap,
                 final_logit_softcapping=config.final_logit_softcap, **common)
    if config.architecture == "gemma2":
        return transformers.Gemma2Config(architectures=["Gemma2ForCausalLM"], rope_parameters=rope, **gemma)
    rope = {"full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": config.local_rope_theta}}
    return transformers.Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], rope_parameters=rope, **gemma)


def save_family_checkpoint(root, family: str, seed: int = 0, **overrides) -> str:
    """A random float32 transformers model of the tiny `family` preset, its norms perturbed off their init
    (Gemma's start at 0, Qwen3's at 1), saved with `save_pretrained`."""
    import torch
    import transformers

    hf = hf_config(PRESETS[f"tiny-{family}"].replace(**overrides))
    torch.manual_seed(seed)
    model = getattr(transformers, hf.architectures[0])._from_config(
        hf, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    path = root / f"{family}-{seed}"
    model.save_pretrained(path, safe_serialization=True)
    return path


# A tiny random model with tied embeddings mostly repeats its input's last token (its hidden state stays
# close to that token's embedding); an untied Qwen3 generates varied tokens (the Gemmas do tied).
CHECKPOINT_OVERRIDES = {"qwen3": dict(tie_word_embeddings=False)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: save_family_checkpoint(root, family, seed=1, **CHECKPOINT_OVERRIDES.get(family, {}))
            for family in FAMILIES}


@pytest.fixture(scope="module")
def references(checkpoints):
    """transformers' greedy continuations of PROMPTS, per family (one row at a time, no padding), each
    ending at the model's EOS or after N tokens."""
    import torch

    out = {}
    for family, path in checkpoints.items():
        hf = load_transformers_model(path)
        eos = PRESETS[f"tiny-{family}"].eos_token_id
        rows = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                rows.append(hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                                        eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist())
        out[family] = rows
    return out


def _responses(out) -> list[list[int]]:
    """Each row's response up to its length (its EOS included)."""
    return [np.asarray(out.response_tokens[row, :int(out.lengths[row])]).tolist() for row in range(len(PROMPTS))]


# ---------------------------------------------------------------- config


def test_family_switches_are_read(checkpoints):
    """config.json of each family gives the preset we built it from (dimensions and switches)."""
    for family, path in checkpoints.items():
        _, config = load_hf_checkpoint(path)
        assert config == PRESETS[f"tiny-{family}"].replace(**CHECKPOINT_OVERRIDES.get(family, {})), family


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "qwen3-0.6b", "qwen3-8b", "gemma2-2b",
                                  "gemma3-1b", "gemma3-4b", "gemma3-27b"])
@pytest.mark.parametrize("linear", [None, 8.0])
def test_config_round_trip(name, linear):
    config = PRESETS[name].replace(rope_linear_factor=linear)
    assert config_from_hf(config_to_hf(config)) == config


def test_parameter_count_matches_transformers():
    """`num_params` (what the planner prices) counts the q/k norms, the extra norms and a head_dim that is
    not hidden / heads as transformers does."""
    import transformers

    for family in FAMILIES:
        config = PRESETS[f"tiny-{family}"]
        for tied in (True, False):
            c = config.replace(tie_word_embeddings=tied)
            hf = getattr(transformers, hf_config(c).architectures[0])(hf_config(c))
            assert c.num_params() == sum(p.numel() for p in hf.parameters()), (family, tied)


def test_legacy_keys():
    """transformers 4.x configs as the published checkpoints ship them: Gemma 3's rope_theta /
    rope_local_base_freq and sliding_window_pattern, Gemma 2 without layer_types (every other layer
    local), Qwen3's rope_theta with rope_scaling null."""
    hf = config_to_hf(PRESETS["gemma3-1b"])
    del hf["rope_parameters"], hf["layer_types"]
    hf.update(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=6, rope_scaling=None)
    assert config_from_hf(hf) == PRESETS["gemma3-1b"]
    # the published multimodal Gemma 3 27B: a sparse text_config (every key left out is transformers' default)
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
          "torch_dtype": "bfloat16", "mm_tokens_per_image": 256, "vision_config": {"hidden_size": 1152},
          "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                          "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                          "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                          "sliding_window": 1024}}
    assert config_from_hf(hf) == PRESETS["gemma3-27b"]
    hf = config_to_hf(PRESETS["gemma2-2b"])
    del hf["rope_parameters"], hf["layer_types"]
    hf.update(hidden_act="gelu_pytorch_tanh", cache_implementation="hybrid")
    assert config_from_hf(hf) == PRESETS["gemma2-2b"]
    hf = config_to_hf(PRESETS["qwen3-0.6b"])
    del hf["rope_parameters"], hf["layer_types"]
    hf.update(rope_scaling=None, max_window_layers=28, torch_dtype="bfloat16")
    assert config_from_hf(hf) == PRESETS["qwen3-0.6b"]


# ---------------------------------------------------------------- parity


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_left_padded(checkpoints, family):
    model, config = load_hf_checkpoint(checkpoints[family])
    hf = load_transformers_model(checkpoints[family])
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5, 17))
    ours, ref = jax_logits(model, tokens, mask), torch_logits(hf, tokens, mask)
    assert max_relative_error(ours, ref, mask) <= TOL
    # row 1 is left-padded: its logits equal those of the same tokens unpadded
    again = jax_logits(model, np.stack([tokens[1, 5:].tolist() + [7] * 5, tokens[1], tokens[2]]), mask)
    np.testing.assert_allclose(again[0, :-5], ours[1, 5:], atol=TOL * np.abs(ref).max())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_linear_rope_scaling_matches_transformers(tmp_path, family):
    """HF rope_type 'linear' (Gemma 3 4B and larger: factor 8 on the global layers only), in transformers 5's
    rope_parameters and, for Gemma 3, the 4.x `rope_scaling` key our export also writes."""
    path = save_family_checkpoint(tmp_path, family, seed=5, rope_linear_factor=8.0)
    model, config = load_hf_checkpoint(path)
    assert config.rope_linear_factor == 8.0
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 7))
    ref = torch_logits(load_transformers_model(path), tokens, mask)
    assert max_relative_error(jax_logits(model, tokens, mask), ref, mask) <= TOL
    unscaled, _ = load_hf_checkpoint(path, config_overrides={"rope_linear_factor": None})
    assert max_relative_error(jax_logits(unscaled, tokens, mask), ref, mask) > 10 * TOL
    save_hf_checkpoint(model, config, tmp_path / "export")
    assert max_relative_error(torch_logits(load_transformers_model(tmp_path / "export"), tokens, mask), ref,
                              mask) <= TOL


@pytest.mark.slow
def test_text_model_of_a_multimodal_gemma3_checkpoint(tmp_path):
    """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration: its text model loads (config from
    text_config, tensors under language_model.), scores text as transformers' multimodal model does, and
    exports as a text-only Gemma3ForCausalLM with the same logits."""
    import torch
    import transformers

    text = hf_config(PRESETS["tiny-gemma3"].replace(rope_linear_factor=8.0)).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    hfc = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(6)
    hf = transformers.Gemma3ForConditionalGeneration._from_config(hfc, attn_implementation="eager",
                                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "mm", safe_serialization=True)
    model, config = load_hf_checkpoint(tmp_path / "mm")
    assert config == PRESETS["tiny-gemma3"].replace(rope_linear_factor=8.0)
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 7))
    ref = torch_logits(hf, tokens, mask)
    assert max_relative_error(jax_logits(model, tokens, mask), ref, mask) <= TOL
    save_hf_checkpoint(model, config, tmp_path / "text")
    exported = load_transformers_model(tmp_path / "text")
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    assert max_relative_error(torch_logits(exported, tokens, mask), ref, mask) <= TOL


# Each switch, set back to Llama's, changes the logits: the parity above exercises all of them.
SWITCHES = {
    "qwen3": [],
    "gemma2": [dict(sliding_window=None, sliding_window_pattern=None), dict(sliding_window_pattern=None),
               dict(attn_logit_softcap=None), dict(final_logit_softcap=None), dict(query_pre_attn_scalar=None),
               dict(scale_embeddings=False), dict(norm_offset=0.0), dict(mlp_activation="silu")],
    "gemma3": [dict(sliding_window=None, sliding_window_pattern=None), dict(sliding_window_pattern=None),
               dict(local_rope_theta=None), dict(query_pre_attn_scalar=None)],
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_each_switch_is_exercised(checkpoints, family):
    path = checkpoints[family]
    _, config = load_hf_checkpoint(path)
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5))
    ref = torch_logits(load_transformers_model(path), tokens, mask)
    for override in SWITCHES[family]:
        other, _ = load_hf_checkpoint(path, config_overrides=override)
        assert max_relative_error(jax_logits(other, tokens, mask), ref, mask) > 10 * TOL, override


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_static_engine_equals_transformers_generate(checkpoints, references, family):
    model, config = load_hf_checkpoint(checkpoints[family])
    ours = gen.generate(model, PROMPTS, N, GREEDY, eos_id=config.eos_token_id, pad_id=0)
    assert _responses(ours) == references[family]
    assert all(len(set(row)) > 3 for row in references[family])  # not a model that repeats one token


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuous_engine_equals_transformers_generate(checkpoints, references, family):
    model, config = load_hf_checkpoint(checkpoints[family])
    graphdef, state = nnx.split(model)
    # One program per family (compiling it is the test's time): groups of 2 samples per prompt, the
    # prompt's pages prefilled once and shared by both rows, and 3 slots for 6 rows, so rows start in
    # freed slots mid-run. group_size is a size in the engine's code, not a branch: group_size=1 (every
    # row its own prompt pages) runs the same code, and test_continuous.py checks it equal to a shared
    # prefill (test_shared_prefix_equals_prefilling_every_row).
    tokens, mask = gen.pad_prompts([p for p in PROMPTS for _ in range(2)], 0)
    out = continuous_fn(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0), max_new_tokens=N,
                        sampling=GREEDY, eos_id=config.eos_token_id, pad_id=0, group_size=2, slots=3)
    rows = [np.asarray(out.response_tokens[r, :int(out.lengths[r])]).tolist() for r in range(2 * len(PROMPTS))]
    assert rows == [ref for ref in references[family] for _ in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3"])
def test_pipelined_forward_knows_each_layers_kind(family):
    """Pipeline stages run their block of layers with each layer's own kind (local / global)."""
    config = PRESETS[f"tiny-{family}"]
    model = random_model(config, seed=2)
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5))
    ref = jax_logits(model, tokens, mask)
    with pipeline.staged(2), pipeline.microbatches(2):
        staged = jax_logits(model, tokens, mask)
    np.testing.assert_allclose(staged, ref, atol=1e-5 * np.abs(ref).max())


# ---------------------------------------------------------------- export


def _params(model: nnx.Module) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip(checkpoints, tmp_path, family):
    """import -> export -> transformers loads it with the same logits; import again: bitwise the same."""
    model, config = load_hf_checkpoint(checkpoints[family])
    path = save_hf_checkpoint(model, config, tmp_path / "export")
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5, 17))
    ref = torch_logits(load_transformers_model(checkpoints[family]), tokens, mask)
    assert max_relative_error(torch_logits(load_transformers_model(path), tokens, mask), ref, mask) <= TOL
    again, config_again = load_hf_checkpoint(path)
    assert config_again == config
    a, b = _params(model), _params(again)
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.mark.parametrize("family", FAMILIES)
def test_untied_export_round_trip(tmp_path, family):
    """A random untied model of each family: export -> import is bitwise, and transformers reads its config."""
    import transformers

    config = PRESETS[f"tiny-{family}"].replace(tie_word_embeddings=False)
    model = random_model(config, seed=4)
    path = save_hf_checkpoint(model, config, tmp_path / "untied")
    again, loaded = load_hf_checkpoint(path)
    assert loaded == config
    a, b = _params(model), _params(again)
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    hf = transformers.AutoConfig.from_pretrained(path)
    assert hf.tie_word_embeddings is False and hf.num_hidden_layers == config.num_layers


# ---------------------------------------------------------------- errors


def _hf(name: str, **changes) -> dict:
    hf = config_to_hf(PRESETS[name])
    hf.update(changes)
    return hf


@pytest.mark.parametrize("name, changes, message", [
    ("tiny-gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0},
                                         "sliding_attention": {"rope_type": "default"}}},
     r"rope_parameters\.full_attention\.rope_type='yarn' is not supported"),
    ("tiny-qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_parameters\.rope_type='dynamic' is not supported"),
    ("tiny-qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling\.rope_type='yarn'"),
    ("tiny-gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                         "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     r"rope_parameters\.sliding_attention: a scaled rope on the local layers is not supported"),
    ("tiny-qwen3", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5 is not supported"),
    ("tiny-gemma3", {"layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                     "sliding_attention", "sliding_attention", "full_attention"]},
     r"layer_types=.*global layers must recur every N layers"),
    ("tiny-gemma2", {"hidden_activation": "gelu"}, r"hidden_activation='gelu' is not supported for gemma2"),
    ("tiny-qwen3", {"attention_bias": True}, r"qwen3 attention_bias=true .* is not supported"),
    ("tiny-gemma3", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=true is not supported"),
    ("tiny-qwen3", {"architectures": ["DeepseekV3ForCausalLM"]},
     r"architectures=\['DeepseekV3ForCausalLM'\] is not supported; supported architectures: .*Qwen3ForCausalLM"),
    ("tiny-gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]},
     r"Gemma3ForConditionalGeneration needs a text_config"),
    ("tiny-qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
     r"qwen3 with sliding window on only some layers"),
])
def test_unsupported_config_is_one_clear_error(name, changes, message):
    with pytest.raises(CheckpointError, match=message) as err:
        config_from_hf(_hf(name, **changes))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, changes, message", [
    ("tiny", {"qk_norm": True}, r"llama checkpoints have qk_norm=False"),
    ("tiny-qwen3", {"qk_norm": False}, r"qwen3 checkpoints have qk_norm=True"),
    ("tiny-gemma2", {"local_rope_theta": 500.0}, r"gemma2 checkpoints have no local_rope_theta"),
    ("tiny-qwen3", {"final_logit_softcap": 30.0}, r"qwen3 checkpoints have no final_logit_softcap"),
    ("tiny-gemma3", {"mlp_activation": "silu"}, r"gemma3 checkpoints have mlp_activation='gelu_tanh'"),
])
def test_export_of_a_config_no_hf_class_holds_is_refused(name, changes, message):
    with pytest.raises(ValueError, match=message):
        config_to_hf(PRESETS[name].replace(**changes))


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_config_is_what_transformers_writes(family):
    """The family's keys in transformers' own config.json, with the same values for our preset."""
    ours = config_to_hf(PRESETS[f"tiny-{family}"])
    theirs = hf_config(PRESETS[f"tiny-{family}"]).to_dict()
    keys = ["model_type", "rope_parameters", "layer_types", "head_dim", "tie_word_embeddings"]
    if family != "qwen3":
        keys += ["sliding_window", "query_pre_attn_scalar", "hidden_activation", "attn_logit_softcapping",
                 "final_logit_softcapping"]
    for key in keys:
        assert ours[key] == theirs[key], key


# ---------------------------------------------------------------- reward models


REWARD_CLASSES = {"qwen3": "Qwen3ForSequenceClassification", "gemma2": "Gemma2ForSequenceClassification",
                  "gemma3": "Gemma3TextForSequenceClassification"}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reward_model_loads_with_same_scores(tmp_path, family):
    """A num_labels=1 sequence classifier transformers wrote: same scores here, and exported back tensor for
    tensor (no final-logit soft-cap on a score)."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    from jaxrlhf.models.transformer import positions_from_mask

    hfc = hf_config(PRESETS[f"tiny-{family}"])
    hfc.num_labels = 1
    torch.manual_seed(9)
    hf = getattr(transformers, REWARD_CLASSES[family])._from_config(
        hfc, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            if name == "score.weight":
                p.mul_(30.0)  # scores well above a soft-cap's linear range, so a capped score would differ
    hf.save_pretrained(tmp_path / "theirs", safe_serialization=True)
    model, config = load_hf_checkpoint(tmp_path / "theirs")
    assert type(model).__name__ == "RewardModel"
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5, 17), pad_id=config.pad_token_id)
    m = jnp.asarray(mask)
    ours = np.asarray(model(jnp.asarray(tokens), positions_from_mask(m), m), np.float32)
    ref = torch_logits(hf, tokens, mask)[:, 0]
    np.testing.assert_allclose(ours, ref, rtol=TOL, atol=TOL * np.abs(ref).max())
    save_hf_checkpoint(model, config, tmp_path / "ours")
    theirs, exported = load_file(tmp_path / "theirs" / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    assert theirs.keys() == exported.keys() and all(theirs[k].tobytes() == exported[k].tobytes() for k in theirs)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == [REWARD_CLASSES[family]]


# ---------------------------------------------------------------- training


def _loss(config: ModelConfig, remat: str = "none"):
    from jaxrlhf.models.transformer import build_model, positions_from_mask

    graphdef, state = nnx.split(build_model(config, seed=3, remat=remat))
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 3, config.vocab_size)
    mask = jnp.ones((2, 24), bool).at[1, :3].set(False)

    def loss(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, positions_from_mask(mask), mask)
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        return -jnp.sum(picked * mask[:, 1:]) / jnp.sum(mask[:, 1:])

    return loss, state


# The Gemmas only: Qwen3's layers are global layers with switches (q/k norms, a head_dim other than
# hidden / heads) that Gemma 3's layers have too, so Gemma 3 checks them under remat and bfloat16 (and
# Llama's plain layers are checked in test_scan_remat.py and test_mixed_precision.py).
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gradients_with_remat_and_in_bfloat16(family):
    """Rematerialised layers (local and global kinds looked up inside the checkpointed scan) give the same
    gradients, and a bfloat16 compute dtype gradients within bfloat16 rounding of float32's."""
    config = PRESETS[f"tiny-{family}"].replace(sliding_window=8)
    loss, state = _loss(config)
    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    remat_loss, _ = _loss(config, remat="full")
    _, remat_grads = jax.jit(jax.value_and_grad(remat_loss))(state)
    loss16, _ = _loss(config.replace(dtype="bfloat16"))
    value16, grads16 = jax.jit(jax.value_and_grad(loss16))(state)
    assert abs(float(value16) - float(value)) < 1e-2 * abs(float(value))
    flat, flat_remat, flat16 = (dict(jax.tree_util.tree_leaves_with_path(g)) for g in (grads, remat_grads, grads16))
    for path, g in flat.items():
        g = np.asarray(g)
        assert np.isfinite(g).all() and np.abs(g).max() > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(flat_remat[path]), g, atol=1e-6 * max(np.abs(g).max(), 1e-12))
        error = np.linalg.norm(np.asarray(flat16[path]) - g) / np.linalg.norm(g)
        assert error < 0.05, (jax.tree_util.keystr(path), error)


# ---------------------------------------------------------------- chat templates


# Templates in the style of each family's tokenizer_config.json, written here.
# Qwen3: ChatML; an assistant turn's reasoning (<think>...</think>) is dropped from the history except after
# the last user query; `enable_thinking=false` (not passed here: thinking on) would add an empty block.
QWEN3_TEMPLATE = """{%- set ns = namespace(last_query=-1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == 'user' and ns.last_query == -1 %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
# Gemma 2/3: BOS, <start_of_turn>user / model turns, a system message folded into the first user turn,
# strict alternation.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim }}
    {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""
CONVERSATIONS = [
    [{"role": "user", "content": "the cat sat on the mat"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12 + 7 = ?  "},
     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n19"}, {"role": "user", "content": "a dog"}],
    [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nhi"}],
]


@pytest.mark.parametrize("style, tokenizer_style, template", [("qwen3", "qwen2", QWEN3_TEMPLATE),
                                                              ("gemma", "llama2", GEMMA_TEMPLATE)])
def test_chat_templates_render_like_transformers(tmp_path, style, tokenizer_style, template):
    import transformers

    from jaxrlhf.models.chat_template import ChatTemplate
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.testing.models import save_tiny_tokenizer

    # the SentencePiece-style tiny tokenizer knows only the characters it was trained on
    corpus = ["<start_of_turn>user\nmodel <end_of_turn>\n be brief 12 + 7 = ? 19 a dog hello world hi <think> </think> say"]
    folder = save_tiny_tokenizer(tmp_path / style, tokenizer_style, corpus=corpus)
    (folder / "chat_template.jinja").write_text(template)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours, tok = ChatTemplate.from_folder(folder), load_tokenizer(folder)
    for messages in CONVERSATIONS:
        for prompt in (False, True):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.render(messages, add_generation_prompt=prompt) == expected, (messages, prompt)
            expected_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)["input_ids"]
            assert tok.encode(ours.render(messages, add_generation_prompt=prompt)) == list(expected_ids)
    if style == "qwen3":  # the last turn's reasoning is kept, an earlier one's dropped
        assert "add them" not in ours.render(CONVERSATIONS[1]) and "say hi" in ours.render(CONVERSATIONS[2])
