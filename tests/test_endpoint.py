"""The agent endpoint (jaxrlhf.environments: service, server, agents) through the official `openai` client, against the real server on
localhost and a tiny real model behind it: greedy answers equal the model's own greedy generation of the
rendered prompt, a two-request episode is recorded token-in/token-out (the sampled ids kept, the new
prompt text as observation tokens with loss mask 0, behaviour log-probs equal to a training forward's),
concurrent episodes share generate calls, tool calls come back as `tool_calls`, and every refusal is the
HTTP error the client raises."""

from __future__ import annotations

import http.client
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.environments.agents import (
    AgentRollout,
    agent_output,
    episode_trajectories,
    load_agent,
    openai_client,
    run_agents,
)
from jaxrlhf.environments.backends import ModelBackend
from jaxrlhf.environments.records import decode_with_special_tokens
from jaxrlhf.environments.server import ChatEndpoint
from jaxrlhf.models.generation import Generator, generate
from jaxrlhf.models.sampling import GREEDY
from jaxrlhf.models.tokenizer import load_tokenizer
from jaxrlhf.testing.models import random_model, save_tiny_tokenizer, tiny_config

openai = pytest.importorskip("openai")

# A compact Hermes-style template (Qwen2.5's shape: tools listed in a system turn, calls as <tool_call> JSON,
# results folded into a user turn), short so the tiny model's sequences stay short.
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\ntools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}"
    "{%- endfor %}{{- '\\ncall as <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}{{- '\\n<tool_call>\\n{\"name\": \"' + call.function.name + "
    "'\", \"arguments\": ' }}{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
IM_END = 2  # the qwen2-style tiny tokenizer's <|im_end|>: the chat model's EOS
NEW_TOKENS = 6
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city."}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = save_tiny_tokenizer(tmp_path_factory.mktemp("tok"), "qwen2", corpus=["what is the weather in Paris"])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def model(tokenizer):
    config = tiny_config("qwen2", vocab_size=tokenizer.vocab_size, eos_token_id=IM_END, pad_token_id=0)
    return random_model(config, seed=3)


BUCKET = 64  # every prompt here pads to one bucket: one compiled program per batch size


def _server(model, tokenizer, **kwargs):
    generator, state = Generator.for_model(model, min_bucket=BUCKET)
    backend = ModelBackend(generator, lambda: state, max_new_tokens=NEW_TOKENS, sampling=GREEDY,
                           max_positions=model.config.max_position_embeddings, batch_size=4)
    return ChatEndpoint(backend, tokenizer, **kwargs)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with _server(model, tokenizer, max_prompt_tokens=120, window_s=0.1) as endpoint:
        yield endpoint


def _prompt_ids(tokenizer, messages, **kwargs):
    return tokenizer.encode(tokenizer.chat_template.render(messages, add_generation_prompt=True, **kwargs))


def _greedy(model, ids, n=NEW_TOKENS):
    out = generate(model, [ids], n, GREEDY, min_bucket=BUCKET)
    keep = np.asarray(out.response_mask[0])
    return np.asarray(out.response_tokens[0])[keep].tolist(), np.asarray(out.logprobs[0])[keep].tolist()


def _forward_logprobs(model, ids):
    """Each token's log-prob under one training-style forward of the whole sequence (independent of the
    decode loop and its KV cache)."""
    tokens = jnp.asarray([ids], jnp.int32)
    logits, _ = model(tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens, bool))
    logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32))
    return np.concatenate([[0.0], np.asarray(jnp.take_along_axis(logp, tokens[0, 1:, None], axis=1)[:, 0])])


@pytest.mark.slow
def test_greedy_answer_is_the_models_own_generation(server, model, tokenizer):
    messages = [{"role": "user", "content": "what is the weather in Paris"}]
    episode = server.open_episode()
    client = openai_client(server.base_url(episode))
    reply = client.chat.completions.create(model="policy", messages=messages, logprobs=True)
    tokens, logprobs = _greedy(model, _prompt_ids(tokenizer, messages))
    choice = reply.choices[0]
    assert choice.message.content == tokenizer.decode([t for t in tokens if t != IM_END])
    assert choice.finish_reason == ("stop" if tokens[-1] == IM_END else "length")
    np.testing.assert_allclose([t.logprob for t in choice.logprobs.content], logprobs, atol=1e-5)
    assert reply.usage.completion_tokens == len(tokens)
    assert reply.usage.prompt_tokens == len(_prompt_ids(tokenizer, messages))
    assert [m.id for m in client.models.list().data] == ["policy"]
    # max_tokens cuts the same generation
    short = client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
    assert short.choices[0].message.content == tokenizer.decode(tokens[:2])
    server.close_episode(episode)


@pytest.mark.slow
def test_two_requests_are_recorded_token_in_token_out(server, model, tokenizer):
    first = [{"role": "user", "content": "what is the weather in Paris"}]
    episode = server.open_episode()
    client = openai_client(server.base_url(episode))
    answer = client.chat.completions.create(model="policy", messages=first).choices[0].message.content
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and a cat"}]
    client.chat.completions.create(model="policy", messages=second)
    record = server.close_episode(episode)

    assert len(record.segments) == 1 and record.matches["rewrite"] == 0 and record.requests == 2
    print("second request matched by", record.matches)
    seg = record.segments[0]
    prompt1 = _prompt_ids(tokenizer, first)
    assert seg.prompt == prompt1
    sampled1, _ = _greedy(model, prompt1)
    mask = np.asarray(seg.loss_mask)
    n1 = len(sampled1)
    assert seg.tokens[:n1] == sampled1 and mask[:n1].all()  # the first answer as sampled, not re-tokenized
    observed = np.flatnonzero(mask == 0)
    assert observed.size and observed[0] == n1 and (mask[n1:n1 + observed.size] == 0).all()
    # the record up to the second answer is the second prompt's text; the second answer is the model's greedy
    # continuation of that record (its ids, not the re-tokenized prompt)
    context = seg.prompt + seg.tokens[:n1 + observed.size]
    assert decode_with_special_tokens(tokenizer, context) == tokenizer.chat_template.render(
        second, add_generation_prompt=True)
    sampled2, _ = _greedy(model, context)
    assert seg.tokens[n1 + observed.size:] == sampled2
    # behaviour log-probs: a training forward over the whole record gives them back; observations have 0
    forward = _forward_logprobs(model, seg.ids)[len(seg.prompt):]
    np.testing.assert_allclose(np.asarray(seg.logprobs)[mask == 1], forward[mask == 1], atol=2e-4)
    assert (np.asarray(seg.logprobs)[mask == 0] == 0).all()

    # a rewritten history starts a new segment, and is counted
    episode = server.open_episode()
    client = openai_client(server.base_url(episode))
    client.chat.completions.create(model="policy", messages=second)
    client.chat.completions.create(model="policy", messages=first)
    record = server.close_episode(episode)
    assert len(record.segments) == 2 and record.matches["rewrite"] == 1
    assert record.segments[1].prompt == prompt1
    metrics = server.metrics()
    assert metrics["endpoint/match_rewrite"] >= 1
    assert metrics["endpoint/match_tokens"] + metrics["endpoint/match_text"] >= 1


def test_a_prompt_whose_text_extends_the_record_keeps_the_sampled_spelling(tokenizer):
    """A model may sample a spelling the tokenizer would not write ("t" + "he" for "the"): the agent's next
    prompt then re-tokenizes differently, but its text still extends the record's, so only the new text is
    tokenized and the sampled ids stay (hand-built record, no model)."""
    from jaxrlhf.environments.records import Episode

    render = tokenizer.chat_template.render
    first = [{"role": "user", "content": "hello world"}]
    prompt = tokenizer.encode(render(first, add_generation_prompt=True))
    sampled = tokenizer.encode("t") + tokenizer.encode("he cat") + [IM_END]
    assert sampled[:-1] != tokenizer.encode("the cat")  # a spelling the tokenizer would not write
    episode = Episode("e")
    assert episode.extend(*episode.match(prompt, "", tokenizer, [])) == prompt
    episode.segments[-1].append(sampled, [-1.0] * len(sampled))
    second = render([*first, {"role": "assistant", "content": "the cat"}, {"role": "user", "content": "a dog"}],
                    add_generation_prompt=True)
    how, observation = episode.match(tokenizer.encode(second), second, tokenizer, [])
    assert how == "text" and observation == tokenizer.encode("\n<|im_start|>user\na dog<|im_end|>\n"
                                                              "<|im_start|>assistant\n")
    context = episode.extend(how, observation)
    assert context == prompt + sampled + observation
    assert episode.segments[-1].loss_mask == [1] * len(sampled) + [0] * len(observation)
    # a history the record's text is not a prefix of starts a new segment
    other = render([{"role": "user", "content": "a dog"}], add_generation_prompt=True)
    assert episode.match(tokenizer.encode(other), other, tokenizer, []) == ("rewrite", tokenizer.encode(other))


def _agent(client, row):
    if row.get("early"):
        raise ValueError("no request at all")
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["text"]}])
    if row.get("fail"):
        raise RuntimeError("the agent gave up")
    return float(len(reply.choices[0].message.content or "")) if row.get("score") else None


def test_concurrent_agents_share_generate_calls_and_a_failing_agent_is_counted(server, model, tokenizer):
    rows = [{"text": "a dog and a cat", "score": True}, {"text": "the cat sat on the mat"},
            {"text": "hello world", "fail": True}, {"text": "12 + 7 = 19", "score": True}]
    def connection_threads():
        return sum("process_request" in t.name for t in threading.enumerate())

    calls, before = server.batcher.calls, connection_threads()
    results = run_agents(server, _agent, [*rows, {"early": True}])
    for _ in range(100):  # each agent's client is closed, so no server thread is left waiting on its connection
        if connection_threads() <= before:
            break
        time.sleep(0.02)
    assert connection_threads() <= before
    assert server.batcher.calls - calls < len(rows)  # gathered into fewer generate calls than requests
    assert results[-1].error == "ValueError: no request at all" and not results[-1].episode.segments
    batch = agent_output(results, prompt_width=BUCKET, response_width=2 * NEW_TOKENS, pad_id=0, failure=-1.0)
    assert batch.response_mask[-1].sum() == 0 and batch.env_reward[-1] == -1.0  # nothing to train, scored failed
    for r, (row, result) in enumerate(zip(rows, results)):
        seg = result.episode.segments[0]
        assert batch.prompt_tokens[r][batch.prompt_mask[r]].tolist() == seg.prompt
        assert batch.response_tokens[r][batch.response_mask[r]].tolist() == seg.tokens
        np.testing.assert_allclose(batch.logprobs[r][batch.loss_mask[r]], seg.logprobs, atol=0)
    prompts = [_prompt_ids(tokenizer, [{"role": "user", "content": row["text"]}]) for row in rows]
    out = generate(model, prompts, NEW_TOKENS, GREEDY, min_bucket=BUCKET)  # the shape the server's batch of 4 has
    for r, (row, result) in enumerate(zip(rows, results)):
        ids, keep = prompts[r], np.asarray(out.response_mask[r])
        tokens = np.asarray(out.response_tokens[r])[keep].tolist()
        logprobs = np.asarray(out.logprobs[r])[keep].tolist()
        seg, = result.episode.segments
        assert seg.prompt == ids and seg.tokens == tokens  # batched rows answer as one row alone does
        np.testing.assert_allclose(seg.logprobs, logprobs, atol=1e-5)
        assert result.error == ("RuntimeError: the agent gave up" if row.get("fail") else None)
        content = tokenizer.decode([t for t in tokens if t != IM_END])
        assert result.reward == (float(len(content)) if row.get("score") else None)
        trajectory, = episode_trajectories(result, failure=-1.0)
        assert trajectory.prompt_ids == ids and trajectory.token_ids == tokens
        assert trajectory.loss_mask == [1] * len(tokens)
        assert trajectory.reward == (-1.0 if row.get("fail") else float(len(content)) if row.get("score") else 0.0)
        assert trajectory.counters["agent_error"] == float(bool(row.get("fail"))) and trajectory.turns == 1
    assert load_agent("json:dumps") is json.dumps
    with pytest.raises(ValueError, match="module:function"):
        load_agent("no_colon")


def test_agent_rollout_gives_the_rollout_batch(server, tokenizer):
    """A step's rows through AgentRollout: the generate call's layout (prompt then response, positions over
    real tokens), the sampled tokens as action_mask, the agents' rewards, the final answers, the metrics."""
    rows = [{"text": "a dog and a cat", "score": True}, {"text": "hello world", "fail": True}]
    limits = server.max_prompt_tokens, server.max_response_tokens
    try:
        rollout = AgentRollout(server, _agent, prompt_width=BUCKET, response_width=2 * NEW_TOKENS, pad_id=0,
                               failure=-1.0)
        assert (server.max_prompt_tokens, server.max_response_tokens) == (BUCKET, 2 * NEW_TOKENS)
        step = rollout(rows)
    finally:
        server.max_prompt_tokens, server.max_response_tokens = limits
    batch = step.output.rollout_batch()
    assert batch["tokens"].shape == (2, BUCKET + 2 * NEW_TOKENS) and batch["action_mask"].shape == (2, 2 * NEW_TOKENS)
    for r, row in enumerate(rows):
        ids = _prompt_ids(tokenizer, [{"role": "user", "content": row["text"]}])
        real = batch["tokens"][r][batch["mask"][r]].tolist()
        assert real[:len(ids)] == ids and batch["positions"][r][batch["mask"][r]].tolist() == list(range(len(real)))
        assert (batch["action_mask"][r] == batch["response_mask"][r]).all()  # one answer, no observations
    assert batch["env_reward"].tolist() == [float(len(step.final_texts[0])), -1.0]
    assert step.metrics["env/agent_failed"] == 0.5  # the failing agent raised after its request
    metrics = step.metrics  # this step's counts, not the endpoint's totals since the module's first test
    assert metrics["endpoint/requests"] == 2 and metrics["endpoint/generate_calls"] in (1, 2)
    assert metrics["endpoint/rows_per_call"] == 2 / metrics["endpoint/generate_calls"]


def test_a_response_budget_cuts_answers_and_refuses_what_does_not_fit(server, tokenizer):
    """`max_response_tokens` (the trainer's response width): an answer is cut to the room left, and a request
    whose observation leaves no room is refused without being recorded."""
    first = [{"role": "user", "content": "hello world"}]
    server.max_response_tokens = 3
    try:
        episode = server.open_episode()
        client = openai_client(server.base_url(episode))
        reply = client.chat.completions.create(model="policy", messages=first)
        assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
        second = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
                  {"role": "user", "content": "a dog"}]
        with pytest.raises(openai.BadRequestError, match="budget is 3") as e:
            client.chat.completions.create(model="policy", messages=second)
        assert e.value.code == "context_length_exceeded"
        record = server.close_episode(episode)
        assert record.requests == 1 and len(record.segments[0].tokens) == 3
    finally:
        server.max_response_tokens = None


def _qa_agent(client, row):
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return float(row["answer"] in (reply.choices[0].message.content or ""))


def test_agent_episodes_are_the_generate_calls_outputs_with_the_steps_parameters(model, tokenizer):
    """The step loop's piece (env.name=openai_agent): the feed's prompts played by agents with the parameters
    handed over for this step (a second step's other parameters answer as that model does), as the generate
    call's outputs: prompt bucket + generation.max_new_tokens columns, action_mask, env_reward."""
    from jaxrlhf.config_schema import AgentServerConfig
    from jaxrlhf.environments.agents import AgentEpisodes
    from jaxrlhf.models.lengths import bucket_length

    graphdef, state = nnx.split(model)
    other = jax.tree.map(lambda x: x * 1.5, state)
    feed = {"prompts": ["a dog and a cat", "hello world", "12 + 7 = 19", "the cat sat"], "answers": ["cat"] * 4}
    episodes = AgentEpisodes(AgentServerConfig(window_ms=50.0), _qa_agent, graphdef=graphdef, tokenizer=tokenizer,
                             sampling=GREEDY, max_new_tokens=NEW_TOKENS, response_budget=NEW_TOKENS - 2, batch_size=4,
                             max_positions=model.config.max_position_embeddings, eos_ids=(IM_END,))
    prompts = [_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in feed["prompts"]]
    try:
        for params in (state, other):
            values, metrics = episodes(params, feed, prefix="full_")
            assert episodes.params is None  # not held past the step
            out = generate((graphdef, params), prompts, NEW_TOKENS, GREEDY, min_bucket=BUCKET)
            assert set(values) == {f"full_{k}" for k in ("tokens", "mask", "positions", "response_tokens",
                                                         "response_mask", "behaviour_logp", "ended_with_eos",
                                                         "action_mask", "env_reward")}
            assert values["full_response_tokens"].shape == (4, NEW_TOKENS)  # the budget's answers, padded to the width
            assert values["full_tokens"].shape == (4, bucket_length(max(map(len, prompts))) + NEW_TOKENS)
            for r in range(4):
                keep = np.asarray(out.response_mask[r])
                sampled = np.asarray(out.response_tokens[r])[keep].tolist()[:NEW_TOKENS - 2]
                assert values["full_response_tokens"][r][values["full_response_mask"][r]].tolist() == sampled
                assert values["full_action_mask"][r].sum() == len(sampled)
                np.testing.assert_allclose(values["full_behaviour_logp"][r][:len(sampled)],
                                           np.asarray(out.logprobs[r])[keep][:len(sampled)], atol=1e-5)
                content = tokenizer.decode([t for t in sampled if t != IM_END])
                assert values["full_env_reward"][r] == float("cat" in content)
            assert metrics["env/agent_failed"] == 0.0
    finally:
        episodes.close()


def _request(server, method, path, body=b""):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = json.loads(response.read())
    conn.close()
    return response.status, payload["error"]


def test_refusals_are_http_errors(server, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    unknown = openai_client(f"http://{server.host}:{server.port}/episodes/nobody/v1")
    with pytest.raises(openai.NotFoundError, match="no open episode 'nobody'"):
        unknown.chat.completions.create(model="policy", messages=messages)
    episode = server.open_episode()
    client = openai_client(server.base_url(episode))
    with pytest.raises(openai.BadRequestError, match="over the endpoint's limit of 120") as e:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "the cat " * 80}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model="policy", messages=messages, n=2)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model="policy", messages=messages, stream=True)
    assert episode.requests == 0 and not episode.segments  # refused requests leave no record
    path = f"/episodes/{episode.episode_id}/v1/chat/completions"
    status, error = _request(server, "POST", path, b"{not json")
    assert status == 400 and "not JSON" in error["message"]
    assert _request(server, "GET", path)[0] == 405
    assert _request(server, "POST", "/v1/chat/completions", b"{}")[0] == 404
    server.close_episode(episode)
    with pytest.raises(openai.NotFoundError):  # an ended episode takes no more requests
        client.chat.completions.create(model="policy", messages=messages)


class _BrokenBackend:
    """A generate call that fails (a device error, say): the error path, no model needed."""

    max_new_tokens, max_positions, sampling = 4, 512, None

    def __call__(self, requests):
        raise RuntimeError("the device fell over")

    def release(self, episode):
        pass


def test_a_failed_generate_call_is_a_500_and_a_huge_body_a_413(tokenizer):
    with ChatEndpoint(_BrokenBackend(), tokenizer) as endpoint:
        episode = endpoint.open_episode()
        client = openai_client(endpoint.base_url(episode))
        with pytest.raises(openai.InternalServerError, match="the device fell over"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        assert episode.requests == 0 and not episode.segments  # a failed call leaves no record
        conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=30)
        conn.putrequest("POST", f"/episodes/{episode.episode_id}/v1/chat/completions")
        conn.putheader("Content-Length", str(64 * 2**20))  # announced, never sent: refused before it is read
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413 and "over" in json.loads(response.read())["error"]["message"]
        conn.close()
        assert endpoint.metrics()["endpoint/refused"] == 2


def test_binds_to_localhost_unless_told(model, tokenizer):
    warnings = []
    with _server(model, tokenizer, warn=warnings.append) as endpoint:
        assert endpoint.host == "127.0.0.1" and not warnings
    with _server(model, tokenizer, host="0.0.0.0", warn=warnings.append) as endpoint:
        assert endpoint.host == "0.0.0.0" and "reachable from other machines" in warnings[0]
        assert endpoint.base_url("e").startswith("http://127.0.0.1:")  # the agents on this machine go through loopback
        with pytest.raises(ValueError, match="choose another env.server.port"):
            _server(model, tokenizer, host="0.0.0.0", port=endpoint.port, warn=warnings.append)


def _taught(model, ids, target, steps=120):
    """A copy of `model` trained on one sequence until its greedy continuation of `ids` is `target` (a real
    model that writes a tool call, not a scripted reply)."""
    import optax

    graphdef, state = nnx.split(model)
    tokens = jnp.asarray([ids + target], jnp.int32)
    positions, mask = jnp.arange(tokens.shape[1])[None], jnp.ones_like(tokens, bool)
    weight = jnp.asarray([[0] * len(ids) + [1] * len(target)], jnp.float32)[:, 1:]

    def loss(state):
        logits, _ = nnx.merge(graphdef, state)(tokens, positions, mask)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=2)[..., 0]
        return -(picked * weight).sum() / weight.sum()

    optimizer = optax.adam(3e-3)

    @jax.jit
    def train(state, opt_state):
        def step(_, carry):
            state, opt_state = carry
            updates, opt_state = optimizer.update(jax.grad(loss)(state), opt_state, state)
            return optax.apply_updates(state, updates), opt_state
        return jax.lax.fori_loop(0, steps, step, (state, opt_state))

    state, _ = train(state, optimizer.init(state))
    return nnx.merge(graphdef, state)


@pytest.mark.slow
def test_tool_calls_come_back_as_tool_calls(model, tokenizer):
    messages = [{"role": "user", "content": "what is the weather in Paris"}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = _prompt_ids(tokenizer, messages, tools=[WEATHER])
    target = tokenizer.encode(call) + [IM_END]
    caller = _taught(model, ids, target)
    assert _greedy(caller, ids, len(target) + 2)[0] == target
    generator, state = Generator.for_model(caller, min_bucket=BUCKET)
    backend = ModelBackend(generator, lambda: state, max_new_tokens=len(target) + 2, sampling=GREEDY,
                           max_positions=caller.config.max_position_embeddings, batch_size=1)
    with ChatEndpoint(backend, tokenizer) as endpoint:
        assert endpoint.tool_format == "hermes"  # detected from the template
        episode = endpoint.open_episode()
        client = openai_client(endpoint.base_url(episode))
        choice = client.chat.completions.create(model="policy", messages=messages, tools=[WEATHER]).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        tool_call, = choice.message.tool_calls
        assert tool_call.type == "function" and tool_call.function.name == "get_weather"
        assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
        # the agent runs the tool and sends the conversation back, as the openai client writes it: the
        # template re-renders the call, and the record goes on in the same segment
        result = [*messages, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": tool_call.id, "content": "18 C"}]
        client.chat.completions.create(model="policy", messages=result, tools=[WEATHER])
        record = endpoint.close_episode(episode)
        assert len(record.segments) == 1 and record.matches["rewrite"] == 0
        assert record.segments[0].tokens[:len(target)] == target
        assert endpoint.metrics()["endpoint/tool_call_errors"] == 0


@pytest.mark.slow
def test_placed_backend_answers_on_the_generate_placement(model, tokenizer, devices):
    """The run's backend: the rollout's own generate call where the plan places it (the actor FSDP-sharded
    over two devices, through the executor), answering as the unsharded model does."""
    import functools

    from jaxrlhf.environments.backends import PlacedBackend
    from jaxrlhf.graph import CallGraph, CallSpec
    from jaxrlhf.placement.calls import CallCache
    from jaxrlhf.placement.executor import Executor, Role
    from jaxrlhf.planner.plan import DeviceGroup, ExecutionPlan, Layout, Placement, validate
    from jaxrlhf.rollouts.graph import generate_call

    outputs = ("tokens", "mask", "positions", "response_tokens", "response_mask", "behaviour_logp", "ended_with_eos")
    graph = CallGraph((CallSpec("actor.generate", "actor", "generate",
                                inputs=("prompt_tokens", "prompt_mask", "rng_generate"), outputs=outputs),),
                      feed=("prompt_tokens", "prompt_mask", "rng_generate"))
    plan = ExecutionPlan("test", 8, {"a": DeviceGroup("a", 0, 2)},
                         {"actor.generate": Placement("a", Layout(fsdp=2))})
    validate(plan, graph)
    cache = CallCache(plan)
    graphdef, state = nnx.split(model)
    placed = cache.placed(plan.home_call("actor"))
    generate_fn = functools.partial(generate_call, graphdef, GREEDY, NEW_TOKENS, IM_END, 0,
                                    ("static", 1, None, None), "")
    actor = Role("actor", graphdef, jax.device_put(state, placed.param_shardings(state)))
    executor = Executor(plan, graph, {"actor": actor},
                        cache=cache, functions={"actor.generate": generate_fn})
    backend = PlacedBackend(executor, generate_fn, pad_id=0, max_new_tokens=NEW_TOKENS, batch_size=2,
                            max_positions=model.config.max_position_embeddings, min_bucket=BUCKET)
    with ChatEndpoint(backend, tokenizer) as endpoint:
        episode = endpoint.open_episode()
        messages = [{"role": "user", "content": "a dog and a cat"}]
        reply = openai_client(endpoint.base_url(episode)).chat.completions.create(model="policy", messages=messages)
        tokens, logprobs = _greedy(model, _prompt_ids(tokenizer, messages))
        assert reply.choices[0].message.content == tokenizer.decode([t for t in tokens if t != IM_END])
        np.testing.assert_allclose(endpoint.close_episode(episode).segments[0].logprobs, logprobs, atol=1e-4)
    # the same placement through the run's builder, from the config's env.server keys
    from jaxrlhf.config_schema import AgentServerConfig

    rollout = AgentRollout.for_run(AgentServerConfig(window_ms=50.0, failure=-1.0), _agent, executor=executor,
                                   generate=generate_fn, tokenizer=tokenizer, batch_size=2, prompt_width=BUCKET,
                                   response_width=NEW_TOKENS, max_new_tokens=NEW_TOKENS,
                                   max_positions=model.config.max_position_embeddings, min_bucket=BUCKET)
    try:
        step = rollout([{"text": "a dog and a cat", "score": True}, {"text": "hello world", "fail": True}])
    finally:
        rollout.close()
    assert step.output.response_tokens[0][step.output.response_mask[0]].tolist() == tokens
    assert step.output.env_reward.tolist() == [float(len(step.final_texts[0])), -1.0]


AGENT_MODULE = '''
def play(client, row):
    """Two requests: the row's prompt, then "again" after the model's answer; reward: the digits of the second."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    return float(sum(c.isdigit() for c in second or ""))
'''


@pytest.mark.slow
def test_grpo_run_with_openai_agents(tokenizer, tmp_path, monkeypatch):
    """env.name=openai_agent end to end: a two-step GRPO run whose rollouts are two-request episodes of an agent
    (env.agent, "module:function") on the official client; the step trains on them and logs their metrics."""
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics

    (tmp_path / "endpoint_test_agent.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    cfg = cfglib.load_config(None, [
        "algorithm.name=grpo", "model.actor.preset=tiny", f"model.tokenizer={tokenizer.path.parent}", "run.steps=2",
        "run.checkpoint_every=0", "run.tensorboard=false", "run.export_hf=false", "run.save_checkpoints=false",
        "sft.steps=0", "data.batch_size=2", "algorithm.group_size=4", "algorithm.minibatches=1",
        "data.max_prompt_len=16", "generation.max_new_tokens=48", "plan.strategy=colocated",
        "env.name=openai_agent", "env.agent=endpoint_test_agent:play", "env.max_turn_tokens=8",
        "rewards.rules=[]", "rewards.eos_only=false", f"run.output_dir={out}"])
    servers = sum(t.name == "endpoint-http" for t in threading.enumerate())
    train.run(cfg)
    import gc

    gc.collect()  # the run's algorithm is gone, and its endpoint stopped with it
    assert sum(t.name == "endpoint-http" for t in threading.enumerate()) == servers
    rows = [r for r in read_metrics(str(out / "metrics.jsonl")) if "env/turns" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # a random model may write a special token the template does not render back: a rewrite
        assert r["env/requests"] == 2 and r["env/agent_failed"] == 0 and r["env/observation_tokens"] > 0
        placed = r["endpoint/match_tokens"] + r["endpoint/match_text"] + r["endpoint/match_rewrite"]
        assert placed == 8 and r["endpoint/requests"] == 16  # the step's own counts: 8 episodes' second requests
        assert r["endpoint/match_rewrite"] <= 2 and np.isfinite(r["loss/policy"])


def test_openai_agent_config_needs_its_agent():
    from jaxrlhf import config as cfglib

    grpo = ["algorithm.name=grpo", "algorithm.group_size=2"]
    with pytest.raises(cfglib.ConfigError, match="env.agent"):
        cfglib.load_config(None, [*grpo, "env.name=openai_agent"])
    with pytest.raises(cfglib.ConfigError, match="env.agent"):
        cfglib.load_config(None, [*grpo, "env.agent=m:f"])
    with pytest.raises(cfglib.ConfigError, match="env.server.port"):
        cfglib.load_config(None, [*grpo, "env.name=openai_agent", "env.agent=m:f",
                                  "env.server.port=70000"])
    cfg = cfglib.load_config(None, [*grpo, "env.name=openai_agent", "env.agent=m:f",
                                    "rewards.rules=[]"])
    assert cfg.env.server is None and cfg.generation.engine == "static"  # the server's defaults
    cfg = cfglib.load_config(None, [*grpo, "env.name=openai_agent",
                                    "env.agent=m:f", "rewards.rules=[]", "env.server.port=8123"])
    assert cfg.env.server.port == 8123 and cfg.env.server.host == "127.0.0.1"


def test_a_body_over_the_limit_gets_its_413_reply(server):
    """A 17 MiB body (over the 16 MiB limit): the endpoint reads and drops it and replies 413, so the client
    reads an error instead of a broken pipe; the openai client raises it as a status error."""
    from jaxrlhf.environments.server import MAX_BODY_BYTES

    episode = server.open_episode()
    path = f"/episodes/{episode.episode_id}/v1/chat/completions"
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x" * (17 * 2**20)}]}).encode()
    assert len(body) > MAX_BODY_BYTES
    status, error = _request(server, "POST", path, body)
    assert status == 413 and "over" in error["message"] and error["code"] == "request_too_large"
    client = openai_client(server.base_url(episode))
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * (17 * 2**20)}])
    assert e.value.status_code == 413
    assert episode.requests == 0  # nothing recorded; the endpoint still answers
    assert client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}]).choices
    server.close_episode(episode)


def _tools_then_none(client, row):
    """Sends `tools` on its first request and not on its second (the conversation so far, then "and a cat"):
    the second prompt does not extend the first's record, so the episode has two segments."""
    first = [{"role": "user", "content": row["prompt"]}]
    reply = client.chat.completions.create(model="policy", messages=first, tools=[WEATHER])
    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content or ""},
              {"role": "user", "content": "and a cat"}]
    client.chat.completions.create(model="policy", messages=second)
    return 2.0


def _two_turns(client, row):
    """Two requests of one conversation: the second extends the first's record (an observation)."""
    first = [{"role": "user", "content": row["prompt"]}]
    reply = client.chat.completions.create(model="policy", messages=first)
    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content or ""},
              {"role": "user", "content": "and a cat"}]
    client.chat.completions.create(model="policy", messages=second)
    return 1.0


def _agent_episodes(model, tokenizer, agent, batch_size):
    from jaxrlhf.config_schema import AgentServerConfig
    from jaxrlhf.environments.agents import AgentEpisodes

    return AgentEpisodes(AgentServerConfig(window_ms=50.0), agent, graphdef=nnx.split(model)[0], tokenizer=tokenizer,
                         sampling=GREEDY, max_new_tokens=64, turn_tokens=NEW_TOKENS, response_budget=64,
                         batch_size=batch_size, max_prompt_tokens=128,  # the cache's prompt bucket: tools fit
                         max_positions=model.config.max_position_embeddings, eos_ids=(IM_END,))


def test_an_agent_that_drops_tools_on_its_second_request_trains_both_turns(model, tokenizer):
    """Every segment is a row of its own with its episode's reward: rows [0, E) the episodes' last segments,
    rows [E, 2E) the segments before them (the first turn, with its tools), each turn's sampled tokens in the
    action mask; the feed's row values are repeated to match, and the metrics count episodes, not rows."""
    feed = {"prompts": ["what is the weather in Paris", "hello world"], "answers": ["", ""],
            "prompt_tokens": np.zeros((2, 4), np.int32), "prompt_mask": np.ones((2, 4), bool)}
    episodes = _agent_episodes(model, tokenizer, _tools_then_none, batch_size=2)
    try:
        values, metrics = episodes(nnx.split(model)[1], feed)
    finally:
        episodes.close()
    assert values["tokens"].shape[0] == 4 and values["prompts"] == feed["prompts"] * 2
    assert values["prompt_tokens"].shape == (4, 4)
    for r, prompt in enumerate(feed["prompts"]):
        first = [{"role": "user", "content": prompt}]
        ids = _prompt_ids(tokenizer, first, tools=[WEATHER])
        answer, logprobs = _greedy(model, ids)
        earlier = values["tokens"][2 + r][values["mask"][2 + r]].tolist()
        assert earlier == ids + answer  # the first turn (tools in its prompt) is a row: trained
        assert values["action_mask"][2 + r].sum() == len(answer) == values["response_mask"][2 + r].sum()
        np.testing.assert_allclose(values["behaviour_logp"][2 + r][:len(answer)], logprobs, atol=1e-5)
        last = values["tokens"][r][values["mask"][r]].tolist()
        assert last[:len(_prompt_ids(tokenizer, first))] == _prompt_ids(tokenizer, first)  # no tools: a rewrite
        assert values["action_mask"][r].sum() > 0
    assert values["env_reward"].tolist() == [2.0] * 4  # the episode's reward on each of its rows
    assert metrics["env/segments"] == 2.0 and metrics["env/requests"] == 2.0 and metrics["env/reward"] == 2.0
    assert metrics["endpoint/match_rewrite"] == 2


def test_a_request_after_an_observation_extends_the_cache(model, tokenizer):
    """The run's agents generate on the multi-turn engine's cache: a second request that continues its
    episode's record prefills only its new tokens (the observation, after the first answer's pending last
    token), not its whole context, and answers as the model's greedy continuation of that whole context."""
    feed = {"prompts": ["what is the weather in Paris", "hello world"], "answers": ["", ""]}
    episodes = _agent_episodes(model, tokenizer, _two_turns, batch_size=2)
    try:
        values, metrics = episodes(nnx.split(model)[1], feed)
    finally:
        episodes.close()
    assert values["tokens"].shape[0] == 2 and metrics["endpoint/match_rewrite"] == 0  # one segment each
    cached = whole = 0
    for r, prompt in enumerate(feed["prompts"]):
        ids = _prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        response = values["response_tokens"][r][values["response_mask"][r]].tolist()
        sampled = values["action_mask"][r][values["response_mask"][r]]
        first = int(np.argmin(sampled))  # the first answer's tokens, then the observation's
        observed = int(np.argmax(sampled[first:])) if sampled[first:].any() else len(sampled) - first
        assert response[:first] == _greedy(model, ids)[0]
        context = ids + response[:first + observed]
        second, logprobs = _greedy(model, context)
        assert response[first + observed:] == second  # the extended cache answers as a full prefill would
        np.testing.assert_allclose(values["behaviour_logp"][r][first + observed:len(response)], logprobs, atol=1e-4)
        cached += len(ids) + observed + 1  # the first prompt, then the observation and the pending token
        whole += len(ids) + len(context)
    assert metrics["endpoint/prefill_tokens"] == cached < whole
