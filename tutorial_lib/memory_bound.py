"""What a decoding step reads: weight bytes per token, this machine's bandwidth, a weight layout.

At batch 1 a decoding step multiplies one vector by every weight matrix: two floating-point
operations per weight read, far too few to keep a CPU's arithmetic busy. The step is bound
by how fast the weights stream from memory, so its lower bound is bytes read / bandwidth,
and fewer bytes per weight (bfloat16, 8 or 4 bits) make it faster. Notebook 11 measures it.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn


def _distinct(tensors) -> list[Tensor]:
    """Each storage once (a tied matrix is one), by where its data starts."""
    seen: dict[tuple[int, int], Tensor] = {}
    for t in tensors:
        seen[(t.untyped_storage().data_ptr(), t.storage_offset())] = t
    return list(seen.values())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a decoding step reads: every distinct parameter (a tied matrix
    once), plus the stored weights of quantized layers (those with a ``weight_bytes()``
    method, tutorial_lib.quant_linear). The embedding lookup reads one row of its table, not
    all of it: where the table is not also the head, only that row is counted."""
    head = getattr(model, "head", None)
    embed = getattr(getattr(model, "embed", None), "tokens", None)
    table = embed.weight if isinstance(embed, nn.Embedding) else None
    tied = table is not None and isinstance(head, nn.Linear) and head.weight is table
    total = sum(m.weight_bytes() for m in model.modules() if m is not model and hasattr(m, "weight_bytes"))
    for t in _distinct(model.parameters()):
        if table is not None and t is table and not tied:
            total += t.size(1) * t.element_size()  # one row per token
        else:
            total += t.numel() * t.element_size()
    return total


def read_bandwidth(megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes per second this machine streams from memory: the sum of a float32 tensor of
    ``megabytes`` MiB (much larger than any cache), best of ``repeats``."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()  # first touch of the pages, outside the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best


def column_major(model: nn.Module) -> int:
    """Store every ``nn.Linear`` weight (out, in) column by column (the same values, strides
    (1, out)), in place; return how many were changed.

    F.linear of one vector then runs as a product with the contiguous (in, out) matrix, which
    on this course's CPU streams the weights faster than the row-by-row dot products of the
    usual layout (benchmarks/bench_real_decode.py measures it). The sums run in another
    order, so results differ in the last bits. A tied head and embedding stay one tensor.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.is_contiguous():
            with torch.no_grad():
                module.weight.data = module.weight.data.t().contiguous().t()
            changed += 1
    return changed
