"""Held-out metrics of generated answers: greedy accuracy and pass@k.

pass@k is the probability that at least one of k answers to a prompt is correct. Drawing exactly
k samples and checking them has high variance; Chen et al. (2021, "Evaluating Large Language
Models Trained on Code") draw n >= k samples, count the c correct ones and use the unbiased
estimator 1 - C(n - c, k) / C(n, k), averaged over prompts. It is computed as a product, which
stays exact where the binomial coefficients would overflow.
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from `n` samples of which `c` are correct (needs k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
