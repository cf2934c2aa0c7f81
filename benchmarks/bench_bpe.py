"""Encoding the built-in corpus with OpenAI's cl100k_base: tutorial_lib.bpe (pure Python)
against tiktoken (Rust), one thread. Target: ours within 15x of tiktoken's time.

    python benchmarks/bench_bpe.py [--rounds 7]

Both encoders are built from the same local rank file (shipped by bpe-openai); tiktoken reads
it with its own loader, pattern and special tokens (tokenizer_files.tiktoken_encoding), and the two must give
identical ids. The two are timed in alternating rounds
(the order swapped each round), so that a busy machine slows them alike, and the median is
reported. Ours is timed twice: cold (its word cache emptied before every round: what a fresh
tokenizer pays) and warm (the cache already holds every piece of the corpus). tiktoken's
``encode_ordinary`` runs on the calling thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _machine import load

from tutorial_lib import tokenizer_files
from tutorial_lib.data import builtin_corpus


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    text = builtin_corpus()
    ours = tokenizer_files.openai_encoding("cl100k_base")
    reference = tokenizer_files.tiktoken_encoding("cl100k_base")  # tiktoken's own pattern and specials, offline
    ids = reference.encode_ordinary(text)
    assert ours.encode(text) == ids, "tutorial_lib.bpe and tiktoken give different ids"

    def ours_cold():
        ours.clear_cache()
        return ours.encode(text)

    runs = {"ours, cold cache": ours_cold, "ours, warm cache": lambda: ours.encode(text),
            "tiktoken": lambda: reference.encode_ordinary(text)}
    times = {name: [] for name in runs}
    for i in range(args.rounds):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"cl100k_base on the built-in corpus: {len(text):,} characters -> {len(ids):,} tokens (identical ids); "
          f"median of {args.rounds} alternating rounds")
    for name, t in median.items():
        print(f"  {name:<17}: {t * 1e3:8.1f} ms  {len(text) / t / 1e6:6.2f} M chars/s")
    print(f"  time ratio ours (cold) / tiktoken: {median['ours, cold cache'] / median['tiktoken']:5.1f}x   "
          "target <= 15x")
    print(f"  time ratio ours (warm) / tiktoken: {median['ours, warm cache'] / median['tiktoken']:5.1f}x")
    print(load())


if __name__ == "__main__":
    main()
