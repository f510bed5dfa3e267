"""Benchmark scripts count the same thing on both sides (no timings here: benchmarks live in scripts/)."""

import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tunix_completions_count_their_eos_like_jaxrlhf_response_mask():
    """tunix cuts a completion before its first EOS; jaxrlhf's response mask includes the EOS. Limit 8:
    EOS at index 3 -> 4 tokens, no EOS -> 8, EOS first -> 1, EOS in the last slot -> 8 (cut length 7)."""
    bench = _load("bench_grpo_tunix")
    assert bench.generated_tokens([3, 8, 0, 7], max_new=8) == 4 + 8 + 1 + 8
    assert bench.generated_tokens([], max_new=8) == 0
