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


def test_rl_response_lengths_are_long_tailed_clipped_and_seeded():
    """bench_generate --workload rl: log-normal lengths, median 64, clipped to [1, 512], same per seed."""
    import numpy as np

    bench = _load("bench_generate")
    lengths = bench.rl_lengths(4096, 64, 1.0, 512)
    assert lengths.min() >= 1 and lengths.max() == 512  # P(> 512) = P(z > ln 8) ~ 2%: the cap is reached
    assert 60 <= np.median(lengths) <= 68 and lengths.mean() > np.median(lengths) * 1.4  # mean e^0.5 x median
    np.testing.assert_array_equal(lengths, bench.rl_lengths(4096, 64, 1.0, 512))
