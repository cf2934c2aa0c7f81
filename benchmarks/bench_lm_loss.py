"""Validation loss of the character-level language model on the built-in corpus after 30, 60
and 90 seconds of training, GPT and LLaMA flavours side by side.

    python benchmarks/bench_lm_loss.py [--budgets 30 60 90] [--flavours gpt llama]
                                       [--d-model 64 --layers 2 --heads 4 --block 64 --batch 16 --lr 8e-3]

Every (flavour, budget) pair is a fresh run whose learning-rate schedule is laid out over its
own budget: linear warmup for the first ``--warmup`` fraction of the time, then a cosine decay
to ``--min-lr`` of the peak, both driven by the clock rather than by a step count (the number
of steps a budget allows is not known in advance). Training time counts the training steps
only (batches included); the evaluation at the end is not counted. The validation loss is the
mean cross-entropy over the whole validation stream (the last 10 % of the corpus), cut into
consecutive windows of the training length; the bigram table's loss on the same stream is
printed for reference.

``--clock cpu`` measures the budget in CPU seconds of this process instead of wall-clock
seconds: on a machine shared with other work that keeps runs comparable.

The defaults are the best of a small sweep (one thread, CPU-clock budgets of 30 and 60 s, on a
2-core machine shared with other jobs): at these budgets small, fast models win because they
take more steps. Width 64 with 2 layers beat 48/2, 96/2, 96/3, 64/3, 64/4, 128/2 and 128/4
(the GPT_TINY shape); batches of 8 or 16 beat 32 and 64; block 64 beat 128; peak rates of 5e-3 to
8e-3 beat 1.5e-3 to 3e-3. Longer budgets favour somewhat larger models.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch
from _machine import load

from tutorial_lib.config import GPT_TINY, LLAMA_TINY
from tutorial_lib.data import CharTokenizer, builtin_corpus, lm_batch, lm_windows, train_val_split
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.train import History, make_optimizer, train


class OutOfTime(Exception):
    """Raised by the batch function once the budget is spent: ends train() between steps."""


def lr_multiplier(fraction: float, warmup: float, min_ratio: float) -> float:
    """Warmup then cosine, as a function of the fraction of the time budget spent."""
    if fraction < warmup:
        return max(fraction / warmup, 0.01)
    progress = min(1.0, (fraction - warmup) / (1 - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def validation_loss(model: DecoderOnlyLM, val_ids: torch.Tensor, block: int, batch: int = 64) -> float:
    model.eval()
    x, y = lm_windows(val_ids, block)  # (N, T) each
    total = sum(model(x[i:i + batch], y[i:i + batch]).loss.item() * len(x[i:i + batch])
                for i in range(0, len(x), batch))
    model.train()
    return total / len(x)


def bigram_loss(train_ids: torch.Tensor, val_ids: torch.Tensor, V: int) -> float:
    counts = torch.ones(V, V)  # add-one smoothing
    counts.view(-1).index_add_(0, train_ids[:-1] * V + train_ids[1:], torch.ones(len(train_ids) - 1))
    log_p = (counts / counts.sum(1, keepdim=True)).log()
    return -log_p[val_ids[:-1], val_ids[1:]].mean().item()


def run(cfg, args, budget: float, train_ids, val_ids) -> dict:
    torch.manual_seed(args.seed)
    model = DecoderOnlyLM(cfg)
    optimizer = make_optimizer(model, args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    data = torch.Generator().manual_seed(args.seed)
    start = clock()

    def get_batch(i):
        if clock() - start >= budget:
            raise OutOfTime
        return lm_batch(train_ids, args.batch, args.block, data)

    def set_lr(info):
        scale = lr_multiplier((clock() - start) / budget, args.warmup, args.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * scale

    for group in optimizer.param_groups:
        group["lr"] = args.lr * lr_multiplier(0.0, args.warmup, args.min_lr)
    history = History()
    try:
        train(model, get_batch, 10**9, optimizer=optimizer, clip_norm=1.0, callbacks=[set_lr],
              history=history, progress=False)
    except OutOfTime:
        pass
    seconds = clock() - start
    steps = len(history.step)
    return dict(steps=steps, seconds=seconds, tokens=steps * args.batch * args.block,
                loss=validation_loss(model, val_ids, args.block), params=sum(p.numel() for p in model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[30, 60, 90])
    parser.add_argument("--flavours", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=8e-3)
    parser.add_argument("--warmup", type=float, default=0.05, help="fraction of the budget")
    parser.add_argument("--min-lr", type=float, default=0.1, help="final learning rate, as a fraction of --lr")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    text = builtin_corpus()
    tok = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(torch.tensor(tok.encode(text)), 0.1)
    d, h = args.d_model, args.heads
    configs = {
        "gpt": dataclasses.replace(GPT_TINY, vocab_size=tok.vocab_size, d_model=d, n_layers=args.layers, n_heads=h,
                                   max_len=args.block),
        "llama": dataclasses.replace(LLAMA_TINY, vocab_size=tok.vocab_size, d_model=d, n_layers=args.layers,
                                     n_heads=h, n_kv_heads=max(1, h // 2), d_ff=8 * (8 * d // 3 // 8),
                                     max_len=args.block),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock}-clock budgets; {load()}")
    print(f"d_model={d}, {args.layers} layers, {h} heads, block {args.block}, batch {args.batch}, peak lr {args.lr}, "
          f"warmup {args.warmup:.0%} of the budget, cosine to {args.min_lr} x peak, weight decay {args.weight_decay}")
    print(f"validation: {len(val_ids):,} characters; bigram table {bigram_loss(train_ids, val_ids, tok.vocab_size):.3f}"
          f" nats/char; uniform {math.log(tok.vocab_size):.3f}")
    results = {}
    for budget in args.budgets:
        for flavour in args.flavours:
            results[flavour, budget] = r = run(configs[flavour], args, budget, train_ids, val_ids)
            print(f"  {flavour:>5} {budget:4.0f} s: {r['steps']:5d} steps, {r['tokens'] / 1e6:5.2f} M tokens, "
                  f"{r['params']:,} parameters -> validation loss {r['loss']:.3f} nats/char "
                  f"({r['loss'] / math.log(2):.3f} bits/char)", flush=True)
    print(f"\n{'budget':>8} " + " ".join(f"{f:>8}" for f in args.flavours) +
          ("   llama - gpt" if len(args.flavours) == 2 else ""))
    for budget in args.budgets:
        losses = [results[f, budget]["loss"] for f in args.flavours]
        diff = f"   {losses[1] - losses[0]:+.3f}" if len(losses) == 2 else ""
        print(f"{budget:7.0f}s " + " ".join(f"{x:8.3f}" for x in losses) + diff)
    print(load())


if __name__ == "__main__":
    main()
