"""A DeepSeek-style mixture of experts for the planner (`deepseek-v2-lite`): many small routed experts and
shared experts, priced as the model builds it (MLA priced as standard attention with the published head
dims, the first dense layer as a MoE layer: docs/models.md), and `jaxrlhf.plan` plans it on 64 H100s."""

from __future__ import annotations

from jaxrlhf.models.config import preset
from jaxrlhf.plan import main
from jaxrlhf.planner.plan import ExecutionPlan
from jaxrlhf.planner.sizes import mlp_width, param_count


def test_the_preset_has_deepseek_v2_lites_published_shape():
    cfg = preset("deepseek-v2-lite")
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_intermediate_size) == (64, 6, 1408)
    assert cfg.shared_expert_intermediate_size == 2 * 1408  # two shared experts as one of their summed width
    assert (cfg.num_heads, cfg.dim_per_head, cfg.num_layers, cfg.hidden_size) == (16, 128, 27, 2048)
    assert mlp_width(cfg) == 64 * 1408 + 2816  # the dense dispatch: every routed expert and the shared one
    # by hand: embeddings and head, then per layer attention (4 d x d), 64 experts x 3 d x f, the router,
    # the shared expert (3 d x 2816) and its gate, two norms; the final norm
    d, layers = 2048, 27
    per_layer = 4 * d * d + 64 * 3 * d * 1408 + d * 64 + 3 * d * 2816 + d + 2 * d
    assert param_count(cfg, "lm") == 2 * 102400 * d + layers * per_layer + d
    assert 15.7e9 < param_count(cfg, "lm") < 1.05 * 15.7e9  # published 15.7B; +4 % as priced (docs/models.md)


def test_the_plan_cli_plans_deepseek_v2_lite(tmp_path, capsys):
    rc = main(["--model-preset", "deepseek-v2-lite", "--devices", "64", "--hardware", "h100", "--algorithm", "grpo",
               "algorithm.group_size=8", "--evaluations", "200", "--out", str(tmp_path)])
    assert rc == 0
    plan = ExecutionPlan.load(str(tmp_path / "plan.yaml"))
    assert plan.num_devices == 64 and set(plan.calls) == {"actor.generate", "ref.inference", "actor.train"}
    assert "actor.train" in capsys.readouterr().out
