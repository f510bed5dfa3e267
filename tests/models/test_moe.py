"""Mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral): parity with transformers on random tiny checkpoints transformers
itself wrote (logits, router logits, the load-balancing loss, greedy generation), export round trips, the
routing functions, gradients through the router, and one clear error per unsupported config or tensor."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models import axes as ax
from jaxrlhf.models import generation as gen
from jaxrlhf.models import moe
from jaxrlhf.models.config import PRESETS, LoraConfig, ModelConfig
from jaxrlhf.models.hf_families import config_from_hf, config_to_hf
from jaxrlhf.models.hf_io import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from jaxrlhf.models.sampling import GREEDY
from jaxrlhf.models.transformer import positions_from_mask
from jaxrlhf.testing.models import (
    hf_dims,
    jax_logits,
    left_padded_batch,
    load_transformers_model,
    max_relative_error,
    torch_logits,
)

TOL = 1e-4  # as tests/models/test_parity.py and test_families.py
LENGTH = 24
FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral"]
PRESET = {"qwen2_moe": "tiny-qwen2-moe", "qwen3_moe": "tiny-qwen3-moe", "mixtral": "tiny-mixtral"}
PROMPTS = [[2, 40, 41, 42, 43, 44, 45], [2, 50], [2, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]
N = 12


def hf_config(config: ModelConfig):
    """transformers' own config for one of our tiny MoE presets, built from its classes (not hf_families)."""
    import transformers

    common = dict(
        hf_dims(config), rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        num_experts_per_tok=config.num_experts_per_tok, router_aux_loss_coef=config.router_aux_loss_coef,
    )
    if config.architecture == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            architectures=["Qwen2MoeForCausalLM"], num_experts=config.num_experts,
            moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
            shared_expert_intermediate_size=config.shared_expert_intermediate_size, **common)
    if config.architecture == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"], num_experts=config.num_experts,
            moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob, **common)
    return transformers.MixtralConfig(architectures=["MixtralForCausalLM"], num_local_experts=config.num_experts,
                                      **common)


def hf_model(family: str, seed: int):
    """A random float32 transformers model of the tiny preset, norms and biases perturbed off their init and the
    router scaled up so that routing is decisive (far from ties between experts)."""
    import torch
    import transformers

    hf = hf_config(PRESETS[PRESET[family]])
    torch.manual_seed(seed)
    model = getattr(transformers, hf.architectures[0])._from_config(
        hf, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            # the router and the shared expert's gate: logits ~0.1 at init, make them ~1
            if name.endswith(".gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family in FAMILIES:
        out[family] = root / family
        hf_model(family, seed=1).save_pretrained(out[family], safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """Per family: (our model, its config, transformers' model), all from the checkpoint transformers wrote."""
    out = {}
    for family, path in checkpoints.items():
        model, config = load_hf_checkpoint(path)
        out[family] = (model, config, load_transformers_model(path))
    return out


# ---------------------------------------------------------------- config


def test_checkpoint_config_is_the_preset(loaded):
    """config.json as transformers writes it (Qwen3-MoE's `num_local_experts` alias included) gives the preset."""
    for family, (_, config, _) in loaded.items():
        assert config == PRESETS[PRESET[family]], family


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-mixtral", "qwen1.5-moe-a2.7b",
                                  "qwen3-30b-a3b", "mixtral-8x7b"])
def test_config_round_trip(name):
    assert config_from_hf(config_to_hf(PRESETS[name])) == PRESETS[name]


def test_parameter_count_matches_transformers():
    """`num_params` (what the planner's memory model reads) counts the router and every expert as transformers
    does; the published sizes have their published totals."""
    import transformers

    for family in FAMILIES:
        config = PRESETS[PRESET[family]]
        hf = getattr(transformers, hf_config(config).architectures[0])(hf_config(config))
        assert config.num_params() == sum(p.numel() for p in hf.parameters()), family
    assert round(PRESETS["qwen3-30b-a3b"].num_params() / 1e9, 1) == 30.5
    assert round(PRESETS["mixtral-8x7b"].num_params() / 1e9, 1) == 46.7
    assert round(PRESETS["qwen1.5-moe-a2.7b"].num_params() / 1e9, 1) == 14.3


@pytest.mark.parametrize("changes, message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be between 1 and num_experts=8"),
    (dict(num_experts_per_tok=0), r"num_experts_per_tok=0 must be between 1 and num_experts=8"),
    (dict(router_order="sigmoid"), r"router_order='sigmoid': choose one of"),
    (dict(router_order="topk_then_softmax", norm_topk_prob=True), r"already sums to 1"),
    (dict(num_experts=0), r"need experts: set num_experts"),
    (dict(lora=LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "up_proj"))), r"LoRA on the MLP projections"),
])
def test_invalid_moe_config_is_one_clear_error(changes, message):
    with pytest.raises(ValueError, match=message):
        PRESETS["tiny-qwen3-moe"].replace(**changes)
    PRESETS["tiny-qwen3-moe"].replace(lora=LoraConfig(rank=2, alpha=4.0))  # attention adapters are fine


# ---------------------------------------------------------------- routing and the auxiliary loss


def test_routing_orders():
    """Top-k of the softmax renormalised equals a softmax over the top-k logits; the combine weights hold
    exactly the k weights (0 elsewhere); without renormalisation the weights are the plain probabilities."""
    logits = jax.random.normal(jax.random.key(0), (50, 8)) * 3
    w1, e1 = moe.route(logits, 3, "softmax_then_topk", normalize=True)
    w2, e2 = moe.route(logits, 3, "topk_then_softmax")
    np.testing.assert_array_equal(e1, e2)
    np.testing.assert_allclose(w1, w2, rtol=1e-6)
    w3, e3 = moe.route(logits, 3, "softmax_then_topk")
    np.testing.assert_allclose(w3, jnp.take_along_axis(jax.nn.softmax(logits), e3, -1), rtol=1e-6)
    combine = np.asarray(moe.combine_weights(w1, e1, 8))
    assert ((combine > 0).sum(-1) == 3).all()
    np.testing.assert_allclose(combine.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(masked):
    """Our loss from [layers, batch, length, experts] logits equals transformers' `load_balancing_loss_func` of
    the same logits as its tuple of [batch * length, experts] per layer, with and without a padding mask."""
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = np.asarray(jax.random.normal(jax.random.key(1), (3, 2, 7, 6)) * 2, np.float32)
    mask = np.ones((2, 7), bool)
    if masked:
        mask[0, :3] = mask[1, 5:] = False
    loss = jax.jit(moe.load_balancing_loss, static_argnums=1)  # one compile each, not one per op
    ours = loss(jnp.asarray(logits), 2, jnp.asarray(mask) if masked else None)
    theirs = load_balancing_loss_func(tuple(torch.tensor(layer.reshape(14, 6)) for layer in logits), 6, 2,
                                      torch.as_tensor(mask, dtype=torch.long) if masked else None)
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)
    stats = jax.jit(moe.router_statistics, static_argnums=1)(jnp.asarray(logits), 2, jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(stats["load"]).sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["probability"]).sum(-1), 1.0, rtol=1e-6)
    # perfectly balanced routing is the minimum, top_k; the loss has a gradient for the router's logits
    assert abs(float(loss(jnp.asarray(np.eye(6, dtype=np.float32)[None, None] * 5), 1)) - 1.0) < 1e-6
    assert np.abs(np.asarray(jax.jit(jax.grad(loss), static_argnums=1)(jnp.asarray(logits), 2))).max() > 0


# ---------------------------------------------------------------- parity


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_router_logits_and_aux_loss_match_transformers(loaded, family):
    """Left-padded batch: logits within TOL of transformers', every layer's router logits likewise (what the
    forward exposes through `forward_with_router_logits`), and the model's auxiliary loss over real tokens
    equal to the one transformers' forward returns (`output_router_logits`, attention_mask)."""
    import torch

    model, config, hf = loaded[family]
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5, 11))
    ours = jax_logits(model, tokens, mask)
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = hf(input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask, dtype=torch.long),
                 position_ids=torch.as_tensor(positions), output_router_logits=True)
    ref = out.logits.numpy()
    assert max_relative_error(ours, ref, mask) <= TOL
    m = jnp.asarray(mask)
    (logits, _), router = moe.forward_with_router_logits(model, jnp.asarray(tokens), positions_from_mask(m), m)
    np.testing.assert_array_equal(np.asarray(logits), ours)  # recording changes nothing
    assert router.shape == (config.num_layers, *tokens.shape, config.num_experts)
    theirs = np.stack([r.numpy().reshape(*tokens.shape, -1) for r in out.router_logits])
    real = np.broadcast_to(mask[None, :, :, None], theirs.shape)
    assert np.abs(np.asarray(router) - theirs)[real].max() <= TOL * np.abs(theirs).max()
    aux = moe.load_balancing_loss(router, config.num_experts_per_tok, m)
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)
    # every expert is used somewhere and routing is not uniform: the test sees real routing
    load = np.asarray(moe.router_statistics(router, config.num_experts_per_tok, m)["load"])
    assert (load > 0).all() and load.max() > 1.2 / config.num_experts


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_engines_equal_transformers_generate(loaded, family):
    """Greedy decoding through both engines equals transformers' generate: the static engine row by row, and
    the continuous engine with groups of 2 rows sharing their prompt's prefill and 3 slots for 6 rows (rows
    start in freed slots mid-run), as test_families.py checks the dense families."""
    import torch

    from jaxrlhf.models.continuous import continuous_fn

    model, config, hf = loaded[family]
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected.append(hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                                        eos_token_id=config.eos_token_id, pad_token_id=0)[0, len(prompt):].tolist())
    assert len({t for row in expected for t in row}) > N  # not a model that repeats one token
    out = gen.generate(model, PROMPTS, N, GREEDY, eos_id=config.eos_token_id, pad_id=0)
    ours = [np.asarray(out.response_tokens[row, :int(out.lengths[row])]).tolist() for row in range(len(PROMPTS))]
    assert ours == expected
    graphdef, state = nnx.split(model)
    tokens, mask = gen.pad_prompts([p for p in PROMPTS for _ in range(2)], 0)
    out = continuous_fn(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(0), max_new_tokens=N,
                        sampling=GREEDY, eos_id=config.eos_token_id, pad_id=0, group_size=2, slots=3)
    rows = [np.asarray(out.response_tokens[r, :int(out.lengths[r])]).tolist() for r in range(2 * len(PROMPTS))]
    assert rows == [ref for ref in expected for _ in range(2)]


def _params(model: nnx.Module) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip(loaded, checkpoints, tmp_path, family):
    """import -> export: transformers' tensors written back bit for bit under their names, transformers loads
    it with the same logits; import again: bitwise the same parameters and config."""
    from safetensors.numpy import load_file

    model, config, hf = loaded[family]
    path = save_hf_checkpoint(model, config, tmp_path / "export")
    theirs, ours = load_file(checkpoints[family] / "model.safetensors"), load_file(path / "model.safetensors")
    assert theirs.keys() == ours.keys() and all(theirs[k].tobytes() == ours[k].tobytes() for k in theirs)
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5))
    exported = load_transformers_model(path)
    assert type(exported).__name__ == type(hf).__name__
    np.testing.assert_array_equal(torch_logits(exported, tokens, mask), torch_logits(hf, tokens, mask))
    again, config_again = load_hf_checkpoint(path)
    assert config_again == config
    a, b = _params(model), _params(again)
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.mark.slow
def test_reward_model_exports_to_transformers_sequence_classifier(tmp_path):
    """A MoE reward model (random, shared-expert family) exported: transformers' Qwen2MoeForSequenceClassification
    scores it as we do, and it loads back as a reward model of the same config."""
    import transformers

    from jaxrlhf.testing.models import random_model

    config = PRESETS["tiny-qwen2-moe"]
    model = random_model(config, head="reward", seed=2)
    path = save_hf_checkpoint(model, config, tmp_path / "rm")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen2MoeForSequenceClassification"
    tokens, mask = left_padded_batch(config.vocab_size, LENGTH, pads=(0, 5))
    m = jnp.asarray(mask)
    ours = np.asarray(model(jnp.asarray(tokens), positions_from_mask(m), m))
    ref = torch_logits(hf, tokens, mask)[:, 0]
    np.testing.assert_allclose(ours, ref, rtol=TOL, atol=TOL * np.abs(ref).max())
    again, loaded = load_hf_checkpoint(path)
    assert type(again).__name__ == "RewardModel" and loaded == config


@pytest.mark.slow
def test_sharded_forward_equals_unsharded(devices):
    """Data x FSDP x tensor parallel (2 x 2 x 2): the experts' weights sharded by their embed / mlp axes (the
    expert axis has no rule: replicated), logits and router logits equal to one device's."""
    from jaxrlhf.placement.layout import activation_resolver, make_mesh, param_shardings
    from jaxrlhf.planner.plan import DeviceGroup, Layout
    from jaxrlhf.testing.models import random_model

    config = PRESETS["tiny-qwen2-moe"]
    graphdef, state = nnx.split(random_model(config, seed=1))
    tokens, mask = (jnp.asarray(a) for a in left_padded_batch(config.vocab_size, 16, pads=(0, 5, 3, 1)))
    mesh = make_mesh(DeviceGroup("g", 0, 8), Layout(data=2, fsdp=2, tensor=2))

    def forward(state, resolver=None):
        with ax.activation_sharding(resolver):
            (logits, _), router = moe.forward_with_router_logits(nnx.merge(graphdef, state), tokens,
                                                                  positions_from_mask(mask), mask)
        return logits, router

    want = jax.jit(forward)(state)
    placed = jax.device_put(state, param_shardings(state, mesh))
    assert tuple(placed["model"]["layers"]["mlp"]["gate"].get_value().sharding.spec) == (None, None, "fsdp", "tensor")
    got = jax.jit(lambda s: forward(s, activation_resolver(mesh)))(placed)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-5 * np.abs(np.asarray(w)).max())


# ---------------------------------------------------------------- training


def test_gradients_reach_router_and_experts():
    """A sparse MLP's output loss plus the weighted auxiliary loss: finite gradients for the router and every
    expert's weights, under jit; the auxiliary loss alone reaches the router."""
    config = PRESETS["tiny-mixtral"]
    graphdef, state = nnx.split(moe.SparseMLP(config, rngs=nnx.Rngs(params=3)))
    x = jax.random.normal(jax.random.key(0), (2, 16, config.hidden_size))
    target = jax.random.normal(jax.random.key(1), x.shape)

    def losses(state):
        y, logits = nnx.merge(graphdef, state)(x)
        aux = moe.load_balancing_loss(logits[None], config.num_experts_per_tok)
        return jnp.mean((y - target) ** 2) + config.router_aux_loss_coef * aux, aux

    grads, aux_grads = jax.jit(lambda s: (jax.grad(lambda s: losses(s)[0])(s), jax.grad(lambda s: losses(s)[1])(s)))(
        state)
    for name in ("router", "gate", "up", "down"):
        g = np.asarray(grads[name].get_value())
        assert np.isfinite(g).all(), name
        per_expert = np.moveaxis(g, -1, 0) if name == "router" else g  # every expert is some token's pick
        assert (np.abs(per_expert).reshape(per_expert.shape[0], -1).max(-1) > 0).all(), name
    assert np.abs(np.asarray(aux_grads["router"].get_value())).max() > 0
    assert not np.asarray(aux_grads["gate"].get_value()).any()  # the aux loss sees the router only


# ---------------------------------------------------------------- errors


def _hf(name: str, **changes) -> dict:
    hf = config_to_hf(PRESETS[name])
    hf.update(changes)
    return hf


@pytest.mark.parametrize("name, changes, message", [
    ("tiny-qwen3-moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
    ("tiny-qwen3-moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported"),
    ("tiny-qwen3-moe", {"shared_expert_intermediate_size": 64}, r"shared_expert_intermediate_size=64 is not supported"),
    ("tiny-qwen3-moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be at most num_experts=8"),
    ("tiny-qwen3-moe", {"num_experts": 0}, r"num_experts=0 must be a positive integer"),
    ("tiny-mixtral", {"router_jitter_noise": 0.01}, r"router_jitter_noise=0\.01 is not supported"),
    ("tiny-qwen2-moe", {"qkv_bias": False}, r"qkv_bias=false is not supported for qwen2_moe"),
    ("tiny-qwen2-moe", {"shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size=0 must be a"),
    ("tiny-mixtral", {"architectures": ["DeepseekV3ForCausalLM"]}, r"architectures=\['DeepseekV3ForCausalLM'\] is"),
])
def test_unsupported_config_is_one_clear_error(name, changes, message):
    with pytest.raises(CheckpointError, match=message) as err:
        config_from_hf(_hf(name, **changes))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, changes, message", [
    ("tiny-qwen3", {"num_experts": 4, "num_experts_per_tok": 2}, r"qwen3 checkpoints have no experts"),
    ("tiny-mixtral", {"router_order": "softmax_then_topk"}, r"mixtral checkpoints route with router_order"),
    ("tiny-mixtral", {"moe_intermediate_size": 32}, r"mixtral checkpoints have one MLP width"),
    ("tiny-qwen3-moe", {"qk_norm": False}, r"qwen3_moe checkpoints have qk_norm=True"),
    ("tiny-qwen3-moe", {"shared_expert_intermediate_size": 16}, r"qwen3_moe checkpoints have no shared expert"),
    ("tiny-qwen2-moe", {"shared_expert_intermediate_size": None}, r"qwen2_moe checkpoints have a shared expert"),
])
def test_export_of_a_config_no_hf_class_holds_is_refused(name, changes, message):
    with pytest.raises(ValueError, match=message):
        config_to_hf(PRESETS[name].replace(**changes))


def test_missing_expert_tensor_is_one_clear_error(checkpoints, tmp_path):
    """A checkpoint without one expert's tensor is one error naming that tensor and its shape; one of fused
    expert tensors is one error naming the fused tensor."""
    from safetensors.numpy import load_file, save_file

    src = checkpoints["mixtral"]
    tensors = load_file(src / "model.safetensors")
    key = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    del tensors[key]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' is missing \(expected shape \[64, 64\]\)") as err:
        load_hf_checkpoint(tmp_path)
    assert "\n" not in str(err.value)
    assert json.loads((src / "config.json").read_text())["architectures"] == ["MixtralForCausalLM"]
    # transformers' in-memory layout, every expert in one tensor: one error naming it
    fused = "model.layers.0.block_sparse_moe.experts.gate_up_proj"
    tensors = {k: v for k, v in tensors.items() if ".experts." not in k or not k.startswith("model.layers.0.")}
    save_file(tensors | {fused: np.zeros((4, 128, 64), np.float32)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"tensor '{fused}' holds every expert fused") as err:
        load_hf_checkpoint(tmp_path)
    assert "\n" not in str(err.value)


def test_dense_models_record_no_router_logits():
    from jaxrlhf.testing.models import random_model

    model = random_model(PRESETS["tiny"])
    mask = jnp.ones((1, 4), bool)
    with pytest.raises(ValueError, match="recorded no router logits: the model has no experts"):  # traced only
        jax.eval_shape(lambda t: moe.forward_with_router_logits(model, t, positions_from_mask(mask), mask),
                       jnp.ones((1, 4), jnp.int32))
