"""Chat templates: our rendering is byte-identical to transformers' `apply_chat_template` (and the
token ids equal) for Llama-3, Qwen2 and Mistral style templates on tiny tokenizers built here; the
datasets render prompts through them and SFT on conversations targets the assistant turns only."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrlhf.config import load_config
from jaxrlhf.data import DataError, ListSource, PromptDataset, SFTDataset
from jaxrlhf.data.dataset import ChatFormat
from jaxrlhf.models.chat_template import ChatTemplate, ChatTemplateError
from jaxrlhf.models.tokenizer import load_tokenizer
from jaxrlhf.testing.models import save_tiny_tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# Templates in the style of each family's tokenizer_config.json (one line, as they ship):
# Llama-3: header tokens, content trimmed, BOS before the first message.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2(.5): ChatML with a default system message, written multi-line with whitespace control.
QWEN2 = """{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Mistral: [INST] blocks, strict alternation enforced with raise_exception, EOS after answers;
# written with indented block tags on their own lines, which only trim_blocks/lstrip_blocks keep off the text.
MISTRAL = """{{ bos_token }}
{%- for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
{{ '[INST] ' + message['content'] + ' [/INST]' -}}
    {% elif message['role'] == 'assistant' %}
{{ message['content'] + eos_token -}}
    {% endif %}
{% endfor %}
"""
STYLES = {"llama3": ("llama3", LLAMA3), "qwen2": ("qwen2", QWEN2), "mistral": ("llama2", MISTRAL)}

CONVERSATIONS = [
    [{"role": "user", "content": "the cat sat on the mat"}],
    [{"role": "user", "content": "12 + 7 = ?  "}, {"role": "assistant", "content": "19"},
     {"role": "user", "content": "héllo ✓ world"}],
    [{"role": "user", "content": "a dog", "name": None}, {"role": "assistant", "content": "and a cat\n"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"},
     {"role": "assistant", "content": "the mat"}],
]


# The SentencePiece-style (llama2) tiny tokenizer knows only the characters it was trained on.
CHAT_CORPUS = ["[INST] the cat [/INST] 12 + 7 = ?  [/INST] 19 be brief hello world a dog and a cat\n the mat ="]


def _folder(tmp_path, style: str, template: str, *, as_jinja_file: bool = False):
    tokenizer_style, _ = STYLES[style]
    folder = save_tiny_tokenizer(tmp_path / style, tokenizer_style, corpus=CHAT_CORPUS)
    config_file = folder / "tokenizer_config.json"
    if as_jinja_file:  # transformers 5 saves the template beside the config
        (folder / "chat_template.jinja").write_text(template)
    else:
        config = json.loads(config_file.read_text())
        config["chat_template"] = template
        config_file.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("as_jinja_file", [False, True])
def test_rendering_and_ids_equal_transformers(style, as_jinja_file, tmp_path):
    folder = _folder(tmp_path, style, STYLES[style][1], as_jinja_file=as_jinja_file)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = ChatTemplate.from_folder(folder)
    tok = load_tokenizer(folder)
    assert tok.chat_template is not None
    compared = 0
    for messages in CONVERSATIONS:
        if style == "mistral" and messages[0]["role"] == "system":
            with pytest.raises(ChatTemplateError, match="roles must alternate"):
                ours.render(messages)
            continue
        for gen in (False, True):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.render(messages, add_generation_prompt=gen) == expected, (messages, gen)
            expected_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)["input_ids"]
            assert tok.encode(ours.render(messages, add_generation_prompt=gen)) == list(expected_ids)
            compared += 1
    assert compared >= 6


def _tokens_in_special_tokens_map(folder, *, as_dicts: bool) -> None:
    """Lay the folder out as an older checkpoint: the named special tokens only in special_tokens_map.json."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    names = [k for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(k)]
    listed = {k: config.pop(k) for k in names}
    if as_dicts:
        listed = {k: {"content": v, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
                  for k, v in listed.items()}
    config_file.write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(listed))


@pytest.mark.parametrize("style, as_dicts", [("llama3", False), ("mistral", True)])
def test_special_tokens_only_in_special_tokens_map_render_like_transformers(style, as_dicts, tmp_path):
    """An older checkpoint names bos_token, eos_token, ... only in special_tokens_map.json (as strings or
    {"content": ...}): transformers fills them in from there, so BOS and EOS are in the rendered text
    (not empty), and the tokenizer's BOS and EOS ids are transformers' too."""
    folder = _folder(tmp_path, style, STYLES[style][1])
    _tokens_in_special_tokens_map(folder, as_dicts=as_dicts)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert hf.bos_token and hf.eos_token  # the reference did read them
    ours, tok = ChatTemplate.from_folder(folder), load_tokenizer(folder)
    for messages in CONVERSATIONS[1:3]:
        for gen in (False, True):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.render(messages, add_generation_prompt=gen) == expected, (messages, gen)
            assert hf.bos_token in expected
            expected_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)["input_ids"]
            assert tok.encode(ours.render(messages, add_generation_prompt=gen)) == list(expected_ids)
    assert (tok.bos_id, tok.eos_id) == (hf.bos_token_id, hf.eos_token_id)


SHOW_TOKENS = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ messages[0]['content'] }}"


@pytest.mark.parametrize("layout", ["both_files", "saved_since_4_34", "map_removes_one"])
def test_which_file_names_the_special_tokens_is_transformers_choice(layout, tmp_path):
    """Both files name the tokens: transformers takes special_tokens_map.json's, unless tokenizer_config.json
    has `added_tokens_decoder` (every save since transformers 4.34), when it does not read the map."""
    folder = _folder(tmp_path, "llama3", SHOW_TOKENS)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    listed = {"bos_token": "<|end_of_text|>", "eos_token": {"content": "<|eom_id|>"}}
    if layout == "saved_since_4_34":
        config["added_tokens_decoder"] = {}
    if layout == "map_removes_one":
        listed = {"bos_token": None}
    config_file.write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps(listed))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = [{"role": "user", "content": "a dog"}]
    assert ChatTemplate.from_folder(folder).render(messages) == hf.apply_chat_template(messages, tokenize=False)
    tok = load_tokenizer(folder)
    assert tok.eos_id == hf.eos_token_id
    if hf.bos_token_id is not None:  # without one, ours names the BOS that tokenizer.json's post-processor adds
        assert tok.bos_id == hf.bos_token_id


def test_no_template_and_a_broken_one(tmp_path):
    folder = save_tiny_tokenizer(tmp_path / "plain", "qwen2")
    assert ChatTemplate.from_folder(folder) is None
    assert load_tokenizer("byte").chat_template is None
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}", {})
    # the sandbox: a template cannot reach Python internals
    evil = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(Exception, match="unsafe|access"):
        evil.render([{"role": "user", "content": "x"}])


def _chat(folder) -> tuple[object, ChatFormat]:
    tok = load_tokenizer(folder)
    return tok, ChatFormat(tok.chat_template, system_prompt=None)


@pytest.mark.parametrize("style", ["llama3", "qwen2"])
def test_prompt_dataset_renders_prompts_like_transformers(style, tmp_path):
    folder = _folder(tmp_path, style, STYLES[style][1])
    tok, chat = _chat(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    rows = [{"prompt": "12 + 7", "answer": "19"},
            {"prompt": [{"role": "user", "content": "a dog"}, {"role": "assistant", "content": "a cat"},
                        {"role": "user", "content": "the mat"}], "answer": "1"}]
    ds = PromptDataset(ListSource(rows), tok, batch_size=2, max_prompt_len=512, template="{prompt} =", chat=chat,
                       shuffle=False)
    batch = ds.next_batch()
    assert not ds.skipped
    expected = [hf.apply_chat_template([{"role": "user", "content": "12 + 7 ="}], add_generation_prompt=True)["input_ids"],
                hf.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True)["input_ids"]]
    for row, ids in enumerate(expected):
        assert batch.input_ids[row][batch.attention_mask[row]].tolist() == list(ids)
    assert batch.answers == ("19", "1")


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("packing", [False, True])
def test_sft_on_conversations_targets_assistant_turns(style, packing, tmp_path):
    folder = _folder(tmp_path, style, STYLES[style][1])
    tok, chat = _chat(folder)
    conversation = [{"role": "user", "content": "12 + 7"}, {"role": "assistant", "content": "19"},
                    {"role": "user", "content": "a dog"}, {"role": "assistant", "content": "a cat"}]
    rows = [{"messages": conversation}, {"prompt": "the cat", "answer": "the mat"}]
    ds = SFTDataset(ListSource(rows), tok, batch_size=2, max_len=512, chat=chat, packing=packing, shuffle=False)
    batch = ds.next_batch()
    assert not ds.skipped
    end = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>\n", "mistral": "</s>"}[style]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    # the conversation's tokens are transformers' ids; the targets are the assistant turns and their end marker
    full = list(hf.apply_chat_template(conversation)["input_ids"])
    segments = batch.segment_ids if packing else batch.attention_mask.astype(int)
    row = 0 if not packing else int(np.argmax([(s == 1).sum() for s in segments]))
    first = (segments[row] == 1) if packing else batch.attention_mask[row]
    assert batch.input_ids[row][first].tolist() == full
    targets = batch.input_ids[row][first & batch.loss_mask[row]].tolist()
    if style == "mistral":  # "19</s>" and "a cat</s>" with the space before each answer kept in its token
        assert hf.decode(targets).replace(" ", "") == ("19" + end + "acat" + end)
    else:
        assert hf.decode(targets) == "19" + end + "a cat" + end
    # a prompt/completion row becomes user + assistant turns: only the completion (and end marker) is a target
    second = (segments[row] == 2) if packing else batch.attention_mask[1]
    r2 = row if packing else 1
    answer = hf.decode(batch.input_ids[r2][second & batch.loss_mask[r2]].tolist())
    assert answer.replace(" ", "") == ("themat" + end).replace(" ", "")


def test_chat_format_needs_a_template(tmp_path):
    config = load_config(None, ["data.prompt_format=chat", f"data.data_dir={tmp_path}"])
    with pytest.raises(DataError, match="ships no chat template"):
        PromptDataset.from_config(config, load_tokenizer("byte"))
    with pytest.raises(Exception, match="data.add_bos does not apply"):
        load_config(None, ["data.prompt_format=chat", "data.add_bos=true"])


# Qwen2 style with transformers' `{% generation %}` markers around each assistant turn and its end
# marker: transformers then computes the assistant-token mask itself, an independent reference.
QWEN2_GENERATION = """{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message.content + '<|im_end|>\\n' }}{%- endgeneration %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def test_assistant_targets_equal_transformers_assistant_mask(tmp_path):
    from jaxrlhf.data.dataset import assistant_targets

    folder = _folder(tmp_path, "qwen2", QWEN2_GENERATION)
    tok, chat = _chat(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    for messages in CONVERSATIONS:
        if not any(m["role"] == "assistant" for m in messages):
            continue
        out = hf.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, targets = assistant_targets(chat, tok, messages)
        assert ids == list(out["input_ids"])
        assert [int(t) for t in targets] == list(out["assistant_masks"]), messages


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft", "grpo"])
def test_a_run_chooses_the_template_from_its_config(name, tmp_path):
    """`data.prompt_format=chat` through `jaxrlhf.train.run`: SFT on conversations and GRPO on
    templated prompts, with a tiny Qwen2-style tokenizer that ships its template."""
    from jaxrlhf import train
    from jaxrlhf.metrics import read_metrics

    folder = _folder(tmp_path, "qwen2", QWEN2)
    data = tmp_path / "data"
    data.mkdir()
    conversation = [{"role": "user", "content": "12 + 7"}, {"role": "assistant", "content": "19"}]
    rows = [{"messages": conversation, "prompt": "12 + 7", "answer": "19"}] * 8
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"run.output_dir={tmp_path / 'run'}", "run.steps=2", "run.checkpoint_every=0",
                 "run.tensorboard=false", "run.export_hf=false", f"model.tokenizer={folder}",
                 "model.actor.preset=tiny", f"data.source={data}", "data.prompt_format=chat", "data.batch_size=8",
                 "data.max_prompt_len=64", "data.max_seq_len=96", "generation.max_new_tokens=4", "sft.steps=0",
                 f"algorithm.name={name}"]
    if name == "grpo":
        overrides += ["algorithm.group_size=2", "algorithm.minibatches=2", "algorithm.kl_coef=0"]
    train.run(load_config(None, overrides))
    records = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2] and records[-1]["data/skipped"] == 0.0
    key = "loss/sft" if name == "sft" else "loss/policy"
    assert np.isfinite(records[-1][key])
