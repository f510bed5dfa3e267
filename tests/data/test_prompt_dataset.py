"""Batches: malformed rows counted, deterministic shuffle and resume, padding
buckets, per-process shards, SFT and preference batches, config wiring."""

import json

import numpy as np
import pytest

from jaxrlhf.config import load_config
from jaxrlhf.data import (
    DataError,
    JsonlSource,
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    bucket_length,
    left_pad,
)
from jaxrlhf.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


class ListSource:
    """An in-memory row source."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _rows(n):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1), "id": i} for i in range(n)]


def _dataset(source, **kw):
    args = dict(batch_size=4, max_prompt_len=16, process_index=0, process_count=1, seed=3)
    args.update(kw)
    return PromptDataset(source, TOK, **args)


def test_bucket_length_and_left_pad():
    assert [bucket_length(n, 16, 64) for n in (1, 16, 17, 40, 64)] == [16, 16, 32, 48, 64]
    assert bucket_length(40, 16, 40) == 40  # capped at the maximum even when it is not a multiple
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
    ds.next_batch()  # the second epoch starts; malformed rows are met (and counted) again
    metrics = ds.metrics()
    assert metrics["data/skipped/missing_key"] >= 2
    for reason in ("wrong_type", "empty", "too_long", "not_a_mapping", "bad_json"):
        assert metrics[f"data/skipped/{reason}"] >= 1, reason
    assert metrics["data/skipped"] == sum(v for k, v in metrics.items() if k.startswith("data/skipped/"))


def test_numeric_answers_and_extraction():
    rows = [{"q": "a", "a": 7}, {"q": "b", "a": "work\n#### 12"}, {"q": "c", "a": "no marker"}]
    ds = _dataset(ListSource(rows), batch_size=1, prompt_key="q", answer_key="a", answer_extract="gsm8k",
                  shuffle=False)
    assert ds.next_batch().answers == ("12",)  # row 0 ("7": no ####) and row 2 are bad answers
    assert ds.metrics()["data/skipped/bad_answer"] == 1


def test_all_rows_malformed_is_an_error_not_a_hang():
    ds = _dataset(ListSource([{"nope": 1}] * 5))
    with pytest.raises(DataError, match="no valid row in a whole pass"):
        ds.next_batch()
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
    rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "five"}, {"chosen": "long chosen text", "rejected": "r"}]
    ds = PreferenceDataset(ListSource(rows), TOK, batch_size=2, max_len=32, prompt_key=None, shuffle=False,
                           process_index=0, process_count=1)
    batch = ds.next_batch()
    assert batch.chosen_ids.shape == batch.rejected_ids.shape == (2, 32)
    assert batch.chosen_ids[0][batch.chosen_mask[0]].tolist() == [TOK.bos_id] + TOK.encode("4") + [TOK.eos_id]
    assert batch.rejected_ids[1, -1] == TOK.eos_id


def test_from_config_reads_the_bundled_task(tmp_path):
    config = load_config(None, [f"data.data_dir={tmp_path}", "data.batch_size=8", "sft.batch_size=4",
                                "run.seed=5"])
    prompts = PromptDataset.from_config(config, TOK, process_index=0, process_count=1)
    batch = prompts.next_batch()
    assert batch.input_ids.shape == (8, 16) and all(p.endswith("=") for p in batch.prompts)
    assert prompts.seed == 5
    sft = SFTDataset.from_config(config, TOK, process_index=0, process_count=1)
    assert sft.next_batch().loss_mask.any()
