import json
import os

import pytest

from jaxrlhf.planner.plan import ExecutionPlan
from jaxrlhf import config as cfglib
from jaxrlhf.plan import main, parse_args, resolve_config

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")


def test_json_output_and_plan_file(tmp_path, capsys):
    rc = main(["--model-preset", "tiny", "--devices", "8", "--hardware", "cpu", "--batch", "32", "--gen-len", "8",
               "--prompt-len", "16", "--iterations", "300", "--json", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"algorithm", "searched", "presets", "search_s"} and out["algorithm"] == "ppo"
    assert out["searched"]["step_s"] > 0 and out["search_s"] > 0
    assert {"colocated", "interleaved", "disaggregated", "reallocated", "heuristic"} <= set(out["presets"])
    for p in out["presets"].values():
        assert p["step_s"] is None and p["reason"] or p["step_s"] > 0
        assert out["searched"]["step_s"] <= p["step_s"] + 1e-12 if p["step_s"] else True
    plan = ExecutionPlan.load(str(tmp_path / "plan.yaml"))
    assert plan.to_dict() == out["searched"]["plan"] and plan.num_devices == 8
    assert os.path.getsize(tmp_path / "timeline.png") > 1000


def test_text_output_with_config(tmp_path, capsys):
    rc = main(["--config", QUICKSTART, "--hardware", "cpu", "--iterations", "200", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "actor.generate" in text and "colocated" in text and "searched" in text and "GiB" in text
    assert os.path.exists(tmp_path / "plan.yaml")


def test_flags_resolve_to_the_training_config():
    """The CLI plans what training would run: the same config, flags mapped onto its keys."""
    cfg = resolve_config(parse_args(["--config", QUICKSTART, "--batch", "16", "--gen-len", "8",
                                     "algorithm.minibatches=4"]))
    want = cfglib.load_config(QUICKSTART, ["data.batch_size=16", "generation.max_new_tokens=8",
                                           "algorithm.minibatches=4"])
    assert cfg == want
    # --model-preset resizes the roles with their own weights; init_from roles follow them.
    cfg = resolve_config(parse_args(["--config", QUICKSTART, "--model-preset", "small"]))
    assert cfg.model.actor.preset == "small" and cfg.model.critic.init_from == "actor"


@pytest.mark.parametrize("algorithm, calls", [
    ("grpo", {"actor.generate", "ref.inference", "actor.train"}),
    ("dpo", {"ref.inference", "actor.train"}),
    ("remax", {"actor.generate", "actor.generate_greedy", "ref.inference", "actor.train"}),
])
def test_plans_the_graph_of_any_algorithm(algorithm, calls, tmp_path, capsys):
    extra = ["algorithm.group_size=4"] if algorithm == "grpo" else []
    rc = main(["--model-preset", "tiny", "--algorithm", algorithm, "--devices", "8", "--hardware", "cpu",
               "--batch", "16", "--iterations", "200", "--json", "--out", str(tmp_path), *extra])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["algorithm"] == algorithm and set(out["searched"]["plan"]["calls"]) == calls


@pytest.mark.parametrize("argv, message", [
    (["--model-preset", "tiny", "--hardware", "warp9"], "known profiles"),
    (["--model-preset", "llama9"], "Known presets"),
    (["--model-preset", "tiny", "--algorithm", "trpo"], "not a known algorithm"),
    ([], "--config"),
    (["--model-preset", "tiny", "--inter-node-gbps", "0"], "must be a positive number of Gb/s"),
    (["--model-preset", "tiny", "--inter-node-gbps", "fast"], "expected a number of Gb/s"),
])
def test_user_mistakes_get_clear_errors(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
