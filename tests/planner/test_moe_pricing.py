"""The planner on a mixture of experts: memory from every expert's weights, FLOPs as the runtime's dense
dispatch runs them (every token through every expert), the expert width in tensor splits, its own
measured-table key, and `jaxrlhf.plan` on Qwen3-30B-A3B."""

from __future__ import annotations

import dataclasses

from jaxrlhf.models.config import preset
from jaxrlhf.plan import main
from jaxrlhf.planner.cost import matmul_params, mlp_width, param_count
from jaxrlhf.planner.measured import model_key
from jaxrlhf.planner.plan import ExecutionPlan, Layout, layout_misfit


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


def test_a_tensor_split_must_divide_each_experts_mlp():
    moe = dataclasses.replace(preset("tiny-qwen3-moe"), moe_intermediate_size=25)  # heads 4, kv 2, mlp 128
    reason = layout_misfit(Layout(tensor=2), moe)
    assert reason is not None and "moe_intermediate_size (each expert's mlp)=25" in reason
    assert layout_misfit(Layout(tensor=2), dataclasses.replace(moe, moe_intermediate_size=32)) is None


def test_the_plan_cli_plans_qwen3_30b_a3b(tmp_path, capsys):
    rc = main(["--model-preset", "qwen3-30b-a3b", "--devices", "64", "--hardware", "h100", "--algorithm", "grpo",
               "algorithm.group_size=8", "--time-budget", "3", "--out", str(tmp_path)])
    assert rc == 0
    plan = ExecutionPlan.load(str(tmp_path / "plan.yaml"))
    assert plan.num_devices == 64 and set(plan.calls) == {"actor.generate", "ref.inference", "actor.train"}
    assert "actor.train" in capsys.readouterr().out
