"""Generation on an FSDP layout, priced as it compiles: the engines decode from weights split into layers
once, outside the token loop (`transformer.split_layers`), so XLA hoists every layer's all-gather out of the
loop and the whole model's weights live gathered for the call (planner.memory.working_set). Priced as two
layers gathered at a time, the 1B's generate call was 2.8 GiB against XLA's 7.0 (scripts/check_memory_model.py)."""

import argparse
import os
import sys

import pytest

from jaxrlhf.graph import CallSpec
from jaxrlhf.models.config import preset
from jaxrlhf.planner.memory import working_set
from jaxrlhf.planner.plan import Layout
from jaxrlhf.planner.sizes import DTYPE_BYTES, matmul_params
from jaxrlhf.planner.workload import Workload

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
GENERATE = CallSpec("actor.generate", "actor", "generate")


def test_an_fsdp_generate_call_holds_every_layer_gathered_and_a_tensor_one_none():
    cfg = preset("llama3.2-1b")
    wl = Workload(batch_size=64, prompt_len=256, gen_len=256, minibatches=1)
    weights = (matmul_params(cfg, "value") - cfg.hidden_size) * DTYPE_BYTES[cfg.param_dtype]  # every layer's
    fsdp = working_set(GENERATE, cfg, Layout(fsdp=8), wl)["fsdp_buffers"]
    assert fsdp >= weights and fsdp < 1.5 * weights
    split = working_set(GENERATE, cfg, Layout(fsdp=2, tensor=4), wl)["fsdp_buffers"]
    assert split == pytest.approx(fsdp / 4, rel=0.05)  # each device gathers its tensor shard's layers
    assert working_set(GENERATE, cfg, Layout(tensor=8), wl)["fsdp_buffers"] == 0.0


@pytest.mark.slow
def test_fsdp_generation_memory_is_within_20_percent_of_xla():
    """The runtime's own generate call (the executor's placed function, shapes only) for a 1B actor at FSDP 8."""
    sys.path.insert(0, SCRIPTS)
    import check_memory_model

    args = argparse.Namespace(devices=8, batch=64, prompt_len=256, gen_len=256, minibatches=4, micro_batch=8,
                              remat="full", logit_chunk=4096, calls="actor.generate", dtype="float32",
                              no_donate=False, packed=False, median=None, sigma=0.0)
    (row,) = check_memory_model.check("llama3.2-1b", "fsdp8", args)
    assert row["error"] == pytest.approx(0.0, abs=0.2), row


@pytest.mark.slow
def test_the_packed_check_compiles_the_packing_the_memory_model_holds():
    """`check_memory_model --packed`: the runtime packer's largest packing of the planner's drawn batches, which
    the script compiles, is the one the memory model holds (`Workload.packed_peak`), for each packed call."""
    sys.path.insert(0, SCRIPTS)
    import check_memory_model

    from jaxrlhf.graph import CallSpec

    args = argparse.Namespace(devices=2, batch=16, prompt_len=16, gen_len=112, minibatches=2, micro_batch=0,
                              remat="full", logit_chunk=4096, calls="actor.train,ref.inference", dtype="float32",
                              no_donate=False, packed=True, median=24, sigma=1.0)
    rows = check_memory_model.check("tiny", "d2", args)
    wl = Workload(batch_size=16, prompt_len=16, gen_len=112, minibatches=2, packed=True, gen_len_median=24,
                  gen_len_sigma=1.0)
    for row in rows:
        (compiled,) = row["packed"].values()
        peak = wl.packed_peak(CallSpec(row["call"], row["call"].split(".")[0], row["call"].split(".")[1]), 2,
                              preset("tiny"))
        assert compiled == [2, peak.updates, peak.micro_batches, peak.rows, peak.width, peak.reads], row["call"]
        assert row["xla_gib"] > 0 and row["estimate_gib"] > 0
