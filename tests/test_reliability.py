"""No lost runs: a new run never overwrites another, SIGINT saves a checkpoint of the step reached,
a damaged newest checkpoint falls back to the previous one with the same metrics as an uninterrupted
run, and a run whose updates are all skipped stops instead of exporting a dead model."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jaxrlhf import config as cfglib
from jaxrlhf import train
from jaxrlhf.errors import RunError
from jaxrlhf.metrics import read_metrics
from jaxrlhf.run import folder as run_dir
from jaxrlhf.run import planning
from jaxrlhf.testing import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = [
    "model.actor.preset=tiny", "run.tensorboard=false", "run.export_hf=false", "data.batch_size=8",
    "data.max_prompt_len=16", "generation.max_new_tokens=4", "algorithm.minibatches=2", "sft.steps=0",
    "optimizer.actor.lr=1e-3", "optimizer.critic.lr=1e-3", "rewards.eos_only=false",
    'rewards.rules=[{name: format, weight: 1.0, args: {pattern: "[a-z0-9]"}}]',
]


def _run(out, *overrides: str) -> list[dict]:
    train.run(cfglib.load_config(None, [*BASE, f"run.output_dir={out}", *overrides]))
    return read_metrics(os.path.join(out, "metrics.jsonl"))


def _strip_times(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))} for r in records]


def _snapshot(folder) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("reference") / "run"
    records = _run(out, "run.steps=4", "run.checkpoint_every=2")
    return out, records


@pytest.mark.slow
def test_a_new_run_into_another_runs_folder_changes_nothing(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    before = _snapshot(out)
    with pytest.raises(RunError, match=r"holds another run \(checkpoints, metrics.jsonl\); nothing was changed"):
        _run(out, "run.steps=2")
    assert _snapshot(out) == before
    records = _run(out, "run.steps=1", "run.overwrite=true")  # the explicit way to replace it
    assert [r["step"] for r in records] == [1]


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path):
    """Two runs started into one folder at once must not interleave: the second is refused before it
    changes anything, while the first holds the folder's lock (here: this test, as another process would)."""
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "a") as first:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunError, match=rf"run.output_dir='{out}' is in use by another run that is still going "
                                           r"\(it holds .*\.lock\); nothing was changed"):
            _run(out, "run.steps=1", "run.overwrite=true")
        assert os.listdir(out) == [".lock"]
    with run_dir.output_dir_lock(str(out)):  # free again once the first run ends (or dies: the OS drops it)
        pass


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(RunError, match="is a file, not a folder"):
        _run(path, "run.steps=1")
    assert path.read_text() == "mine"


def _damage_truncated_array(step_dir):
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "arrays", "d")) for f in fs]
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(max(os.path.getsize(f) // 3, 1))


def _damage_missing_arrays(step_dir):
    shutil.rmtree(os.path.join(step_dir, "arrays", "d"))


def _damage_missing_metadata(step_dir):
    shutil.rmtree(os.path.join(step_dir, "meta"))


def _damage_empty_step(step_dir):
    for name in os.listdir(step_dir):
        path = os.path.join(step_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


DAMAGES = [_damage_truncated_array, _damage_missing_arrays, _damage_missing_metadata, _damage_empty_step]


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.removeprefix("_damage_"))
def test_every_kind_of_damage_falls_back_to_the_previous_step(damage, tmp_path, capsys):
    """The checkpoint manager restores step 2 when step 4 is damaged in any of these ways, and keeps
    the damaged step aside (the run below checks one of them end to end)."""
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.checkpoint import CheckpointManager

    def tree(v):
        return {"actor": {"params": {"w": jnp.full((4, 3), v, jnp.float32)}, "step": jnp.int32(v)}}

    mngr = CheckpointManager(str(tmp_path / "ckpt"))
    for step in (2, 4):
        mngr.save(step, tree(step), {"step": step})
    mngr.close()
    damage(str(tmp_path / "ckpt" / "4"))
    mngr = CheckpointManager(str(tmp_path / "ckpt"))
    step, arrays, meta = mngr.restore_latest(tree(0))
    mngr.close()
    assert step == 2 and meta["step"] == 2
    np.testing.assert_array_equal(arrays["actor"]["params"]["w"], np.full((4, 3), 2, np.float32))
    assert "checkpoint step 4" in capsys.readouterr().err
    assert [n for n in os.listdir(tmp_path / "ckpt") if n.startswith("damaged-step-4-")]


def test_damage_another_process_sees_moves_every_process_to_the_older_step(tmp_path, monkeypatch, capsys):
    """Damage visible to one process only (in the shard files it reads): this process restores step 4
    fine, but the agreement says another could not, so all use step 2, the newest every process read,
    and process 0 (this one) moves step 4 aside. The agreement is the one `any_process` gathers."""
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.checkpoint import CheckpointManager
    from jaxrlhf.transfer import processes

    def tree(v):
        return {"actor": {"params": {"w": jnp.full((4, 3), v, jnp.float32)}}}

    mngr = CheckpointManager(str(tmp_path / "ckpt"))
    for step in (2, 4):
        mngr.save(step, tree(step), {"step": step})
    answers = iter([True, False])  # step 4: another process failed; step 2: every process read it
    monkeypatch.setattr(processes, "any_process", lambda flag: flag or next(answers))
    step, arrays, _ = mngr.restore_latest(tree(0))
    mngr.close()
    assert step == 2
    np.testing.assert_array_equal(arrays["actor"]["params"]["w"], np.full((4, 3), 2, np.float32))
    assert "checkpoint step 4 in" in capsys.readouterr().err
    assert len([n for n in os.listdir(tmp_path / "ckpt") if n.startswith("damaged-step-4-")]) == 1


@pytest.mark.slow
def test_damaged_newest_checkpoint_resumes_from_the_previous_one(reference, tmp_path, capsys):
    """A run killed while writing its newest checkpoint resumes from the one before with the metrics of
    an uninterrupted run (the other kinds of damage take the same path, tested above)."""
    ref_out, ref_records = reference
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    _damage_truncated_array(os.path.join(out, "checkpoints", "4"))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "reward/me')  # and a half-written line from a run killed mid-write
    records = _run(out, "run.steps=4", "run.checkpoint_every=2", "run.resume=true")
    err = capsys.readouterr().err
    assert "checkpoint step 4" in err and "using step 2" in err
    assert _strip_times(records) == _strip_times(ref_records)


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    ("model.actor.overrides={hidden_size: 32}", r"actor.params.* with shape \[.*64.*\], but this config builds"),
    ("model.actor.overrides={num_layers: 3}", r"actor.params.model.layers.* with shape \[2, .*\], but this config "
                                              r"builds \[3, "),
], ids=["wider", "deeper"])
def test_resume_with_other_model_shapes_names_the_difference(reference, tmp_path, change, message):
    """A checkpoint of a model of another size is not damage: nothing is moved aside, the error names the
    first parameter that differs."""
    from jaxrlhf.checkpoint import CheckpointMismatch

    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    before = _snapshot(out / "checkpoints")
    with pytest.raises(CheckpointMismatch, match=message):
        _run(out, "run.steps=5", "run.resume=true", change)
    assert _snapshot(out / "checkpoints") == before


@pytest.mark.slow
def test_resume_with_another_algorithm_names_what_wrote_the_checkpoint(reference, tmp_path):
    """A PPO run resumed as RLOO: the error says which algorithm and roles wrote the checkpoint (not
    Orbax's "tree structures do not match" for every step, which reads as damage)."""
    from jaxrlhf.checkpoint import CheckpointMismatch

    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    before = _snapshot(out / "checkpoints")
    with pytest.raises(CheckpointMismatch, match=r"checkpoint step 4 was written by algorithm ppo with roles actor, "
                                                 r"critic, ref, but this config runs rloo with roles actor, ref: resume with "
                                                 r"the "
                                                 r"config that run was started with"):
        _run(out, "run.steps=5", "run.resume=true", "algorithm.name=rloo", "algorithm.group_size=2")
    assert _snapshot(out / "checkpoints") == before


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """A real full disk (a 2 MB tmpfs, where this test may mount one): the save fails with one line
    saying so and naming the intact step; the partial folder is gone; the earlier step restores."""
    import subprocess as sp

    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.checkpoint import CheckpointManager
    from jaxrlhf.models.hf_io import CheckpointError

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or sp.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                                   capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs (the run-level test below simulates the error)")
    try:
        mngr = CheckpointManager(str(disk / "ckpt"))
        mngr.save(1, {"w": jnp.ones((1000,), jnp.float32)}, {"step": 1})
        with pytest.raises(CheckpointError, match=r"cannot save checkpoint step 2 in .*: the disk is full \(no space "
                                                  r"left on device\); the newest intact checkpoint is step 1\. Free"):
            mngr.save(2, {"w": jnp.arange(1_000_000, dtype=jnp.float32)}, {"step": 2})
        mngr.close()
        assert os.listdir(disk / "ckpt") == ["1"]
        mngr = CheckpointManager(str(disk / "ckpt"))
        step, arrays, _ = mngr.restore_latest({"w": jnp.zeros((1000,), jnp.float32)})
        mngr.close()
        assert step == 1 and np.all(np.asarray(arrays["w"]) == 1)
    finally:
        sp.run(["umount", str(disk)], check=True)


# Run in a process of their own: the library's leftovers are printed when they are collected, up to the
# interpreter's exit, and pytest would turn them into warnings instead.
PENDING_READS = """
import asyncio, os, sys
import jax.numpy as jnp
from orbax.checkpoint._src.serialization import serialization
from jaxrlhf.checkpoint import CheckpointManager

def tree(v):
    return {"actor": {"params": {f"w{i}": jnp.full((8, 4), v, jnp.float32) for i in range(8)}}}

mngr = CheckpointManager(sys.argv[1])
for step in (2, 4):
    mngr.save(step, tree(step), {"step": step})
read = serialization._read_shard

async def read_shard(t, **kwargs):  # step 4: one shard is damaged, the others are still being read
    spec = str(t.spec())
    if f"{os.sep}4{os.sep}arrays" in spec:
        if "actor.params.w0/" in spec:
            raise ValueError("DATA_LOSS: Error reading shard: damaged")
        await asyncio.sleep(0.5)
    return await read(t, **kwargs)

serialization._read_shard = read_shard
step, _, _ = mngr.restore_latest(tree(0))
mngr.close()
print("restored step", step, file=sys.stderr)
"""

FULL_DISK = """
import sys
import jax, jax.numpy as jnp
from jaxrlhf.checkpoint import CheckpointManager, DiskFull

mngr = CheckpointManager(sys.argv[1])
mngr.save(1, {"w": jnp.ones((1000,), jnp.float32)}, {"step": 1})
try:
    mngr.save(2, {f"w{i}": jax.random.normal(jax.random.key(i), (100_000,)) for i in range(20)}, {"step": 2})
except DiskFull as e:
    print(e, file=sys.stderr)
mngr.close()
"""


def _stderr_of(script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("JAXRLHF_DEBUG", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_a_damaged_shard_read_among_others_prints_one_line_and_no_library_tracebacks(tmp_path):
    """One shard of the newest step fails to read while the other reads of the step are still going (as
    when only another process's files are damaged): the fallback says so in one line, and the reads
    Orbax abandoned print no "Encountered error while reading array index" traceback each."""
    err = _stderr_of(PENDING_READS, str(tmp_path / "ckpt"))
    assert "checkpoint step 4 in" in err and "using step 2" in err and "restored step 2" in err, err
    assert err.count("Traceback") == 0, err


def test_a_full_disk_prints_one_line_and_no_library_tracebacks(tmp_path):
    """A real full disk (a 2 MB tmpfs, where this test may mount one) under a save of many arrays: the one
    line, and none of the tracebacks of TensorStore writes that end after Orbax closed its event loop."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        err = _stderr_of(FULL_DISK, str(disk / "ckpt"))
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert "the disk is full (no space left on device); the newest intact checkpoint is step 1" in err, err
    assert err.count("Traceback") == 0, err


def test_an_unfinished_saves_folder_is_removed_on_resume(tmp_path, capsys):
    """A second Ctrl-C during a save exits at once and leaves Orbax's temporary folder of that step: the
    resume removes it with one line naming it, and restores the newest finished step."""
    import jax.numpy as jnp

    from jaxrlhf.checkpoint import CheckpointManager

    def tree(v):
        return {"actor": {"params": {"w": jnp.full((4, 3), v, jnp.float32)}}}

    folder = tmp_path / "ckpt"
    mngr = CheckpointManager(str(folder))
    for step in (1, 2):
        mngr.save(step, tree(step), {"step": step})
    mngr.close()
    shutil.copytree(folder / "2", folder / "3.orbax-checkpoint-tmp")  # step 3's save, cut short
    shutil.rmtree(folder / "3.orbax-checkpoint-tmp" / "meta")
    mngr = CheckpointManager(str(folder))
    step, _, meta = mngr.restore_latest(tree(0))
    mngr.close()
    assert step == 2 and meta["step"] == 2
    assert sorted(os.listdir(folder)) == ["1", "2"]
    err = capsys.readouterr().err
    assert f"removed {folder / '3.orbax-checkpoint-tmp'}: an unfinished checkpoint save left it behind" in err, err


@pytest.mark.slow
def test_a_run_whose_disk_fills_during_a_save_stops_and_resumes(reference, tmp_path, monkeypatch):
    """The step-4 save fails as a full disk fails in Orbax (its writer raises with the OS's text, after
    writing part of the step): one clear error, step 2 intact, and the resumed run gives the metrics of
    the uninterrupted one."""
    import orbax.checkpoint as ocp

    from jaxrlhf.models.hf_io import CheckpointError

    real_save = ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step == 4:
            os.makedirs(os.path.join(str(self.directory), "4.orbax-checkpoint-tmp-1", "arrays"))
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "actor/0": No space left on device [os_error_code=28]')
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    out = tmp_path / "run"
    with pytest.raises(CheckpointError, match="cannot save checkpoint step 4 .* the disk is full .* the newest intact "
                                              "checkpoint is step 2. Free space .* run.resume=true"):
        _run(out, "run.steps=4", "run.checkpoint_every=2")
    assert os.listdir(out / "checkpoints") == ["2"]
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
    records = _run(out, "run.steps=4", "run.checkpoint_every=2", "run.resume=true")
    assert _strip_times(records) == _strip_times(reference[1])


@pytest.mark.slow
def test_one_role_whose_updates_are_all_skipped_stops_the_run(tmp_path):
    """NaN in every update of the critic only (learning rate 1e30): the actor still learns, but a critic
    that never changes again makes every later advantage wrong, so the run stops with one line after
    MAX_DEAD_STEPS steps; the checkpoints written before stay readable."""
    from jaxrlhf.checkpoint import CheckpointManager

    out = tmp_path / "run"
    with pytest.raises(RunError, match=r"every update of the last 5 steps \(to step \d+\) had a non-finite loss or "
                                       r"gradient and was skipped \(critic/skipped_nonfinite\), so that model stopped "
                                       r"changing; .* the last checkpoint is step (\d+)") as e:
        _run(out, "run.steps=12", "run.checkpoint_every=2", "optimizer.critic.lr=1e30")
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert len(records) < 12 and all(r["skipped_nonfinite"] == 0 for r in records)  # the actor kept learning
    last = int(str(e.value).rsplit("step ", 1)[1].split()[0])
    mngr = CheckpointManager(str(out / "checkpoints"))
    assert mngr.steps()[-1] == last and mngr.read_meta(last)["step"] == last
    mngr.close()


@pytest.mark.slow
def test_a_run_whose_updates_are_all_skipped_stops_and_exports_nothing(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RunError, match="every update of the last 5 steps"):
        _run(out, "run.steps=12", "optimizer.actor.lr=1e30", "optimizer.critic.lr=1e30", "run.export_hf=true")
    assert not os.path.exists(out / "actor_hf")
    assert len(read_metrics(os.path.join(out, "metrics.jsonl"))) < 12


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigint_saves_the_step_reached_and_resumes(tmp_path):
    # The in-process runs' config on their 8 CPU devices: the CLI run's programs are the `reference`
    # fixture's, loaded from the test run's compilation cache (compiling is most of a tiny run's time)
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "jaxrlhf.train", *BASE, "run.platform=cpu", "run.devices=8", f"run.output_dir={out}",
           "run.checkpoint_every=0", compile_cache.override()]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*cmd, "run.steps=200"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    log = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        if os.path.exists(log) and len(read_metrics(log)) >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "checkpoint saved" in stderr and "run.resume=true" in stderr
    reached = read_metrics(log)[-1]["step"]
    assert os.listdir(os.path.join(out, "checkpoints")) == [str(reached)]
    # the checkpoint restores: one more step continues the same run
    subprocess.run([*cmd, f"run.steps={reached + 1}", "run.resume=true"], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=600)
    assert [r["step"] for r in read_metrics(log)] == list(range(1, reached + 2))


def test_jsonl_rows_with_invalid_utf8_are_skipped_and_counted(tmp_path):
    from jaxrlhf.data.sources import JsonlSource, RowError

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff\xfe1+2=", "answer": "3"}\n')
    source = JsonlSource(path)
    assert source[0]["answer"] == "2"
    with pytest.raises(RowError) as e:
        source[1]
    assert e.value.reason == "invalid_utf8" and "line 2" in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--devices", "0", "--model-preset", "tiny"], "--devices: must be at least 1"),
    (["--model-preset", "tiny", "plan.hardware=h101"], "unknown hardware 'h101'"),
    (["--devices", "lots", "--model-preset", "tiny"], "--devices: expected a whole number (at least 1), got 'lots'"),
])
def test_plan_cli_mistakes_are_one_line(argv, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jaxrlhf.plan", "--out", str(tmp_path), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_train_cli_platform_and_output_folder_mistakes_are_one_line(tmp_path):
    file = tmp_path / "taken"
    file.write_text("x")
    for extra, message in ([f"run.output_dir={file}"], "is a file, not a folder"), (
            ["run.platform=tpu", "run.devices=null", f"run.output_dir={tmp_path / 'o'}"], "no TPU backend"):
        proc = subprocess.run([sys.executable, "-m", "jaxrlhf.train", "--config", "configs/quickstart.yaml",
                               compile_cache.override(), *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(vocab_size="abc"), "vocab_size='abc' must be a number"),
    (lambda c: c.update(num_attention_heads=0), "num_attention_heads=0 must be at least 1"),
    (lambda c: c.update(num_key_value_heads=3), "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    (None, "holds a JSON list"),
])
def test_bad_hf_config_values_name_the_key(edit, message, tmp_path):
    import json

    from jaxrlhf.models.hf_io import CheckpointError, load_hf_checkpoint
    from jaxrlhf.testing.models import save_tiny_hf_checkpoint

    path = save_tiny_hf_checkpoint(tmp_path, "llama", seed=0)
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    if edit is None:
        cfg = [cfg]
    else:
        edit(cfg)
    with open(file, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match="config.json: " + message.replace("(", r"\(")):
        load_hf_checkpoint(path)



def test_plan_file_placing_a_call_on_an_undefined_group_names_the_file_and_group(tmp_path):
    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.planner.plan import PlanError

    plan = tmp_path / "plan.yaml"
    plan.write_text("num_devices: 1\ngroups: {all: {start: 0, size: 1}}\ncalls:\n"
                    "  actor.generate: {group: nowhere}\n"
                    + "".join(f"  {c}: {{group: all}}\n"
                              for c in ("ref.inference", "critic.inference", "actor.train", "critic.train")))
    cfg = cfglib.load_config(None, [*BASE, f"plan.file={plan}"])
    algorithm = build_algorithm(cfg)
    models = planning.role_configs(cfg, algorithm.graph().roles)
    with pytest.raises(PlanError, match=rf"plan.file={plan}: call 'actor.generate' uses group 'nowhere', which the "
                                        r"plan does not define; defined groups: \['all'\]"):
        planning.plan_for(cfg, algorithm, models, 1)


BOMB = "".join(f"{k}: &{k} [{', '.join([f'*{p}'] * 10 if p else ['x'] * 10)}]\n"
               for p, k in zip(["", "a", "b", "c", "d"], "abcde"))


@pytest.mark.parametrize("text, message", [
    (BOMB, "line 4: YAML aliases expand to more than 10,000 nodes"),
    ("name: h100\nname: mine\n", "line 2: duplicate key 'name' (first set on line 1)"),
], ids=["alias_bomb", "duplicate_key"])
def test_plan_files_and_hardware_profiles_are_read_with_the_config_limits(text, message, tmp_path):
    """The limits of the config loader hold for every YAML file a user hands in."""
    from jaxrlhf.planner.hardware import get_profile
    from jaxrlhf.planner.plan import ExecutionPlan, PlanError

    path = tmp_path / "user.yaml"
    path.write_text(text)
    with pytest.raises(PlanError, match=f"{path}, {message}".replace("(", r"\(").replace(")", r"\)")):
        ExecutionPlan.load(str(path))
    with pytest.raises(ValueError, match=f"{path}, {message}".replace("(", r"\(").replace(")", r"\)")):
        get_profile(str(path))
    with pytest.raises(cfglib.ConfigError, match=f"plan.hardware={str(path)!r}: {path}, "):  # as training says it
        planning.hardware_profile(cfglib.load_config(None, [f"plan.hardware={path}"]))
