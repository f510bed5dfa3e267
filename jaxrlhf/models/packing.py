"""Packed rollout batches: the host step that lays a batch's sequences back to back in rows.

A rollout batch is [B, L]: a left-padded prompt followed by a right-padded response, every row as wide
as the longest. With long-tailed response lengths most of it is padding that the train and inference
calls would compute only to mask out. Packing (`algorithm.pack_sequences`) lays each sequence's real
tokens back to back in rows of T tokens, numbered by segment ids (the attention never crosses a
segment, `models.transformer`), with the positions the sequence had, so every token sees exactly the
keys and rotary angles it saw unpacked.

Only the model forward is packed. The per-token math (advantages, ratios, KL, entropy, the loss and its
aggregation) runs on the unpacked [slots, N] grid of each micro-batch's sequences: the model reads its
hidden states at the positions that predict (or value) each response token (`read`, or `last` for a
reward model's score) and everything after that is the unpacked code on the same numbers. So packed and
unpacked calls agree up to float summation order, by construction.

Layout of one packing (`pack_batch`), every array with the shard axis first so the executor's batch
split gives each data-parallel shard whole micro-batch blocks (`s` shards, `U` updates, `K` micro-batches
per update, `R` rows and `M` sequence slots per shard and micro-batch, `N` response columns):

    tokens, positions, segments   [s, U, K, R, T]   segments: 1, 2, ... per sequence, 0 = padding
    slots                         [s, U, K, M]      the batch row of each slot; B = an empty slot
    read                          [s, U, K, M, N]   flat index (row * T + column) in its shard's block
                                                    of the position whose output predicts response
                                                    token n (0 where there is none)
    last                          [s, U, K, M]      flat index of the sequence's last real token
    take                          [s, U, K, P]      the `read` positions of real response tokens only,
                                                    compacted (0 past the last): an LM head reads these
    take_from                     [s, U, K, P]      where each `take` entry sits in the shard's [M, N]
                                                    slot grid (slot * N + n; M * N = none)
    experts (router replay only)  [s, U, K, R, T, layers, k]  each token's recorded experts, packed as
                                                    its token is (-1 = padding: routed afresh)

An LM's loss and log-probs read `take`, not the [M, N] grid: the grid holds every slot's whole response
width (a long tail's longest), while `take` holds the P real response tokens (`size_bucket` of the most
any micro-batch holds), so the full-vocabulary logits are built only where a token is predicted.

Updates are the train call's minibatches of every epoch (the same rows `update.minibatch_indices`
draws, so a packed run trains on the same minibatches as an unpacked one); an inference call has one.
Micro-batches hold at most `budget` real tokens (`algorithm.max_tokens_per_micro_batch`); sequences
are spread over micro-batches (as many as the budget needs, rounded up to `size_bucket`), then
shards, then rows, longest first onto the least loaded (balanced: no shard waits long on another).
Rows are as wide as the padded batch (T = L: the prompt width plus the trimmed response width,
`lengths.response_widths`: at most 4 values), and K, R and M come from `size_bucket`'s 2^a and
3 x 2^a, so a call compiles at most one program per combination of those values that a run meets:
with B rows, K, R and M take at most 2 log2(B) values each; in practice a run meets a handful.

**One row where attention is blockwise.** Rows as wide as the longest sequence suit dense attention,
whose cost grows with a row's width squared. A long-tailed batch then pads: a shard's 55k tokens with one
28k-token sequence among them fill three 29k-token rows (87k). Where every model reading the packing
attends a long row a block at a time on one device (`one_row_rule`; `models.blockwise` skips each row's
block pairs of two sequences), a shard's part of a micro-batch is laid in one row instead (R = 1), T
the `row_blocks` blocks that hold the largest part (4 to 7 times a power of two): padding only to that,
and attention about each sequence's own (the cost model prices both, `planner.cost.forward_shape`), where
that holds no more tokens than the wide rows (sequences of one length fill those exactly).
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Iterable, Sequence

import numpy as np

from jaxrlhf.models.lengths import bucket_length

PACKED_FIELDS = ("tokens", "positions", "segments", "slots", "read", "last", "take", "take_from")


@dataclasses.dataclass(frozen=True)
class PackStats:
    """What packing saved, for metrics: the real tokens of every update, the tokens the packed rows hold,
    and the tokens the same updates hold unpacked."""

    real_tokens: int
    packed_tokens: int
    padded_tokens: int  # the unpacked batch's B x L

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/fill": self.real_tokens / max(self.packed_tokens, 1),
                f"{prefix}/padded_fill": self.real_tokens / max(self.padded_tokens, 1)}


def size_bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^a and 3 x 2^a) that holds `n`: counts of
    micro-batches, rows and slots come from this set, so a run compiles few shapes, and padding to it
    wastes at most a third (a power of two alone would waste up to half)."""
    n = max(int(n), 1)
    power = bucket_length(n, 1)
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power


def _spread(weights: np.ndarray, items: Sequence[int], bins: int) -> list[list[int]]:
    """`items` over `bins`, longest first onto the lightest bin (deterministic: ties go to the lowest bin; a
    heap of (load, bin), which the planner's searches call often enough for an argmin per item to show)."""
    w = {i: int(weights[i]) for i in items}
    if len(w) <= bins and all(w.values()):  # each onto an empty bin in turn, as the heap would place them
        first = [[i] for i in sorted(w, key=lambda i: (-w[i], i))]
        return first + [[] for _ in range(bins - len(first))]
    heap = [(0, b) for b in range(bins)]  # already a heap
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(items, key=lambda i: (-w[i], i)):
        load, b = heap[0]
        out[b].append(i)
        heapq.heapreplace(heap, (load + w[i], b))
    return out


def _rows(lengths: np.ndarray, items: Sequence[int], width: int) -> list[list[int]]:
    """First-fit decreasing of `items` into rows of `width` tokens."""
    if len(items) <= 1:  # most parts of a finely split batch (the planner asks for every shard's)
        return [list(items)] if len(items) else []
    if len(items) > FIRST_FIT_SCAN:
        return _rows_scanned(lengths, items, width)
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(items, key=lambda i: (-int(lengths[i]), i)):
        for r, room in enumerate(free):
            if room >= lengths[i]:
                rows[r].append(i)
                free[r] -= int(lengths[i])
                break
        else:
            rows.append([i])
            free.append(width - int(lengths[i]))
    return rows


FIRST_FIT_SCAN = 64  # parts with more items find each one's row by an array scan (same rows, fewer loops)


def _rows_scanned(lengths: np.ndarray, items: Sequence[int], width: int) -> list[list[int]]:
    """`_rows` for many items: the first row with room found by one comparison over every row's room."""
    rows: list[list[int]] = []
    free = np.empty(len(items), dtype=np.int64)
    for i in sorted(items, key=lambda i: (-int(lengths[i]), i)):
        n = int(lengths[i])
        fits = np.flatnonzero(free[:len(rows)] >= n)
        if len(fits):
            rows[fits[0]].append(i)
            free[fits[0]] -= n
        else:
            free[len(rows)] = width - n
            rows.append([i])
    return rows


def micro_batches(lengths: np.ndarray, items: Sequence[int], budget: int | None, group: int = 1) -> list[list[int]]:
    """`items` in the fewest balanced micro-batches of at most `budget` real tokens each (one without a
    budget), every `group` consecutive items kept in one micro-batch (a preference pair's two sequences,
    whose loss needs both). A group longer than the budget is the config's error
    (`max_tokens_per_micro_batch`)."""
    if budget is None or not len(items):
        return [list(items)]
    groups = [list(items[j:j + group]) for j in range(0, len(items), group)]
    weights = np.asarray([sum(int(lengths[i]) for i in g) for g in groups])
    if int(weights.max()) > budget:
        what = "sequence" if group == 1 else f"group of {group} sequences"
        raise ValueError(f"a {what} of {int(weights.max())} tokens exceeds the micro-batch budget of {budget} tokens")
    k = size_bucket(-(-int(weights.sum()) // budget))
    while True:
        bins = _spread(weights, range(len(groups)), k)
        if all(sum(int(weights[g]) for g in b) <= budget for b in bins):
            return [[i for g in sorted(b) for i in groups[g]] for b in bins]
        k = size_bucket(k + 1)


@dataclasses.dataclass(frozen=True)
class PackedShape:
    """The shapes of one packing: `updates` x `micro_batches`, each with `rows` rows of `width` tokens,
    `slots` sequence slots and `reads` read positions (`take`: real response tokens) per shard. The
    planner prices a packed call with it (`planner.cost`): the mean over its drawn batches, whose fields are
    floats (`Workload.packed_shape`), or the largest (`Workload.packed_peak`)."""

    updates: int
    micro_batches: int
    rows: int
    slots: int
    width: int
    reads: int = 0

    @property
    def tokens_per_shard(self) -> int:
        """Tokens one shard's forwards run over, padding included, in all updates."""
        return self.updates * self.micro_batches * self.rows * self.width


def packing_layout(
    lengths: np.ndarray, updates: np.ndarray, shards: int, width: int, budget: int | None = None, group: int = 1,
    reads: np.ndarray | None = None, blockwise: tuple[int, int] | None = None,
) -> tuple[list[list[list[list[list[int]]]]], PackedShape]:
    """Where each sequence goes (per update, micro-batch, shard and row: sequence indices) for sequences
    of `lengths` real tokens (`reads` of them real response tokens; default none) trained in `updates`
    ([U, rows]) in rows of `width` tokens, every `group` consecutive rows of an update in one
    micro-batch, and the packing's shapes; with `blockwise` (`one_row_rule`) each part in one row where such a
    row attends blockwise (`_one_row_width`)."""
    return _pack(lengths, updates, shards, width, budget, group, reads, blockwise, keep=True)


def packing_shape(
    lengths: np.ndarray, updates: np.ndarray, shards: int, width: int, budget: int | None = None, group: int = 1,
    reads: np.ndarray | None = None, blockwise: tuple[int, int] | None = None,
) -> PackedShape:
    """`packing_layout`'s shapes alone, without keeping where each sequence goes: what the planner prices
    (it asks for every layout's shard count; a finely split batch leaves most shards' parts empty)."""
    return _pack(lengths, updates, shards, width, budget, group, reads, blockwise, keep=False)[1]


def one_row_rule(configs: Iterable[Any], contexts: Iterable[int] = ()) -> tuple[int, int] | None:
    """The `blockwise` of a packing its readers share (`pack_batch`): the largest `blockwise_attention_from` and
    `attention_block` of the models reading it (`ModelConfig`s), so a row wide enough attends blockwise in
    each; None where one of them attends densely or splits its rows over context devices (`contexts` > 1:
    the ring, whose chunks are too wide to skip a packed row's pairs of sequences)."""
    configs = list(configs)
    if not configs or any(c.blockwise_attention_from is None for c in configs) or any(int(c) > 1 for c in contexts):
        return None
    return max(c.blockwise_attention_from for c in configs), max(c.attention_block for c in configs)


def _one_row_width(lengths: np.ndarray, parts: Iterable[list[int]], blockwise: tuple[int, int] | None) -> int | None:
    """The width of one row holding any shard's part of any micro-batch (`row_blocks` blocks), where such a
    row attends blockwise (`ModelConfig.attends_blockwise`: at least `from` tokens and more than a block);
    None otherwise, or without `blockwise`. `_pack` lays the parts so where that holds no more tokens than
    rows as wide as the batch (sequences of one length fill those exactly, and a block's rounding would not)."""
    if blockwise is None:
        return None
    start, block = blockwise
    most = max((int(lengths[p].sum()) for p in parts if len(p)), default=0)
    width = block * row_blocks(-(-most // block))
    return width if width >= start and width > block else None


def row_blocks(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ... (4 to 7 times a power of two) that holds
    `n`: the blocks of a one-row packing's width, wasting under a fifth of the row (`size_bucket`'s coarser
    set, up to a third, would cost a whole third of the row's work where one row is all a shard has)."""
    n = max(int(n), 1)
    if n <= 4:
        return n
    step = 2 ** (n.bit_length() - 3)  # n / step in [4, 8)
    return -(-n // step) * step


def _pack(lengths: np.ndarray, updates: np.ndarray, shards: int, width: int, budget: int | None, group: int,
          reads: np.ndarray | None, blockwise: tuple[int, int] | None, keep: bool) -> tuple[list, PackedShape]:
    """The packing of `packing_layout` and its shapes (the largest part of any shard sets them); with
    `keep` False the placement is not kept (returned empty) and empty parts are skipped."""
    if int(np.max(lengths, initial=0)) > width:
        raise ValueError(f"a sequence of {int(np.max(lengths))} tokens does not fit a row of {width}")
    read = None if reads is None else np.asarray(reads).tolist()
    split = [[_spread(lengths, mb, shards) for mb in micro_batches(lengths, [int(r) for r in rows_of_update],
                                                                  budget, group)]
             for rows_of_update in np.asarray(updates)]
    layout = [[[_rows(lengths, part, width) for part in mb if keep or part] for mb in update] for update in split]
    one = _one_row_width(lengths, (part for update in split for mb in update for part in mb), blockwise)
    wide_rows = size_bucket(max((len(rows) for update in layout for mb in update for rows in mb), default=1))
    if one is not None and one <= wide_rows * width:  # else rows as wide as the batch hold fewer tokens (even lengths)
        width = one
        layout = [[[[sorted(part, key=lambda i: (-int(lengths[i]), i))] if part else [] for part in mb if keep or part]
                   for mb in update] for update in split]
    most_rows, most_slots, most_reads = 0, 0, 0  # over every shard of every micro-batch
    for rows in (rows for update in layout for parts in update for rows in parts):
        most_rows = max(most_rows, len(rows))
        most_slots = max(most_slots, sum(map(len, rows)))
        if read is not None:
            most_reads = max(most_reads, sum(read[i] for row in rows for i in row))
    shape = PackedShape(updates=len(layout), micro_batches=size_bucket(max(len(u) for u in layout)),
                        rows=size_bucket(most_rows), slots=size_bucket(most_slots), width=width,
                        reads=0 if reads is None else size_bucket(most_reads))
    return (layout if keep else []), shape


def pack_batch(
    mask: np.ndarray,
    tokens: np.ndarray,
    positions: np.ndarray,
    response_width: int,
    updates: np.ndarray,
    *,
    shards: int,
    budget: int | None = None,
    group: int = 1,
    experts: np.ndarray | None = None,
    blockwise: tuple[int, int] | None = None,
) -> tuple[dict[str, np.ndarray], PackStats]:
    """Pack the [B, L] batch (`mask` marks real tokens; the last `response_width` columns are the
    response) for calls that run `updates` ([U, rows]: the batch rows of each update; every `group`
    consecutive rows in one micro-batch), in rows as wide
    as the batch (L: the longest sequence fits, and a row attends over no more keys than an unpacked
    row would), or with `blockwise` (`one_row_rule`: the readers' models attend long rows a block at a time)
    each shard's part in one row where that row is long enough to and holds no more tokens (`_one_row_width`). `experts`
    ([B, L, layers, k], router replay): packed beside the tokens. See the module docstring for the layout."""
    mask = np.asarray(mask, bool)
    tokens, positions = np.asarray(tokens), np.asarray(positions)
    b, l = mask.shape
    p = l - response_width  # padded prompt width: position p - 1 + n predicts response token n
    lengths = mask.sum(axis=1).astype(np.int64)
    answered = mask[:, p:] & mask[:, p - 1:-1]  # real response tokens predicted by a real position
    plan, shape = packing_layout(lengths, updates, shards, l, budget, group, reads=answered.sum(axis=1),
                                 blockwise=blockwise)
    u, k, r, m_slots, width = shape.updates, shape.micro_batches, shape.rows, shape.slots, shape.width
    out = {
        "tokens": np.zeros((shards, u, k, r, width), np.int32),
        "positions": np.zeros((shards, u, k, r, width), np.int32),
        "segments": np.zeros((shards, u, k, r, width), np.int32),
        "slots": np.full((shards, u, k, m_slots), b, np.int32),
        "read": np.zeros((shards, u, k, m_slots, response_width), np.int32),
        "last": np.zeros((shards, u, k, m_slots), np.int32),
        "take": np.zeros((shards, u, k, shape.reads), np.int32),
        "take_from": np.full((shards, u, k, shape.reads), m_slots * response_width, np.int32),
    }
    if experts is not None:
        experts = np.asarray(experts)
        out["experts"] = np.full((shards, u, k, r, width, *experts.shape[2:]), -1, experts.dtype)
    cols = np.arange(l)
    for ui, update in enumerate(plan):
        for ki, mb in enumerate(update):
            for si, rows in enumerate(mb):
                slot = taken = 0
                for ri, row in enumerate(rows):
                    at = 0
                    for seg, i in enumerate(row, start=1):
                        real = cols[mask[i]]
                        n = len(real)
                        out["tokens"][si, ui, ki, ri, at:at + n] = tokens[i, real]
                        out["positions"][si, ui, ki, ri, at:at + n] = positions[i, real]
                        out["segments"][si, ui, ki, ri, at:at + n] = seg
                        if experts is not None:
                            out["experts"][si, ui, ki, ri, at:at + n] = experts[i, real]
                        # where each padded column sits in the packed row (-1: padding)
                        where = np.full(l, -1, np.int64)
                        where[real] = ri * width + at + np.arange(n)
                        src = where[p - 1 + np.arange(response_width)]
                        out["read"][si, ui, ki, slot] = np.where(src >= 0, src, 0)
                        cols_read = np.flatnonzero(answered[i])
                        n_read = len(cols_read)
                        out["take"][si, ui, ki, taken:taken + n_read] = src[cols_read]
                        out["take_from"][si, ui, ki, taken:taken + n_read] = slot * response_width + cols_read
                        taken += n_read
                        out["last"][si, ui, ki, slot] = ri * width + at + n - 1
                        out["slots"][si, ui, ki, slot] = i
                        at += n
                        slot += 1
    updates = np.asarray(updates)
    stats = PackStats(real_tokens=int(lengths[updates].sum()), packed_tokens=shards * u * k * r * width,
                      padded_tokens=int(updates.size) * l)
    return out, stats
