"""Tokenizers: byte-level round trip; a tokenizer.json built here, saved and loaded."""

import json

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
)


def test_byte_round_trip():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    text = "12+7=19, héllo ✓"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert min(ids) >= 3 and max(ids) < tok.vocab_size == 259
    assert tok.decode(ids) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
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
    assert tok.pad_id == eos  # no pad token anywhere: pad with EOS


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
