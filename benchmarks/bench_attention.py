"""Forward + backward time of tutorial_lib's MultiHeadAttention (fast path) against
torch.nn.MultiheadAttention, same weights, B=8, T=256, d=256, h=8. Target: ratio <= 1.10.

    python benchmarks/bench_attention.py [--repeats 30]

The two are timed in alternating rounds in one process, and the median round is reported,
so that a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _machine import time_step

from tutorial_lib.attention import MultiHeadAttention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    B, T, d, h = 8, 256, 256, 8
    ours = MultiHeadAttention(d, h)
    theirs = torch.nn.MultiheadAttention(d, h, batch_first=True)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(ours.qkv.weight)
        theirs.in_proj_bias.copy_(ours.qkv.bias)
        theirs.out_proj.weight.copy_(ours.out.weight)
        theirs.out_proj.bias.copy_(ours.out.bias)
    x = torch.randn(B, T, d, requires_grad=True)
    assert torch.allclose(ours(x).out, theirs(x, x, x, need_weights=False)[0], atol=1e-5)

    def step_ours():
        ours(x).out.sum().backward()

    def step_theirs():
        theirs(x, x, x, need_weights=False)[0].sum().backward()

    for step in (step_ours, step_theirs):  # warm-up
        time_step(step, 3)
    ours_t, theirs_t = [], []
    for _ in range(args.rounds):
        ours_t += time_step(step_ours, args.repeats)
        theirs_t += time_step(step_theirs, args.repeats)
    a, b = statistics.median(ours_t), statistics.median(theirs_t)
    print(f"forward+backward, B={B} T={T} d={d} h={h}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"  tutorial_lib MultiHeadAttention : {a * 1e3:7.2f} ms")
    print(f"  torch.nn.MultiheadAttention     : {b * 1e3:7.2f} ms")
    print(f"  ratio (ours / torch)            : {a / b:7.3f}   target <= 1.10")


if __name__ == "__main__":
    main()
