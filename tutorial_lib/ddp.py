"""Data-parallel training with ``torch.nn.parallel.DistributedDataParallel`` (DDP).

One script for every case: run it plainly for one process, or under ``torchrun`` for several
(NCCL when every process on the machine has a GPU of its own, gloo on the CPU otherwise)::

    python -m tutorial_lib.ddp --batch 16 --out one.json
    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tutorial_lib.ddp --batch 8 --out two.json

What makes the two runs follow the same loss curve: every process builds the same model from
the same seed (and DDP broadcasts rank 0's weights anyway); at step i every process draws the
same *global* batch of ``world_size * batch`` windows from a generator seeded by (seed, i) and
keeps its own slice of ``batch`` rows; backward() averages the gradients over the processes
(an all-reduce), so every process takes the same optimiser step with the gradient of the whole
global batch. With equal token counts per process, the mean of the per-process losses is the
loss of the global batch. Only the order of floating-point additions differs.

:func:`launch` starts the script in a subprocess and returns what it measured (the notebook and
the tests use it); it starts ``tutorial_lib.parallel``'s script the same way (notebook 10), and
:func:`init_processes` joins the process group for both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from .config import ModelConfig
from .data import CharTokenizer, builtin_corpus
from .gpt import DecoderOnlyLM
from .train import make_optimizer, train, warmup_cosine_schedule


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a small character language model, data-parallel.")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="windows per process per step")
    parser.add_argument("--block", type=int, default=32, help="window length in characters")
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus_chars", type=int, default=200_000, help="use the corpus's first N characters")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--out", type=Path, default=None, help="rank 0 writes the loss curve here (JSON)")
    parser.add_argument("--progress", action="store_true", help="show a progress bar on rank 0")
    parser.add_argument("--device", choices=("auto", "cpu"), default="auto",
                        help="auto: one GPU per process when the machine has enough, else the CPU")
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "block", "d_model", "n_layers", "n_heads", "corpus_chars", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"need 0 <= --warmup < --steps, got {args.warmup} and {args.steps}")
    return args


def corpus_ids(n_chars: int) -> tuple[torch.Tensor, int]:
    """The built-in corpus's first ``n_chars`` characters as ids, and the vocabulary size."""
    text = builtin_corpus()[:n_chars]
    tokenizer = CharTokenizer.from_text(text)
    return torch.tensor(tokenizer.encode(text), dtype=torch.long), tokenizer.vocab_size


def global_batch(stream: torch.Tensor, step: int, size: int, block: int,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` windows of step ``step``: the same on every process, whatever it did before
    (the generator is seeded by (seed, step), so no data-order state needs to be shared)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - block, (size,), generator=generator)
    index = starts[:, None] + torch.arange(block)  # (size, T)
    return stream[index], stream[index + 1]


def shard(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """Rank r's contiguous slice of every tensor in a global batch (rows r*b .. (r+1)*b - 1)."""
    size = batch[0].size(0)
    if size % world_size:
        raise ValueError(f"a global batch of {size} rows does not split evenly over {world_size} processes")
    b = size // world_size
    return tuple(t[rank * b:(rank + 1) * b] for t in batch)


def run(args: argparse.Namespace, rank: int = 0, world_size: int = 1, device: torch.device | None = None) -> dict:
    """Train on this process's share; return this process's losses and gradient norms.

    With ``world_size`` > 1 the process group must already be initialised; the model is then
    wrapped in DDP, which all-reduces (averages) the gradients inside ``backward()``.
    """
    device = torch.device("cpu") if device is None else device
    stream, vocab_size = corpus_ids(args.corpus_chars)
    cfg = ModelConfig(family="decoder", vocab_size=vocab_size, d_model=args.d_model, n_layers=args.n_layers,
                      n_heads=args.n_heads, max_len=args.block, dropout=0.0)  # dropout would differ per process
    torch.manual_seed(args.seed)
    model = DecoderOnlyLM(cfg).to(device)
    optimizer = make_optimizer(model, args.lr)  # groups from the bare model: DDP shares its parameters
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    def get_batch(step: int):
        batch = global_batch(stream, step, args.batch * world_size, args.block, args.seed)
        return tuple(t.to(device) for t in shard(batch, rank, world_size))

    history = train(model, get_batch, args.steps, optimizer=optimizer,
                    schedule=warmup_cosine_schedule(args.warmup, args.steps), clip_norm=1.0,
                    progress=args.progress and rank == 0, desc=f"{world_size} process(es)")
    return {"loss": history.loss, "grad_norm": history.grad_norm, "seconds": history.seconds[-1]}


def init_processes(device_choice: str = "auto") -> tuple[int, int, torch.device, str]:
    """Join the process group that ``torchrun`` describes in the environment (none when this
    is a plain single process); return (rank, world_size, device, backend).

    NCCL and one GPU per process when ``device_choice`` is "auto" and this machine has a GPU
    for every local process; otherwise gloo, and the processes share the CPU.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    on_gpus = (device_choice == "auto" and torch.cuda.is_available()
               and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    backend = "nccl" if on_gpus else "gloo"
    device = torch.device("cuda", local_rank) if on_gpus else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group(backend)
    return rank, world_size, device, backend if world_size > 1 else "none"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rank, world_size, device, backend = init_processes(args.device)
    try:
        mine = run(args, rank, world_size, device)
        if world_size > 1:
            # the global batch's loss is the mean of the per-process losses (equal token counts)
            losses = torch.tensor(mine["loss"], dtype=torch.float64, device=device)
            dist.all_reduce(losses)
            mine["loss"] = (losses / world_size).tolist()
    finally:
        if world_size > 1:
            dist.destroy_process_group()
    result = {"world_size": world_size, "batch_per_process": args.batch, "global_batch": args.batch * world_size,
              "backend": backend, "device": device.type, **mine}
    if rank == 0 and args.out is not None:
        args.out.write_text(json.dumps(result))
    return result


def leave_without_teardown() -> None:
    """End this process at once, after flushing its output (see the end of this file)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Failures of the processes' rendezvous or of their connections, not of the training: on a
# busy machine a port can be taken or a connection refused between two steps of the start-up.
_TRANSIENT = ("DistNetworkError", "Address already in use", "EADDRINUSE", "Connection refused",
              "Connection reset by peer", "RendezvousConnectionError", "RendezvousTimeoutError")


def launch(nproc: int, args: list[str], *, module: str = "tutorial_lib.ddp", timeout: float = 600,
           attempts: int = 2) -> dict:
    """Run ``python -m module`` as ``nproc`` processes (``torchrun --standalone``) or, for 1,
    plainly, and return what its rank 0 wrote as JSON to the path given by ``--out`` (this
    script's result; ``tutorial_lib.parallel`` gathers every rank's results there). A start
    that fails in the rendezvous or in connecting the processes is tried again, up to
    ``attempts`` times in all; any other failure raises RuntimeError at once, with the
    processes' output."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    # one thread per process unless told otherwise; setting it also silences torchrun's notice
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    attempt = 1
    while True:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "result.json"
            command = launcher + ["-m", module, *args, "--out", str(out)]
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
            if done.returncode == 0 and out.is_file():
                return json.loads(out.read_text())
        transient = any(sign in done.stderr for sign in _TRANSIENT)
        if not transient or attempt == attempts:
            # the first traceback in stderr is the cause; torchrun's summary comes after it
            raise RuntimeError(f"the {nproc}-process run failed (exit code {done.returncode}, attempt {attempt} "
                               f"of {attempts}):\n{done.stderr[:6000]}\n...\n{done.stderr[-1500:]}")
        attempt += 1


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown. With gloo on a CPU (torch 2.13) about one run
    # in ten aborted there ("terminate called without an active exception", SIGABRT) after
    # all the work was done and the result written, which torchrun reports as a failed run.
    leave_without_teardown()
