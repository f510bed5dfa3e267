import json
import os

import pytest

from jaxrlhf.mesh.plan import ExecutionPlan
from jaxrlhf.plan import graph_for, main, settings_from_config

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.yaml")


def test_json_output_and_plan_file(tmp_path, capsys):
    rc = main(["--model-preset", "tiny", "--devices", "8", "--hardware", "cpu", "--batch", "32", "--gen-len", "8",
               "--prompt-len", "16", "--iterations", "300", "--json", "--out", str(tmp_path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"searched", "presets", "search_s"}
    assert out["searched"]["step_s"] > 0 and out["search_s"] > 0
    assert {"colocated", "interleaved", "disaggregated", "reallocated"} <= set(out["presets"])
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


def test_config_mapping():
    import yaml

    with open(QUICKSTART) as f:
        raw = yaml.safe_load(f)
    s = settings_from_config(raw)
    assert s.models == {"actor": "tiny", "critic": "tiny", "ref": "tiny"}  # rule-based reward: no model
    expected = (
        raw["data"]["batch_size"], raw["data"]["max_prompt_len"], raw["generation"]["max_new_tokens"],
        raw["run"]["devices"], raw["algorithm"]["minibatches"],
    )
    assert (s.batch_size, s.prompt_len, s.gen_len, s.devices, s.minibatches) == expected
    assert "reward.inference" not in graph_for(list(s.models)).names


@pytest.mark.parametrize("argv, message", [
    (["--model-preset", "tiny", "--hardware", "warp9"], "known profiles"),
    (["--model-preset", "llama9"], "Known presets"),
    ([], "--config"),
])
def test_user_mistakes_get_clear_errors(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
