"""The planner weighs context parallelism for long sequences: the search's layouts and the heuristic
preset's ladder include context degrees there (never for generation, never pipelined), and on a
32k-token workload the plan splits the train call's sequences and says why."""

from __future__ import annotations

import re

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.plan import main
from jaxrlhf.planner.cost import Workload
from jaxrlhf.planner.plan import CONTEXT_MIN_TOKENS, ExecutionPlan
from jaxrlhf.planner.search import valid_layouts

TRAIN = CallSpec("actor.train", "actor", "train")
GENERATE = CallSpec("actor.generate", "actor", "generate")


def test_context_degrees_are_weighed_for_long_sequences_only():
    cfg = preset("qwen2-7b")
    long = Workload(batch_size=64, prompt_len=1024, gen_len=CONTEXT_MIN_TOKENS, minibatches=4, micro_batch=1)
    short = Workload(batch_size=64, prompt_len=1024, gen_len=1024, minibatches=4, micro_batch=1)
    degrees = {lay.context for lay in valid_layouts(TRAIN, cfg, 16, long, 8)}
    assert degrees == {1, 2, 4, 8, 16}
    assert all(lay.stage == 1 for lay in valid_layouts(TRAIN, cfg, 16, long, 8) if lay.context > 1)
    assert {lay.context for lay in valid_layouts(TRAIN, cfg, 16, short, 8)} == {1}
    assert {lay.context for lay in valid_layouts(GENERATE, cfg, 16, long, 8)} == {1}


def test_a_32k_token_plan_splits_the_train_calls_sequences_and_says_why(tmp_path, capsys):
    rc = main(["--devices", "64", "--hardware", "h100", "--model-preset", "qwen2-7b", "--algorithm", "grpo",
               "--prompt-len", "1024", "--gen-len", "31744", "--batch", "8", "--time-budget", "3",
               "algorithm.group_size=8", "algorithm.micro_batch_size=1", "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    plan = ExecutionPlan.load(str(tmp_path / "plan.yaml"))
    assert plan.calls["actor.train"].layout.context > 1
    assert plan.calls["actor.generate"].layout.context == 1
    why = re.search(r"actor\.train: its 32768-token sequences over (\d+) devices .* need ([\d.]+) GiB per device; "
                    r"whole on one device \(\S+\) they need ([\d.]+) GiB of ([\d.]+) usable: does not fit", text)
    assert why, text
    assert int(why[1]) == plan.calls["actor.train"].layout.context
    assert float(why[2]) < float(why[4]) < float(why[3])

