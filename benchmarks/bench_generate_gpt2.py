"""Generating 128 tokens at batch 1 with the GPT-2 small shape (124M parameters, random
weights: nothing is downloaded): tutorial_lib's generate with its KV cache, in both ways (the
default, every step through the model's modules, and ``fast=True``, the one-token steps through
``tutorial_lib.fast_decode.FastDecoder``), against transformers' ``generate`` (its own cache),
greedy. Target: each at least as fast as transformers.

    python benchmarks/bench_generate_gpt2.py [--rounds 3] [--threads N]

Our model gets the weights of the transformers model (tutorial_lib.convert.from_hf_model), so
all three must produce identical tokens, which is checked. They are timed in alternating rounds
(the order rotated each round) after one warm-up each, and the median is reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _machine import load

from tutorial_lib.convert import from_hf_model
from tutorial_lib.params import expected_parameters
from tutorial_lib.sampling import generate

NEW_TOKENS, PROMPT = 128, 16
HF = "transformers generate"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(bos_token_id=None, eos_token_id=None)  # GPT-2 small's shape
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    hf.generation_config.eos_token_id = None  # exactly NEW_TOKENS tokens, as ours
    ours = from_hf_model(hf)
    n_params = expected_parameters(ours.cfg)["total"]
    assert n_params == sum(p.numel() for p in ours.parameters()) == 124_439_808, n_params
    prompt = torch.randint(0, hf_cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)

    def run_hf():
        with torch.inference_mode():
            return hf.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0)

    runs = {
        "generate, modules (default)": lambda: generate(ours, prompt, NEW_TOKENS, use_cache=True),
        "generate, fast=True": lambda: generate(ours, prompt, NEW_TOKENS, use_cache=True, fast=True),
        HF: run_hf,
    }
    reference = run_hf()  # warm-up, and the check
    for name, run in runs.items():
        out = run()
        assert torch.equal(out, reference), \
            f"{name}: the tokens differ from position {int((out != reference).nonzero()[0, 1])}"
    times = {name: [] for name in runs}
    names = list(runs)
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotate the order every round
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"greedy generation of {NEW_TOKENS} tokens after a {PROMPT}-token prompt, batch 1, GPT-2 small shape "
          f"({n_params:,} parameters, random weights), identical tokens; {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; median of {args.rounds} rounds")
    for name, t in median.items():
        print(f"  {name:<28}: {t:6.2f} s  {NEW_TOKENS / t:6.1f} tokens/s")
    for name in names[:2]:
        print(f"  {name} / transformers: {median[HF] / median[name]:6.2f}x speed   target >= 1.0")
    print(f"  fast=True / modules: {median[names[0]] / median[names[1]]:6.2f}x speed")
    print(load())


if __name__ == "__main__":
    main()
