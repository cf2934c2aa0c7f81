"""KV-cache decoding against recomputing the whole context at every step: 512 new tokens from
a 16-token prompt, greedy, with ``tutorial_lib.sampling.generate`` (use_cache=True and
use_cache=False) on the tiny GPT and LLaMA presets, at batch 1 and batch 8. Target: >= 10x.

    python benchmarks/bench_kv_cache.py [--new-tokens 512] [--batch 1 8] [--rounds 3] [--threads N]

The presets' context (max_len=128) is raised to 1024 so that all 528 positions fit in one
window: past max_len, generate crops the context and refills the cache at every step, and
the cache no longer saves anything (notebook 06, section 4, shows why). Both paths must
produce the same tokens; the script checks that before it prints a ratio. The two are timed
in alternating rounds and the fastest round of each is reported (on a shared machine the
slower rounds measure the neighbours).

At batch 1 a cached step of these tiny models is about 20 matrix-vector products and a few
hundred small operations, about a millisecond: what it costs is mostly fixed per-call
overhead (Python, module calls, PyTorch's dispatch), not arithmetic, and the speed-up sits
near the target for GPT and below it for LLaMA, whose step has more small operations (RoPE,
RMSNorm, a third FFN matrix). At batch 8 the recomputation's arithmetic grows eightfold
while a cached step barely changes, and both pass the target.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from _machine import load

from tutorial_lib.config import GPT_TINY, LLAMA_TINY
from tutorial_lib.data import CharTokenizer, builtin_corpus
from tutorial_lib.gpt import DecoderOnlyLM
from tutorial_lib.sampling import GREEDY, generate

PROMPT_LEN = 16


def timed(model, prompt, n: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = generate(model, prompt, n, sampler=GREEDY, use_cache=use_cache)
    return time.perf_counter() - start, out


def compare(model, prompt, n: int, rounds: int) -> tuple[float, float]:
    """Best time of ``rounds`` alternating rounds: (with the cache, recomputing), in seconds."""
    cached_t, plain_t = [], []
    for _ in range(rounds):
        t, cached = timed(model, prompt, n, use_cache=True)
        cached_t.append(t)
        t, plain = timed(model, prompt, n, use_cache=False)
        plain_t.append(t)
        assert torch.equal(cached, plain), "cached and uncached generation disagree"
    return min(cached_t), min(plain_t)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    text = builtin_corpus()
    tok = CharTokenizer.from_text(text)
    print(f"{args.new_tokens} new tokens after a {PROMPT_LEN}-token prompt, greedy, best of {args.rounds} "
          f"rounds; {torch.get_num_threads()} threads, torch {torch.__version__}")
    for batch in args.batch:
        starts = range(0, batch * 1000, 1000)  # a different 16-character prompt per sequence
        prompt = torch.tensor([tok.encode(text[s:s + PROMPT_LEN]) for s in starts])  # (B, 16)
        print(f"batch {batch}")
        for name, preset in (("GPT_TINY", GPT_TINY), ("LLAMA_TINY", LLAMA_TINY)):
            cfg = dataclasses.replace(preset, vocab_size=tok.vocab_size, max_len=1024)
            torch.manual_seed(0)
            model = DecoderOnlyLM(cfg).eval()
            a, b = compare(model, prompt, args.new_tokens, args.rounds)
            print(f"  {name:<10} (d={cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
                  f"{cfg.kv_heads} kv heads)")
            print(f"    with KV cache      : {a:6.2f} s  ({a / args.new_tokens * 1e3:5.2f} ms/step)")
            print(f"    recomputing        : {b:6.2f} s  ({b / args.new_tokens * 1e3:5.2f} ms/step)")
            print(f"    speed-up           : {b / a:6.1f}x   target >= 10")
    print(load())


if __name__ == "__main__":
    main()
