"""LoRA adapters: the zero-initialised adapter is the base model, merging and PEFT's layout reproduce the
adapted model's logits (PEFT and transformers as the independent reference), and only adapters train."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.algorithms.optim import build_optimizer
from jaxrlhf.algorithms.update import minibatch_updates
from jaxrlhf.models import lora
from jaxrlhf.models.config import LoraConfig
from jaxrlhf.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from jaxrlhf.models.transformer import build_model
from jaxrlhf.testing.models import (
    jax_logits,
    left_padded_batch,
    load_transformers_model,
    max_relative_error,
    random_model,
    tiny_config,
    torch_logits,
)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def with_random_adapters(model: nnx.Module, seed: int = 1, std: float = 0.1) -> nnx.Module:
    """`model` with every adapter (B included) set to random values, so the update is far from zero."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)
    leaves = [(p, v.replace(value=jnp.asarray(std * rng.standard_normal(v.get_value().shape), v.get_value().dtype)))
              if lora.is_adapter(p) else (p, v) for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def base_and_adapted(arch: str = "llama", targets=ALL, rank: int = 4):
    """A random base model and the same weights with random (non-zero) adapters on `targets`."""
    cfg = tiny_config(arch)
    base = random_model(cfg)
    lcfg = cfg.replace(lora=LoraConfig(rank=rank, alpha=2.0 * rank, targets=targets))
    graphdef, fresh = nnx.split(build_model(lcfg))
    base_flat = dict((tuple(p), v) for p, v in nnx.to_flat_state(nnx.state(base)))
    leaves = [(p, v if lora.is_adapter(p) else base_flat[tuple(p)]) for p, v in nnx.to_flat_state(fresh)]
    zero_init = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    return cfg, lcfg, base, zero_init


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_zero_initialised_adapter_gives_the_base_logits(arch):
    cfg, _, base, adapted = base_and_adapted(arch)
    tokens, mask = left_padded_batch(cfg.vocab_size, 12, pads=(0, 3))
    # B starts at zero: exactly the base model (the adapters add an exact 0)
    np.testing.assert_array_equal(jax_logits(adapted, tokens, mask), jax_logits(base, tokens, mask))
    moved = jax_logits(with_random_adapters(adapted), tokens, mask)
    assert np.abs(moved - jax_logits(base, tokens, mask))[mask].max() > 1e-2  # the adapters do act


def test_same_seed_keeps_the_base_weights_and_adapters_carry_logical_axes():
    cfg = tiny_config()
    lcfg = cfg.replace(lora=LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "o_proj", "down_proj")))
    base = dict(nnx.to_flat_state(nnx.state(build_model(cfg, seed=3))))
    adapted = nnx.state(build_model(lcfg, seed=3))
    for p, v in nnx.to_flat_state(adapted):
        if lora.is_adapter(p):
            continue
        np.testing.assert_array_equal(v.get_value(), base[p].get_value())  # adapters draw from their own stream
    axes = {tuple(p): v.get_metadata()["logical_axes"] for p, v in nnx.to_flat_state(lora.adapter_state(adapted))}
    assert axes[("model", "layers", "attn", "q_lora", "a")] == ("layers", "embed", None)
    assert axes[("model", "layers", "attn", "q_lora", "b")] == ("layers", None, "heads", "head_dim")
    assert axes[("model", "layers", "attn", "o_lora", "a")] == ("layers", "heads", "head_dim", None)
    assert axes[("model", "layers", "mlp", "down_lora", "a")] == ("layers", "mlp", None)
    # the reference model is the stripped state: the base model's structure exactly
    assert jax.tree.structure(lora.strip_adapters(adapted)) == jax.tree.structure(nnx.state(build_model(cfg)))


def test_merged_adapters_give_the_adapted_logits():
    cfg, lcfg, _, adapted = base_and_adapted()
    adapted = with_random_adapters(adapted)
    merged = nnx.merge(nnx.graphdef(build_model(cfg)), lora.merge_adapters(nnx.state(adapted), lcfg.lora))
    tokens, mask = left_padded_batch(cfg.vocab_size, 12, pads=(0, 3))
    ours, ref = jax_logits(merged, tokens, mask), jax_logits(adapted, tokens, mask)
    assert max_relative_error(ours, ref, mask) < 1e-5


@pytest.mark.slow
def test_only_adapters_train_and_only_they_have_optimizer_state():
    _, lcfg, _, model = base_and_adapted(targets=("q_proj", "v_proj"))
    graphdef, params = nnx.split(with_random_adapters(model))  # B != 0, so A has a gradient too
    opt = build_optimizer(lr=1e-2, total_updates=4, trainable=lora.trainable)
    opt_state = opt.init(params)
    adapter_count = sum(x.size for x in jax.tree.leaves(lora.adapter_state(params)))
    # AdamW's two moments over the adapters, nothing for the frozen base
    assert sum(x.size for x in jax.tree.leaves(opt_state) if x.ndim) == 2 * adapter_count
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, lcfg.vocab_size, (4, 8)))

    def loss_fn(p, rows):
        m = nnx.merge(graphdef, p)
        logits, _ = m(rows, jnp.broadcast_to(jnp.arange(8), rows.shape), jnp.ones(rows.shape, bool))
        lp = jax.nn.log_softmax(logits[:, :-1])
        loss = -jnp.mean(jnp.take_along_axis(lp, rows[:, 1:, None], -1))
        return loss, {"stats": {"loss/nll": loss}, "stop": jnp.asarray(False), "weight": jnp.asarray(1.0),
                      "stats_weight": jnp.asarray(1.0)}

    new, _, stats = jax.jit(lambda p, s: minibatch_updates(loss_fn, opt, p, s, tokens, jax.random.key(0)))(
        params, opt_state)
    before, after = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(new))
    assert set(before) == set(after)
    for p in before:
        changed = not np.array_equal(before[p].get_value(), after[p].get_value())
        assert changed == lora.is_adapter(p), p
    assert float(stats["grad_norm"]) > 0


@pytest.mark.slow
def test_hf_load_with_lora_starts_at_the_base_model(tmp_path):
    cfg, _, base, _ = base_and_adapted()
    save_hf_checkpoint(base, cfg, tmp_path / "base")
    lcfg = LoraConfig(rank=4, alpha=8.0, targets=ALL)
    model, config = load_hf_checkpoint(tmp_path / "base", config_overrides={"lora": lcfg})
    assert config.lora == lcfg
    adapters = dict(nnx.to_flat_state(lora.adapter_state(nnx.state(model))))
    assert adapters and all(np.any(v.get_value() != 0) == (p[-1] == "a") for p, v in adapters.items())
    tokens, mask = left_padded_batch(cfg.vocab_size, 10, pads=(0, 2))
    np.testing.assert_array_equal(jax_logits(model, tokens, mask), jax_logits(base, tokens, mask))


@pytest.mark.slow
def test_exports_load_in_transformers_and_peft_with_the_same_logits(tmp_path):
    """The merged checkpoint (transformers) and the adapter alone on the base (PEFT) both reproduce our
    adapted model's logits."""
    peft = pytest.importorskip("peft")
    cfg, lcfg, base, adapted = base_and_adapted(targets=ALL)
    adapted = with_random_adapters(adapted, std=0.05)
    tokens, mask = left_padded_batch(cfg.vocab_size, 12, pads=(0, 3))
    ours = jax_logits(adapted, tokens, mask)

    save_hf_checkpoint(base, cfg, tmp_path / "base")
    lora.save_peft_adapter(nnx.state(adapted), lcfg.lora, str(tmp_path / "adapter"), base_model=str(tmp_path / "base"))
    save_hf_checkpoint(adapted, lcfg, tmp_path / "merged")

    merged = load_transformers_model(tmp_path / "merged")
    assert max_relative_error(torch_logits(merged, tokens, mask), ours, mask) < 1e-4
    with_adapter = peft.PeftModel.from_pretrained(load_transformers_model(tmp_path / "base"), tmp_path / "adapter")
    assert max_relative_error(torch_logits(with_adapter, tokens, mask), ours, mask) < 1e-4
    without = jax_logits(base, tokens, mask)
    assert max_relative_error(without, ours, mask) > 1e-2  # the adapter matters: the match is not trivial
