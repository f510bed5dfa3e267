"""The bundled coding task: write-a-function prompts whose answer column is the asserts that the
`sandboxed_python` rule runs. Scores of hand-written right and wrong programs are hand-counted from
the rows' own tests; a short GRPO run of configs/coding-sandbox.yaml scores its samples in the sandbox."""

from __future__ import annotations

import os

import pytest

from jaxrlhf.data.sources import open_source
from jaxrlhf.rewards.rules import CombinedReward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULE = CombinedReward([("sandboxed_python", 1.0, {"timeout": 10, "cpu_seconds": 2, "workers": 2})])

# (function, a wrong program, the fraction of that row's tests it passes, counted by hand)
WRONG = [
    # reverse_list([1, 2, 3]) fails, [] passes, [5] passes, ['a', 'b'] fails: 2 of 4
    ("reverse_list", "def reverse_list(xs):\n    return xs\n", 2 / 4),
    # 'racecar' True passes, 'ab' False passes, '' raises IndexError, 'abba' passes, 'abca' True fails: 3 of 5
    ("is_palindrome", "def is_palindrome(s):\n    return s[0] == s[-1]\n", 3 / 5),
    # 15 is divisible by 3 first: 'Fizz' fails; 9, 10 and 7 pass: 3 of 4
    ("fizzbuzz", "def fizzbuzz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n"
                 "        return 'Buzz'\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    return str(n)\n", 3 / 4),
]


def _rows(tmp_path) -> dict[str, dict]:
    """Every row of both splits by its function's name (the task loads through its TFDS builder)."""
    rows = {}
    for split in ("train", "test"):
        source = open_source("coding", split, str(tmp_path))
        for i in range(len(source)):
            row = source[i]
            rows[row["prompt"].split("`")[1].split("(")[0]] = row
    return rows


def _fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\n"


def test_right_and_wrong_programs_score_their_fraction_of_the_rows_tests(tmp_path):
    rows = _rows(tmp_path)
    assert len(rows) == 51 and {"reverse_list", "is_palindrome", "fizzbuzz"} <= set(rows)
    responses, answers, expected = [], [], []
    for name, wrong, fraction in WRONG:
        row = rows[name]
        assert row["prompt"].startswith(f"Write a Python function `{name}(")
        responses += [_fenced(row["solution"]), _fenced(wrong)]
        answers += [row["answer"], row["answer"]]
        expected += [1.0, fraction]
    # what a byte-level model samples: not Python; its tests run and fail (scored 0, not a failure)
    responses.append("d}f rev(\x01 xs:: ~~")
    answers.append(rows["reverse_list"]["answer"])
    expected.append(0.0)
    parts = RULE.batch_components(["p"] * len(responses), responses, answers)
    assert [p["sandboxed_python"] for p in parts] == pytest.approx(expected)
    assert all(p["sandboxed_python/failure"] == 0 for p in parts)


@pytest.mark.slow
def test_every_reference_solution_passes_all_its_tests_and_an_empty_program_none(tmp_path):
    """The tests are hand-written values and the solutions hand-written code: they check each other."""
    rows = list(_rows(tmp_path).values())
    responses = [_fenced(r["solution"]) for r in rows] + ["pass\n"] * len(rows)
    answers = [r["answer"] for r in rows] * 2
    scores = [p["sandboxed_python"] for p in RULE.batch_components(["p"] * len(responses), responses, answers)]
    assert scores == [1.0] * len(rows) + [0.0] * len(rows)


@pytest.mark.slow
def test_coding_config_runs_and_scores_its_samples_in_the_sandbox(tmp_path):
    """Two steps of configs/coding-sandbox.yaml (smaller batch and responses): the tiny model's programs are run
    by the reward workers beside decoding, scored, counted; none is killed by another's cleanup (`crashed`)."""
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics

    out = tmp_path / "run"
    cfg = cfglib.load_config(os.path.join(ROOT, "configs", "coding-sandbox.yaml"), [
        "run.steps=2", f"run.output_dir={out}", "run.tensorboard=false", "run.export_hf=false",
        "run.save_checkpoints=false", f"data.data_dir={tmp_path / 'tfds'}", "data.batch_size=4",
        "algorithm.group_size=2", "generation.max_new_tokens=16", "generation.stream_chunk=8"])
    train.run(cfg)
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 <= r["reward/rule/sandboxed_python"] <= 1.0 and r["reward/rule/sandboxed_python/crashed"] == 0.0
        assert 0.0 <= r["reward/rule/sandboxed_python/failure"] <= 1.0
        assert r["time/reward_work_s"] > 0.0 and 0.0 <= r["reward/hidden_frac"] <= 1.0
