"""The bundled calculator task (docs/agentic.md, "The calculator task"): its byte-level tokenizer's chat template
describes the tools, a demonstration played through the tool environment gives observations whose concatenation
with the model's turns is the rendered conversation, and the SFT warm-up renders the same demonstration with the
same text and trains only on the assistant turns. Cheap: no TFDS preparation, no model."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from jaxrlhf import environments as envs
from jaxrlhf.data.bundled import bundled_file
from jaxrlhf.data.dataset import ChatFormat, assistant_targets
from jaxrlhf.data.sources import JsonFieldsSource, RowError
from jaxrlhf.environments.tool_calls import detect_tool_format
from jaxrlhf.models.tokenizer import load_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "jaxrlhf" / "data" / "bundled" / "calculator_tokenizer"


def _demos() -> list[dict]:
    rows = [json.loads(line) for line in bundled_file("calculator_sft.jsonl").open(encoding="utf-8")]
    return [{**r, "messages": json.loads(r["messages"]), "direct": json.loads(r["direct"])} for r in rows]


def test_bundled_tokenizer_is_reproducible_and_byte_level():
    spec = importlib.util.spec_from_file_location("make_bundled_data", REPO / "scripts" / "make_bundled_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    on_disk = {f"calculator_tokenizer/{p.name}": p.read_text(encoding="utf-8") for p in TOKENIZER.iterdir()}
    assert script.render_tokenizers() == on_disk, "regenerate with scripts/make_bundled_data.py"
    tok = load_tokenizer(str(TOKENIZER))
    assert tok.vocab_size == 258 and tok.special_prefix == ()
    text = "<|im_start|>user\nWhat is 12*34? é<|im_end|>"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) - len("<|im_start|><|im_end|>") + 2  # one id per byte, specials whole
    assert ids[-1] == tok.eos_id and tok._tok.id_to_token(tok.eos_id) == "<|im_end|>"
    assert tok.decode(ids) == "user\nWhat is 12*34? é"  # special tokens dropped, as for any HF tokenizer


def test_demonstration_through_the_environment_is_the_rendered_conversation_and_sft_trains_only_the_model():
    """A tool-calling demonstration replayed through env.name=tools: prompt + the model's turns (each closed by
    <|im_end|>) + observations == the template's rendering of the conversation; the SFT warm-up (sft.tools)
    renders the demonstration to the same text, and its targets are exactly the assistant turns' tokens."""
    tok = load_tokenizer(str(TOKENIZER))
    template = tok.chat_template
    assert detect_tool_format(template.tool_source) == "hermes"
    demos = _demos()
    demo = next(d for d in demos if len(d["messages"]) == 4)
    assert 0.3 < sum(len(d["messages"]) == 4 for d in demos) / len(demos) < 0.5  # only some demos call the tool
    user, call, result, answer = demo["messages"]
    expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
    assert result["content"] == answer["content"] == demo["answer"] == envs.calculator(expression)

    context = envs.EnvironmentContext(tokenizer=tok, chat_template=template, tool_format="hermes",
                                      end_of_turn=("<|im_end|>",))
    env = envs.make_environment("tools", context, {"tools": ["calculator"], "reward": "exact_match"})
    text = env.reset({"prompt": demo["prompt"], "answer": demo["answer"]}).text
    assert text == ("<|im_start|>system\nTools: calculator(expression)<|im_end|>\n"
                    f"<|im_start|>user\n{demo['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    action = f'<tool_call>{{"name":"calculator","arguments":{{"expression":"{expression}"}}}}</tool_call>'
    step = env.step(action)
    assert not step.done and step.info == {"tool_calls": 1.0, "tool_error": 0.0}
    assert step.observation.text == f"\n<|im_start|>tool\n{demo['answer']}<|im_end|>\n<|im_start|>assistant\n"
    final = env.step(demo["answer"])
    assert final.done and final.reward == 1.0
    text += action + "<|im_end|>" + step.observation.text + demo["answer"] + "<|im_end|>"
    rendered = template.render(demo["messages"], tools=[envs.calculator])
    assert text + "\n" == rendered == template.render(env.messages, tools=[envs.calculator])

    chat = ChatFormat(template, tools=(envs.calculator,))
    assert chat.render(demo["messages"]) == rendered
    ids, targets = assistant_targets(chat, tok, demo["messages"])
    assert ids == tok.encode(rendered)
    trained = "".join(tok._tok.id_to_token(i) if i < 2 else tok.decode([i]) for i, t in zip(ids, targets) if t)
    # the assistant turns as rendering them adds them (the template's newline after <|im_end|> included, as
    # transformers' assistant mask does); the user turn, the tool's result and the assistant headers carry no loss
    assert trained == action + "<|im_end|>\n" + demo["answer"] + "<|im_end|>\n"

    # the no-tools twin: the same problem answered directly, no tools described
    env = envs.make_environment("tools", context, {"tools": [], "reward": "exact_match"})
    assert env.reset({"prompt": demo["prompt"], "answer": demo["answer"]}).text == template.render(
        demo["direct"][:1], add_generation_prompt=True, tools=[])
    assert "Tools" not in ChatFormat(template, tools=()).render(demo["direct"])
    assert env.step("1234").reward == float(demo["answer"] == "1234")


def test_json_fields_are_decoded_and_the_configs_load():
    from jaxrlhf.config import load_config

    source = JsonFieldsSource([{"prompt": "p", "messages": '[{"role": "user", "content": "x"}]', "direct": ""},
                               {"prompt": "q", "messages": "[", "direct": ""}], ("messages", "direct"))
    assert source[0] == {"prompt": "p", "messages": [{"role": "user", "content": "x"}], "direct": None}
    with pytest.raises(RowError, match="bad_json"):
        source[1]
    cfg = load_config(str(REPO / "configs" / "calculator-tools.yaml"))
    assert cfg.env.name == "tools" and cfg.sft.tools == ("calculator",) and cfg.generation.engine == "continuous"
    twin = load_config(str(REPO / "configs" / "calculator-tools.yaml"),
                       ["env.args.tools=[]", "sft.tools=[]", "data.messages_key=direct", "env.max_turns=1"])
    assert twin.env.args["tools"] == [] and twin.sft.tools == ()
    from jaxrlhf.config import ConfigError

    for override, message in [
            ("sft.tools=[calculater]", "sft.tools: unknown tool 'calculater'. Did you mean 'calculator'"),
            ("env.args.reward=exact_mach", "env.args.reward: unknown reward function 'exact_mach'. Did you mean")]:
        with pytest.raises(ConfigError, match=message):
            load_config(str(REPO / "configs" / "calculator-tools.yaml"), [override])


@pytest.mark.slow
def test_calculator_config_runs_the_warm_up_and_tool_episodes(tmp_path):
    """configs/calculator-tools.yaml for two warm-up steps on the demonstration conversations and one GRPO step
    of tool episodes (2 prompts x 2): the run completes and logs the episodes' env metrics. (~2-4 min on the
    shared 2-core machine, most of it compiling.)"""
    from jaxrlhf import config as cfglib
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics

    cfg = cfglib.load_config(str(REPO / "configs" / "calculator-tools.yaml"), [
        f"model.tokenizer={TOKENIZER}", "run.steps=1", "sft.steps=2", "sft.batch_size=4", "data.batch_size=2",
        "algorithm.group_size=2", "algorithm.minibatches=1", "run.tensorboard=false", "run.export_hf=false",
        "run.save_checkpoints=false", f"run.output_dir={tmp_path}", f"data.data_dir={tmp_path / 'tfds'}"])
    train.run(cfg)
    [row] = [r for r in read_metrics(str(tmp_path / "metrics.jsonl")) if "env/turns" in r]
    assert 1 <= row["env/turns"] <= 2 and 0.0 <= row["env/reward"] <= 1.0 and row["sft/final_loss"] > 0
