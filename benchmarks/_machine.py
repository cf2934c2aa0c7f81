"""What the benchmarks print about the machine they ran on (imported by the bench_*.py scripts,
which run with this folder on sys.path)."""

import os


def load() -> str:
    """The load average: on a shared machine a timing is only as good as this."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} CPUs"
