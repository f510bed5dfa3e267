"""Batches: malformed rows counted, deterministic shuffle and resume, padding
buckets, per-process shards, SFT and preference batches, config wiring."""

import json

import numpy as np
import pytest

from jaxrlhf.config import load_config
from jaxrlhf.data import (
    DataError,
    JsonlSource,
    ListSource,
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    left_pad,
)
from jaxrlhf.models.lengths import bucket_length
from jaxrlhf.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _rows(n):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1), "id": i} for i in range(n)]


def _dataset(source, tokenizer=TOK, **kw):
    args = dict(batch_size=4, max_prompt_len=16, process_index=0, process_count=1, seed=3)
    args.update(kw)
    return PromptDataset(source, tokenizer, **args)


def test_bucket_length_and_left_pad():
    assert [bucket_length(n, 16, multiple=16, cap=64) for n in (1, 16, 17, 40, 64)] == [16, 16, 32, 48, 64]
    assert bucket_length(40, 16, multiple=16, cap=40) == 40  # capped at the maximum even when it is not a multiple
    tokens, mask = left_pad([[5, 6], [7]], 4, 0)
    assert tokens.tolist() == [[0, 0, 5, 6], [0, 0, 0, 7]]
    assert mask.tolist() == [[False, False, True, True], [False, False, False, True]]
    assert tokens.dtype == np.int32 and mask.dtype == bool


def test_prompt_batch_contents():
    ds = _dataset(ListSource(_rows(10)), shuffle=False, template="Q {prompt}")
    batch = ds.next_batch()
    assert batch.input_ids.shape == (4, 16) and batch.attention_mask.shape == (4, 16)
    assert batch.prompts[0] == "Q 0+1=" and batch.answers[0] == "1" and batch.meta[0] == {"id": 0}
    ids = batch.input_ids[0][batch.attention_mask[0]].tolist()
    assert ids == [TOK.bos_id] + TOK.encode("Q 0+1=") and batch.prompt_lens[0] == len(ids)
    assert (batch.input_ids[~batch.attention_mask] == TOK.pad_id).all()
    assert batch.attention_mask[:, -1].all()  # left padding: every prompt ends at the last column
    assert batch.row_ids.tolist() == [0, 1, 2, 3] and batch.global_batch_size == 4


def test_padding_buckets_follow_the_longest_prompt():
    rows = [{"prompt": "x" * n, "answer": "a"} for n in (3, 20, 40)]
    ds = _dataset(ListSource(rows), batch_size=1, max_prompt_len=48, shuffle=False, add_bos=False)
    assert [ds.next_batch().input_ids.shape[1] for _ in range(3)] == [16, 32, 48]


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    good = _rows(4)
    bad = [
        {"answer": "1"},  # missing prompt
        {"prompt": 12, "answer": "1"},  # wrong type
        {"prompt": "   ", "answer": "1"},  # empty
        {"prompt": "y" * 50, "answer": "1"},  # too long
        {"prompt": "3+3=", "answer": None},  # missing answer
        ["not", "a", "mapping"],
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good + bad) + "{broken json\n")
    ds = _dataset(JsonlSource(path), batch_size=4)
    batch = ds.next_batch()
    assert sorted(batch.row_ids.tolist()) == [0, 1, 2, 3]
    for _ in range(5):  # four more epochs: the malformed rows are met again, but counted once each
        ds.next_batch()
    assert ds.epoch >= 3
    metrics = ds.metrics()
    assert metrics["data/skipped/missing_key"] == 2
    for reason in ("wrong_type", "empty", "too_long", "not_a_mapping", "bad_json"):
        assert metrics[f"data/skipped/{reason}"] == 1, reason
    assert metrics["data/skipped"] == 7 == len(bad) + 1  # never more than the file's rows


def test_numeric_answers_and_extraction():
    rows = [{"q": "a", "a": 7}, {"q": "b", "a": "work\n#### 12"}, {"q": "c", "a": "no marker"}]
    ds = _dataset(ListSource(rows), batch_size=1, prompt_key="q", answer_key="a", answer_extract="gsm8k",
                  shuffle=False)
    assert ds.next_batch().answers == ("12",)  # row 0 ("7": no ####) and row 2 are bad answers
    assert ds.metrics()["data/skipped/bad_answer"] == 1


def test_all_rows_malformed_is_an_error_not_a_hang():
    ds = _dataset(ListSource([{"nope": 1}] * 5))
    with pytest.raises(DataError, match="no valid row in a whole pass") as e:
        ds.next_batch()
    # the counts never exceed the rows, and the message names the key that is missing
    assert "skipped 5 of 5 rows: missing_key 5 (first: row " in str(e.value)
    assert "no key 'prompt' (the row has 'nope')" in str(e.value)
    with pytest.raises(DataError, match="has no rows"):
        _dataset(ListSource([]))


def test_deterministic_shuffle_and_epochs():
    first = [b.row_ids.tolist() for b, _ in zip(_dataset(ListSource(_rows(10))), range(6))]
    again = [b.row_ids.tolist() for b, _ in zip(_dataset(ListSource(_rows(10))), range(6))]
    other = [b.row_ids.tolist() for b, _ in zip(_dataset(ListSource(_rows(10)), seed=4), range(6))]
    assert first == again and first != other
    flat = sum(first, [])
    assert sorted(flat[:10]) == list(range(10))  # one epoch covers every row once
    assert flat[:10] != list(range(10))  # ... shuffled
    assert flat[10:20] != flat[:10]  # each epoch has its own order


def test_resume_from_state_equals_uninterrupted():
    source = ListSource(_rows(11) + [{"bad": 1}])
    full = _dataset(source)
    expected = [full.next_batch() for _ in range(8)]
    part = _dataset(source)
    for _ in range(3):
        part.next_batch()
    state = json.loads(json.dumps(part.state_dict()))  # survives a JSON checkpoint
    resumed = _dataset(source)
    resumed.load_state_dict(state)
    for want in expected[3:]:
        got = resumed.next_batch()
        np.testing.assert_array_equal(got.input_ids, want.input_ids)
        assert got.row_ids.tolist() == want.row_ids.tolist()
    assert resumed.metrics() == full.metrics()  # skip counters are part of the state
    with pytest.raises(DataError, match="cannot resume data position"):
        _dataset(ListSource(_rows(5))).load_state_dict(state)


def test_per_process_shards_partition_the_global_batch():
    rows = [{"prompt": "z" * (i % 13 + 1), "answer": "a"} for i in range(40)]
    whole = _dataset(ListSource(rows), batch_size=8, max_prompt_len=32)
    shards = [_dataset(ListSource(rows), batch_size=8, max_prompt_len=32, process_index=p, process_count=4)
              for p in range(4)]
    for _ in range(5):
        batch = whole.next_batch()
        parts = [s.next_batch() for s in shards]
        assert all(p.input_ids.shape == (2, batch.input_ids.shape[1]) for p in parts)  # same padded length
        np.testing.assert_array_equal(np.concatenate([p.input_ids for p in parts]), batch.input_ids)
        assert all(p.global_batch_size == 8 for p in parts)
    assert all(s.state_dict() == whole.state_dict() for s in shards)
    with pytest.raises(DataError, match="divisible by the number of processes 3"):
        _dataset(ListSource(rows), batch_size=8, process_index=0, process_count=3)


def test_sft_batch_masks_only_the_completion():
    ds = SFTDataset(ListSource(_rows(4)), TOK, batch_size=2, max_len=16, shuffle=False,
                    process_index=0, process_count=1)
    batch = ds.next_batch()
    row = batch.input_ids[0]
    targets = row[batch.loss_mask[0]].tolist()
    assert targets == TOK.encode("1") + [TOK.eos_id]
    assert row[batch.attention_mask[0]].tolist() == [TOK.bos_id] + TOK.encode("0+1=1") + [TOK.eos_id]
    assert not (batch.loss_mask & ~batch.attention_mask).any()


def test_preference_pairs_share_one_length():
    rows = [{"chosen": "2+2=4", "rejected": "2+2=five"}, {"chosen": "Q: a? A: long chosen text", "rejected": "Q: a? A: r"}]
    ds = PreferenceDataset(ListSource(rows), TOK, batch_size=2, max_len=32, prompt_key=None, shuffle=False,
                           process_index=0, process_count=1)
    batch = ds.next_batch()
    assert batch.chosen_ids.shape == batch.rejected_ids.shape == (2, 32)
    assert batch.chosen_ids[0][batch.chosen_mask[0]].tolist() == [TOK.bos_id] + TOK.encode("2+2=4") + [TOK.eos_id]
    assert batch.rejected_ids[1, -1] == TOK.eos_id
    # without a prompt key the shared prefix is the prompt: the loss starts where the texts differ
    assert batch.chosen_ids[0][batch.chosen_loss_mask[0]].tolist() == TOK.encode("4") + [TOK.eos_id]
    assert batch.rejected_ids[1][batch.rejected_loss_mask[1]].tolist() == TOK.encode("r") + [TOK.eos_id]


def test_preference_pairs_without_a_shared_prefix_are_an_error():
    rows = [{"chosen": "yes", "rejected": "no"}]
    ds = PreferenceDataset(ListSource(rows), TOK, batch_size=1, max_len=32, prompt_key=None,
                           process_index=0, process_count=1)
    with pytest.raises(DataError, match="share no token prefix, so there is no prompt"):
        ds.check()
    assert ds.state_dict()["index"] == 0  # a check does not move the stream


def test_from_config_reads_the_bundled_task(tmp_path):
    config = load_config(None, [f"data.data_dir={tmp_path}", "data.batch_size=8", "sft.batch_size=4",
                                "run.seed=5"])
    prompts = PromptDataset.from_config(config, TOK, process_index=0, process_count=1)
    batch = prompts.next_batch()
    assert batch.input_ids.shape == (8, 16) and all(p.endswith("=") for p in batch.prompts)
    assert prompts.seed == 5
    sft = SFTDataset.from_config(config, TOK, process_index=0, process_count=1)
    assert sft.next_batch().loss_mask.any()


# ---------------------------------------------------------------- BOS: as the tokenizer does, or forced


@pytest.fixture(scope="module", params=["qwen2", "llama3"])
def hf_tok(request, tmp_path_factory):
    """A tokenizer.json beside a config.json naming a BOS id, as Qwen2 checkpoints ship it."""
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.testing.models import save_tiny_tokenizer

    folder = save_tiny_tokenizer(tmp_path_factory.mktemp("tok") / request.param, request.param)
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    return folder, load_tokenizer(folder)


def test_prompts_are_encoded_as_auto_tokenizer_encodes_them(hf_tok):
    transformers = pytest.importorskip("transformers")
    folder, tok = hf_tok
    rows = [{"prompt": "the cat sat", "answer": "1"}, {"prompt": "12 + 7 =", "answer": "19"}]
    batch = _dataset(ListSource(rows), tokenizer=tok, batch_size=2, shuffle=False).next_batch()
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    for row, text in enumerate(["the cat sat", "12 + 7 ="]):
        assert batch.input_ids[row][batch.attention_mask[row]].tolist() == hf(text)["input_ids"]


@pytest.mark.parametrize("add_bos", [None, True, False])
def test_add_bos_forces_bos_in_every_dataset(hf_tok, add_bos):
    _, tok = hf_tok
    expect = list(tok.special_prefix) if add_bos is None else [tok.bos_id] if add_bos else []
    rows = [{"prompt": "the cat", "answer": "a dog", "chosen": "a dog", "rejected": "a mat"}]
    kw = dict(batch_size=1, shuffle=False, process_index=0, process_count=1, add_bos=add_bos)
    prompt = PromptDataset(ListSource(rows), tok, max_prompt_len=32, **kw).next_batch()
    assert prompt.input_ids[0][prompt.attention_mask[0]].tolist() == expect + tok.encode("the cat")
    completed = expect + tok.encode("the cat") + tok.encode("a dog") + [tok.eos_id]
    sft = SFTDataset(ListSource(rows), tok, max_len=32, **kw).next_batch()
    assert sft.input_ids[0][sft.attention_mask[0]].tolist() == completed
    pairs = PreferenceDataset(ListSource(rows), tok, max_len=32, **kw).next_batch()
    assert pairs.chosen_ids[0][pairs.chosen_mask[0]].tolist() == completed


def test_data_add_bos_from_config():
    """data.add_bos: null keeps the byte tokenizer's BOS (our convention), false drops it, true keeps it."""
    row = ListSource([{"prompt": "1+1=", "answer": "2"}])
    for value, expect in (("null", [TOK.bos_id]), ("false", []), ("true", [TOK.bos_id])):
        config = load_config(None, [f"data.add_bos={value}"])
        ds = PromptDataset(row, TOK, batch_size=1, max_prompt_len=16, shuffle=False, process_index=0,
                           process_count=1, add_bos=config.data.add_bos)
        batch = ds.next_batch()
        assert batch.input_ids[0][batch.attention_mask[0]].tolist() == expect + TOK.encode("1+1="), value


def test_forcing_bos_on_a_tokenizer_without_one_is_a_data_error(tmp_path):
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.testing.models import save_tiny_tokenizer

    tok = load_tokenizer(save_tiny_tokenizer(tmp_path / "q", "qwen2"))
    with pytest.raises(DataError, match="data.add_bos: add_bos=true, but .* has no BOS token"):
        _dataset(ListSource(_rows(4)), tokenizer=tok, add_bos=True)


def test_few_valid_rows_are_found_across_reshuffled_epochs():
    rows = [{"nope": i} for i in range(9)] + [{"prompt": "1+1=", "answer": "2"}]
    ds = _dataset(ListSource(rows), batch_size=4, max_prompt_len=16, seed=3)
    for _ in range(20):  # every batch is the one valid row, whatever the epochs' orders
        assert ds.next_batch().answers == ("2",) * 4
