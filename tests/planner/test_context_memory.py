"""The memory model at 16k tokens (scripts/check_memory_model.py, docs/benchmarks.md "Context parallelism:
memory at 16k tokens"): one sequence of a 1B model trains under context 8 on H100s; one sequence per
device (no context parallelism) does not fit with dense attention and fits blockwise; and the terms that
make them agree with XLA."""

import dataclasses

import pytest

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.planner.hardware import get_profile
from jaxrlhf.planner.memory import (
    RING_MASK_BYTES,
    SCORE_COPIES_INFER,
    optimizer_per_device,
    params_per_device,
    working_set,
)
from jaxrlhf.planner.plan import Layout
from jaxrlhf.planner.workload import Workload

CFG = preset("llama3.2-1b").replace(dtype="float32", param_dtype="float32", max_position_embeddings=16384)
DENSE = CFG.replace(blockwise_attention_from=None)  # every [T, T] score matrix held
TRAIN = CallSpec("actor.train", "actor", "train")
INFER = CallSpec("ref.inference", "ref", "inference")


def _workload(batch: int) -> Workload:
    return Workload(batch_size=batch, prompt_len=1024, gen_len=15360, minibatches=1, micro_batch=None,
                    remat="full")


def _peak(call: CallSpec, layout: Layout, wl: Workload, cfg=CFG) -> float:
    total = params_per_device(cfg, "lm", layout) + sum(working_set(call, cfg, layout, wl).values())
    if call.kind == "train":
        total += optimizer_per_device(cfg, "lm", layout, wl, call.role)
    return total


def test_16k_tokens_train_under_context_8_and_blockwise_where_dense_attention_does_not_fit():
    usable = get_profile("h100").usable_memory
    assert _peak(TRAIN, Layout(fsdp=8), _workload(8), DENSE) > usable  # [T, T] scores of 32 heads: refused
    assert _peak(TRAIN, Layout(context=8), _workload(1)) < usable
    assert _peak(INFER, Layout(context=8), _workload(1)) < usable
    assert _peak(TRAIN, Layout(fsdp=8), _workload(8)) < usable  # blockwise: one block of scores at a time


def test_blockwise_estimates_stay_just_above_xla():
    """XLA's own bytes for these calls (scripts/check_memory_model.py --layouts f8 --batch 8 --micro-batch 0
    --prompt-len 1024 --gen-len 15360 --minibatches 1, docs/benchmarks.md): 11.30 GiB for the train call,
    3.54 for the inference; the model may over-count (a refused plan that fits) a little, never under-count
    (an accepted plan that does not)."""
    gib, wl = 2**30, dataclasses.replace(_workload(8), logit_chunk=4096)  # the script's default chunk
    assert 1.0 < _peak(TRAIN, Layout(fsdp=8), wl) / (11.30 * gib) < 1.2
    assert 1.0 < _peak(INFER, Layout(fsdp=8), wl) / (3.54 * gib) < 1.2


def test_packed_calls_hold_the_largest_drawn_packing_just_above_xla():
    """Packed, 64 sequences with long-tailed responses (median 2,048 of 15,360): XLA's bytes for the runtime
    packer's largest packing of the planner's drawn batches, one blockwise row of 40,960 tokens a device
    (scripts/check_memory_model.py --layouts f8 --batch 64 --micro-batch 0 --prompt-len 1024 --gen-len 15360
    --minibatches 1 --packed --median 2048 --sigma 1, docs/benchmarks.md): 18.42 GiB for the train call, 5.70
    for the inference. The memory model holds that packing (`Workload.packed_peak`), not the draws' mean."""
    gib = 2**30
    wl = dataclasses.replace(_workload(64), packed=True, gen_len_median=2048, gen_len_sigma=1.0, logit_chunk=4096)
    for call in (TRAIN, INFER):
        peak = wl.packed_peak(call, 8, CFG)
        assert (peak.micro_batches, peak.rows, peak.width) == (1, 1, 40960)
        assert wl.packed_shape(call, 8, CFG).width < peak.width
    assert 1.0 < _peak(TRAIN, Layout(fsdp=8), wl) / (18.42 * gib) < 1.2
    assert 1.0 < _peak(INFER, Layout(fsdp=8), wl) / (5.70 * gib) < 1.2


def test_ring_masks_are_counted_for_train_calls_under_context_parallelism_only():
    wl = _workload(1)
    ring = working_set(TRAIN, CFG, Layout(context=8), wl)
    tok = keys = 16384 / 8
    assert ring["ring_masks"] == pytest.approx(8 * tok * keys * RING_MASK_BYTES)  # a bool per pair, not per head
    assert "ring_masks" not in working_set(INFER, CFG, Layout(context=8), wl)
    assert "ring_masks" not in working_set(TRAIN, DENSE, Layout(fsdp=8), _workload(8))


def test_dense_attention_counts_more_score_copies_than_the_ring():
    """Dense inference holds SCORE_COPIES_INFER [T, T] float32 matrices per head (scores, exponentials,
    probabilities); the ring's online softmax one block of T / c keys."""
    dense = working_set(INFER, DENSE, Layout(fsdp=8), _workload(8))["activations"]
    ring = working_set(INFER, CFG, Layout(context=8), _workload(1))["activations"]
    score = 16384 * 16384 * CFG.num_heads * 4
    assert dense > SCORE_COPIES_INFER * score
    assert ring < dense / 8
