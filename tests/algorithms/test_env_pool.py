"""Environments in worker processes (`environments/pool.py`, `env.workers`): episodes live in one worker each,
built from a user module the workers import (`env.imports`); multi-turn generation with them gives the same
trajectories, rewards and metrics as with the environments in the trainer; a step that raises, hangs past
`env.step_timeout_s` or kills its worker ends its episode (counted, failure reward), never the run."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from jaxrlhf.environments import EnvironmentContext, make_environment
from jaxrlhf.environments.pool import EnvPool, EnvStepFailed, EnvWorkerError
from jaxrlhf.models.multiturn import ENGINE_METRICS

# A user's module registering an environment: the workers import it by name (env.imports), as a run would.
MODULE = "envpool_test_envs"
SOURCE = '''
import os, time
from jaxrlhf.environments import Observation, StepResult, register_environment

class Scripted:
    """Shows "<k:LEN>" after turn k; ends after row["turns"] turns with reward turns + LEN / 100. At step
    row["fault_at"] it does row["fault"]: raise, crash (the process exits) or hang."""

    def __init__(self, context):
        self.k = 0

    def reset(self, row):
        self.row = row
        return Observation(row["prompt"])

    def step(self, text):
        self.k += 1
        if self.k == self.row.get("fault_at"):
            if self.row["fault"] == "raise":
                raise RuntimeError("the environment broke")
            if self.row["fault"] == "crash":
                os._exit(3)
            time.sleep(60)
        info = {"steps": 1.0, **({"pid": float(os.getpid())} if self.row.get("pid") else {})}
        if self.k >= self.row["turns"]:
            return StepResult(None, self.k + len(text) / 100, True, info)
        return StepResult(Observation(f"<{self.k}:{len(text)}>"), 0.0, False, info)

register_environment("scripted_test")(Scripted)
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_envs")
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    sys.path.insert(0, str(folder))  # the workers get the trainer's sys.path
    __import__(MODULE)  # registered here too, for the in-process runs
    yield MODULE
    sys.path.remove(str(folder))


def _pool(module, workers=2, timeout=2.0, **kw):
    return EnvPool("scripted_test", EnvironmentContext(), kw.pop("args", {}), workers=workers, step_timeout_s=timeout,
                   imports=[module], **kw)


def test_episodes_stick_to_their_worker_and_faults_end_only_their_episode(user_module):
    """Episodes are dealt to the workers in turn and stepped there (another process); a step that raises ends
    its episode and the worker's other episodes go on; one that hangs past the timeout is stopped (the worker
    restarted, its other episodes lost); one that kills its worker likewise; new episodes run on the
    restarted workers."""
    pool = _pool(user_module)
    try:
        rows = [{"prompt": "a", "turns": 3, "fault_at": 2, "fault": "raise"},
                {"prompt": "b", "turns": 3, "fault_at": 2, "fault": "hang"},
                {"prompt": "c", "turns": 2, "pid": True}, {"prompt": "d", "turns": 2}]
        episodes, observations = pool.reset(rows)
        assert [o.text for o in observations] == ["a", "b", "c", "d"]
        assert [e.worker.index for e in episodes] == [0, 1, 0, 1]  # dealt in turn
        assert episodes[0].step("xy").observation.text == "<1:2>" and episodes[1].step("").observation.text == "<1:0>"
        with pytest.raises(EnvStepFailed, match="the environment broke") as raised:
            episodes[0].step("z")
        assert raised.value.kind == "raised"
        first = episodes[2].step("abc")  # the same worker kept its other episode
        assert first.observation.text == "<1:3>" and first.info["pid"] != os.getpid()
        assert episodes[2].step("q").done
        start = time.perf_counter()
        with pytest.raises(EnvStepFailed) as timeout:
            episodes[1].step("w")
        assert timeout.value.kind == "timeout" and 2.0 <= time.perf_counter() - start < 30
        with pytest.raises(EnvStepFailed) as lost:  # it lived in the worker the timeout restarted
            episodes[3].step("w")
        assert lost.value.kind == "worker_lost"
        again, _ = pool.reset([{"prompt": "e", "turns": 1}, {"prompt": "f", "turns": 1, "fault_at": 1, "fault": "crash"}])
        assert [e.worker.index for e in again] == [0, 1]
        assert again[0].step("ok").reward == pytest.approx(1.02)
        with pytest.raises(EnvStepFailed, match="exit code 3") as crash:
            again[1].step("x")
        assert crash.value.kind == "worker_crash"
        last, _ = pool.reset([{"prompt": "g", "turns": 1}, {"prompt": "h", "turns": 1}])
        assert [e.step("").done for e in last] == [True, True]  # the crashed worker was replaced
        assert last[1].reset({"prompt": "i", "turns": 1}).text == "i" and last[1].step("").done  # a fresh one there
        pool.release([*episodes, *again, *last])
    finally:
        pool.close()


def test_bad_setups_are_one_clear_error(user_module):
    with pytest.raises(ValueError, match="env.workers: an environment pool needs at least one worker"):
        _pool(user_module, workers=0)
    with pytest.raises(ValueError, match="env.args must pickle"):
        _pool(user_module, args={"reward": lambda row, text: 1.0})
    pool = EnvPool("scripted_test", EnvironmentContext(), workers=1, imports=["no_such_envs_module"])
    try:
        with pytest.raises(EnvWorkerError, match="env.imports: cannot import .no_such_envs_module"):
            pool.reset([{"prompt": "a", "turns": 1}])
    finally:
        pool.close()
    pool = EnvPool("tools", EnvironmentContext(), workers=1)  # the factory's own error, as in the trainer
    try:
        with pytest.raises(ValueError, match="needs a chat template"):
            pool.reset([{"prompt": "a"}])
    finally:
        pool.close()


def test_tool_environment_in_a_worker_steps_as_in_the_trainer(tmp_path):
    """env.name=tools with the context a run builds (a checkpoint tokenizer and its chat template, which
    reach the worker pickled): the worker's first observation and every step's result (a call, a malformed
    call, the answer) equal the same environment's in the trainer."""
    import importlib.util
    import json
    import pathlib

    from jaxrlhf.models.tokenizer import HFTokenizer
    from jaxrlhf.testing.models import save_tiny_tokenizer

    where = pathlib.Path(__file__).with_name("test_environments.py")  # its Qwen2.5 tool template and call format
    spec = importlib.util.spec_from_file_location("_env_pool_tool_cases", where)
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    folder = save_tiny_tokenizer(tmp_path / "tok", "qwen2", corpus=["<tool_call> calculator expression"])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": cases.QWEN25,
                                                              "eos_token": "<|im_end|>"}))
    tok = HFTokenizer(folder)
    context = EnvironmentContext(tokenizer=tok, chat_template=tok.chat_template, tool_format="qwen2.5",
                                 end_of_turn=("<|im_end|>",))
    row = {"prompt": "What is (3 + 4) * 6?", "answer": "42"}
    here = make_environment("tools", context, {"tools": ["calculator"]})
    pool = EnvPool("tools", context, {"tools": ["calculator"]}, workers=1)
    try:
        [episode], [first] = pool.reset([row])
        assert first == here.reset(row) and "calculator" in first.text
        for action in (cases.CALL.format(name="calculator", args='{"expression": "(3 + 4) * 6"}'),
                       '<tool_call>\n{"name": "calculator", "arguments": }\n</tool_call>', "42"):
            assert episode.step(action) == here.step(action)
    finally:
        pool.close()


# ---------------------------------------------------------------- in multi-turn generation


@pytest.fixture(scope="module")
def tiny():
    from flax import nnx

    from jaxrlhf.models.config import preset
    from jaxrlhf.testing.models import random_model

    return nnx.split(random_model(preset("tiny"), seed=0))


def _generate(tiny, envs, rows):
    from jaxrlhf.models import multiturn as mt
    from jaxrlhf.models.sampling import SamplingParams
    from jaxrlhf.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    # tests/models/test_multiturn.py's spec (its compiled programs): many end-of-turn ids, so turns end often
    spec = mt.MultiTurnSpec(rows=4, prompt_bucket=16, max_tokens=64, max_turn_tokens=12, sampling=SamplingParams(),
                            eos_ids=tuple(range(3, 51)), pad_id=0, max_observation_tokens=7)
    return mt.generate_multiturn(*tiny, envs=envs, rows=rows, encode=tok.encode, decode_text=tok.decode,
                                 rng=jax.random.key(0), spec=spec, max_turns=4, chunk=4, failure_reward=-1.0,
                                 prompt_ids=[tok.encode(r["prompt"]) for r in rows])


ROWS = [{"prompt": "hi", "turns": 3}, {"prompt": "what is 2+2", "turns": 1},
        {"prompt": "x", "turns": 3, "fault_at": 2, "fault": "raise"}, {"prompt": "tell me", "turns": 2}]


def _same(a, b, rows):
    for name in ("response_tokens", "loss_mask", "logprobs", "lengths", "env_reward", "turns"):
        np.testing.assert_array_equal(getattr(a, name)[rows], getattr(b, name)[rows], err_msg=name)
    assert [a.counters[i] for i in rows] == [b.counters[i] for i in rows]
    assert [a.finish[i] for i in rows] == [b.finish[i] for i in rows]


@pytest.mark.slow  # compiles start, decode and extend of the tiny model (shared with tests/models/test_multiturn.py)
def test_generation_with_worker_environments_equals_in_process(user_module, tiny):
    """The same episodes with the environments in the trainer (threads) and in 2 workers: identical
    trajectories, rewards, counters, finish reasons and metrics (a raising step included: its episode scores
    the failure reward). A worker killed mid-episode ends that episode (worker_crash, failure reward); the
    other worker's episodes are unchanged."""
    here = [make_environment("scripted_test", EnvironmentContext()) for _ in ROWS]
    for env, row in zip(here, ROWS):
        env.reset(row)
    local = _generate(tiny, here, ROWS)
    assert local.finish[2] == "env_error" and local.env_reward[2] == -1.0
    assert "done" in local.finish and local.loss_mask.sum() < local.response_mask.sum()  # observations appended
    pool = _pool(user_module)
    try:
        episodes, _ = pool.reset(ROWS)
        remote = _generate(tiny, episodes, ROWS)
        _same(local, remote, range(4))
        episode_metrics = lambda out: {k: v for k, v in out.metrics().items() if k not in ENGINE_METRICS}  # noqa: E731
        assert episode_metrics(local) == episode_metrics(remote) and remote.metrics()["env/env_error/raised"] == 0.25
        pool.release(episodes)
        crashing = [dict(ROWS[0], fault_at=1, fault="crash"), *ROWS[1:]]
        episodes, _ = pool.reset(crashing)
        assert [e.worker.index for e in episodes] == [0, 1, 0, 1]
        crashed = _generate(tiny, episodes, crashing)
    finally:
        pool.close()
    assert crashed.finish[0] == "env_error" and crashed.env_reward[0] == -1.0
    assert crashed.counters[0] == {"env_error": 1.0, "env_error/worker_crash": 1.0}
    _same(local, crashed, [1, 3])  # the other worker's episodes
    # row 2 shared the crashed worker: it raised before (its own fault) or found its environment lost
    assert crashed.finish[2] == "env_error" and crashed.env_reward[2] == -1.0


@pytest.mark.parametrize("overrides, message", [
    (["env.workers=-1"], "env.workers"),
    (["env.step_timeout_s=0"], "env.step_timeout_s"),
    (["env.imports=[my-envs]"], "must be importable module names, e.g. [my_envs]"),
    (["env.name=tools", "generation.engine=continuous", "env.imports=[no_such_envs_module]"],
     "env.imports: cannot import 'no_such_envs_module'"),
    (["env.name=openai_agent", "env.agent=m:f", "env.workers=2"], "set env.workers=0"),
])
def test_env_worker_config_refusals(overrides, message):
    from jaxrlhf.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)
    load_config(None, ["env.name=tools", "generation.engine=continuous", "env.workers=2", "env.step_timeout_s=null",
                       "env.imports=[json]", "env.failure=-1"])
