"""Multi-turn generation (`models/multiturn.py`): an observation is prefilled onto a row's existing pages,
and the logits after it equal a full recompute of the whole trajectory; the trajectory is token in / token
out (the observation's tokens exactly as encoded, loss-masked), and the other rows decode while a row's
environment steps."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.environments import Observation, StepResult
from jaxrlhf.models import multiturn as mt
from jaxrlhf.models.config import preset
from jaxrlhf.models.sampling import SamplingParams
from jaxrlhf.models.tokenizer import ByteTokenizer
from jaxrlhf.models.transformer import positions_from_mask
from jaxrlhf.testing.models import random_model

TOK = ByteTokenizer()
# Many end-of-turn ids, so a random tiny model ends turns often (a real model ends on EOS).
EOT = tuple(range(3, 3 + 48))
SPEC = mt.MultiTurnSpec(rows=4, prompt_bucket=16, max_tokens=64, max_turn_tokens=12, sampling=SamplingParams(),
                        eos_ids=EOT, pad_id=0, max_observation_tokens=7)  # pages of 16, extends of 8 tokens


class Echo:
    """Shows "<k:LEN>" after turn k (the length of the model's text); ends after `turns` turns with reward
    turns + (the last turn's length) / 100."""

    def __init__(self, turns: int):
        self.turns, self.k, self.actions, self.threads = turns, 0, [], set()

    def reset(self, row):
        return Observation(row["prompt"])

    def step(self, action_text):
        self.threads.add(threading.get_ident())
        self.k += 1
        self.actions.append(action_text)
        if self.k >= self.turns:
            return StepResult(None, self.k + len(action_text) / 100, True, {"steps": 1.0})
        return StepResult(Observation(f"<{self.k}:{len(action_text)}>"), 0.0, False, {"steps": 1.0})


class Faulty(Echo):
    """An Echo whose second step raises: its episode ends (`env_error`), the others go on."""

    def step(self, action_text):
        if self.k == 1:
            self.actions.append(action_text)
            raise RuntimeError("the environment broke")
        return super().step(action_text)


@pytest.fixture(scope="module")
def model():
    return random_model(preset("tiny"), seed=0)


def _dense_logprobs(model, prompt, prompt_mask, response, response_mask):
    tokens = np.concatenate([prompt, response], axis=1)
    mask = np.concatenate([prompt_mask, response_mask], axis=1)
    m = jnp.asarray(mask)
    logits, _ = model(jnp.asarray(tokens), positions_from_mask(m), m)
    logp = jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1)
    p = prompt.shape[1]
    # logits at column c predict column c + 1
    return np.take_along_axis(np.asarray(logp)[:, p - 1:-1], response[..., None], axis=-1)[..., 0], logits


@pytest.mark.slow  # ~30 s on a shared 2-core machine: compiles start, decode and extend
def test_observation_extends_the_cache_and_equals_a_full_recompute(model):
    """Episodes of 1-3 turns: every sampled token's log-prob (those right after an observation come from the
    extend's logits) equals a dense forward over prompt + the whole trajectory; observation tokens are the
    encoded observations, loss_mask 0; the environments saw exactly the sampled turns' text."""
    graphdef, params = nnx.split(model)
    envs = [Echo(3), Echo(1), Faulty(3), Echo(3)]
    rows = [{"prompt": p} for p in ("hi", "what is 2+2", "x", "tell me")]
    out = mt.generate_multiturn(graphdef, params, envs=envs, rows=rows, encode=TOK.encode, decode_text=TOK.decode,
                                rng=jax.random.key(0), spec=SPEC, max_turns=4, chunk=4)
    assert out.loss_mask[out.response_mask].sum() < out.response_mask.sum()  # some observations were appended
    cuts = 0
    for i, env in enumerate(envs):
        n = out.lengths[i]
        tokens, keep = out.response_tokens[i, :n].tolist(), out.loss_mask[i, :n].tolist()
        # split the trajectory into its model turns and its observations (runs of loss_mask 1 and 0)
        runs = []
        for t, k in zip(tokens, keep):
            if not runs or runs[-1][0] != k:
                runs.append((k, []))
            runs[-1][1].append(t)
        turns = [r for k, r in runs if k]
        observations = [r for k, r in runs if not k]
        assert [TOK.decode(t) for t in turns[:len(env.actions)]] == env.actions  # what the environment was shown
        for k, (turn, observation) in enumerate(zip(turns, observations)):
            # the encoded text the environment returned, after an end-of-turn token closing a turn that was cut
            cut = turn[-1] not in EOT
            cuts += cut
            assert cut == (len(turn) == SPEC.max_turn_tokens) or not cut
            assert observation == [EOT[0]] * cut + TOK.encode(f"<{k + 1}:{len(env.actions[k])}>")
        if out.finish[i] == "done":
            assert out.env_reward[i] == pytest.approx(env.turns + len(env.actions[-1]) / 100)
            assert out.turns[i] == env.turns == len(turns)
    assert set(out.finish) <= {"done", "max_tokens", "env_error"} and "done" in out.finish
    # two turns of at most 12 tokens and an observation fit the 64-token budget: the second step raised
    assert out.finish[2] == "env_error" and out.counters[2]["env_error"] == 1 and out.turns[2] == 2
    dense, _ = _dense_logprobs(model, out.prompt_tokens, out.prompt_mask, out.response_tokens, out.response_mask)
    sampled = out.loss_mask
    np.testing.assert_allclose(out.logprobs[sampled], dense[sampled], atol=2e-4)
    assert (out.logprobs[~sampled] == 0).all()
    metrics = out.metrics()
    assert metrics["env/steps"] > 1 and 0 < metrics["env/finish/done"] <= 1
    # what the planner prices the batch with: the decode steps cover the row that decoded most (each turn's
    # first token is sampled by the prefill or an extend) and each step samples for one row at least; an
    # extend prefills one observation at least
    starts = [1 + int(np.sum(np.diff(out.loss_mask[i, :out.lengths[i]].astype(int)) == 1)) for i in range(4)]
    decoded = [int(out.loss_mask[i].sum()) - starts[i] for i in range(4)]
    assert max(decoded) <= out.decode_steps <= sum(decoded)
    observations = sum(s - 1 for s in starts)
    assert 1 <= out.extends <= observations and out.env_wait_s >= 0
    assert len(out.step_seconds) == sum(len(env.actions) for env in envs) and metrics["env/step_s"] >= 0
    assert metrics["env/decode_steps"] == out.decode_steps and metrics["env/extends"] == out.extends


@pytest.mark.slow  # ~30 s alone (compiles start, decode, extend); under a second after the test above
def test_extend_logits_equal_a_full_recompute(model):
    """The logits an extend returns (after a row's observation) are those of a dense forward over the whole
    sequence, for every row extended at once, each at its own length."""
    graphdef, params = nnx.split(model)
    prompt = np.zeros((4, 16), np.int32)
    mask = np.zeros((4, 16), bool)
    for i, ids in enumerate(TOK.encode(t) for t in ("a", "bcd", "hello", "q")):
        prompt[i, 16 - len(ids):], mask[i, 16 - len(ids):] = ids, True
    st = mt.start_fn(graphdef, params, jnp.asarray(prompt), jnp.asarray(mask), jax.random.key(1), spec=SPEC)
    for _ in range(3):  # the other test's chunk of 4 steps (one compile), up to a turn's 12 tokens
        st = mt.decode_fn(graphdef, params, st, spec=SPEC, steps=4)
    waiting = np.asarray(st.status) == mt.AWAIT
    assert waiting.sum() >= 2
    obs = np.zeros((4, SPEC.extend_width - 1), np.int32)
    length = np.array([3, 7, 1, 5], np.int32)
    for i in range(4):
        obs[i, :length[i]] = TOK.encode("observation")[:length[i]]
    n_before = np.asarray(st.n)
    st, last = mt.extend_fn(graphdef, params, st, jnp.asarray(obs), jnp.asarray(length), jnp.asarray(waiting),
                            spec=SPEC)
    n = np.asarray(st.n)
    assert (n[waiting] == n_before[waiting] + length[waiting] + 1).all() and (n[~waiting] == n_before[~waiting]).all()
    response = np.asarray(st.tokens)
    rmask = np.arange(SPEC.max_tokens)[None] < (n - 1)[:, None]  # every fed token (the last is pending)
    _, logits = _dense_logprobs(model, prompt, mask, response, rmask)
    at = 16 + n - 2  # the column of the last fed token (the observation's last)
    dense = np.asarray(logits, np.float32)[np.arange(4), at]
    np.testing.assert_allclose(np.asarray(last)[waiting], dense[waiting], atol=2e-4, rtol=1e-4)


@pytest.mark.slow  # ~20 s: the generation of the test above (shared compiles) and one GRPO update
def test_grpo_update_on_multiturn_trajectories(model):
    """A GRPO update (the rollout's actor.train call) on environment trajectories: rewards from the
    environment, the batch's action_mask keeping observation tokens out of the loss; the update moves the
    parameters, its statistics are finite, and it equals the update on a batch whose observation tokens'
    sampled log-probs and advantages are scrambled (they carry no weight)."""
    import functools

    from jaxrlhf.algorithms import rollout
    from jaxrlhf.algorithms.optim import build_optimizer

    graphdef, params = nnx.split(model)
    envs = [Echo(t) for t in (2, 2, 3, 3)]  # two groups of two samples
    rows = [{"prompt": p} for p in ("hi", "hi", "tell me", "tell me")]
    out = mt.generate_multiturn(graphdef, params, envs=envs, rows=rows, encode=TOK.encode, decode_text=TOK.decode,
                                rng=jax.random.key(3), spec=SPEC, max_turns=4, chunk=4)
    batch = out.rollout_batch()
    assert (batch["action_mask"] <= batch["response_mask"]).all() and (~batch["action_mask"] & batch["response_mask"]).any()
    inputs = {k: jnp.asarray(v) for k, v in batch.items() if k != "env_reward"}
    inputs.update(rule_scores=jnp.asarray(batch["env_reward"]), kl_coef=jnp.float32(0.0), rng_actor=jax.random.key(0))
    opt = build_optimizer(lr=1e-2, total_updates=10)
    settings = rollout.RLSettings(estimator="grpo", loss="grpo", group_size=2, loss_agg="seq-mean-token-mean",
                                  minibatches=1, max_new_tokens=SPEC.max_tokens, eos_only=False,
                                  ratio_early_stop=None, sampling=SPEC.sampling)
    train = jax.jit(functools.partial(rollout.actor_train, graphdef, opt, settings))
    new, _, stats = train(params, opt.init(params), inputs)
    assert all(np.isfinite(float(v)) for v in jax.tree_util.tree_leaves(stats["actor_stats"]))
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(new))]
    assert any(moved)
    obs = ~batch["action_mask"]
    scrambled = dict(inputs, behaviour_logp=jnp.where(obs, -3.0, inputs["behaviour_logp"]))
    new2, _, stats2 = train(params, opt.init(params), scrambled)
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(new2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert out.metrics()["env/turns"] >= 1
