"""The planner weighs context parallelism for long sequences: the search's layouts and the heuristic
preset's ladder include context degrees there (never for generation; beside pipeline stages too), and on a
32k-token workload the plan splits the train call's sequences and says why."""

from __future__ import annotations

import re

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.plan import main
from jaxrlhf.planner.plan import CONTEXT_MIN_TOKENS, ExecutionPlan
from jaxrlhf.planner.search import valid_layouts
from jaxrlhf.planner.workload import Workload

TRAIN = CallSpec("actor.train", "actor", "train")
GENERATE = CallSpec("actor.generate", "actor", "generate")


def test_context_degrees_are_weighed_for_long_sequences_only():
    cfg = preset("qwen2-7b")
    long = Workload(batch_size=64, prompt_len=1024, gen_len=CONTEXT_MIN_TOKENS, minibatches=4, micro_batch=1)
    short = Workload(batch_size=64, prompt_len=1024, gen_len=1024, minibatches=4, micro_batch=1)
    degrees = {lay.context for lay in valid_layouts(TRAIN, cfg, 16, long, 8)}
    assert degrees == {1, 2, 4, 8, 16}
    assert any(lay.stage > 1 for lay in valid_layouts(TRAIN, cfg, 16, long, 8) if lay.context > 1)  # rings in stages
    assert {lay.context for lay in valid_layouts(TRAIN, cfg, 16, short, 8)} == {1}
    assert {lay.context for lay in valid_layouts(GENERATE, cfg, 16, long, 8)} == {1}


def test_a_32k_token_plan_splits_the_train_calls_sequences_and_says_why(tmp_path, capsys):
    rc = main(["--devices", "64", "--hardware", "h100", "--model-preset", "qwen2-7b", "--algorithm", "grpo",
               "--prompt-len", "1024", "--gen-len", "31744", "--batch", "8", "--evaluations", "200",
               "algorithm.group_size=8", "algorithm.micro_batch_size=1",
               # dense attention: blockwise, a whole 32k sequence trains on one device (test_context_memory)
               "model.actor.overrides={blockwise_attention_from: null}", "--out", str(tmp_path)])
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



def test_the_planner_chooses_the_packed_token_budget_and_the_run_packs_with_it(tmp_path, capsys):
    """Packing on, algorithm.max_tokens_per_micro_batch unset: the search tries each candidate budget
    (`planner.budget`), keeps the fastest plan that fits, writes its budget into the plan file, prints
    why, and the run's config takes it (a budget the config sets wins)."""
    from jaxrlhf import config as cfglib
    from jaxrlhf.algorithms import declare
    from jaxrlhf.plan import parse_args, resolve_config
    from jaxrlhf.planner.budget import budget_candidates
    from jaxrlhf.run.planning import knob_workload

    argv = ["--devices", "8", "--hardware", "h100", "--model-preset", "qwen2-7b", "--algorithm", "grpo",
            "--prompt-len", "512", "--gen-len", "8192", "--batch", "32", "--evaluations", "1000",
            "algorithm.group_size=8", "algorithm.pack_sequences=true", "plan.response_length_median=1024",
            "plan.response_length_sigma=1",
            # dense attention: rows as wide as the batch, where a budget pays (attending blockwise, one row a
            # shard runs fastest with none here)
            "model.actor.overrides={blockwise_attention_from: null}", "model.ref.overrides={blockwise_attention_from: null}",
            "--out", str(tmp_path)]
    rc = main(argv)
    assert rc == 0
    text = capsys.readouterr().out
    plan = ExecutionPlan.load(str(tmp_path / "plan.yaml"))
    line = re.search(r"token budget \(algorithm\.max_tokens_per_micro_batch unset\): (\d+) tokens per micro-batch, "
                     r"the fastest that fits of (.*)", text)
    assert line and int(line.group(1)) == plan.token_budget
    tried = dict(re.findall(r"(none|\d+): (does not fit|[\d.]+ s)", line.group(2)))
    wl = declare(resolve_config(parse_args(argv))).workload()
    assert wl.packed and wl.token_budget is None
    assert list(tried) == ["none" if b is None else str(b) for b in budget_candidates(wl)]
    seconds = {b: float(t[:-2]) for b, t in tried.items() if t != "does not fit"}
    assert seconds["none" if plan.token_budget is None else str(plan.token_budget)] == min(seconds.values())
    assert f"packed micro-batches of at most {plan.token_budget} tokens" in text
    # the run packs with the plan's budget; one the config sets wins
    cfg = cfglib.with_overrides(cfglib.load_config("configs/quickstart-grpo.yaml"), ["algorithm.pack_sequences=true"])
    assert knob_workload(declare(cfg), plan).token_budget == plan.token_budget == plan.execution.token_budget
    own = cfglib.with_overrides(cfg, ["algorithm.max_tokens_per_micro_batch=100000"])
    assert knob_workload(declare(own), plan).token_budget == 100000
