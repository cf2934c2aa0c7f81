"""Speculative decoding with prompt lookup against plain greedy decoding, on the bundled
SmolLM2-135M-Instruct (float32, the KV cache), identical tokens asserted.
Target: at least 1.5x on the repetitive prompt (PASS or MISS, not asserted).

    python benchmarks/bench_speculative.py [--tokens 128] [--rounds 3] [--k 8] [--threads N]

Two prompts. *Repetitive*: a passage of the built-in corpus, a blank line and the passage's first
60 characters again, as plain text: the model continues by copying what it has just read, and
prompt lookup (the last 1-3 tokens found earlier in the context; what followed them there is
the draft) guesses those tokens. *Unhelpful*: a chat request for a short story, where nothing
repeats and the drafts are mostly wrong; there speculation can only lose (a pass over 1 + k
positions costs a little more than over one).

Both ways run ``--tokens`` new tokens without stop ids; after a warm-up they are timed in
alternating rounds, and the median round is reported as ms per token (prefill included).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _machine import load

from tutorial_lib.data import builtin_corpus
from tutorial_lib.pretrained import bundled_gguf, load_pretrained
from tutorial_lib.sampling import generate
from tutorial_lib.speculative import speculative_generate

PASSAGE_START, PASSAGE_CHARS, REPEATED_CHARS = 150_000, 900, 60


def prompts(tokenizer) -> dict[str, torch.Tensor]:
    corpus = builtin_corpus()
    passage = corpus[PASSAGE_START:PASSAGE_START + PASSAGE_CHARS]
    passage = passage[passage.index("\n") + 1:]  # from the start of a line
    story = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
    return {"repetitive": torch.tensor([tokenizer.encode(passage + "\n\n" + passage[:REPEATED_CHARS])]),
            "unhelpful": torch.tensor([tokenizer.apply_chat_template(story)])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=8, help="drafted tokens per pass at most")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's (one per core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    start = time.perf_counter()
    model, tokenizer, _ = load_pretrained(bundled_gguf())
    print(f"greedy decoding of {args.tokens} tokens, batch 1, float32 SmolLM2-135M-Instruct; prompt lookup "
          f"drafts of up to k={args.k}; {torch.get_num_threads()} threads; median of {args.rounds} alternating rounds")
    for name, prompt in prompts(tokenizer).items():
        runs = {"greedy": lambda p=prompt: (generate(model, p, args.tokens), None),
                "speculative": lambda p=prompt: speculative_generate(model, p, args.tokens, k=args.k)}
        for run in runs.values():
            run()
        times = {n: [] for n in runs}
        results = {}
        for i in range(args.rounds):
            for n in (list(runs) if i % 2 == 0 else list(reversed(runs))):
                t0 = time.perf_counter()
                results[n] = runs[n]()
                times[n].append(time.perf_counter() - t0)
        plain, (fast, stats) = results["greedy"][0], results["speculative"]
        assert torch.equal(plain, fast), f"{name}: speculative tokens differ from greedy decoding"
        ms = {n: statistics.median(t) / args.tokens * 1e3 for n, t in times.items()}
        ratio = ms["greedy"] / ms["speculative"]
        target = "   target >= 1.5x  " + ("PASS" if ratio >= 1.5 else "MISS") if name == "repetitive" else ""
        print(f"  {name:<11} ({prompt.size(1)}-token prompt): greedy {ms['greedy']:6.1f} ms/token, speculative "
              f"{ms['speculative']:6.1f} ms/token; {stats.forward_passes - 1} passes for {stats.new_tokens} "
              f"tokens ({stats.tokens_per_pass:.2f} a pass), {stats.accepted} of {stats.drafted} drafted kept "
              f"({stats.acceptance_rate:.0%}); speed-up {ratio:.2f}x{target}")
        print(f"              continues: {tokenizer.decode(plain[0, prompt.size(1):].tolist())[:70]!r}")
    print(f"{load()}; the script took {time.perf_counter() - start:.0f} s after its imports")


if __name__ == "__main__":
    main()
