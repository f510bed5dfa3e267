"""Preference data as HH-RLHF ships it (chosen/rejected hold the whole dialogue, no prompt column)
through the CLI path: `jaxrlhf.train.run` on a config built from command-line overrides."""

from __future__ import annotations

import json
import math

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import errors, train
from jaxrlhf.metrics import read_metrics

QUESTIONS = [("What is 2+3?", "5", "six"), ("Name a colour.", "red", "dog"), ("Capital of France?", "Paris", "Rome"),
             ("Say hi.", "hi", "no"), ("What is 1+1?", "2", "11"), ("Opposite of up?", "down", "cat"),
             ("Is ice cold?", "yes", "no"), ("Pick a number.", "7", "x")]


def _hh_rows(shift: int = 0) -> list[dict]:
    return [{"chosen": f"\n\nHuman: {q}\n\nAssistant: {good}", "rejected": f"\n\nHuman: {q}\n\nAssistant: {bad}"}
            for q, good, bad in QUESTIONS[shift:] + QUESTIONS[:shift]]


def _write(folder, rows_by_split: dict[str, list[dict]]) -> str:
    folder.mkdir()
    for split, rows in rows_by_split.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def _overrides(tmp_path, source: str, name: str, *extra: str) -> list[str]:
    out = [f"run.output_dir={tmp_path / ('run-' + name)}", "run.steps=2", "run.checkpoint_every=0",
           "run.tensorboard=false", "run.export_hf=false", "run.eval_every=2", f"algorithm.name={name}",
           f"data.source={source}", "data.prompt_key=null", "data.answer_key=null", "data.batch_size=8",
           "data.max_seq_len=64", "model.actor.preset=tiny", "model.ref.init_from=actor", "sft.steps=0"]
    if name == "rm":
        out.append("model.reward.init_from=actor")
    return out + list(extra)


@pytest.mark.slow
@pytest.mark.parametrize("name, keys", [("dpo", ("loss/dpo", "eval/rewards_accuracy")),
                                        ("rm", ("loss/rm", "eval/rm_accuracy"))])
def test_dpo_and_rm_on_hh_shaped_pairs_from_the_cli(name, keys, tmp_path, capsys):
    source = _write(tmp_path / "hh", {"train": _hh_rows(), "test": _hh_rows(3)})
    cfg = cfglib.load_config(None, _overrides(tmp_path, source, name))
    assert cfg.data.prompt_key is None
    train.run(cfg)
    run = tmp_path / f"run-{name}"
    records = read_metrics(str(run / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    for key in keys:
        assert math.isfinite(records[-1][key]), (key, records[-1])
    assert records[-1]["data/skipped"] == 0.0
    # The console names the run's files at the start and again at the end (run_dir.RunFiles).
    out = capsys.readouterr().out
    assert out.count(f"run folder: {run}\n  metrics:     {run}/metrics.jsonl (every step, run.log_every=1") == 2
    assert f"checkpoints: {run}/checkpoints (at the last step, the newest 3 kept)" in out
    assert f"checkpoints: {run}/checkpoints (latest: step 2)" in out


def _cli(overrides: list[str], capsys) -> tuple[int, str, str]:
    """The CLI's error boundary around load + run, as `python -m jaxrlhf.train` applies it."""
    code = errors.run_cli("jaxrlhf.train", lambda argv: train.run(cfglib.load_config(None, argv)) or 0, overrides)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_pairs_without_a_shared_prefix_fail_with_one_line(tmp_path, capsys):
    rows = [{"chosen": "Paris is the capital.", "rejected": "Rome, I think."}] * 8
    source = _write(tmp_path / "bad", {"train": rows, "test": rows})
    code, out, err = _cli(_overrides(tmp_path, source, "dpo"), capsys)
    assert code == 2, err
    assert "data.prompt_key=null" in err and "share no token prefix" in err and "set data.prompt_key" in err
    assert "Traceback" not in err
    assert "step 1" not in out  # nothing was trained


def test_a_dpo_data_error_stops_the_run_before_the_sft_warm_up(tmp_path, capsys):
    # DPO rows keyed "question"/"good"/"bad" while the config expects prompt/chosen/rejected: every
    # row is malformed. The warm-up (50 SFT steps on the bundled task) must not run first.
    rows = [{"question": q, "good": g, "bad": b} for q, g, b in QUESTIONS]
    source = _write(tmp_path / "keys", {"train": rows, "test": rows})
    overrides = [o for o in _overrides(tmp_path, source, "dpo") if not o.startswith(("data.prompt_key", "sft."))]
    code, out, err = _cli([*overrides, "sft.steps=50", "sft.source=arithmetic"], capsys)
    assert code == 2, err
    assert "data:" in err and "no valid row" in err and "missing_key" in err
    assert "sft warm-up step" not in out


@pytest.mark.parametrize("extra, message", [
    (["algorithm.name=ppo"], "data.prompt_key=null is for preference pairs"),
    (["sft.steps=10"], "the SFT warm-up (sft.steps > 0) reads prompts from data.prompt_key"),
])
def test_prompt_key_null_outside_pairs_is_a_config_error(extra, message, tmp_path):
    with pytest.raises(cfglib.ConfigError) as e:
        cfglib.load_config(None, [*_overrides(tmp_path, "preference", "dpo"), *extra])
    assert message in str(e.value)
