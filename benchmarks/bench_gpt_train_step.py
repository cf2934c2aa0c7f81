"""Train-step throughput (forward, loss, backward, AdamW step) of tutorial_lib's GPT flavour
against Hugging Face's ``GPT2LMHeadModel`` at the identical configuration: B=12, T=64,
4 layers, 4 heads, d=128, the vocabulary of the built-in corpus. Target (issue 18): ours / HF >= 1.30.

    python benchmarks/bench_gpt_train_step.py [--steps 100] [--threads N] [--profile]

``--profile`` also runs 30 more steps of each model under ``torch.profiler`` and prints, side by
side, the operations that take the most time (milliseconds per step, the profiler's own overhead
included), so that one can see where the two steps differ.

Both models start from the same weights (ours is converted from the HF model and checked to
give the same logits), see the same batch, and use the same optimiser settings. Their steps
are timed alternately, one step each (the order swapped every time), and the median step is
reported, so that a busy machine slows both alike; the load average is printed with the
result. Both compute the loss the same way: cross-entropy of the logits of all T positions
against the next tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _machine import load

from tutorial_lib.convert import gpt2_from_hf
from tutorial_lib.data import CharTokenizer, builtin_corpus, lm_batch

B, T, N_LAYERS, N_HEADS, D_MODEL = 12, 64, 4, 4, 128


def build_models(vocab_size: int):
    import transformers

    hf_cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=T, n_embd=D_MODEL, n_layer=N_LAYERS,
                                     n_head=N_HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    ours = gpt2_from_hf(hf)
    return ours.train(), hf.train()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100, help="timed steps of each model")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", action="store_true", help="print where each step's time goes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    text = builtin_corpus()
    tok = CharTokenizer.from_text(text)
    stream = torch.tensor(tok.encode(text))
    ours, hf = build_models(tok.vocab_size)
    x, y = lm_batch(stream, B, T, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (ours(x).logits - hf(x).logits).abs().max().item()
    assert gap < 1e-4, f"the two models do not compute the same logits (largest difference {gap:.2e})"

    def stepper(model, logits_of):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

        def step():
            opt.zero_grad(set_to_none=True)
            logits = logits_of(model, x)  # (B, T, V)
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
            opt.step()

        return step

    step_ours = stepper(ours, lambda m, ids: m(ids).logits)
    step_hf = stepper(hf, lambda m, ids: m(input_ids=ids).logits)
    for step in (step_ours, step_hf):  # warm-up
        for _ in range(5):
            step()
    times = {step_ours: [], step_hf: []}
    for i in range(args.steps):
        for step in ((step_ours, step_hf) if i % 2 == 0 else (step_hf, step_ours)):
            start = time.perf_counter()
            step()
            times[step].append(time.perf_counter() - start)
    a, b = statistics.median(times[step_ours]), statistics.median(times[step_hf])
    print(f"train step (forward, backward, AdamW), B={B} T={T} layers={N_LAYERS} heads={N_HEADS} d={D_MODEL} "
          f"V={tok.vocab_size}; {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"  tutorial_lib DecoderOnlyLM (GPT) : {a * 1e3:7.2f} ms/step  {B * T / a:9.0f} tokens/s")
    print(f"  transformers GPT2LMHeadModel     : {b * 1e3:7.2f} ms/step  {B * T / b:9.0f} tokens/s")
    print(f"  throughput ratio (ours / HF)     : {b / a:7.3f}   target >= 1.30")
    if args.profile:
        print_profiles({"tutorial_lib": step_ours, "transformers": step_hf})
    print(load())


def print_profiles(steps: dict, n: int = 30, rows: int = 12) -> None:
    """The operations with the most self time per step under torch.profiler, for each stepper."""
    from torch.profiler import ProfilerActivity, profile

    per_step = {}
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                step()
        per_step[name] = {e.key: e.self_cpu_time_total / n / 1e3 for e in prof.key_averages()}  # ms per step
    top = sorted(set().union(*per_step.values()), key=lambda k: -max(p.get(k, 0.0) for p in per_step.values()))
    names = list(per_step)
    print(f"  profiler, self time in ms per step ({n} steps each):")
    print(f"    {'operation':<60}" + "".join(f"{name:>14}" for name in names))
    for key in top[:rows]:
        print(f"    {key[:60]:<60}" + "".join(f"{per_step[name].get(key, 0.0):14.2f}" for name in names))
    print(f"    {'total':<60}" + "".join(f"{sum(per_step[name].values()):14.2f}" for name in names))


if __name__ == "__main__":
    main()
