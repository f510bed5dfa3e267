"""The continuous engine's sizes, JAX-free: the runtime (`continuous.py`) and the planner's cost and
memory model (`planner/workload.py`, `planner/memory.py`) size the slot pool, the page pool and the
active-width steps with the same functions, so a plan assumes exactly what the engine allocates.

Every size is per batch shard: a sharded generate call runs one engine per shard of the batch axis
(its own rows, slots and pages), so nothing a shard decodes is read from another device.
"""

from __future__ import annotations

import math

PAGE_SIZE = 16  # tokens per KV page (a prompt bucket is a multiple of it: buckets are 16 x 2^k)
WIDTHS = 4  # active-width steps: the pool's width, 1/2, 1/4 and 1/8 of it at least,
MAX_WIDTHS, MIN_WIDTH = 8, 8  # and its further halves down to 1/128 of it, none under 8 rows (a long tail)
READS = 4  # response columns a decode step may read: the cap, 1/2, 1/4 and 1/8 of it
MIN_READ = 512  # no narrower read than this many response columns (a short cap's steps read all of it)


def default_slots(rows: int) -> int:
    """The whole batch: every row starts at once (no refill round trips when responses all run to the
    cap), the page pool bounds memory and the active-width steps bound compute on a long tail."""
    return max(rows, 1)


def pool_size(rows: int, slots: int | None, batch_ways: int = 1) -> int:
    """Slots the engine runs (all shards): `slots` (None = `default_slots`) rounded up to a multiple of
    the batch's shards (a sharded batch axis must divide evenly), at most the batch."""
    s = default_slots(rows) if slots is None else int(slots)
    if s < 1:
        raise ValueError(f"generation.slots must be >= 1, got {s}")
    return min(-(-s // batch_ways) * batch_ways, rows)


def stream_groups(prompts: int, lead: int, batch_ways: int = 1) -> int:
    """Group slots of a partial-rollout stream, all shards: every group admitted and not yet trained may be in
    it, the prompts of `lead` + 1 steps (`lead`: how far the generator may run ahead, at most), rounded up to
    whole group slots per shard. Its rows (x group size) bound the stream's slot pool (`pool_size`), so a pool
    set wider than one batch decodes rows of several batches side by side."""
    return -(-(lead + 1) * prompts // batch_ways) * batch_ways


def page_size(prompt_bucket: int) -> int:
    """Tokens per page: `PAGE_SIZE`, or less for a prompt bucket it does not divide (a response's
    first token must start a fresh page, so a prompt's pages are never written)."""
    return math.gcd(PAGE_SIZE, int(prompt_bucket))


def pages_per_row(prompt_bucket: int, max_new_tokens: int) -> tuple[int, int]:
    """(prompt pages, response pages) one row spans: its block table's width."""
    ps = page_size(prompt_bucket)
    return prompt_bucket // ps, -(-max_new_tokens // ps)


def check_groups(rows: int, group_size: int) -> None:
    """A batch handed to a generation engine is made of whole groups of `group_size` adjacent rows."""
    if group_size < 1 or rows % group_size:
        raise ValueError(f"a batch of {rows} rows is not made of groups of group_size={group_size} rows")


def shard_group(rows: int, group_size: int, batch_ways: int = 1) -> int:
    """Adjacent rows that share one prefilled prompt inside a shard: G, or the largest divisor of G
    that tiles a shard's rows (a group never straddles two shards)."""
    if rows % batch_ways:
        raise ValueError(f"a batch of {rows} rows does not split into {batch_ways} shards")
    return math.gcd(group_size, rows // batch_ways)


def response_pages(prompt_bucket: int, max_new_tokens: int, rows: int, slots: int | None,
                   kv_pages: int | None, batch_ways: int = 1) -> int:
    """Response pages of one shard's pool (`generation.kv_pages` over all shards, rounded up).
    None: every slot can hold a full response (never preempts; the worst case). A pool must hold at
    least one full response per shard, so the oldest row always progresses."""
    one_row = pages_per_row(prompt_bucket, max_new_tokens)[1]
    if kv_pages is None:
        return pool_size(rows, slots, batch_ways) // batch_ways * one_row
    pages = -(-int(kv_pages) // batch_ways)
    if pages < one_row:
        raise ValueError(
            f"generation.kv_pages={kv_pages} gives {pages} pages per batch shard, fewer than one response of "
            f"max_new_tokens={max_new_tokens} needs ({one_row} pages of {page_size(prompt_bucket)} tokens); "
            f"set it to at least {one_row * batch_ways} or leave it null")
    return pages


def kv_columns(prompt_bucket: int, max_new_tokens: int, rows: int, group_size: int, slots: int | None,
               kv_pages: int | None, batch_ways: int = 1) -> tuple[int, int]:
    """Cache columns (tokens) of one shard: (prefix = its distinct prompts x bucket, stored once and
    referenced by every row of the group; pool = prefix pages + response pages)."""
    prefix = rows // batch_ways // shard_group(rows, group_size, batch_ways) * prompt_bucket
    pool = prefix + response_pages(prompt_bucket, max_new_tokens, rows, slots, kv_pages, batch_ways) * page_size(
        prompt_bucket)
    return prefix, pool


def step_widths(slots_per_shard: int) -> tuple[int, ...]:
    """Widths a decode step may run at, widest first: the active slots are moved to the front and each
    step runs the narrowest width that holds them, so a long tail's last rows cost a narrow step. The pool
    and its halves down to 1/8 of it, then on down to 1/128 of it but not under `MIN_WIDTH` rows: a pool of
    1,024 rows whose last few run to a long cap would otherwise step 128 wide, each idle slot reading the span
    its oldest row needs (each width is one more compiled decode step per read)."""
    out: list[int] = []
    for k in range(MAX_WIDTHS):
        w = -(-slots_per_shard // 2**k)
        if k >= WIDTHS and w < MIN_WIDTH:
            break
        if w not in out:
            out.append(w)
    return tuple(out)


def read_columns(max_new_tokens: int, page: int) -> tuple[int, ...]:
    """Response columns a decode step may read, widest first: the cap, then halves of it in whole pages, none
    under `MIN_READ`. Each step reads the narrowest that holds every active row's tokens so far (after its prompt
    bucket): a row's early steps attend over the columns it has filled, not over the cap's. A cap under twice
    `MIN_READ` has one read (each extra one is one more compiled decode step per width)."""
    out = [int(max_new_tokens)]
    for k in range(1, READS):
        share = -(-max_new_tokens // 2**k)  # ceil(cap / 2^k)
        read = -(-share // page) * page  # in whole pages
        if read < MIN_READ or read >= out[-1]:
            break
        out.append(read)
    return tuple(out)
