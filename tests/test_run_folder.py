"""What a run says about its files: every path it writes, and how often, at the start and at the end."""

from jaxrlhf import config as cfglib
from jaxrlhf.run.folder import RunFiles


def _run(*overrides):
    return cfglib.load_config(None, ["run.output_dir=runs/x", *overrides]).run


def test_the_start_names_every_file_and_how_often():
    run = _run("run.log_every=10", "run.checkpoint_every=50", "run.keep_checkpoints=3")
    text = RunFiles.of(run, ("actor", "critic")).summary(run)
    assert text.splitlines() == [
        "run folder: runs/x",
        "  metrics:     runs/x/metrics.jsonl (every 10 steps and the last, run.log_every=10; the console shows the "
        "same steps)",
        "  tensorboard: runs/x/tensorboard (tensorboard --logdir runs/x/tensorboard)",
        "  plan:        runs/x/plan.yaml (the placement it starts with; plan.file=... runs it again), priced with "
        "runs/x/hardware.yaml",
        "  checkpoints: runs/x/checkpoints (every 50 steps and the last, the newest 3 kept)",
        "  actor model: runs/x/actor_hf (HF checkpoint, written at the end)",
        "  critic model: runs/x/critic_hf (HF checkpoint, written at the end)",
    ]


def test_the_end_names_what_was_written():
    run = _run("run.log_every=1", "run.tensorboard=false", "run.export_hf=false", "run.checkpoint_every=0")
    files = RunFiles.of(run, ("actor",))
    assert files.tensorboard is None and files.exports == {}
    assert files.summary(run, last_checkpoint=7, finished=True).splitlines() == [
        "run folder: runs/x",
        "  metrics:     runs/x/metrics.jsonl (every step, run.log_every=1; the console shows the same steps)",
        "  plan:        runs/x/plan.yaml (the placement it started with; plan.file=... runs it again), priced with "
        "runs/x/hardware.yaml",
        "  checkpoints: runs/x/checkpoints (latest: step 7)",
    ]
    assert "checkpoints: at the last step" not in files.summary(run)
    assert "(at the last step, the newest 3 kept)" in files.summary(run)


def test_a_run_that_saves_no_checkpoint_says_so():
    run = _run("run.save_checkpoints=false")
    assert "  checkpoints: none (run.save_checkpoints=false)" in RunFiles.of(run, ()).summary(run).splitlines()
