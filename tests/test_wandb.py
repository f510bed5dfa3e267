"""Weights & Biases logging (`run.wandb`), offline and without network: a short real run writes W&B's
offline run files, whose history holds the steps of metrics.jsonl and whose config is the run's
resolved config; a resumed run continues the same W&B run; a bad mode or a missing package is one
line before anything runs."""

from __future__ import annotations

import glob
import json
import os
import struct
import time

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import errors, train
from jaxrlhf.metrics import WANDB_ID_FILE, read_metrics

# test_train.py's small PPO run, 2 steps, checkpoints every step (for the resume)
BASE = [
    "model.actor.preset=tiny", "run.steps=2", "run.checkpoint_every=1", "run.tensorboard=false",
    "run.export_hf=false", "data.batch_size=8", "data.max_prompt_len=16", "generation.max_new_tokens=4",
    "algorithm.minibatches=2", "sft.steps=0", "rewards.eos_only=false",
    'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]',
]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline, every W&B folder inside tmp_path; returns where W&B writes its runs."""
    for var in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, name in (("WANDB_DIR", "wandb_dir"), ("WANDB_CONFIG_DIR", "wandb_config"),
                      ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_DATA_DIR", "wandb_data")):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(var, str(tmp_path / name))
    return tmp_path / "wandb_dir" / "wandb"


def read_records(path: str) -> list:
    """The protobuf `Record`s of a W&B transaction log (`run-<id>.wandb`): a 7-byte header (':W&B', magic,
    version), then LevelDB-log blocks of 32 KiB, each record split into chunks with a 7-byte header
    (crc32, length, type: 1 whole, 2 first, 3 middle, 4 last). wandb no longer ships a Python reader."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def offline_run(root, run_id: str, wait_s: float = 60.0) -> list:
    """The records of every offline W&B run folder with `run_id`, oldest first, each read once its log holds
    the run's `exit` record: `wandb.finish()` can return before W&B's writer process has written the rest of the
    log (under load, a resumed run's log was read with none of its records yet), so the reader waits for it."""
    folders = sorted(glob.glob(str(root / f"offline-run-*-{run_id}")))
    out = []
    for f in folders:
        path, deadline = os.path.join(f, f"run-{run_id}.wandb"), time.monotonic() + wait_s
        while True:
            records = read_records(path)
            if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        out.append(records)
    return out


def history(records) -> dict[int, dict]:
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            out[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    return out


@pytest.mark.slow
def test_an_offline_run_logs_its_metrics_and_config_and_a_resume_continues_it(tmp_path, offline):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    cfg = cfglib.load_config(None, [*BASE, f"run.output_dir={out}", "run.wandb={project: jaxrlhf-test}"])
    train.run(cfg)
    run_id = (out / WANDB_ID_FILE).read_text().strip()
    (first,) = offline_run(offline, run_id)
    meta = next(r.run for r in first if r.WhichOneof("record_type") == "run")
    assert (meta.project, meta.display_name, meta.run_id) == ("jaxrlhf-test", "run", run_id)

    # the wandb config is the resolved config, section by section
    logged = {}  # the run record holds the config given to wandb.init, config records later updates
    for r in first:
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else ()
        logged.update({i.key: json.loads(i.value_json) for i in items})
    want = json.loads(json.dumps(cfglib.to_dict(cfg)))
    assert {k: logged[k] for k in want} == want

    # every numeric value of every step of metrics.jsonl, as logged
    records = read_metrics(str(out / "metrics.jsonl"))
    logged_steps = history(first)
    assert sorted(logged_steps) == [r["step"] for r in records] == [1, 2]
    for r in records:
        numbers = {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
        assert {"reward/mean", "kl/mean", "loss/policy", "time/step_s"} <= set(numbers)
        assert logged_steps[r["step"]] == pytest.approx(numbers, rel=1e-12, abs=0)

    # resumed from the step-2 checkpoint: the same W&B run goes on with step 3
    train.run(cfglib.with_overrides(cfg, ["run.steps=3", "run.resume=true"]))
    assert (out / WANDB_ID_FILE).read_text().strip() == run_id
    runs = offline_run(offline, run_id)
    assert len(runs) == 2 and sorted(history(runs[1])) == [3]
    assert history(runs[1])[3]["reward/mean"] == read_metrics(str(out / "metrics.jsonl"))[-1]["reward/mean"]


def test_mode_is_validated():
    with pytest.raises(cfglib.ConfigError) as e:
        cfglib.load_config(None, ["run.wandb.mode=sometimes"])
    assert str(e.value) == "config key 'run.wandb.mode' must be one of online, offline, disabled; got 'sometimes'"
    assert cfglib.load_config(None, []).run.wandb is None  # off unless asked
    section = cfglib.load_config(None, ["run.wandb.project=p"]).run.wandb
    assert (section.project, section.name, section.mode) == ("p", None, None)


def test_a_missing_package_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "run"
    code = errors.run_cli("jaxrlhf.train", lambda argv: train.run(cfglib.load_config(None, argv)) or 0,
                          [*BASE, f"run.output_dir={out}", "run.wandb.project=p"])
    err = capsys.readouterr().err
    assert code == 2
    first = err.splitlines()[0]
    assert "run.wandb" in first and "pip install 'jaxrlhf[wandb]'" in first and "Traceback" not in err
    assert not out.exists()  # refused before the run folder was made
    # mode disabled needs no package
    from jaxrlhf.metrics import require_wandb

    require_wandb(cfglib.load_config(None, ["run.wandb.mode=disabled"]).run.wandb)


def test_overwrite_starts_a_new_wandb_run(tmp_path):
    from jaxrlhf.run.folder import prepare_output_dir

    out = tmp_path / "run"
    (out / "wandb" / "offline-run-x").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / WANDB_ID_FILE).write_text("abc\n")
    prepare_output_dir(cfglib.load_config(None, [f"run.output_dir={out}", "run.overwrite=true"]).run)
    assert sorted(os.listdir(out)) == []
