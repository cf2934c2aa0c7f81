"""Train the encoder-decoder of notebook 05 on the date task and report how long it takes to
reach 99 % exact match (greedy decoding) on the 1,000 fixed held-out examples.
Target: >= 99 % within 90 s of training on 2 CPU cores.

    python benchmarks/bench_seq2seq.py [--threads 2] [--steps 900] [--eval-every 50]

The defaults are the CPU recipe of notebook 05: width 64, 2 + 2 layers, batches of 64 fresh
examples, AdamW (0.9, 0.98), peak learning rate 3e-3 with 100 warmup steps and a cosine
decay to 0 over 900 steps, label smoothing 0.1, gradient clipping at 1.0.

Training time is the wall-clock time spent in training steps (batches made on the fly
included); the evaluations every ``--eval-every`` steps are timed separately and not counted
in it. The CPU time of the training steps (all threads together) is printed beside it, and
the machine's load average before and after: on a shared machine the wall-clock time grows
with the load, the CPU time much less.
"""

from __future__ import annotations

import argparse
import time

import torch
from _machine import load

from tutorial_lib import dates
from tutorial_lib.train import inverse_sqrt_schedule, make_optimizer, train, warmup_cosine_schedule
from tutorial_lib.transformer import EncoderDecoder

TARGET_ACCURACY = 0.99
TARGET_SECONDS = 90.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--schedule", choices=["cosine", "inverse_sqrt"], default="cosine")
    parser.add_argument("--smoothing", type=float, default=0.1)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {load()}")
    cfg = dates.model_config(d_model=args.d_model, d_ff=4 * args.d_model, n_layers=args.layers)
    model = EncoderDecoder(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: d_model={cfg.d_model}, {cfg.n_layers}+{cfg.decoder_layers} layers, {cfg.n_heads} heads, "
          f"{n_params:,} parameters; batch {args.batch}, {args.steps} steps, peak lr {args.lr}, "
          f"warmup {args.warmup} + {args.schedule.replace('_', ' ')}, label smoothing {args.smoothing}")

    held_out = dates.held_out_examples()
    generator = torch.Generator().manual_seed(args.seed + 1)  # seeds as in notebook 05: the same run
    rows = []  # (step, training wall s, training CPU s, loss, exact match)
    evaluation = {"wall": 0.0, "cpu": 0.0}
    wall0, cpu0 = time.perf_counter(), time.process_time()

    def evaluate_now(info) -> None:
        if info.step % args.eval_every and info.step != args.steps:
            return
        wall, cpu = time.perf_counter(), time.process_time()
        accuracy = dates.evaluate(info.model, held_out)  # greedy decoding, eval mode inside
        info.model.train()
        rows.append((info.step, wall - wall0 - evaluation["wall"], cpu - cpu0 - evaluation["cpu"],
                     info.loss, accuracy))
        evaluation["wall"] += time.perf_counter() - wall
        evaluation["cpu"] += time.process_time() - cpu

    optimizer = make_optimizer(model, args.lr, weight_decay=0.01)
    schedule = (warmup_cosine_schedule(args.warmup, args.steps, 0.0) if args.schedule == "cosine"
                else inverse_sqrt_schedule(args.warmup))
    train(model, lambda i: dates.train_batch(args.batch, generator), args.steps, optimizer=optimizer,
          schedule=schedule,
          compute_loss=lambda m, b: dates.loss(m, b, args.smoothing), clip_norm=1.0,
          callbacks=[evaluate_now], progress=False)

    print(f"{'step':>6} {'train s':>8} {'CPU s':>8} {'loss':>7} {'exact match':>12}")
    for row in rows:
        print(f"{row[0]:6d} {row[1]:8.1f} {row[2]:8.1f} {row[3]:7.4f} {row[4]:12.3f}")
    print(f"evaluation: {len(rows)} x 1,000 greedy decodings, {evaluation['wall']:.1f} s (not counted above)")
    print(load())
    reached = next((row for row in rows if row[4] >= TARGET_ACCURACY), None)
    if reached is None:
        print(f"time to {TARGET_ACCURACY:.0%}: not reached in {rows[-1][1]:.1f} s of training")
    else:
        print(f"time to {TARGET_ACCURACY:.0%} exact match: {reached[1]:.1f} s of training (step {reached[0]}, "
              f"{reached[2]:.1f} CPU s), target <= {TARGET_SECONDS:.0f} s")
    print(f"final exact match: {rows[-1][4]:.3f} after {rows[-1][0]} steps, {rows[-1][1]:.1f} s of training")


if __name__ == "__main__":
    main()
