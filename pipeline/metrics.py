"""Latency percentiles and the run summary."""
from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_summary(values: list[float], qs=(50, 90, 99)) -> dict:
    out = {f"p{q}": (round(v, 6) if (v := percentile(values, q)) is not None else None) for q in qs}
    out["mean"] = round(sum(values) / len(values), 6) if values else None
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM, the high-water mark of its own address space.
    ru_maxrss, the fallback off Linux, carries over the mark of the process it was forked from
    (a large parent makes a small child look large)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
