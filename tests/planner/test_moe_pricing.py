"""The planner on a mixture of experts: memory from every expert's weights, FLOPs as the runtime's dense
dispatch runs them (every token through every expert), the expert width in tensor splits, its own
measured-table key, and `jaxrlhf.plan` on Qwen3-30B-A3B."""

from __future__ import annotations

import dataclasses

import pytest
from pytest import approx

from jaxrlhf.models.config import preset
from jaxrlhf.plan import main
from jaxrlhf.planner.measured import model_key
from jaxrlhf.planner.plan import ExecutionPlan, Layout, layout_misfit
from jaxrlhf.planner.sizes import flop_params, matmul_params, mlp_width, param_count


def test_experts_count_in_memory_and_in_the_dense_dispatchs_flops():
    moe = preset("qwen3-30b-a3b")
    d, e, f = moe.hidden_size, moe.num_experts, moe.expert_intermediate_size
    assert mlp_width(moe) == e * f
    dense = dataclasses.replace(moe, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=None,
                                norm_topk_prob=False)
    # one layer's experts and router beyond the dense MLP, in both counts (all weights are held, and the
    # dense dispatch multiplies every one of them for every token)
    extra = moe.num_layers * (e * 3 * d * f + d * e - 3 * d * moe.intermediate_size)
    assert param_count(moe, "lm") - param_count(dense, "lm") == extra
    assert matmul_params(moe, "lm") - matmul_params(dense, "lm") == extra
    assert 29e9 < param_count(moe, "lm") < 32e9  # Qwen3-30B-A3B: 30.5B parameters
    assert model_key(moe, "lm") != model_key(dense, "lm")


def test_a_grouped_dispatch_prices_the_k_picked_experts_flops_and_holds_every_expert():
    dense = preset("qwen3-30b-a3b")
    grouped = dataclasses.replace(dense, moe_dispatch="grouped")
    d, e, k, f, layers = 2048, 128, 8, 768, 48  # Qwen3-30B-A3B's published sizes, by hand
    assert (dense.hidden_size, dense.num_experts, dense.num_experts_per_tok, dense.expert_intermediate_size,
            dense.num_layers) == (d, e, k, f, layers)
    assert flop_params(dense, "lm") == matmul_params(dense, "lm")  # dense: every expert runs
    assert matmul_params(dense, "lm") - flop_params(grouped, "lm") == layers * 3 * d * f * (e - k)
    assert 3.0e9 < flop_params(grouped, "lm") < 3.6e9  # "A3B": ~3.3B active parameters
    assert matmul_params(grouped, "lm") == matmul_params(dense, "lm")  # every expert's weights still held
    assert param_count(grouped, "lm") == param_count(dense, "lm")
    assert model_key(grouped, "lm") != model_key(dense, "lm")  # measured times are the dispatch's own


def test_a_tensor_split_must_divide_each_experts_mlp():
    moe = dataclasses.replace(preset("tiny-qwen3-moe"), moe_intermediate_size=25)  # heads 4, kv 2, mlp 128
    reason = layout_misfit(Layout(tensor=2), moe)
    assert reason is not None and "moe_intermediate_size (each expert's mlp)=25" in reason
    assert layout_misfit(Layout(tensor=2), dataclasses.replace(moe, moe_intermediate_size=32)) is None


def test_the_plan_cli_plans_qwen3_30b_a3b(tmp_path, capsys):
    rc = main(["--model-preset", "qwen3-30b-a3b", "--devices", "64", "--hardware", "h100", "--algorithm", "grpo",
               "algorithm.group_size=8", "--evaluations", "200", "--out", str(tmp_path)])
    assert rc == 0
    plan = ExecutionPlan.load(str(tmp_path / "plan.yaml"))
    assert plan.num_devices == 64 and set(plan.calls) == {"actor.generate", "ref.inference", "actor.train"}
    assert "actor.train" in capsys.readouterr().out


def test_the_expert_axis_divides_the_experts_memory_and_prices_its_token_gathers():
    """Expert parallelism as `models.moe.expert_parallel` runs it: each device holds num_experts / e experts;
    per MoE layer of a forward it all-gathers its expert group's tokens and combine weights ([e x n, hidden +
    num_experts]) and reduce-scatters the partial sums ([e x n, hidden]): (e - 1) / e of each over the axis."""
    from jaxrlhf.graph import CallSpec
    from jaxrlhf.planner.cost import call_cost
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.plan import DeviceGroup
    from jaxrlhf.planner.sizes import expert_param_count, shard_count
    from jaxrlhf.planner.workload import Workload

    moe = preset("qwen3-30b-a3b")
    d, e, f, layers = moe.hidden_size, moe.num_experts, moe.expert_intermediate_size, moe.num_layers
    assert expert_param_count(moe) == layers * e * d * (3 * f + 1)  # stacked experts and router
    whole = shard_count(moe, "lm", Layout())
    assert shard_count(moe, "lm", Layout(expert=8)) == whole - expert_param_count(moe) * 7 / 8
    assert shard_count(moe, "lm", Layout(fsdp=2, expert=4)) == (whole - expert_param_count(moe) * 3 / 4) / 2

    hw, wl = get_profile("h100"), Workload(batch_size=64, prompt_len=256, gen_len=256, minibatches=1)
    call, group = CallSpec("ref.inference", "ref", "inference"), DeviceGroup("g", 0, 8)
    cost = call_cost(call, moe, group, Layout(expert=8), wl, hw)
    n = 64 * 512 / 8  # tokens per device: the batch is split over the expert axis
    ab = 2  # bfloat16 activations
    bw = hw.link_bandwidth(False, 8, 8)  # one host's NVLink
    gather, scatter = 8 * n * (d + e) * ab, 8 * n * d * ab
    want = layers * ((gather + scatter) * 7 / 8 / bw + 2 * hw.collective_latency)
    assert cost.parts["expert_comm"] == approx(want)
    assert "expert_comm" not in call_cost(call, moe, group, Layout(data=8), wl, hw).parts
    # the same FLOPs per device as the dense dispatch over its own tokens (e x the tokens, 1/e of the experts)
    assert cost.flops == approx(call_cost(call, moe, group, Layout(data=8), wl, hw).flops)
    train = call_cost(CallSpec("actor.train", "actor", "train"), moe, group, Layout(expert=8), wl, hw)
    # forward, recomputed forward (full remat) and the backward's transposed gathers and scatters
    assert train.parts["expert_comm"] == approx(3 * cost.parts["expert_comm"])


def test_optimizer_state_splits_over_data_and_outside_the_experts_over_expert_too():
    """ZeRO-1 as `placement.layout.optimizer_spec` lays it out: the experts' state (already split over
    expert) over data, the weights outside the experts (replicated over expert) over data x expert."""
    from jaxrlhf.planner.sizes import expert_param_count, optimizer_shard_count, shard_count

    moe = preset("qwen3-30b-a3b")
    experts, whole = expert_param_count(moe), shard_count(moe, "lm", Layout())
    outside = whole - experts
    assert optimizer_shard_count(moe, "lm", Layout(data=2, expert=4)) == approx(experts / 4 / 2 + outside / 8)
    assert optimizer_shard_count(moe, "lm", Layout(expert=8)) == approx(whole / 8)
    assert optimizer_shard_count(moe, "lm", Layout(data=4, tensor=2)) == approx(whole / 8)
    dense = preset("llama3-8b")
    assert optimizer_shard_count(dense, "lm", Layout(data=4, fsdp=2)) == approx(shard_count(dense, "lm", Layout()) / 8)


def test_the_search_considers_expert_degrees_for_a_mixture_of_experts_only():
    from jaxrlhf.graph import CallSpec
    from jaxrlhf.planner.search import valid_layouts
    from jaxrlhf.planner.workload import Workload

    wl = Workload(batch_size=64, prompt_len=256, gen_len=256, minibatches=1)
    train = CallSpec("actor.train", "actor", "train")
    moe = preset("tiny-qwen3-moe")  # 8 experts
    degrees = {lay.expert for lay in valid_layouts(train, moe, 16, wl, max_tensor=8)}
    assert degrees == {1, 2, 4, 8}  # the divisors of 16 that divide the 8 experts
    assert Layout(data=2, expert=8) in valid_layouts(train, moe, 16, wl, max_tensor=8)
    assert all(lay.stage == 1 for lay in valid_layouts(train, moe, 16, wl, max_tensor=8) if lay.expert > 1)
    dense = preset("tiny")
    assert {lay.expert for lay in valid_layouts(train, dense, 16, wl, max_tensor=8)} == {1}


@pytest.mark.slow
def test_the_plan_cli_splits_qwen3_30b_a3b_over_an_expert_axis_and_says_why(tmp_path, capsys):
    """On 64 H100s, each update in one micro-batch (a micro-batch size above the minibatch: free micro-batches
    would make a 16-stage pipeline's bubble small, and the search takes that), the 128 experts' weights and
    their FSDP gathers dominate: the search puts the train call on an expert axis, and the report prices the
    token gathers against the layout without it."""
    rc = main(["--model-preset", "qwen3-30b-a3b", "--devices", "64", "--hardware", "h100", "--algorithm", "grpo",
               "algorithm.group_size=8", "algorithm.micro_batch_size=4096", "--evaluations", "1000",
               "--iterations", "20", "--out", str(tmp_path)])
    assert rc == 0
    plan = ExecutionPlan.load(str(tmp_path / "plan.yaml"))
    assert plan.calls["actor.train"].layout.expert > 1
    out = capsys.readouterr().out
    assert "expert parallelism:" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("actor.train: 128 experts over"))
    assert "token gathers and scatters" in line and "without the expert axis" in line
