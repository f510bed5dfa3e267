"""Environments (`environments/`) and the multi-turn batch's math: the tool environment's
observations are exactly what the chat template adds to the conversation, a bad tool call is an error
observation (counted), never an exception; observation tokens carry no loss (zero gradient) and the RL math
on an interleaved trajectory equals the math on the model's tokens alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlhf import environments as envs
from jaxrlhf.algorithms.losses import AGGREGATIONS, POLICY_LOSSES
from jaxrlhf.algorithms.rollout import RLSettings, model_tokens, rollout_advantages
from jaxrlhf.environments import ACTION_MASK, EnvironmentContext, make_environment
from jaxrlhf.environments.tool_calls import parse_tool_calls
from jaxrlhf.models.chat_template import ChatTemplate

QWEN25 = (  # Qwen2.5's tool template, trimmed to the parts a tool conversation renders
    "{%- if tools %}{{- '<|im_start|>system\\nYou are Qwen.\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONTEXT = EnvironmentContext(chat_template=ChatTemplate(QWEN25, {}), tool_format="qwen2.5",
                             end_of_turn=("<|im_end|>",))
CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_tool_episode_renders_as_the_chat_template_and_bad_calls_are_counted_observations():
    """Model text + observations, concatenated as the rollout appends them, equal the chat template's rendering
    of the conversation (so the trajectory's tokens are the conversation's); a call with bad JSON, an unknown
    tool, wrong arguments or a tool that raises becomes an "Error: ..." tool message, counted."""
    env = make_environment("tools", CONTEXT, {"reward": lambda row, text: float(text.strip() == row["answer"])})
    text = env.reset({"prompt": "What is (3 + 4) * 6?", "answer": "42"}).text
    turns = [
        (CALL.format(name="calculator", args='{"expression": "(3 + 4) * 6"}'), {"tool_calls": 1.0, "tool_error": 0.0}),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": }\n</tool_call>',
         {"malformed_tool_call": 1.0, "malformed_tool_call/bad_json": 1.0}),
        (CALL.format(name="search", args='{"q": "x"}'),
         {"malformed_tool_call": 1.0, "malformed_tool_call/unknown_tool": 1.0}),
        (CALL.format(name="calculator", args='{"expr": "1"}'),
         {"malformed_tool_call": 1.0, "malformed_tool_call/bad_arguments": 1.0}),
        (CALL.format(name="calculator", args='{"expression": "1 / 0"}'), {"tool_calls": 1.0, "tool_error": 1.0}),
    ]
    observations = []
    for action, counts in turns:
        result = env.step(action)
        assert not result.done and result.info == counts and result.reward == 0.0
        observations.append(result.observation.text)
        text += action + "<|im_end|>" + result.observation.text  # the model's turn ends on its EOS token
    final = env.step("42")
    assert final.done and final.reward == 1.0 and final.observation is None
    text += "42<|im_end|>"
    assert text + "\n" == CONTEXT.chat_template.render(env.messages, tools=[envs.calculator])
    assert "<tool_response>\n42\n</tool_response>" in observations[0]
    assert "Error: tool call 1: not valid JSON" in observations[1]
    assert "unknown tool 'search' (available: calculator)" in observations[2]
    assert "missing required argument 'expression'" in observations[3]
    assert "Error: calculator raised ZeroDivisionError" in observations[4]
    assert all(o.endswith("<|im_end|>\n<|im_start|>assistant\n") for o in observations)
    # the calls are parsed as the model's template family writes them (the same parser, checked here once)
    assert parse_tool_calls(turns[0][0], "qwen2.5", [envs.calculator]).calls[0].arguments == {
        "expression": "(3 + 4) * 6"}


def test_calculator_and_registries():
    assert envs.calculator("(3 + 4) * 2") == "14" and envs.calculator("7 / 2") == "3.5"
    with pytest.raises(ValueError, match="unsupported expression element"):
        envs.calculator("__import__('os')")
    with pytest.raises(ValueError, match="exponent too large"):
        envs.calculator("9 ** 99999")
    with pytest.raises(ValueError, match="unknown environment 'tool'. Did you mean 'tools'"):
        make_environment("tool", CONTEXT)
    with pytest.raises(ValueError, match="unknown tool 'calc'"):
        make_environment("tools", CONTEXT, {"tools": ["calc"]})
    with pytest.raises(ValueError, match="needs a chat template"):
        make_environment("tools", EnvironmentContext(), {})


# ---------------------------------------------------------------- the multi-turn batch's math

# Two trajectories of 12 columns: model turns (1), observations (0), then padding (response_mask 0).
RESPONSE = np.array([[1] * 12, [1] * 9 + [0] * 3], bool)
ACTION = np.array([[1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1],
                   [1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0]], bool)


def _compress(x, mask):
    """Each row's model tokens moved to the front (observations removed), zero padded: the single-turn
    batch the same model tokens would make."""
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        kept = x[i][mask[i]]
        out[i, :len(kept)] = kept
    return out


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda: rng.normal(size=RESPONSE.shape).astype(np.float32)  # noqa: E731
    return {"response_mask": RESPONSE, ACTION_MASK: ACTION, "behaviour_logp": -np.abs(f()),
            "ref_logp": -np.abs(f()), "values": f(), "rule_scores": np.array([1.0, -0.5], np.float32),
            "ended_with_eos": np.array([True, True])}


@pytest.mark.parametrize("estimator", ["gae", "grpo", "reinforce_pp"])
def test_advantages_and_kl_count_only_model_tokens(estimator):
    """Advantages, returns and KL of an interleaved trajectory equal those of the same model tokens without
    the observations (the recursions step over them); observation tokens get 0."""
    inputs = _batch()
    s = RLSettings(estimator=estimator, group_size=2, gamma=0.9, lam=0.8, kl_in_reward=True)
    adv, returns, kl, scores = rollout_advantages({k: jnp.asarray(v) for k, v in inputs.items()}, s,
                                                  jnp.float32(0.1), None)
    single = {k: _compress(v, ACTION) if np.ndim(v) == 2 and k != ACTION_MASK else v for k, v in inputs.items()}
    single["response_mask"] = _compress(ACTION, ACTION)
    del single[ACTION_MASK]
    ref = rollout_advantages({k: jnp.asarray(v) for k, v in single.items()}, s, jnp.float32(0.1), None)
    for ours, theirs in zip((adv, returns, kl), ref[:3]):
        ours = np.asarray(ours)
        np.testing.assert_allclose(_compress(ours, ACTION), np.asarray(theirs), rtol=1e-5, atol=1e-6)
        assert (ours[~ACTION] == 0).all()
    np.testing.assert_allclose(np.asarray(scores), np.asarray(ref[3]))


def test_loss_gradient_is_zero_on_observation_tokens():
    """d loss / d logp is 0 on every observation token (and padding), for every policy loss and aggregation it
    takes, with an entropy bonus and KL in the loss; the loss equals the loss of the model tokens alone."""
    inputs = _batch(1)
    rng = np.random.default_rng(2)
    logp = inputs["behaviour_logp"] + 0.1 * rng.normal(size=RESPONSE.shape).astype(np.float32)
    adv = rng.normal(size=RESPONSE.shape).astype(np.float32)
    ent = np.abs(rng.normal(size=RESPONSE.shape)).astype(np.float32)
    mask = model_tokens({"response_mask": RESPONSE, ACTION_MASK: ACTION})
    c = lambda x: _compress(x, ACTION)  # noqa: E731
    checked = 0
    for loss in sorted(POLICY_LOSSES):
        for agg in AGGREGATIONS if loss != "gspo" else ("seq-mean-token-mean",):  # gspo: per sequence only
            kwargs = {"agg": agg, "norm_len": 12, "entropy_coef": 0.01}
            if loss != "ppo":
                kwargs.update(kl_coef=0.05, kl_kind="k3")
            fn = POLICY_LOSSES[loss]

            def f(lp, old, a, m, ref, e, fn=fn, kwargs=kwargs):
                return fn(lp, old, a, m, ref_logp=ref, entropy=e, **kwargs)[0]

            value, grad = jax.value_and_grad(f)(jnp.asarray(logp), inputs["behaviour_logp"], adv, jnp.asarray(mask),
                                                inputs["ref_logp"], ent)
            grad = np.asarray(grad)
            assert (grad[~ACTION] == 0).all() and np.abs(grad[ACTION]).min() > 0, (loss, agg)
            single = f(jnp.asarray(c(logp)), c(inputs["behaviour_logp"]), c(adv), jnp.asarray(c(ACTION)),
                       c(inputs["ref_logp"]), c(ent))
            np.testing.assert_allclose(float(value), float(single), rtol=1e-5, atol=1e-7, err_msg=f"{loss} {agg}")
            checked += 1
    assert checked >= 7


def test_single_turn_gae_is_bit_identical_to_the_plain_recursion():
    """For a mask without gaps (single-turn batches) gae's step over gaps changes nothing: the same bits as the
    recursion before multi-turn (the shifted next value, the plain masked carry), written out here."""
    from jaxrlhf.algorithms.advantages import AdvantageBatch, gae

    rng = np.random.default_rng(3)
    lengths = np.array([12, 5, 1, 9])
    mask = jnp.asarray(np.arange(12)[None, :] < lengths[:, None])
    rewards = jnp.asarray(rng.normal(size=mask.shape).astype(np.float32)) * mask
    values = jnp.asarray(rng.normal(size=mask.shape).astype(np.float32))

    @jax.jit
    def before(rewards, values, mask):
        m = mask.astype(jnp.float32)
        r, v = rewards * m, values * m
        deltas = (r + 0.99 * jnp.concatenate([v[:, 1:], jnp.zeros_like(v[:, :1])], axis=1) - v) * m

        def step(next_adv, xs):
            adv_t = (xs[0] + 0.99 * 0.95 * next_adv) * xs[1]
            return adv_t, adv_t

        adv = jax.lax.scan(step, jnp.zeros(4, jnp.float32), (deltas.T, m.T), reverse=True)[1].T
        return adv, (adv + v) * m

    now = jax.jit(lambda r, v, m: gae(AdvantageBatch(r, m, values=v), gamma=0.99, lam=0.95))(rewards, values, mask)
    for ours, want in zip(now, before(rewards, values, mask)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(want))


@pytest.mark.parametrize("overrides, message", [
    (["env.name=tool"], "env.name: unknown environment 'tool'. Did you mean 'tools'?"),
    (["env.name=tools"], "set generation.engine=continuous (not static)"),
    (["env.name=tools", "generation.engine=continuous", "env.max_tokens=16", "env.max_turn_tokens=17"],
     "env.max_turn_tokens=17 exceeds the trajectory's budget env.max_tokens=16"),
    (["env.name=tools", "generation.engine=continuous", "env.max_tokens=64"],
     "env.max_tokens=64 exceeds generation.max_new_tokens=32"),
    (["env.name=tools", "generation.engine=continuous", "algorithm.max_staleness=1", "plan.strategy=disaggregated"],
     "set algorithm.max_staleness=0 and plan.offpolicy=false"),
    (["env.name=tools", "generation.engine=continuous", "algorithm.name=remax"], "greedy baseline"),
    (["env.name=tools", "generation.engine=continuous", "generation.ignore_eos=true", "rewards.eos_only=false"],
     "set generation.ignore_eos=false"),
    (["env.max_turns=0"], "env.max_turns"),
])
def test_env_config_refusals(overrides, message):
    from jaxrlhf.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)
    load_config(None, ["env.max_turns=2"])  # the section's keys without env.name: the single-turn run
    load_config(None, ["env.name=tools", "generation.engine=continuous", "rewards.rules=[]"])  # the env's reward


class _Retry:
    """A test environment: "Again:" after the first turn, then done; reward: the digits of the second turn."""

    def __init__(self, context):
        self.turn = 0

    def reset(self, row):
        return envs.Observation(row["prompt"])

    def step(self, action_text):
        self.turn += 1
        if self.turn == 1:
            return envs.StepResult(envs.Observation("\nAgain:\n"), 0.0, False, {"retries": 1.0})
        return envs.StepResult(None, float(sum(c.isdigit() for c in action_text)), True)


if "test_retry" not in envs.ENVIRONMENTS:
    envs.register_environment("test_retry")(_Retry)


@pytest.mark.slow
def test_grpo_run_with_an_environment_completes_and_logs_env_metrics(tmp_path):
    """A GRPO run whose rollouts are two-turn episodes (env.name): the step trains on them (the generate
    call's outputs come from the multi-turn engine) and logs the env/... metrics. (~2.5 min on a shared
    2-core machine, most of it compiling.)"""
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics

    cfg = cfglib.load_config(None, [
        "algorithm.name=grpo", "model.actor.preset=tiny", "run.steps=1", "run.checkpoint_every=0",
        "run.tensorboard=false", "run.export_hf=false", "run.save_checkpoints=false", "sft.steps=0",
        "data.batch_size=2", "algorithm.group_size=4", "algorithm.minibatches=1", "data.max_prompt_len=16",
        "generation.max_new_tokens=32", "generation.engine=continuous", "plan.strategy=colocated",
        "env.name=test_retry", "env.max_turn_tokens=8", "env.max_turns=3", "rewards.rules=[]",
        "rewards.eos_only=false", f"run.output_dir={tmp_path}"])
    train.run(cfg)
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows if "env/turns" in r] == [1]
    for r in rows:
        if "env/turns" in r:
            assert r["env/turns"] == 2 and r["env/retries"] == 1 and r["env/finish/done"] == 1
            assert r["env/observation_tokens"] > len("\nAgain:\n") - 1 and np.isfinite(r["loss/policy"])
            # the engine's work on the batch, measured for the planner (`planner.episodes`)
            assert r["env/decode_steps"] > 0 and r["env/extends"] >= 1 and r["env/wait_s"] >= 0


@pytest.mark.slow
def test_grpo_run_with_the_calculator_tool_environment(tmp_path):
    """env.name=tools in a one-step GRPO run on a checkpoint tokenizer with a tool-calling chat template: the
    prompts are rendered with the calculator described, turns end on <|im_end|> (or are cut and closed with
    it), the model's text goes through the template family's parser, and the run logs env metrics. (A random
    tiny model writes no well-formed call; the calls themselves are tested above.)"""
    import json

    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics
    from jaxrlhf.testing.models import save_tiny_tokenizer

    folder = save_tiny_tokenizer(tmp_path / "tok", "qwen2", corpus=["<tool_call> calculator expression"])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN25,
                                                              "eos_token": "<|im_end|>"}))
    cfg = cfglib.load_config(None, [
        "algorithm.name=grpo", "model.actor.preset=tiny", f"model.tokenizer={folder}", "run.steps=1",
        "run.checkpoint_every=0", "run.tensorboard=false", "run.export_hf=false", "run.save_checkpoints=false",
        "sft.steps=0", "data.batch_size=2", "algorithm.group_size=2", "algorithm.minibatches=1",
        "data.max_prompt_len=32", "generation.max_new_tokens=32", "generation.engine=continuous",
        "plan.strategy=colocated", "env.name=tools", "env.max_turn_tokens=8", "env.max_turns=2",
        "rewards.rules=[]", "rewards.eos_only=false", f"run.output_dir={tmp_path / 'run'}"])
    train.run(cfg)
    [row] = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "env/turns" in r]
    assert 1 <= row["env/turns"] <= 2 and np.isfinite(row["loss/policy"])
    assert row["env/finish/done"] + row["env/finish/max_turns"] + row["env/finish/max_tokens"] == 1
