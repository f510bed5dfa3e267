"""`rewards.workers`: rule rewards scored in worker processes give the scores the rules give (a streamed
run scored by workers against the synchronous step: tests/test_partial_rollouts.py)."""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import threading
import time

import pytest

from jaxrlhf.rewards.pool import RewardPool, rows_at_once
from jaxrlhf.rewards.rules import CombinedReward

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


class _SlowScorer(http.server.BaseHTTPRequestHandler):
    """Scores a row after DELAY seconds (a judge or test runner): the response's length."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        row = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(DELAY)
        body = json.dumps({"score": float(len(row["response"]))}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


DELAY = 0.5


@pytest.fixture(scope="module")
def slow_url():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowScorer)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/score"
    httpd.shutdown()
    httpd.server_close()


def test_a_free_worker_gathers_the_queued_samples_up_to_the_rules_concurrency(slow_url):
    """Eight one-row tasks of one step handed over at once (samples that ended in one chunk): the first
    goes alone, the other seven together (the `remote` rule scores 8 rows at once), so two delays, not
    eight; each task gets its own rows back, and the seconds add up to the worker's."""
    url = slow_url
    spec = [("remote", 1.0, {"url": url, "timeout": 10, "retries": 0, "concurrency": 8})]
    assert rows_at_once(spec) == 8 and rows_at_once(SPEC) is None
    assert rows_at_once([("remote", 1.0, {"url": url})]) == 8  # the rule's default
    pool = RewardPool(spec, workers=1)
    try:
        pool.submit(["warm"], ["x"], [None]).result()  # the worker started and imported
        start = time.perf_counter()
        futures = [pool.submit([f"p{i}"], ["y" * i], [None], priority=3) for i in range(8)]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - start
        # one task per hand-off took 8 x 0.5 s; gathered, 2 x 0.5 s (a wide margin for a loaded machine)
        assert wall < 5 * DELAY, wall
        assert [r[0] for r in results] == [[{"remote": float(i), "remote/failure": 0.0, **{
            k: 0.0 for k in results[0][0][0] if k not in ("remote", "remote/failure")}}] for i in range(8)]
        assert 2 * DELAY * 0.95 <= sum(r[1] for r in results) < 5 * DELAY  # two rounds, not eight
        assert DELAY * 0.95 <= pool.timing.row_s < 4 * DELAY  # every task was one round (not 8 x DELAY)
    finally:
        pool.close()


def test_the_step_measures_its_rules_for_the_planner(slow_url):
    """`score_rules` in the step times the rules: 16 rows, 8 at once, two rounds of DELAY; the
    workload the planner prices the step with (`reward_row_s`) is that round."""
    import numpy as np

    from jaxrlhf.algorithms import build_algorithm
    from jaxrlhf.config import load_config
    from jaxrlhf.models.tokenizer import ByteTokenizer

    cfg = load_config(None, ["algorithm.name=grpo", "algorithm.group_size=4", "model.actor.preset=tiny",
                             "model.tokenizer=byte", f'rewards.rules=[{{name: remote, weight: 1.0, args: '
                             f'{{url: "{slow_url}", retries: 0, concurrency: 8}}}}]'])
    alg = build_algorithm(cfg)
    alg.tokenizer = ByteTokenizer()  # what `bind` attaches (the step needs no model)
    assert alg.workload().reward_row_s == 0.0 and alg.workload().reward_at_once == 8  # nothing scored yet
    texts = [str(i) * (i % 5 + 1) for i in range(16)]
    tokens = np.zeros((16, 16), np.int32)
    mask = np.zeros((16, 16), bool)
    for r, text in enumerate(texts):
        ids = alg.tokenizer.encode(text)
        tokens[r, :len(ids)], mask[r, :len(ids)] = ids, True
    start = time.perf_counter()
    out = alg.host_steps()["score_rules"](prompts=["p"] * 16, answers=[None] * 16, response_tokens=tokens,
                                          response_mask=mask)
    wall = time.perf_counter() - start
    assert out["rule_scores"].tolist() == [float(len(t)) for t in texts]
    assert alg.workload().reward_row_s == pytest.approx(wall / 2, rel=0.2)
    # a round of 8 rows at once is one delay, not eight (sequential rows: 8 x DELAY); never shorter than the
    # server's sleep, longer on a loaded machine (HTTP and thread start-up ride on it)
    assert DELAY * 0.95 <= alg.workload().reward_row_s < 4 * DELAY
