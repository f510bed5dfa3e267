"""Context parallelism: ring attention (`models/context.py`) against the model's dense attention, the
whole model's logits and gradients through a placed jit with a context degree, and the `context` axis of
layouts, plan files and plan validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.models import axes as ax
from jaxrlhf.models import context, pipeline
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.transformer import build_model, positions_from_mask
from jaxrlhf.placement.calls import CallCache
from jaxrlhf.placement.layout import activation_resolver, make_mesh
from jaxrlhf.planner.plan import (
    DeviceGroup,
    ExecutionPlan,
    Layout,
    Placement,
    PlanError,
    layout_misfit,
    validate,
)
from jaxrlhf.testing.graphs import ppo_graph

# GQA (4 query heads over 2 kv heads), local (sliding window 5) and global layers alternating in one
# scanned body (the layer's kind a traced flag), Gemma's score scale and attention soft-cap, q/k norms
CFG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    sliding_window=5, sliding_window_pattern=2, attn_logit_softcap=20.0, query_pre_attn_scalar=16.0,
    qk_norm=True, max_position_embeddings=64,
)
B, T = 4, 24  # 2 x 2 and 2 x 4 divide T: zig-zag order as it is; 2 x 8 does not: the model pads to 32 first


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 64, size=(B, T), dtype=np.int32)
    mask = np.ones((B, T), bool)
    mask[1, :3] = False  # left padding
    mask[2, -6:] = False  # right padding
    # packed rows: two sequences in row 0 (the boundary inside a device's block for every degree), three in
    # row 3 (one boundary on a block edge)
    segments = np.zeros((B, T), np.int32)
    segments[0, 7:] = 1
    segments[3, 4:] = 1
    segments[3, 12:] = 2
    positions = np.array(positions_from_mask(jnp.asarray(mask)))
    for r in (0, 3):  # positions restart in every packed sequence
        for s in np.unique(segments[r]):
            cols = segments[r] == s
            positions[r, cols] = np.arange(cols.sum())
    return tokens, positions, mask, segments


def _loss_and_grad(graphdef):
    def run(params, tokens, positions, mask, segments):
        def loss(p):
            logits, _ = nnx.merge(graphdef, p)(tokens, positions, mask, segment_ids=segments)
            return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2) / 1000.0, logits

        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, grads

    return run


@pytest.fixture(scope="module")
def model():
    graphdef, params = nnx.split(build_model(CFG, seed=0))
    batch = _batch()
    logits, grads = jax.jit(_loss_and_grad(graphdef))(params, *batch)  # dense attention, one device
    return graphdef, params, batch, np.asarray(logits), [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]


# 2, 4 and 8 devices in the ring: beside data and tensor parallelism (heads split too), beside FSDP, alone
LAYOUTS = [Layout(data=2, tensor=2, context=2), Layout(fsdp=2, context=4), Layout(context=8)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_model_logits_and_gradients_match_dense_attention(model, layout):
    graphdef, params, batch, want_logits, want_grads = model
    plan = ExecutionPlan("test", 8, {"g": DeviceGroup("g", 0, layout.num_devices)},
                         {"actor.train": Placement("g", layout)})
    cache = CallCache(plan)
    placed = cache.placed("actor.train")
    assert placed.mesh.shape["context"] == layout.context
    ps, bs = placed.param_shardings(params), placed.batch_sharding(2)
    fn = cache.function("actor.train", _loss_and_grad(graphdef), in_shardings=(ps, bs, bs, bs, bs),
                                  out_shardings=None)
    logits, grads = fn(jax.device_put(params, ps), *(jax.device_put(x, bs) for x in batch))
    # activations are split along the sequence: the logits come back in blocks of T / context tokens
    assert len(logits.sharding.device_set) == layout.num_devices
    assert logits.sharding.shard_shape(logits.shape)[1] == T // layout.context
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=2e-6, rtol=0)
    got = [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]
    assert len(got) == len(want_grads)
    scale = max(np.abs(g).max() for g in want_grads)
    for g, w in zip(got, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-6 * scale, rtol=0)


def _dense(q, k, v, valid, window, cap, scale):
    """Reference attention written out: every query over every key of its row, [B, T, heads, D]."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    k, v = jnp.repeat(k, h // kvh, axis=2), jnp.repeat(v, h // kvh, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    s = cap * jnp.tanh(s / cap)
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    allowed = (j <= i) & (i - j < window) & valid[:, None, None, :]
    allowed |= i == j
    p = jax.nn.softmax(jnp.where(allowed, s, -1e30), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v)


@pytest.mark.parametrize("zigzag", [True, False], ids=["zigzag", "contiguous"])
def test_ring_attention_and_its_backward_against_written_out_attention(zigzag):
    """Every layer local (the window a Python constant), no segments, 1 kv head for 4 query heads: the
    ring's forward and its custom backward (a second ring) against autodiff of plain attention, in
    zig-zag and in contiguous order."""
    cfg = CFG.replace(sliding_window_pattern=None, num_kv_heads=1, query_pre_attn_scalar=None)
    rng = np.random.default_rng(1)
    t = 24
    q = jnp.asarray(rng.normal(size=(2, t, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, t, 1, 8)), jnp.float32) for _ in range(2))
    valid = jnp.ones((2, t), bool).at[0, :5].set(False)
    cot = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    mesh = make_mesh(DeviceGroup("g", 0, 4), Layout(context=4))

    def ring(q, k, v):
        with ax.activation_sharding(activation_resolver(mesh)):
            assert ax.length_ways() == 4
            return context.ring_attention(q, k, v, valid, None, cfg, True, zigzag=zigzag)

    def dense(q, k, v):
        return _dense(q, k, v, valid, cfg.sliding_window, cfg.attn_logit_softcap, cfg.dim_per_head ** -0.5)

    def out_and_grads(f):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(cot))

    got = jax.jit(lambda: out_and_grads(ring))()
    want = jax.jit(lambda: out_and_grads(dense))()
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-6, rtol=0, err_msg=name)
    assert got[0].sharding.spec[1] == "context"


def test_no_resolver_or_context_one_keeps_dense_attention():
    assert ax.length_ways() == 1
    mesh = make_mesh(DeviceGroup("g", 0, 4), Layout(data=4))
    assert "context" not in mesh.shape  # a layout without context parallelism builds the mesh it always did
    with ax.activation_sharding(activation_resolver(mesh)):
        assert ax.length_ways() == 1 and ax.batch_ways() == 4
    mesh = make_mesh(DeviceGroup("g", 0, 8), Layout(data=2, context=4))
    assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 1, "context": 4, "tensor": 1}
    assert [d.id for d in mesh.devices[0, 1, 0, :, 0]] == [4, 5, 6, 7]  # a ring's devices are neighbours
    with ax.activation_sharding(activation_resolver(mesh)):
        assert ax.length_ways() == 4 and ax.batch_ways() == 2


def test_layout_string_parse_and_plan_file_round_trip():
    lay = Layout(data=2, tensor=2, context=2)
    assert lay.num_devices == 8
    assert str(lay) == "d2f1t2c2" and Layout.parse("d2f1t2c2") == lay
    assert str(Layout(data=2)) == "d2f1t1" and Layout.parse("d2f1t1") == Layout(data=2)  # c1 never written
    assert Layout.parse(str(Layout(fsdp=2, stage=2, context=2))) == Layout(fsdp=2, stage=2, context=2)
    with pytest.raises(ValueError, match="c<context>"):
        Layout.parse("d2f1t1x2")
    assert lay.serialised == {"data": 2, "fsdp": 1, "context": 2, "tensor": 2}
    assert "context" not in Layout(data=8).serialised  # plan files without context parallelism unchanged
    plan = ExecutionPlan("custom", 8, {"g": DeviceGroup("g", 0, 8)},
                         {"actor.train": Placement("g", lay), "actor.inference": Placement("g", Layout(data=8))})
    text = plan.to_yaml()
    assert "context: 2" in text and text.count("context") == 1
    back = ExecutionPlan.from_yaml(text)
    assert back.calls == plan.calls
    assert "x context 2" in back.table()


@pytest.mark.slow
def test_ring_attention_inside_pipeline_stages_matches_one_device(model, monkeypatch):
    """Context 2 x pipeline 2 (x data 2): each stage's layers run the ring over the context axis inside
    the GPipe schedule (`models.pipeline.gpipe`: the stages a vmap over the stage mesh axis, the ring a
    shard_map under it), over 2 micro-batches: the logits and gradients of one device."""
    graphdef, params, batch, want_logits, want_grads = model
    layout = Layout(data=2, stage=2, context=2)
    assert layout_misfit(layout, seq_len=T) is None
    plan = ExecutionPlan("test", 8, {"g": DeviceGroup("g", 0, 8)}, {"actor.train": Placement("g", layout)})
    cache = CallCache(plan)
    placed = cache.placed("actor.train")
    rings = []
    ring = context.ring_attention
    monkeypatch.setattr(context, "ring_attention", lambda *a, **k: rings.append(1) or ring(*a, **k))
    run = _loss_and_grad(graphdef)

    def pipelined(*args):
        with pipeline.microbatches(2):
            return run(*args)

    ps, bs = placed.param_shardings(params), placed.batch_sharding(2)
    fn = cache.function("actor.train", pipelined, in_shardings=(ps, bs, bs, bs, bs), out_shardings=None)
    logits, grads = fn(jax.device_put(params, ps), *(jax.device_put(x, bs) for x in batch))
    assert rings, "the stages' attention did not run the ring"
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=2e-6, rtol=0)
    got = [np.asarray(g) for g in jax.tree_util.tree_leaves(grads)]
    scale = max(np.abs(g).max() for g in want_grads)
    for g, w in zip(got, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-6 * scale, rtol=0)


def test_context_degree_that_does_not_divide_the_sequence_is_a_clear_error():
    lay = Layout(data=2, context=4)
    reason = layout_misfit(lay, seq_len=30)
    assert "d2f1t1c4" in reason and "context=4 does not divide the sequence length 30" in reason
    assert "use context=3" in reason and "32 tokens" in reason
    assert layout_misfit(lay, seq_len=32) is None
    # generation (a KV cache) is never context-parallel
    assert "generation" in layout_misfit(lay, kind="generate") and "data=8" in layout_misfit(lay, kind="generate")
    graph = ppo_graph()
    home = {c.name: Placement("g", Layout(data=8)) for c in graph.calls}
    plan = ExecutionPlan("custom", 8, {"g": DeviceGroup("g", 0, 8)}, {**home, "actor.train": Placement("g", lay)})
    with pytest.raises(PlanError, match=r"actor.train.*d2f1t1c4.*does not divide the sequence length 30"):
        validate(plan, graph, batch_size=8, seq_len=30)
    validate(plan, graph, batch_size=8, seq_len=32)
    bad = dict(home, **{"actor.generate": Placement("g", lay)})
    with pytest.raises(PlanError, match="never context-parallel"):
        validate(ExecutionPlan("custom", 8, {"g": DeviceGroup("g", 0, 8)}, bad), graph, batch_size=8)
    # at run time (a padded length the plan did not know): the ring names the degree and lengths that fit
    mesh = make_mesh(DeviceGroup("g", 0, 4), Layout(context=4))
    q = jax.ShapeDtypeStruct((2, 30, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 30, 2, 8), jnp.float32)
    with ax.activation_sharding(activation_resolver(mesh)):
        with pytest.raises(ValueError, match=r"over 4 devices .* sequence length 30: pad .* \(e.g. 32\)"):
            jax.eval_shape(lambda q, k, v: context.ring_attention(q, k, v, jnp.ones((2, 30), bool), None, CFG,
                                                                  False), q, kv, kv)


def test_cost_and_memory_models_price_the_context_axis():
    from jaxrlhf.graph import CallSpec
    from jaxrlhf.models.config import preset
    from jaxrlhf.planner.cost import call_cost
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.memory import working_set
    from jaxrlhf.planner.sizes import attention_flops, kv_bytes_per_token
    from jaxrlhf.planner.workload import Workload

    # dense attention on one device (8192-token rows would otherwise attend blockwise, priced apart)
    cfg, hw = preset("llama2-7b").replace(blockwise_attention_from=None), get_profile("h100")
    wl = Workload(batch_size=8, prompt_len=4096, gen_len=4096, minibatches=1)
    inf, train = CallSpec("ref.inference", "ref", "inference"), CallSpec("actor.train", "actor", "train")

    def cost(call, layout, hw=hw):
        return call_cost(call, cfg, DeviceGroup("g", 0, layout.num_devices), layout, wl, hw)

    attend = attention_flops(cfg, wl.batch_size * wl.seq_len, wl.seq_len)  # one forward's scores, one device
    for call, forwards, recomputed in ((inf, 1, 0.0), (train, 4, 0.5)):  # train: full remat, 2 + 1 + 1
        one, ring = cost(call, Layout()), cost(call, Layout(context=4))
        # per-device tokens divided by the degree: a quarter of the matmul FLOPs; in zig-zag order a device
        # scores 9/16 of its queries' [T / 4, T] scores, and the backward recomputes them (half a forward's)
        steps = wl.minibatches * wl.ppo_epochs if call is train else 1
        share = (2 * 4 + 1) / (4 * 4)
        assert ring.flops == pytest.approx((one.flops - steps * forwards * attend) / 4
                                           + steps * (forwards + recomputed) * attend / 4 * share, rel=1e-9)
        assert "context_comm" in ring.parts and "context_comm" not in one.parts
        act = working_set(call, cfg, Layout(context=4), wl)["activations"]
        assert act < working_set(call, cfg, Layout(), wl)["activations"] / 3.5
    # per layer and forward: 3 passes of the device's K/V block (2048 tokens' keys and values), and the
    # zig-zag trades (8 | 8192): half of q, k, v and the output, for Llama-2 (kv_heads = heads) one block
    block = wl.batch_size * wl.seq_len / 4 * kv_bytes_per_token(cfg) / cfg.num_layers
    assert cost(inf, Layout(context=4)).collective_bytes == pytest.approx((3 + 1) * cfg.num_layers * block)
    # train (full remat, the default): forward, recomputed forward and backward (the ring twice the bytes)
    assert wl.remat_for("actor") == "full"
    steps = wl.minibatches * wl.ppo_epochs
    assert cost(train, Layout(context=4)).collective_bytes == pytest.approx(
        steps * (4 * 3 + 3 * 1) * cfg.num_layers * block)
    # contiguous order where 2c does not divide the sequence: the ring alone
    odd = dataclasses.replace(wl, gen_len=4092)
    assert call_cost(inf, cfg, DeviceGroup("g", 0, 4), Layout(context=4), odd, hw).collective_bytes == \
        pytest.approx(3 * cfg.num_layers * block * odd.seq_len / wl.seq_len)
    # a pass overlaps the attention over the block before it: on H100 links (180 GB/s as priced) a Llama-2
    # block (32 kv heads) hides its pass from ~3300 tokens on (593 TFLOP/s / 180 GB/s), so 2048-token blocks
    # expose part of it, 8192-token blocks none, unless the link is slow
    # (a length 2c does not divide: contiguous order, no zig-zag trades)
    wl = Workload(batch_size=8, prompt_len=4096, gen_len=4092, minibatches=1)
    assert cost(inf, Layout(context=4)).parts["context_comm"] > 0.0
    wl = Workload(batch_size=2, prompt_len=16384, gen_len=16380, minibatches=1)
    assert cost(inf, Layout(context=4)).parts["context_comm"] == 0.0
    slow = dataclasses.replace(hw, name="slow", intra_host_bandwidth=hw.intra_host_bandwidth / 10)
    assert cost(inf, Layout(context=4), slow).parts["context_comm"] > 0.0
    # in zig-zag order the trades are exposed: all that is left of the ring's time once it is hidden
    wl = Workload(batch_size=2, prompt_len=16384, gen_len=16384, minibatches=1)
    trade = wl.batch_size * wl.seq_len / 4 * 2 * cfg.num_heads * cfg.dim_per_head * 2  # q/k/v + out halves, bf16
    bw = hw.link_bandwidth(False, 4, 4)
    assert cost(inf, Layout(context=4)).parts["context_comm"] == pytest.approx(
        cfg.num_layers * (trade / bw + 8 * hw.collective_latency))


@pytest.mark.slow
def test_a_run_with_context_parallel_calls_trains_like_colocated(tmp_path):
    """PPO (actor, critic, reference) for two steps: unpacked on the colocated plan against a plan that
    runs the train and inference calls with a context axis (context 2 x data 2 x tensor 2; generation
    data 8), so every call's parameters are reallocated between layouts with and without it, and packed
    there in micro-batches of a token budget: the same metrics (plan equivalence extended to the context
    axis and to packed calls)."""
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement

    base = ["model.actor.preset=tiny", "run.steps=2", "run.checkpoint_every=0", "run.save_checkpoints=false",
            "run.tensorboard=false", "run.export_hf=false", "data.batch_size=8", "data.max_prompt_len=16",
            "generation.max_new_tokens=16", "generation.trim_responses=false", "sft.steps=0",
            "optimizer.actor.lr=1e-3", "optimizer.critic.lr=1e-3", "rewards.eos_only=false",
            'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]', "algorithm.name=ppo",
            "algorithm.minibatches=2", "algorithm.kl_coef=0.05"]
    split = Layout(data=2, tensor=2, context=2)
    calls = {"actor.generate": Layout(data=8), "ref.inference": split, "critic.inference": split,
             "actor.train": split, "critic.train": split}
    plan = ExecutionPlan("context", 8, {"all": DeviceGroup("all", 0, 8)},
                         {c: Placement("all", lay) for c, lay in calls.items()})
    plan.save(str(tmp_path / "plan.yaml"))
    runs = {}
    for name, extra in (("colocated", ["plan.strategy=colocated"]),
                        ("context", [f"plan.file={tmp_path / 'plan.yaml'}", "algorithm.pack_sequences=true",
                                     "algorithm.max_tokens_per_micro_batch=48"])):
        train.run(cfglib.load_config(None, [*base, *extra, f"run.output_dir={tmp_path / name}"]))
        runs[name] = read_metrics(str(tmp_path / name / "metrics.jsonl"))
    for ref, got in zip(runs["colocated"], runs["context"]):
        assert got["packing/actor/micro_batches"] > 1 and got["packing/critic/micro_batches"] > 1  # the budget
        for key in ("reward/mean", "kl/mean", "loss/policy", "entropy", "advantages/mean", "loss/value",
                    "returns/mean", "grad_norm"):
            assert got[key] == pytest.approx(ref[key], rel=1e-3, abs=2e-5), (ref["step"], key)
