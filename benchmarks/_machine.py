"""What the benchmarks share: the machine they ran on and how a step is timed (imported by the
bench_*.py scripts, which run with this folder on sys.path)."""

import os
import time


def load() -> str:
    """The load average: on a shared machine a timing is only as good as this."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} CPUs"


def time_step(step, repeats: int) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of ``step()``, one entry per call."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times
