"""ggml's block formats written in PyTorch (``tutorial_lib.quant``) against the ``gguf`` package's
numpy port of ggml's reference quantizer: every 2-D weight of the bundled SmolLM2-135M-Instruct
(211 matrices, 134.5M values, read with ``tutorial_lib.gguf.read`` and dequantized to float32
first) quantized to Q8_0, Q4_0 and Q4_1, and the bytes dequantized again. Target: ours at least
as fast as ``gguf`` on each kind, quantizing and dequantizing (PASS or MISS, not asserted).

    python benchmarks/bench_quantize.py [--rounds 3] [--threads 1]

Every tensor is run through both, alternately, in every round; outside the clocks the bytes are
checked to be identical and the values read back to be identical bit for bit (an AssertionError
otherwise). A kind's time is the sum over the 211 tensors, and the fastest of the rounds is
reported (on a shared machine the slower rounds measure the neighbours too). ``gguf`` runs on
one core (numpy, groups of 16 rows); torch runs on ``--threads`` threads, 1 by default so that
the two compare like with like.

Both are memory-bound passes over the values. ``gguf`` works on 16 rows at a time; ours, all
blocks in chunks of 4096 (quantize) or each whole tensor at once (dequantize), with a few
element-wise operations each (Q4_0's search for its signed extreme, an argmax, is the slowest).
"""

from __future__ import annotations

import argparse
import time
from importlib.metadata import version

import numpy as np
import torch
from _machine import load

from tutorial_lib import quant
from tutorial_lib.gguf import read
from tutorial_lib.pretrained import bundled_gguf


def timed(function, *args):
    """function(*args) and the seconds it took."""
    start = time.perf_counter()
    out = function(*args)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import gguf  # llama.cpp's Python package: the reference

    path = bundled_gguf()
    with read(path) as f:
        weights = {name: f.tensor(name) for name, info in f.tensors.items() if len(info.shape) == 2}
    n_values = sum(w.numel() for w in weights.values())
    steps = [(kind, step) for kind in quant.BLOCK_KINDS for step in ("quantize", "dequantize")]
    best = {(kind, step, who): float("inf") for kind, step in steps for who in ("ours", "gguf")}
    with torch.inference_mode(), np.errstate(over="raise", invalid="raise"):  # no float16 overflow here
        for _ in range(args.rounds):
            total = dict.fromkeys(best, 0.0)
            for kind in quant.BLOCK_KINDS:
                qtype = gguf.GGMLQuantizationType[kind]
                for name, x in weights.items():
                    ours, seconds = timed(quant.quantize, x, kind)
                    total[kind, "quantize", "ours"] += seconds
                    ref, seconds = timed(gguf.quants.quantize, x.numpy(), qtype)
                    total[kind, "quantize", "gguf"] += seconds
                    assert torch.equal(ours, torch.from_numpy(ref)), f"{name} {kind}: the bytes differ"
                    values, seconds = timed(quant.dequantize, ours, kind)
                    total[kind, "dequantize", "ours"] += seconds
                    ref_values, seconds = timed(gguf.quants.dequantize, ref, qtype)
                    total[kind, "dequantize", "gguf"] += seconds
                    assert torch.equal(values.view(torch.int32), torch.from_numpy(ref_values).view(torch.int32)), \
                        f"{name} {kind}: the values read back differ"
            best = {key: min(best[key], total[key]) for key in best}
    print(f"{len(weights)} 2-D weights of {path.name} ({n_values / 1e6:.1f}M values, float32), identical bytes and "
          f"values for every tensor in every round; fastest of {args.rounds} rounds, seconds for all tensors; "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, gguf {version('gguf')}, "
          f"numpy {np.__version__}")
    for kind, step in steps:
        ours, ref = best[kind, step, "ours"], best[kind, step, "gguf"]
        verdict = "PASS" if ours <= ref else "MISS"
        print(f"  {kind} {step:<10}: ours {ours:6.3f} s   gguf {ref:6.3f} s   gguf / ours {ref / ours:5.2f}x   "
              f"({n_values / ours / 1e6:6.1f}M values/s)   target ours <= gguf  {verdict}")
    print(load())


if __name__ == "__main__":
    main()
