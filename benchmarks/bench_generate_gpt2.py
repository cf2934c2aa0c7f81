"""Generating 128 tokens at batch 1 with the GPT-2 small shape (124M parameters, random
weights: nothing is downloaded): tutorial_lib's generate with its KV cache against
transformers' ``generate`` (its own cache), greedy. Target: ours at least as fast.

    python benchmarks/bench_generate_gpt2.py [--rounds 3] [--threads N]

Our model gets the weights of the transformers model (tutorial_lib.convert.from_hf_model), so
both must produce identical tokens, which is checked. The two are timed in alternating rounds
(the order swapped each round) after one warm-up each, and the median is reported.
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

    def run_ours():
        return generate(ours, prompt, NEW_TOKENS, use_cache=True)

    def run_hf():
        with torch.inference_mode():
            return hf.generate(prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0)

    a, b = run_ours(), run_hf()  # warm-up, and the check
    assert torch.equal(a, b), f"the generated tokens differ from position {int((a != b).nonzero()[0, 1])}"
    times = {run_ours: [], run_hf: []}
    for i in range(args.rounds):
        for run in ((run_ours, run_hf) if i % 2 == 0 else (run_hf, run_ours)):
            start = time.perf_counter()
            run()
            times[run].append(time.perf_counter() - start)
    t_ours, t_hf = statistics.median(times[run_ours]), statistics.median(times[run_hf])
    print(f"greedy generation of {NEW_TOKENS} tokens after a {PROMPT}-token prompt, batch 1, GPT-2 small shape "
          f"({n_params:,} parameters, random weights), identical tokens; {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, transformers {transformers.__version__}; median of {args.rounds} rounds")
    print(f"  tutorial_lib generate (KV cache) : {t_ours:6.2f} s  {NEW_TOKENS / t_ours:6.1f} tokens/s")
    print(f"  transformers generate            : {t_hf:6.2f} s  {NEW_TOKENS / t_hf:6.1f} tokens/s")
    print(f"  speed ratio (ours / transformers): {t_hf / t_ours:6.2f}   target >= 1.0")
    print(load())


if __name__ == "__main__":
    main()
