"""One call of each norm on the vectors of one decoding step, (1, d) with d = 128 (the tiny
presets): ``F.layer_norm`` (GPT), torch's ``F.rms_norm`` (LLaMA through the modules) and
``tutorial_lib.fast_decode.rms_norm_steps`` (LLaMA in ``FastDecoder``: the same operations written
out, with the width and epsilon as tensors made once). The two RMSNorms are checked to give
the same bits before anything is timed.

    python benchmarks/bench_norms.py [--calls 20000] [--rounds 5] [--threads N]

At this size a call costs its fixed overheads, not arithmetic: on a CPU torch's rms_norm is a
composite of about eight operations, some of which turn Python numbers into tensors at every
call, while layer_norm is one kernel. The rounds alternate the three, and the fastest round of
each is reported.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _machine import load

from tutorial_lib.fast_decode import rms_norm_steps

D, EPS = 128, 1e-6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, weight, bias = torch.randn(1, D), torch.randn(D), torch.randn(D)
    width, eps = torch.tensor(float(D)), torch.tensor(EPS)
    shape = weight.shape
    norms = {
        "F.layer_norm": lambda: F.layer_norm(x, shape, weight, bias, EPS),
        "F.rms_norm": lambda: F.rms_norm(x, shape, weight, EPS),
        "rms_norm_steps": lambda: rms_norm_steps(x, weight, width, eps),
    }
    with torch.inference_mode():
        assert torch.equal(norms["rms_norm_steps"](), norms["F.rms_norm"]()), "the two RMSNorms give other bits"
        best = dict.fromkeys(norms, float("inf"))
        for _ in range(args.rounds):
            for name, call in norms.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                best[name] = min(best[name], (time.perf_counter() - start) / args.calls)
    print(f"one call on a ({x.size(0)}, {D}) tensor, fastest of {args.rounds} rounds of {args.calls} calls; "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    for name, seconds in best.items():
        print(f"  {name:<15}: {seconds * 1e6:6.2f} µs  ({seconds / best['F.layer_norm']:.2f}x layer_norm)")
    print(f"  F.rms_norm / rms_norm_steps: {best['F.rms_norm'] / best['rms_norm_steps']:.2f}")
    print(load())


if __name__ == "__main__":
    main()
