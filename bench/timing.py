"""Alternating timers: measure two implementations turn by turn so machine noise hits both."""

import time
from collections.abc import Callable

import numpy as np


def alternate(
    fns: dict[str, Callable[[], object]], rounds: int, inner: int = 1
) -> dict[str, np.ndarray]:
    """Run each fn `inner` times per round, round-robin; per-call seconds for every round."""
    samples = {name: np.empty(rounds) for name in fns}
    for fn in fns.values():  # warm caches and lazy imports outside the measurement
        fn()
    for r in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name][r] = (time.perf_counter() - start) / inner
    return samples


def percentiles(seconds: np.ndarray, scale: float = 1e6) -> dict[str, float]:
    """p50/p99/mean in the given unit (default µs)."""
    return {
        "p50": float(np.percentile(seconds, 50) * scale),
        "p99": float(np.percentile(seconds, 99) * scale),
        "mean": float(seconds.mean() * scale),
    }
