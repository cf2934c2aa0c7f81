"""Re-execute notebooks in place, top to bottom, and print how long each took.

    python tools/execute_notebooks.py notebooks/*.ipynb

Each notebook runs in a fresh kernel from its own folder, as nbval runs it, and offline
(HF_HUB_OFFLINE=1, as notebooks/conftest.py sets for nbval), so the committed outputs are the
ones every test machine reproduces. Timing metadata is not written, so a re-run changes only
what the cells print.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(path: Path, timeout: int) -> float:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)
    return seconds


def main() -> int:
    os.environ["HF_HUB_OFFLINE"] = "1"  # the kernels inherit it: notebook 09 takes its offline path
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args()
    times = {}
    for path in args.notebooks:
        print(f"executing {path} ...", flush=True)
        times[path.name] = execute(path, args.timeout)
        print(f"  {times[path.name]:.1f} s", flush=True)
    print("\nnotebook                             seconds")
    for name, seconds in times.items():
        print(f"{name:<36} {seconds:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
