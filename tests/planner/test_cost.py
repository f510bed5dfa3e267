import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.models.transformer import build_model
from jaxrlhf.planner.cost import TP_ALLREDUCES_PER_LAYER, call_cost, realloc_cost
from jaxrlhf.planner.hardware import get_profile
from jaxrlhf.planner.plan import DeviceGroup, Layout
from jaxrlhf.planner.sizes import DTYPE_BYTES, attention_flops, matmul_params
from jaxrlhf.planner.workload import Workload

H100 = get_profile("h100")
CFG = preset("llama2-7b")
WL = Workload(batch_size=64, prompt_len=128, gen_len=128, minibatches=4)
GEN = CallSpec("actor.generate", "actor", "generate")
INF = CallSpec("ref.inference", "ref", "inference")
TRAIN = CallSpec("actor.train", "actor", "train")


def cost(call, n, layout, wl=WL, start=0, cfg=CFG, hw=H100):
    return call_cost(call, cfg, DeviceGroup("g", start, n), layout, wl, hw)


@pytest.mark.parametrize("call", [INF, TRAIN, GEN])
def test_doubling_tensor_halves_flops_and_adds_allreduce_bytes(call):
    t2, t4 = cost(call, 2, Layout(tensor=2)), cost(call, 4, Layout(tensor=4))
    assert t4.flops == pytest.approx(t2.flops / 2, rel=1e-9)
    if call.kind == "inference":
        # Two activation all-reduces per layer over every token: ring bytes 2 (t-1)/t each.
        act = TP_ALLREDUCES_PER_LAYER * CFG.num_layers * WL.batch_size * WL.seq_len * CFG.hidden_size * DTYPE_BYTES[CFG.dtype]
        assert t2.collective_bytes == pytest.approx(2 * (1 / 2) * act)
        assert t4.collective_bytes == pytest.approx(2 * (3 / 4) * act)
    assert t4.collective_bytes > t2.collective_bytes > 0
    assert cost(call, 1, Layout()).collective_bytes == 0


def test_data_parallel_train_pays_a_gradient_allreduce_fsdp_pays_gathers():
    dp = cost(TRAIN, 4, Layout(data=4))
    fsdp = cost(TRAIN, 4, Layout(fsdp=4))
    assert dp.parts["grad_allreduce"] > 0 and dp.parts["fsdp_comm"] == 0
    assert fsdp.parts["fsdp_comm"] > 0 and fsdp.parts["grad_allreduce"] == 0
    assert dp.flops == pytest.approx(fsdp.flops)


def test_decode_time_grows_with_kv_length():
    short = cost(GEN, 8, Layout(data=2, tensor=4), Workload(batch_size=64, prompt_len=128, gen_len=128))
    long = cost(GEN, 8, Layout(data=2, tensor=4), Workload(batch_size=64, prompt_len=2048, gen_len=128))
    assert long.parts["decode"] > short.parts["decode"]
    # Per decode step: 128 more tokens cost more than the first 128 (the cache is longer).
    g128 = cost(GEN, 8, Layout(data=2, tensor=4), Workload(batch_size=64, prompt_len=128, gen_len=128))
    g256 = cost(GEN, 8, Layout(data=2, tensor=4), Workload(batch_size=64, prompt_len=128, gen_len=256))
    assert g256.parts["decode"] - g128.parts["decode"] > g128.parts["decode"]


def test_generation_is_memory_bound_and_fsdp_generation_is_slow():
    g = cost(GEN, 8, Layout(data=8), Workload(batch_size=8, prompt_len=16, gen_len=256))
    weights_read = 256 * CFG.num_params() * 2 / H100.memory_bandwidth()
    assert g.parts["decode"] == pytest.approx(weights_read, rel=0.05)
    assert cost(GEN, 8, Layout(fsdp=8)).seconds > 5 * cost(GEN, 8, Layout(data=2, tensor=4)).seconds


def test_tensor_across_hosts_is_slower_than_inside_a_host():
    hw4 = H100.__class__(**{**H100.to_dict(), "devices_per_host": 4})
    inside = cost(INF, 8, Layout(data=2, tensor=4), hw=hw4)
    across = cost(INF, 8, Layout(data=1, tensor=8), hw=hw4)
    assert across.parts["tensor_comm"] > 2 * inside.parts["tensor_comm"]


def test_reallocation_costs():
    g8, lo, hi = DeviceGroup("a", 0, 8), DeviceGroup("lo", 0, 4), DeviceGroup("hi", 4, 4)
    same = realloc_cost(CFG, "lm", g8, Layout(fsdp=8), g8, Layout(fsdp=8), H100)
    assert same == 0.0
    relayout = realloc_cost(CFG, "lm", g8, Layout(fsdp=8), g8, Layout(data=2, tensor=4), H100)
    disjoint = realloc_cost(CFG, "lm", lo, Layout(fsdp=4), hi, Layout(tensor=4), H100)
    assert relayout > 0 and disjoint > 0
    # Across hosts (over the NICs) is slower than inside a host.
    far = realloc_cost(CFG, "lm", DeviceGroup("a", 0, 8), Layout(fsdp=8), DeviceGroup("b", 8, 8), Layout(fsdp=8), H100)
    near = realloc_cost(CFG, "lm", lo, Layout(fsdp=4), hi, Layout(fsdp=4), H100)
    assert far > near


@pytest.mark.slow
def test_analytic_flops_match_xla_cost_analysis():
    # One layer: the layers run in a scan, and XLA's cost analysis counts a loop body once.
    cfg = preset("small", num_layers=1)
    model = build_model(cfg, "lm")
    graphdef, params = nnx.split(model, nnx.Param)
    b, t = 4, 64
    tok = jnp.zeros((b, t), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.ones((b, t), bool)

    def fwd(params, tok, pos, mask):
        return nnx.merge(graphdef, params)(tok, pos, mask)[0]

    xla = jax.jit(fwd).lower(params, tok, pos, mask).cost_analysis()["flops"]
    analytic = 2 * matmul_params(cfg, "lm") * b * t + attention_flops(cfg, b * t, t)
    assert analytic == pytest.approx(xla, rel=0.05)


def test_generation_prefills_each_group_once_and_continuous_decodes_a_slot_pool():
    """GRPO G=8: both engines prefill batch/8 prompts (per batch shard); the continuous engine's slots
    (default the batch, or 16) run ceil(batch / slots) rounds of gen_len steps when every response is max
    length; the KV memory is what each engine allocates (hand count)."""
    from jaxrlhf.planner.memory import working_set

    static = Workload(batch_size=64, prompt_len=128, gen_len=128, minibatches=4, gen_group=8)
    cont = Workload(batch_size=64, prompt_len=128, gen_len=128, minibatches=4, gen_group=8, gen_engine="continuous")
    assert static.generate_shape(GEN, 2) == (4, 32, 128)
    assert cont.generate_shape(GEN, 2) == (4, 32, 128)
    assert dataclasses.replace(cont, gen_slots=16).generate_shape(GEN, 2) == (4, 8, 4 * 128)
    assert cont.generate_shape(GEN, 16)[0] == 1  # 4 rows per shard: half a group, prefilled once per shard
    ungrouped = dataclasses.replace(static, gen_group=1)
    s, u = cost(GEN, 1, Layout(), wl=static), cost(GEN, 1, Layout(), wl=ungrouped)
    assert s.parts["prefill"] < u.parts["prefill"] / 4  # 8x fewer prompt tokens (fixed costs aside)
    per_token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.dim_per_head * DTYPE_BYTES[CFG.dtype]
    # 64 rows x 256 columns carried in and out of the decode loop, plus the 8 prefilled rows they copy
    assert working_set(GEN, CFG, Layout(), static)["kv_cache"] == (2 * 64 + 8) * 256 * per_token
    assert working_set(GEN, CFG, Layout(), ungrouped)["kv_cache"] == 2 * 64 * 256 * per_token
    # prefix: 8 prompts x 128; pool: those 8 x 8 prompt pages of 16 + 64 slots x 8 response pages of 16
    # (default) or 100 pages; carried in and out of the loop, plus the prefill's prefix
    prefix, pool = 8 * 128, 8 * 128 + 64 * 8 * 16
    assert working_set(GEN, CFG, Layout(), cont)["kv_cache"] == (2 * pool + prefix) * per_token
    small = dataclasses.replace(cont, gen_pages=100)
    assert working_set(GEN, CFG, Layout(), small)["kv_cache"] == (2 * (8 * 128 + 100 * 16) + prefix) * per_token
    with pytest.raises(ValueError, match="gen_group"):
        Workload(batch_size=64, gen_group=5)


def test_decode_reads_the_cache_as_jaxrlhf_does_and_a_paged_peer_only_its_rows_tokens():
    """jaxrlhf's static engine attends over every column of a row's cache at every step, masked (prompt + gen_len
    columns); its continuous engine, whose pool starts every row at once, over the narrowest read of response
    columns that holds its rows' tokens (`models.slots.read_columns`: 512 then 1024 of a 1024 cap). A peer's paged
    engine (`Workload.live_kv`) reads each row's own tokens: prompt + s at its step s; with drawn lengths (a row of
    L tokens, s < L) every step at prompt + sum L(L - 1) / 2 / sum L of the drawn rows (by hand here)."""
    from jaxrlhf.planner.sizes import kv_bytes_per_token

    drawn = Workload(batch_size=64, prompt_len=128, gen_len=1024, gen_engine="continuous", gen_len_median=300,
                     gen_len_sigma=0.8)
    live = dataclasses.replace(drawn, live_kv=True)
    lengths = [int(x) for x in drawn.response_lengths(64).ravel()]
    by_hand = 128 + sum(n * (n - 1) / 2 for n in lengths) / sum(lengths)
    assert live.live_context() == pytest.approx(by_hand, rel=1e-12)
    assert 128 + 300 / 2 < by_hand < 128 + 1023 / 2  # long rows weigh more than the median; the cap's mean is far
    layout = Layout(data=2, tensor=4)
    rows = 64 / 2  # rows a replica decodes per step, every step of the cap (decode_fractions scale them later)
    per_token = rows * kv_bytes_per_token(CFG) / min(4, CFG.num_kv_heads)  # a context token's bytes, all rows

    def kv_bytes(a: Workload, b: Workload) -> float:  # decode bytes of a less those of b: only the reads differ
        return cost(GEN, 8, layout, a).hbm_bytes - cost(GEN, 8, layout, b).hbm_bytes

    # 1024 steps: at the drawn rows' mean context against the continuous engine's reads (512 steps of 128 + 512
    # columns, 512 of 128 + 1024) and the static engine's whole cache (128 + 1024 columns at every step)
    static = dataclasses.replace(drawn, gen_engine="static")
    assert drawn.decode_reads(GEN, 2) == (1024, 512) and static.decode_reads(GEN, 2) is None
    reads = 512 * (128 + 512) + 512 * (128 + 1024)
    assert kv_bytes(live, drawn) == pytest.approx(per_token * (1024 * by_hand - reads), rel=1e-9)
    assert kv_bytes(drawn, static) == pytest.approx(per_token * (reads - 1024 * (128 + 1024)), rel=1e-9)
    assert cost(GEN, 8, layout, live).parts["decode"] < cost(GEN, 8, layout, drawn).parts["decode"] < cost(
        GEN, 8, layout, static).parts["decode"]
    # every response at the cap: a paged engine's context runs from the prompt to the cap, 128 + s at step s
    at_cap = Workload(batch_size=64, prompt_len=128, gen_len=1024, gen_engine="static")
    growing = sum(128 + s for s in range(1024))
    assert kv_bytes(dataclasses.replace(at_cap, live_kv=True), at_cap) == pytest.approx(
        per_token * (growing - 1024 * (128 + 1024)), rel=1e-9)


def test_the_decode_steps_roofline_sums_in_closed_form():
    """A decode step's FLOPs and bytes grow linearly with its context, so the sum of the steps' rooflines (the
    larger of two lines) is summed in closed form (`cost._sum_of_max`): equal to the step-by-step sum."""
    import random

    import numpy as np

    from jaxrlhf.planner.cost import _sum_of_max

    rng = random.Random(0)
    for _ in range(500):
        a1, b1, a2, b2 = (rng.uniform(-5, 5) for _ in range(4))
        lo = rng.randint(0, 50)
        hi = lo + rng.randint(-1, 100)
        x = np.arange(lo, hi + 1, dtype=float)
        want = float(np.maximum(a1 + b1 * x, a2 + b2 * x).sum()) if len(x) else 0.0
        assert _sum_of_max(a1, b1, a2, b2, lo, hi) == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_blockwise_attention_skips_the_future_blocks_and_recomputes_scores_in_the_backward():
    """A 16k-token row on one device attends blockwise (16 key blocks of 1024): 16 x 17 / 2 of 256 block pairs,
    and the backward one more q.k^T product per pair (half the forward's attention); dense attention (the
    runtime's rule switched off) computes every score. A peer's FlashAttention is priced the same, in its
    tiles (`Workload.flash_attention`)."""
    wl = Workload(batch_size=8, prompt_len=1024, gen_len=15360, minibatches=1, remat="full")
    dense_cfg = CFG.replace(blockwise_attention_from=None)
    assert CFG.attends_blockwise(wl.seq_len) and not dense_cfg.attends_blockwise(wl.seq_len)
    rows = wl.batch_size / 8  # one row a device
    attend = attention_flops(CFG, rows * wl.seq_len, wl.seq_len)  # every score of one forward
    passes = 3 + 1  # forward, backward (two forwards' worth), recomputed forward
    share = 17 / 32
    for call, forwards, recomputed in ((INF, 1, 0.0), (TRAIN, passes, 0.5)):
        dense = cost(call, 8, Layout(fsdp=8), wl, cfg=dense_cfg).flops
        blocked = cost(call, 8, Layout(fsdp=8), wl).flops
        assert dense - blocked == pytest.approx(forwards * attend * (1 - share) - recomputed * attend * share,
                                                rel=1e-9)
    dense = cost(TRAIN, 8, Layout(fsdp=8), wl, cfg=dense_cfg).flops
    flash = cost(TRAIN, 8, Layout(fsdp=8), dataclasses.replace(wl, flash_attention=True), cfg=dense_cfg).flops
    tiles = wl.seq_len // 128
    share = (tiles + 1) / (2 * tiles)
    assert dense - flash == pytest.approx(passes * attend * (1 - share) - 0.5 * attend * share, rel=1e-9)


def test_packed_rows_attending_blockwise_are_priced_by_their_own_sequences():
    """Where the model attends 8k-token rows and wider blockwise, a shard's part of the packing is one row
    (`packing.one_row_rule`), with less padding than rows as wide as the batch; each row skips its block pairs of two sequences (`models.blockwise`), so a token meets about its
    own sequence's keys (sum L^2 / sum L, and a block more), not the row's width, as dense packed rows do.
    A context split keeps the wide rows (the ring attends them)."""
    from jaxrlhf.planner.cost import Geometry, _Ctx, forward_shape

    wl = Workload(batch_size=64, prompt_len=512, gen_len=16384, minibatches=1, packed=True,
                  gen_len_median=2048, gen_len_sigma=1.0, remat="full")
    layout = Layout(fsdp=8)
    ctx = lambda cfg: _Ctx(cfg, "lm", layout, Geometry.of(DeviceGroup("g", 0, 8), layout, H100), H100)  # noqa: E731
    dense_cfg = CFG.replace(blockwise_attention_from=None)
    one, wide = wl.packed_shape(INF, 8, CFG), wl.packed_shape(INF, 8)
    # every draw's shard part is one row (the mean shape's rows x width is the draws' mean tokens)
    assert wl.packed_peak(INF, 8, CFG).rows == 1 and CFG.attends_blockwise(one.width)
    assert one.tokens_per_shard < wide.tokens_per_shard
    assert wl.packed_shape(INF, 8, CFG, context=2) == wide
    assert wl.packed_shape(INF, 8, dense_cfg) == wide
    tokens, keys, _, micro, blockwise = forward_shape(ctx(CFG), wl, INF)
    assert blockwise and micro == one.micro_batches and tokens == pytest.approx(one.tokens_per_shard)
    assert keys == wl.varlen_shape(INF, 8)[1] + CFG.attention_block < one.width / 2
    assert forward_shape(ctx(dense_cfg), wl, INF)[:2] == pytest.approx((wide.tokens_per_shard, wide.width))
    assert cost(INF, 8, layout, wl).flops < cost(INF, 8, layout, wl, cfg=dense_cfg).flops
