"""`rewards.workers`: rule rewards scored in worker processes give the scores the rules give (a streamed
run scored by workers against the synchronous step: tests/test_partial_rollouts.py)."""

from __future__ import annotations

import concurrent.futures

import pytest

from jaxrlhf.algorithms.reward_pool import RewardPool
from jaxrlhf.algorithms.rules import CombinedReward

SPEC = [("exact_match", 1.0, {}), ("format", 0.5, {"pattern": "[0-9]+"})]


def test_workers_score_what_the_rules_score():
    prompts = [f"{i}+1=" for i in range(7)]
    responses = ["1", "2", "x", "3", "4", "", "7"]
    answers = ["1", "3", "3", "3", "5", "6", "7"]
    pool = RewardPool(SPEC, workers=2)
    try:
        assert pool.score(prompts, responses, answers) == CombinedReward(SPEC).batch_components(
            prompts, responses, answers)
        parts, seconds = pool.submit(prompts[:2], responses[:2], answers[:2]).result()
        assert len(parts) == 2 and seconds >= 0
        # at most one task per worker; the rest wait by priority: the late urgent task overtakes
        expected = pool.score(prompts, responses, answers)
        one = RewardPool(SPEC, workers=1)
        try:
            ended, futures = [], []
            for name, priority in (("first", 5), ("later", 5), ("urgent", 1)):
                futures.append(one.submit(prompts, responses, answers, priority=priority))
                futures[-1].add_done_callback(lambda f, name=name: ended.append((name, f.result()[0] == expected)))
            concurrent.futures.wait(futures)
        finally:
            one.close()
        assert ended == [("first", True), ("urgent", True), ("later", True)]
    finally:
        pool.close()
    with pytest.raises(ValueError, match="at least one worker"):
        RewardPool(SPEC, workers=0)
