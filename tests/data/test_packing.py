"""SFT packing: whole demonstrations back to back (first fit in stream order), segment ids,
restarting positions, completion-only loss masks, exact resume, nothing lost at a batch
boundary; and packing changes the compute, not the loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlhf.algorithms import sft
from jaxrlhf.data import ListSource, SFTDataset
from jaxrlhf.models.config import preset
from jaxrlhf.models.tokenizer import ByteTokenizer
from jaxrlhf.models.transformer import build_model

TOK = ByteTokenizer()
BOS, EOS, PAD = TOK.bos_id, TOK.eos_id, TOK.pad_id


# (prompt, answer) -> ids = BOS + prompt + answer + EOS, prompt part = BOS + prompt
PAIRS = [
    ("aa", "b"),        # 0: 5 tokens, prompt 3
    ("ccc", "d"),       # 1: 6 tokens, prompt 4
    ("ee", "fff"),      # 2: 7 tokens, prompt 3
    ("gggg", "hhh"),    # 3: 9 tokens, prompt 5
    ("i", "j"),         # 4: 4 tokens, prompt 2
    ("k", "lm"),        # 5: 5 tokens, prompt 2
    ("nn", "o"),        # 6: 5 tokens
    ("pp", "qq"),       # 7: 6 tokens
    ("rrr", "s"),       # 8: 6 tokens
    ("t", "uuuuuu"),    # 9: 9 tokens
]
ROWS = [{"prompt": p, "answer": a} for p, a in PAIRS]
MAX_LEN = 16


def _ids(i):
    p, a = PAIRS[i]
    return [BOS] + TOK.encode(p) + TOK.encode(a) + [EOS], 1 + len(p)


def _packed(rows=ROWS, **kw):
    args = dict(batch_size=2, max_len=MAX_LEN, packing=True, shuffle=False, process_index=0, process_count=1)
    args.update(kw)
    return SFTDataset(ListSource(rows), TOK, **args)


def _segments(batch, r):
    """The (tokens, loss mask, positions) of each segment of packed row r, in order."""
    seg = batch.segment_ids[r]
    out = []
    for k in range(1, int(seg.max()) + 1):
        at = seg == k
        out.append((batch.input_ids[r][at].tolist(), batch.loss_mask[r][at].tolist(), batch.positions[r][at].tolist()))
    return out


def test_first_fit_layout_hand_checked():
    batch = _packed().next_batch()
    # First fit into 2 rows of 16: item0 (5) -> row0, item1 (6) -> row0 [11], item2 (7) -> row1,
    # item3 (9) -> row1 [16], item4 (4) -> row0 [15]; item5 (5) fits nowhere: the batch ends.
    assert batch.input_ids.shape == (2, MAX_LEN) and batch.segment_ids.shape == (2, MAX_LEN)
    assert batch.segment_ids[0].tolist() == [1] * 5 + [2] * 6 + [3] * 4 + [0]
    assert batch.segment_ids[1].tolist() == [1] * 7 + [2] * 9
    assert batch.positions[0].tolist() == list(range(5)) + list(range(6)) + list(range(4)) + [0]
    assert batch.positions[1].tolist() == list(range(7)) + list(range(9))
    assert batch.input_ids[0].tolist() == _ids(0)[0] + _ids(1)[0] + _ids(4)[0] + [PAD]
    assert batch.input_ids[1].tolist() == _ids(2)[0] + _ids(3)[0]
    # loss mask: completion + EOS of each segment; row 0 targets at 3-4 ("b" EOS), 9-10 ("d" EOS), 13-14 ("j" EOS)
    assert np.flatnonzero(batch.loss_mask[0]).tolist() == [3, 4, 9, 10, 13, 14]
    # row 1: 3-6 ("fff" EOS), 7 + 5 = 12..15 ("hhh" EOS)
    assert np.flatnonzero(batch.loss_mask[1]).tolist() == [3, 4, 5, 6, 12, 13, 14, 15]
    np.testing.assert_array_equal(batch.attention_mask, batch.segment_ids > 0)
    assert not (batch.loss_mask & ~batch.attention_mask).any()
    assert batch.row_ids.tolist() == [0, 1, 2, 3, 4]


def test_segments_are_whole_sequences_with_completion_only_targets():
    ds = _packed()
    seen = []
    for _ in range(3):
        batch = ds.next_batch()
        for r in range(2):
            segs = _segments(batch, r)
            for tokens, loss, positions in segs:
                seen.append(tokens)
                assert tokens[0] == BOS and tokens[-1] == EOS and tokens.count(EOS) == 1  # never split
                assert positions == list(range(len(tokens)))
                i = [_ids(j)[0] for j in range(len(PAIRS))].index(tokens)
                prompt_len = _ids(i)[1]
                assert loss == [False] * prompt_len + [True] * (len(tokens) - prompt_len)
            # segments sit back to back from the left; only the tail is padding
            used = sum(len(t) for t, _, _ in segs)
            assert (batch.segment_ids[r, :used] > 0).all() and (batch.segment_ids[r, used:] == 0).all()
            assert (batch.input_ids[r, used:] == PAD).all()
    # Stream order with nothing skipped or repeated across batch boundaries (10 items, then epoch 2).
    expected = [_ids(i % len(PAIRS))[0] for i in range(len(seen))]
    assert sorted(map(tuple, seen)) == sorted(map(tuple, expected))


def test_item_that_does_not_fit_starts_the_next_batch():
    ds = _packed()
    first = ds.next_batch()
    # item5 was read and put back: the position is just before it
    assert ds.state_dict()["epoch"] == 0 and ds.state_dict()["index"] == 5
    second = ds.next_batch()
    assert first.row_ids.tolist() == [0, 1, 2, 3, 4]
    # item5 (5) -> row0, item6 (5) -> row0 [10], item7 (6) -> row0 [16], item8 (6) -> row1,
    # item9 (9) -> row1 [15]; item0 of the next epoch (5) fits nowhere.
    assert second.row_ids.tolist() == [5, 6, 7, 8, 9]
    assert _segments(second, 0)[0][0] == _ids(5)[0]
    assert second.input_ids[0].tolist() == _ids(5)[0] + _ids(6)[0] + _ids(7)[0]
    assert ds.state_dict()["epoch"] == 0 and ds.state_dict()["index"] == 10
    third = ds.next_batch()
    assert third.row_ids.tolist()[:1] == [0] and ds.state_dict()["epoch"] == 1


def test_put_back_does_not_double_count_skipped_rows():
    rows = ROWS[:5] + [{"prompt": "x"}] + ROWS[5:]  # a malformed row (no answer) before item5
    ds = _packed(rows)
    ds.next_batch()
    ds.next_batch()
    # The malformed row was read once in each batch's lookahead, but is counted once.
    assert ds.state_dict()["skipped"] == {"missing_key": 1}


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_stream_gives_the_same_next_batches(shuffle):
    ds = _packed(shuffle=shuffle, seed=5)
    ds.next_batch()
    state = ds.state_dict()
    expected = [ds.next_batch() for _ in range(3)]  # crosses the epoch boundary
    resumed = _packed(shuffle=shuffle, seed=5)
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_batch()
        for field in ("input_ids", "attention_mask", "loss_mask", "positions", "segment_ids", "row_ids"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    assert resumed.state_dict() == ds.state_dict()


def test_process_shards_agree_with_the_global_batch():
    whole = _packed().next_batch()
    parts = [_packed(process_index=i, process_count=2).next_batch() for i in range(2)]
    for field in ("input_ids", "attention_mask", "loss_mask", "positions", "segment_ids"):
        np.testing.assert_array_equal(np.concatenate([getattr(p, field) for p in parts]), getattr(whole, field))


# ---------------------------------------------------------------- packing changes compute, not the loss


@pytest.fixture(scope="module")
def lm():
    return nnx.split(build_model(preset("tiny"), "lm", seed=0))


def _np_token_nll(logits, tokens, targets):
    """-log p(tokens[t] | ...) for every t with targets[t], from logits[t - 1] (numpy log-softmax)."""
    x = np.asarray(logits, np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return np.array([-logp[t - 1, tokens[t]] for t in range(1, len(tokens)) if targets[t]])


@pytest.mark.slow
def test_packed_nll_equals_unpacked_nll_per_demonstration(lm):
    graphdef, params = lm
    model = nnx.merge(graphdef, params)
    batch = _packed().next_batch()
    logits, _ = model(jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), jnp.asarray(batch.attention_mask),
                      segment_ids=jnp.asarray(batch.segment_ids))
    leaky, _ = model(jnp.asarray(batch.input_ids), jnp.asarray(batch.positions), jnp.asarray(batch.attention_mask))
    checked = 0
    for r in range(2):
        seg = batch.segment_ids[r]
        for k in range(1, int(seg.max()) + 1):
            at = np.flatnonzero(seg == k)
            lo, hi = at[0], at[-1] + 1
            tokens = batch.input_ids[r, lo:hi]
            targets = batch.loss_mask[r, lo:hi]
            packed = _np_token_nll(np.asarray(logits[r, lo:hi]), tokens, targets)
            # The same demonstration alone: no padding, positions 0..n-1.
            alone_logits, _ = model(jnp.asarray(tokens[None]), jnp.arange(len(tokens))[None],
                                    jnp.ones((1, len(tokens)), bool))
            alone = _np_token_nll(np.asarray(alone_logits[0]), tokens, targets)
            assert len(alone) == len(packed) == targets.sum() > 0
            np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-5)
            if k > 1:  # without segment ids the later demonstrations would see the earlier ones
                without = _np_token_nll(np.asarray(leaky[r, lo:hi]), tokens, targets)
                assert np.max(np.abs(without - alone)) > 1e-4
            checked += 1
    assert checked == 5


@pytest.mark.slow
def test_sft_loss_same_packed_and_unpacked(lm):
    graphdef, params = lm
    packed = _packed().next_batch()  # items 0..4
    unpacked = _packed(batch_size=5, packing=False).next_batch()  # the same 5 items, one per row, left-padded
    assert unpacked.row_ids.tolist() == packed.row_ids.tolist() == [0, 1, 2, 3, 4]
    fn = jax.jit(sft.sft_nll, static_argnums=0)

    def inputs(b):
        out = {"tokens": b.input_ids, "mask": b.attention_mask, "loss_mask": b.loss_mask, "positions": b.positions}
        if b.segment_ids is not None:
            out["segment_ids"] = b.segment_ids
        return {k: jnp.asarray(v) for k, v in out.items()}

    loss_p, count_p = fn(graphdef, params, inputs(packed))
    loss_u, count_u = fn(graphdef, params, inputs(unpacked))
    # completions + EOS: 2 + 2 + 4 + 4 + 2 = 14 target tokens either way
    assert float(count_p) == float(count_u) == 14.0
    np.testing.assert_allclose(loss_p, loss_u, rtol=1e-5)
