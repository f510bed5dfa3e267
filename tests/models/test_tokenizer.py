"""Tokenizers: byte-level round trip; a tokenizer.json built here, saved and loaded; prompt
ids (BOS or not) exactly as transformers' AutoTokenizer gives them; every EOS id."""

import json
import warnings

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, trainers

from jaxrlhf.models.config import PRESETS
from jaxrlhf.models.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    prompt_prefix,
)
from jaxrlhf.testing.models import TOKENIZER_STYLES, save_tiny_tokenizer


def test_byte_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    text = "12+7=19, héllo ✓"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert min(ids) >= 3 and max(ids) < tok.vocab_size == 259
    assert tok.decode(ids) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.eos_ids == (2,) and tok.special_prefix == (1,)  # our convention: prompts start with BOS
    # Special tokens are dropped on decode; so is anything outside the byte range.
    assert tok.decode([tok.bos_id, *tok.encode("ab"), tok.eos_id, tok.pad_id, 300]) == "ab"
    assert tok.vocab_size <= PRESETS["tiny"].vocab_size


def test_byte_decode_of_broken_utf8_does_not_raise():
    tok = ByteTokenizer()
    assert tok.decode([0xE2 + 3]) == "\ufffd"


def _train_tokenizer(folder):
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    raw.train_from_iterator(["the cat sat on the mat", "a dog and a cat", "12 + 7 = 19"] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    raw.save(str(folder / "tokenizer.json"))
    return raw


def test_hf_tokenizer_json_with_special_tokens(tmp_path):
    raw = _train_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"})
    )
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (
        raw.token_to_id("<pad>"), raw.token_to_id("<s>"), raw.token_to_id("</s>"))
    ids = tok.encode("the cat sat")
    assert ids == raw.encode("the cat sat").ids
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == "the cat sat"
    assert tok.vocab_size == raw.get_vocab_size()
    # Loading the file directly finds the same sidecar config.
    assert load_tokenizer(tmp_path / "tok" / "tokenizer.json").eos_id == tok.eos_id


def test_hf_tokenizer_ids_from_model_config_and_pad_fallback(tmp_path):
    raw = _train_tokenizer(tmp_path / "tok")
    eos = raw.token_to_id("</s>")
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"eos_token_id": [eos, 99], "bos_token_id": 1}))
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.eos_id == eos and tok.bos_id == 1
    assert tok.eos_ids == (eos, 99)  # every listed EOS id ends a sequence
    assert tok.pad_id == eos  # no pad token anywhere: pad with EOS
    assert tok.special_prefix == ()  # a post-processor-less tokenizer.json adds nothing...
    assert prompt_prefix(tok) == [] and prompt_prefix(tok, add_bos=True) == [1]  # ...unless BOS is forced


def test_hf_tokenizer_needs_an_eos(tmp_path):
    _train_tokenizer(tmp_path / "tok")
    with pytest.raises(TokenizerError, match="no EOS token known"):
        load_tokenizer(tmp_path / "tok")
    assert HFTokenizer(tmp_path / "tok", eos_token="</s>").eos_id is not None
    with pytest.raises(TokenizerError, match="eos_token '<eot>' is not in the vocabulary"):
        HFTokenizer(tmp_path / "tok", eos_token="<eot>")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(TokenizerError, match="neither a built-in"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="tokenizer file not found: .*empty/tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read tokenizer .*bad.json"):
        load_tokenizer(tmp_path / "bad.json")


# ---------------------------------------------------------------- prompt ids as transformers gives them

TEXTS = ["the cat sat", "hello world, héllo ✓", " 12 + 7 = 19", "a dog and a cat"]  # the toy corpus' characters
EXPECT_BOS = {"llama2": True, "llama3": True, "qwen2": False}


def _auto_tokenizer(folder):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("style", TOKENIZER_STYLES)
def test_prompt_ids_equal_auto_tokenizer(tmp_path, style):
    folder = save_tiny_tokenizer(tmp_path / style, style)
    # A model config.json with a BOS id, as Qwen2 checkpoints have (151643, = EOS) though their
    # tokenizer never adds it: the tokenizer's own post-processor decides, not this id.
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # these files agree with themselves: no warning
        tok = load_tokenizer(folder)
    hf = _auto_tokenizer(folder)
    for text in TEXTS:
        assert prompt_prefix(tok) + tok.encode(text) == hf(text)["input_ids"], text
    assert bool(tok.special_prefix) == EXPECT_BOS[style]
    if EXPECT_BOS[style]:
        assert tok.special_prefix == (tok.bos_id,) == (hf.bos_token_id,)
    else:
        assert tok.bos_id == 0  # known from config.json, used only when forced
    # data.add_bos=true / false force BOS on or off whatever the tokenizer does.
    assert prompt_prefix(tok, add_bos=True) == [tok.bos_id]
    assert prompt_prefix(tok, add_bos=False) == []


def test_forcing_bos_without_one_is_an_error(tmp_path):
    tok = load_tokenizer(save_tiny_tokenizer(tmp_path / "q", "qwen2"))  # bos_token null, no config.json
    assert tok.bos_id is None and prompt_prefix(tok) == []
    with pytest.raises(TokenizerError, match="add_bos=true, but .* has no BOS token"):
        prompt_prefix(tok, add_bos=True)


def test_byte_tokenizer_keeps_its_bos():
    tok = ByteTokenizer()
    assert prompt_prefix(tok) == prompt_prefix(tok, add_bos=True) == [tok.BOS]
    assert prompt_prefix(tok, add_bos=False) == []


def test_add_bos_token_that_disagrees_with_tokenizer_json_warns(tmp_path):
    """transformers 5 ignores tokenizer_config.json's add_bos_token when tokenizer.json exists; so do we, loudly."""
    folder = save_tiny_tokenizer(tmp_path / "l", "llama2")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    with pytest.warns(UserWarning, match="add_bos_token=false, but the post-processor .* adds BOS"):
        tok = load_tokenizer(folder)
    assert prompt_prefix(tok) + tok.encode("the cat") == _auto_tokenizer(folder)("the cat")["input_ids"]


def test_eos_ids_gather_config_and_generation_config(tmp_path):
    folder = save_tiny_tokenizer(tmp_path / "l3", "llama3")  # eos_token <|eot_id|>
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [1, 2, 3]}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    tok = load_tokenizer(folder)
    assert tok.eos_id == 3 and tok.eos_ids == (3, 1, 2)  # the tokenizer's own EOS first, no repeats
    assert tok.pad_id == 3
