"""The collectives and a tensor-parallel layer written by hand, before PyTorch's engines
(notebook 10, section 2).

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tutorial_lib.parallel_by_hand --out r.json

runs in 2 processes (gloo on the CPU): every rank calls one all-reduce, one all-gather and one
reduce-scatter on a toy tensor, then computes a column-parallel and a row-parallel
``nn.Linear`` and a Megatron-style two-layer FFN from its own slices of the weights. Rank 0
writes every rank's results to ``--out``. :func:`launch_by_hand` starts it through
``tutorial_lib.ddp.launch``; :func:`one_process` computes what the layers must equal.

A column-parallel layer splits the output features: rank r holds rows r of the ``nn.Linear``
weight (which stores W transposed, (out, in)), computes its slice of the output from the whole
input, and an all-gather puts the slices side by side. A row-parallel layer splits the input
features: rank r holds columns r of the weight and the matching slice of the input, its
product is a partial sum of the whole output, and an all-reduce adds the partial sums (the
bias is added once, after the sum). A column-parallel layer followed by a row-parallel one
needs no communication between them (the first leaves exactly the slice the second reads),
so Megatron's FFN costs one all-reduce (Shoeybi et al., 2019, section 3).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .ddp import init_processes, launch, leave_without_teardown

SEED, BATCH, D_IN, D_HIDDEN, D_OUT = 0, 3, 8, 16, 6


def toy_tensor(rank: int) -> Tensor:
    """Rank r's tensor for the collectives: [10 r, 10 r + 1, 10 r + 2, 10 r + 3]."""
    return torch.arange(4.0) + 10 * rank


def collectives(rank: int, world_size: int) -> dict[str, list[float]]:
    """One call of each collective on :func:`toy_tensor`; what this rank is left with."""
    mine = toy_tensor(rank)
    summed = mine.clone()
    dist.all_reduce(summed)  # in place: the sum of every rank's tensor, on every rank
    gathered = torch.empty(world_size * mine.numel())
    dist.all_gather_into_tensor(gathered, mine)  # every rank's tensor, side by side, on every rank
    piece = torch.empty(mine.numel() // world_size)
    dist.reduce_scatter_tensor(piece, mine)  # piece r of the sum, on rank r
    return {"mine": mine.tolist(), "all_reduce": summed.tolist(), "all_gather": gathered.tolist(),
            "reduce_scatter": piece.tolist()}


def layers(seed: int = SEED) -> dict[str, Tensor]:
    """The input and the weights of the two layers, drawn from ``seed``: ``nn.Linear``'s layout,
    weight (out, in). Every rank draws them all and keeps only its slices (a real run would
    create or load its slices alone)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g)
    return {"x": draw(BATCH, D_IN), "w1": draw(D_HIDDEN, D_IN), "b1": draw(D_HIDDEN),
            "w2": draw(D_OUT, D_HIDDEN), "b2": draw(D_OUT)}


def column_parallel(x: Tensor, w_rows: Tensor, b_rows: Tensor, world_size: int) -> Tensor:
    """This rank's output features from the whole input, then an all-gather along the features."""
    mine = x @ w_rows.T + b_rows  # (batch, out / N)
    pieces = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(pieces, mine)
    return torch.cat(pieces, dim=-1)  # (batch, out)


def row_parallel(x_cols: Tensor, w_cols: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's input features times its columns of the weight: a partial sum of the whole
    output; an all-reduce adds the partial sums. Returns (the partial sum, the output)."""
    partial = x_cols @ w_cols.T  # (batch, out), one summand of x W^T
    total = partial.clone()
    dist.all_reduce(total)
    return partial, total + bias  # the bias once, after the sum


def by_hand(rank: int, world_size: int) -> dict[str, list]:
    """The collectives and the three layers on this rank's slices."""
    t = layers()
    rows = lambda w: w.chunk(world_size, dim=0)[rank]  # this rank's output features
    cols = lambda w: w.chunk(world_size, dim=-1)[rank]  # this rank's input features
    column = column_parallel(t["x"], rows(t["w1"]), rows(t["b1"]), world_size)
    hidden = F.gelu(t["x"] @ t["w1"].T + t["b1"])  # the row-parallel layer's input, whole
    partial, row = row_parallel(cols(hidden), cols(t["w2"]), t["b2"])
    # Megatron's FFN: column-parallel, GELU on this rank's own features, row-parallel; one all-reduce
    mine = F.gelu(t["x"] @ rows(t["w1"]).T + rows(t["b1"]))
    _, ffn = row_parallel(mine, cols(t["w2"]), t["b2"])
    return {"rank": rank, "collectives": collectives(rank, world_size), "column": column.tolist(),
            "row_partial": partial.tolist(), "row": row.tolist(), "ffn": ffn.tolist(),
            "held": {"w1": list(rows(t["w1"]).shape), "w2": list(cols(t["w2"]).shape)}}


def one_process(seed: int = SEED) -> dict[str, Tensor]:
    """What the layers compute in one process with the whole weights."""
    t = layers(seed)
    hidden = F.gelu(t["x"] @ t["w1"].T + t["b1"])
    return {"column": t["x"] @ t["w1"].T + t["b1"], "row": hidden @ t["w2"].T + t["b2"],
            "ffn": hidden @ t["w2"].T + t["b2"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Collectives and tensor-parallel layers by hand, under torchrun.")
    parser.add_argument("--out", type=Path, default=None, help="rank 0 writes every rank's results here (JSON)")
    args = parser.parse_args(argv)
    rank, world_size, _, _ = init_processes("cpu")
    if world_size < 2 or D_HIDDEN % world_size or D_OUT % world_size:
        raise ValueError(f"run this in 2 processes (or any N dividing {D_HIDDEN} and {D_OUT}), got {world_size}")
    try:
        mine = by_hand(rank, world_size)
        everyone = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
    finally:
        dist.destroy_process_group()
    if rank == 0 and args.out is not None:
        args.out.write_text(json.dumps({"world_size": world_size, "ranks": everyone}))


def launch_by_hand(nproc: int = 2, *, timeout: float = 300) -> list[dict]:
    """Run :func:`by_hand` in ``nproc`` processes; every rank's results, the layers' outputs as tensors."""
    ranks = launch(nproc, [], module="tutorial_lib.parallel_by_hand", timeout=timeout)["ranks"]
    for r in ranks:
        for key in ("column", "row_partial", "row", "ffn"):
            r[key] = torch.tensor(r[key])
    return ranks


if __name__ == "__main__":
    main()
    leave_without_teardown()  # see tutorial_lib.ddp: gloo's teardown can abort a finished run
