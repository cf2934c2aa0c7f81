"""Does one CPU thread train the tiny models of notebooks 02 and 03 faster than two?

    python benchmarks/bench_threads_tiny_training.py [--rounds 7] [--steps 60]

The two notebooks once trained their models under ``torch.set_num_threads(1)``. This script
times the same training steps (same model configs, batch sizes and sequence lengths as the
notebooks, through ``tutorial_lib.train.train``) with 1 and with 2 threads, in alternating
rounds in one process, and reports the median round of each, so that a busy machine slows
both alike. It prints the load average before and after: on a shared machine the numbers
are only as good as that load.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _machine import load

from tutorial_lib.config import ModelConfig
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.train import make_optimizer, train


def workloads() -> dict[str, tuple[ModelConfig, int, int]]:
    """name -> (config, batch size, sequence length), as in the notebooks."""
    nb02 = ModelConfig(family="decoder", vocab_size=18, d_model=32, n_layers=1, n_heads=2, max_len=16, dropout=0.0)
    found = {"02 (d=32, 1 layer, T=16)": (nb02, 32, 16)}
    for scheme in ("learned", "rope", "alibi"):
        nb03 = ModelConfig(family="decoder", vocab_size=16, d_model=64, n_layers=2, n_heads=4, max_len=64,
                           positions=scheme, scale_embeddings=True, dropout=0.0)
        found[f"03 {scheme} (d=64, 2 layers, T=32)"] = (nb03, 32, 32)
    return found


def time_training(cfg: ModelConfig, batch_size: int, length: int, steps: int, threads: int) -> float:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = DecoderOnlyLM(cfg)
    data = torch.Generator().manual_seed(1)

    def batch(i):
        ids = torch.randint(0, cfg.vocab_size, (batch_size, length + 1), generator=data)
        return ids[:, :-1], ids[:, 1:]

    optimizer = make_optimizer(model, 3e-3, weight_decay=0.0)
    train(model, batch, 5, optimizer=optimizer, progress=False)           # warm-up, not timed
    start = time.perf_counter()
    train(model, batch, 5 + steps, optimizer=optimizer, progress=False, start_step=5)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60, help="timed training steps per round")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, default threads {default_threads}; before: {load()}")
    print(f"{'workload':<34} {'1 thread':>10} {'2 threads':>10} {'2 / 1':>7}   (ms per step, median of "
          f"{args.rounds} alternating rounds)")
    for name, (cfg, batch_size, length) in workloads().items():
        times = {1: [], 2: []}
        for r in range(args.rounds):
            order = (1, 2) if r % 2 == 0 else (2, 1)
            for threads in order:
                times[threads].append(time_training(cfg, batch_size, length, args.steps, threads))
        one, two = (1000 * statistics.median(times[n]) / args.steps for n in (1, 2))
        print(f"{name:<34} {one:10.2f} {two:10.2f} {two / one:7.2f}")
    torch.set_num_threads(default_threads)
    print(f"after: {load()}")


if __name__ == "__main__":
    main()
